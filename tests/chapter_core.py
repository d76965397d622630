"""Cut a technique file at its `# BEYOND THE CHAPTER` banner and load the lines above it alone: the copy a reader takes.

    core = load_core("long_seq", tmp_path)     # a module built from long_seq.py's lines above the banner

The core is written to `tmp_path/core_<name>.py` (an empty folder) and imported from there under that name, so
nothing of the full file or of the repository leaks into it. Before it is imported, its import statements are read
from the source: only the standard library, torch, numpy and einops may appear, never a file of this repository.
"""
import ast
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BANNER = "# BEYOND THE CHAPTER"
ALLOWED_THIRD_PARTY = {"torch", "numpy", "einops"}
REPOSITORY_MODULES = {name[:-3] for name in os.listdir(ROOT) if name.endswith(".py")}


def core_lines(name):
    """The lines of `name`.py above its one banner line; fails if the file has no banner or more than one."""
    with open(os.path.join(ROOT, f"{name}.py")) as f:
        lines = f.read().splitlines(keepends=True)
    banners = [i for i, line in enumerate(lines) if line.startswith(BANNER)]
    if len(banners) != 1:
        raise AssertionError(f"{name}.py has {len(banners)} lines starting with {BANNER!r}; it needs exactly one")
    return lines[:banners[0]]


def imported_top_level_modules(source):
    """Every top-level module name the source imports, at any depth of the file (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.add("." * node.level + (node.module or ""))
            else:
                names.add(node.module.split(".")[0])
    return names


def check_imports(name, source):
    for module in imported_top_level_modules(source):
        if module in REPOSITORY_MODULES or module.startswith("."):
            raise AssertionError(f"the core of {name}.py imports {module}, a file of this repository")
        if module not in ALLOWED_THIRD_PARTY and module not in sys.stdlib_module_names:
            raise AssertionError(f"the core of {name}.py imports {module}: only the standard library, "
                                 f"{sorted(ALLOWED_THIRD_PARTY)} are allowed")


def load_core(name, folder):
    """Write the core of `name`.py into `folder` (empty) as core_<name>.py, check its imports, import it."""
    source = "".join(core_lines(name))
    check_imports(name, source)
    path = os.path.join(str(folder), f"core_{name}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"core_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module
