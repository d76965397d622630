"""The cores, cut at their banners, are the chapter: they fit the reader's budget, every name they use is defined in
them (or in the standard library, torch, numpy, einops), no file binds a name twice at its top level (the code you
read is the code that runs), and together they train the composed run as the whole files do, bit for bit. And the
checkers themselves can fail."""
import ast
import json
import os

import pytest

import chapter_core


# ---- no name bound twice at a file's top level --------------------------------------------------------------
#
# An at-scale form has its own name and builds on the core (a subclass, or a function that calls it): were it bound
# to a core name again below the banner (`class MoE(MoE)`, `TABLE["beyond"] = ...`, `Cls.attr = ...`,
# `TABLE.update(...)`), the core a reader reads would not be the code that runs. Files join NAMES_BOUND_ONCE as
# their at-scale forms get their own names; the others are expected to fail (strict: one that passes must join).
# All seven have joined.
TECHNIQUE_FILES = chapter_core.CORES
NAMES_BOUND_ONCE = set(chapter_core.CORES)
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
    chapter_core.check_imports("train_gpt", "import topology\n", repository=("topology",))  # the program's core


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


# The chapter's part of the files, in lines above their banners (grad_accum.py is all chapter: the whole file), and
# the module docstring that teaches each: a reader's budget, so that at-scale forms added above a banner fail here.
# The seven together, and train_gpt.py's (the composed step, the loop, the chapter's command line) on its own.
CORES_BUDGET, TRAIN_GPT_CORE_BUDGET, DOCSTRING_LINES = 4400, 1400, 60


def test_the_cores_fit_the_readers_budget():
    sizes = {name: len(chapter_core.core_lines(name)) for name in chapter_core.CORES}
    assert sum(sizes.values()) < CORES_BUDGET, sizes
    assert sizes["train_gpt"] < TRAIN_GPT_CORE_BUDGET, sizes
    for name in chapter_core.CORES:
        docstring = ast.get_docstring(ast.parse("".join(chapter_core.core_lines(name))), clean=False)
        assert docstring and len(docstring.splitlines()) <= DOCSTRING_LINES, name


def test_every_name_a_core_uses_is_defined_in_a_core_or_the_standard_library_torch_numpy_einops():
    sources = {name: "".join(chapter_core.core_lines(name)) for name in chapter_core.CORES}
    for name, source in sources.items():
        chapter_core.check_imports(name, source, chapter_core.TECHNIQUE_FILES if name == "train_gpt" else ())
    assert chapter_core.undefined_names(sources) == []


def test_the_name_check_finds_a_name_below_a_banner_a_missing_attribute_and_a_keyword():
    sources = {"a": "import b\nX = 1\ndef f(y, *, z=0):\n    return y + X + Hidden + len([w for w in range(y)])\n",
               "b": "import a\nclass C:\n    def __init__(self, p):\n        self.p = p\n"
                    "def g():\n    return a.f(1, z=2) + a.Below + a.f(1, q=3) + C(p=1).p\n"}
    assert chapter_core.undefined_names(sources) == [
        "a.py: Hidden (in f) is defined nowhere", "b.py: a.Below is not in a.py's core",
        "b.py: a.f(... q=...): the core's f takes no q"]


# ---- The cores alone train the composed run ------------------------------------------------------------------
# Each layout runs twice, as `torchrun train_gpt.py FLAGS --metrics ...`: the seven files cut at their banners in an
# empty folder, and the repository's. Every step's loss, router loss, learning rate and gradient norm must agree to
# the bit. The README main job's layout runs its 10 steps; the precision and memory flags a few steps on 2 ranks.
README_LAYOUT = ("--tp 2 --sequence-parallel --pp 2 --cp 2 --ep 2 --moe-every 2 --experts 4 --batch 32 "
                 "--micro-batch 8 --steps 10")
SMALL = "--layers 2 --hidden 32 --seq 32 --batch 8 --micro-batch 2 --steps 3"
CUT_LAYOUTS = [  # (name, ranks, flags)
    ("world 1", 1, "--steps 10"),
    ("fp16, full recomputation", 2, f"{SMALL} --dtype float16 --recompute full"),
    ("bf16, ZeRO-1 (the distributed optimizer), selective recomputation", 2,
     f"{SMALL} --dtype bfloat16 --zero 1 --recompute selective"),
    ("README main job", 8, README_LAYOUT),
]
FIELDS = ("step", "loss", "aux_loss", "lr", "grad_norm")


def _records(path):
    with open(path) as f:
        return [{k: json.loads(line).get(k) for k in FIELDS} for line in f]


@pytest.mark.parametrize("name, world, flags", CUT_LAYOUTS)
def test_the_cores_cut_at_their_banners_train_as_the_whole_files_do(tmp_path, name, world, flags):
    cut = tmp_path / "cut"
    cut.mkdir()
    chapter_core.cut_cores(cut)
    runs = {}
    for program, folder in (("cut", cut), ("whole", chapter_core.ROOT)):
        out = tmp_path / f"run_{program}"
        out.mkdir()
        ranks = chapter_core.run_program(folder, flags.split() + ["--metrics", str(out / "metrics.jsonl")], world,
                                         out)
        assert all(code == 0 for code, *_ in ranks), (program, ranks[0][2][-3000:])
        runs[program] = _records(out / "metrics.jsonl")
    steps = int(flags.split("--steps ")[1].split()[0])
    print(f"\n{name}: torchrun --nproc_per_node={world} train_gpt.py {flags}\n  step  loss (cut)           loss (whole)"
          "          grad norm (cut)      grad norm (whole)")
    for a, b in zip(runs["cut"], runs["whole"]):
        print(f"  {a['step']:4d}  {a['loss']!r:20} {b['loss']!r:20} {a['grad_norm']!r:20} {b['grad_norm']!r:20}")
    assert len(runs["cut"]) == steps and runs["cut"] == runs["whole"]


def test_the_core_command_line_refuses_delayed_fp8_under_recomputation_in_one_line(capsys, monkeypatch):
    """The core's own parse_args (the chapter's flags) refuses what its run cannot do right: a recomputed forward
    would push each GEMM's amax into the delayed history twice. Selective recomputation redoes no GEMM: allowed."""
    import train_gpt
    monkeypatch.setenv("RANK", "0")
    for policy in ("full", "sqrt"):
        with pytest.raises(SystemExit) as stop:
            train_gpt.parse_args(["--dtype", "fp8", "--fp8-recipe", "delayed", "--recompute", policy])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and f"--recompute {policy}" in err, err
    _, train_cfg = train_gpt.parse_args(["--dtype", "fp8", "--fp8-recipe", "delayed", "--recompute", "selective"])
    assert (train_cfg.fp8_recipe, train_cfg.recompute) == ("delayed", "selective")
