"""The core-alone checker itself can fail: a banner missing or doubled, a repository import, a foreign package;
and no technique file binds a name twice at its top level."""
import ast
import os

import pytest

import chapter_core

# ---- no name bound twice at a file's top level --------------------------------------------------------------
#
# An at-scale form has its own name and builds on the core (a subclass, or a function that calls it): were it bound
# to a core name again below the banner (`class MoE(MoE)`, `TABLE["beyond"] = ...`, `Cls.attr = ...`,
# `TABLE.update(...)`), the core a reader reads would not be the code that runs. Files join NAMES_BOUND_ONCE as
# their at-scale forms get their own names; the others are expected to fail (strict: one that passes must join).
TECHNIQUE_FILES = ("topology", "mixed_precision", "grad_accum", "checkpointing", "moe_ep", "long_seq", "train_gpt")
NAMES_BOUND_ONCE = {"topology", "mixed_precision", "grad_accum", "checkpointing", "moe_ep", "long_seq"}
MUTATING_METHODS = {"update", "append", "extend", "insert", "setdefault", "add"}


def top_level_bindings(source):
    """{name: [line, ...]} of every binding at the module's top level (inside top-level if/for/while/with/try too,
    never inside a def or class): def, class, import, assignment (a store into name[...] or name.attr binds name),
    augmented assignment, a for target, and a call of a mutating method on a name (name.update(...))."""
    found = {}
    add = lambda name, line: found.setdefault(name, []).append(line)

    def root(node):
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    def store(target, line):
        for node in ast.walk(target):
            if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)) and isinstance(node.ctx, ast.Store):
                if root(node):
                    add(root(node), line)

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                add(node.name, node.lineno)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    add((alias.asname or alias.name).split(".")[0], node.lineno)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    store(target, node.lineno)
            elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                  and isinstance(node.value.func, ast.Attribute) and node.value.func.attr in MUTATING_METHODS
                  and root(node.value.func.value)):
                add(root(node.value.func.value), node.lineno)
            elif isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
                if isinstance(node, ast.For):
                    store(node.target, node.lineno)
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
    visit(ast.parse(source).body)
    return found


def test_the_binding_walk_finds_every_kind_of_rebinding():
    source = ("import os\nclass A: pass\nclass A(A): pass\nT = {}\nT['x'] = 1\nA.attr = 2\nT.update(y=3)\n"
              "def f(): g = 1\ndef g(): pass\nif True:\n    import os\nn = 0\nn += 1\nfor i in (): pass\n")
    twice = {name: lines for name, lines in top_level_bindings(source).items() if len(lines) > 1}
    assert twice == {"os": [1, 11], "A": [2, 3, 6], "T": [4, 5, 7], "n": [12, 13]}


@pytest.mark.parametrize("name", TECHNIQUE_FILES)
def test_no_name_is_bound_twice_at_a_files_top_level(name):
    with open(os.path.join(chapter_core.ROOT, f"{name}.py")) as f:
        twice = {k: lines for k, lines in top_level_bindings(f.read()).items() if len(lines) > 1}
    if name not in NAMES_BOUND_ONCE:
        assert twice, f"{name}.py binds every name once now: add it to NAMES_BOUND_ONCE"
        pytest.xfail(f"{name}.py still binds names twice: {twice}")
    assert not twice, f"{name}.py binds these names more than once (lines): {twice}"


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
CORE_BUDGETS = {"topology": 500, "mixed_precision": 810, "long_seq": 600, "moe_ep": 450, "checkpointing": 400,
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
