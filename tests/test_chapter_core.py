"""The core-alone checker itself can fail: a banner missing or doubled, a repository import, a foreign package."""
import pytest

import chapter_core


def test_a_repository_import_is_refused_at_any_depth():
    with pytest.raises(AssertionError, match="a file of this repository"):
        chapter_core.check_imports("x", "import torch\ndef f():\n    from topology import rank_groups\n")
    with pytest.raises(AssertionError, match="a file of this repository"):
        chapter_core.check_imports("x", "from . import topology\n")


def test_only_the_standard_library_torch_numpy_and_einops_are_allowed():
    chapter_core.check_imports("x", "import os, math\nimport torch.nn.functional as F\nimport numpy\n"
                                    "from einops import rearrange\n")
    with pytest.raises(AssertionError, match="only the standard library"):
        chapter_core.check_imports("x", "import scipy\n")


def test_a_file_needs_exactly_one_banner(tmp_path, monkeypatch):
    monkeypatch.setattr(chapter_core, "ROOT", str(tmp_path))
    (tmp_path / "none.py").write_text("x = 1\n")
    (tmp_path / "two.py").write_text(f"x = 1\n{chapter_core.BANNER}\ny = 2\n{chapter_core.BANNER}: again\n")
    (tmp_path / "one.py").write_text(f"x = 1\n{chapter_core.BANNER}: at scale\nraise SystemExit\n")
    for name in ("none", "two"):
        with pytest.raises(AssertionError, match="exactly one"):
            chapter_core.core_lines(name)
    (tmp_path / "out").mkdir()
    core = chapter_core.load_core("one", tmp_path / "out")
    assert core.x == 1 and not hasattr(core, "y")


# The chapter's part of each file, in lines above its banner (grad_accum.py is all chapter: the whole file), and
# the module docstring that teaches it: a reader's budget, so an at-scale form added above a banner fails here
CORE_BUDGETS = {"topology": 500, "mixed_precision": 700, "long_seq": 600, "moe_ep": 420, "checkpointing": 400,
                "grad_accum": 400, "train_gpt": 1100}


@pytest.mark.parametrize("name", sorted(CORE_BUDGETS))
def test_each_files_chapter_fits_its_reading_budget(name):
    import ast
    import os
    if name == "grad_accum":  # no banner: the whole file
        with open(os.path.join(chapter_core.ROOT, "grad_accum.py")) as f:
            lines = f.read().splitlines(keepends=True)
    else:
        lines = chapter_core.core_lines(name)
    budget = CORE_BUDGETS[name]
    assert len(lines) <= budget, f"{name}.py: {len(lines)} lines of chapter, over its {budget}"
    docstring = ast.get_docstring(ast.parse("".join(lines)), clean=False)
    assert docstring and len(docstring.splitlines()) <= 60, name
