"""Cut a file at its `# BEYOND THE CHAPTER` banner and load the lines above it alone: the copy a reader takes.

    core = load_core("long_seq", tmp_path)     # a module built from long_seq.py's lines above the banner
    cut_cores(tmp_path)                        # the seven cores as topology.py, ..., train_gpt.py: a program

A core is written to `tmp_path/core_<name>.py` (an empty folder) and imported from there under that name, so
nothing of the full file or of the repository leaks into it; `cut_cores` writes all seven under their own names
(grad_accum.py, all chapter, whole), the program train_gpt.py's core composes. Before anything is imported, its
import statements are read from the source: only the standard library, torch, numpy and einops may appear, and of
this repository's files only the technique files, in train_gpt.py's core. `undefined_names` reads every name a core
uses (ast and symtable) against what the cores define.
"""
import ast
import builtins
import importlib.util
import os
import signal
import symtable
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BANNER = "# BEYOND THE CHAPTER"
ALLOWED_THIRD_PARTY = {"torch", "numpy", "einops"}
REPOSITORY_MODULES = {name[:-3] for name in os.listdir(ROOT) if name.endswith(".py")}
TECHNIQUE_FILES = ("topology", "mixed_precision", "grad_accum", "checkpointing", "moe_ep", "long_seq")
CORES = TECHNIQUE_FILES + ("train_gpt",)  # the program: its core composes the six others'
WHOLE = {"grad_accum"}  # all chapter: no banner, the whole file
MODULE_ATTRIBUTES = {"__file__", "__name__", "__doc__", "__spec__", "__loader__", "__package__"}  # every module's


def core_lines(name):
    """The lines of `name`.py above its one banner line (grad_accum.py: all of it); fails if the file has no banner
    or more than one."""
    with open(os.path.join(ROOT, f"{name}.py")) as f:
        lines = f.read().splitlines(keepends=True)
    if name in WHOLE:
        return lines
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


def check_imports(name, source, repository=()):
    """Only the standard library, torch, numpy and einops, and of this repository's files those in `repository`."""
    for module in imported_top_level_modules(source):
        if module in repository:
            continue
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


def cut_cores(folder):
    """Write the seven cores into `folder` (empty) under their own names, imports checked: the chapter's program,
    run there as `python3 train_gpt.py` or `torchrun ... train_gpt.py`. Returns {name: source}."""
    if os.listdir(folder):
        raise AssertionError(f"{folder} is not empty: the cores must run alone")
    sources = {name: "".join(core_lines(name)) for name in CORES}
    for name, source in sources.items():
        check_imports(name, source, repository=TECHNIQUE_FILES if name == "train_gpt" else ())
        with open(os.path.join(str(folder), f"{name}.py"), "w") as f:
            f.write(source)
    return sources


def _module_bindings(table):
    """The names a module binds at its top level (assigned, imported, def and class; `global` ones assigned in a
    function too)."""
    bound = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    stack = list(table.get_children())
    while stack:
        scope = stack.pop()
        bound |= {s.get_name() for s in scope.get_symbols() if s.is_declared_global() and s.is_assigned()}
        stack.extend(scope.get_children())
    return bound


def _signatures(tree):
    """{top-level name: its parameter names, or None where any keyword goes (**kwargs, or not known)}: a function's
    own, a class's __init__'s, a dataclass's fields."""
    out = {}
    for node in tree.body:
        fn = node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if isinstance(node, ast.ClassDef):
            fn = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            if fn is None:
                dataclass = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
                out[node.name] = ({n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
                                  if dataclass and not node.bases else None)
                continue
        if fn is not None:
            a = fn.args
            out[node.name] = None if a.kwarg else {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    return out


def undefined_names(sources):
    """Every name a core uses that nothing defines, as "file: what" lines: a name neither bound in that core nor a
    builtin; `module.attr` of a technique file it imports where that file's core has no top-level `attr`; a keyword
    that the called core function (or class) does not take. Imports themselves: `check_imports`."""
    trees = {name: ast.parse(source) for name, source in sources.items()}
    tables = {name: symtable.symtable(source, f"{name}.py", "exec") for name, source in sources.items()}
    bindings = {name: _module_bindings(table) for name, table in tables.items()}
    signatures = {name: _signatures(tree) for name, tree in trees.items()}
    known = bindings  # module -> its top-level names
    problems = []
    for name, table in tables.items():
        stack = [table]
        while stack:
            scope = stack.pop()
            for s in scope.get_symbols():
                if s.is_referenced() and s.is_global() and s.get_name() not in bindings[name] | MODULE_ATTRIBUTES \
                        and not hasattr(builtins, s.get_name()):
                    problems.append(f"{name}.py: {s.get_name()} (in {scope.get_name()}) is defined nowhere")
            stack.extend(scope.get_children())
        aliases = {}  # `import topology` (as t): the name it binds -> the technique file
        for node in ast.walk(trees[name]):
            if isinstance(node, ast.Import):
                aliases.update({(a.asname or a.name): a.name for a in node.names if a.name in known})
        for node in ast.walk(trees[name]):
            target = node.func if isinstance(node, ast.Call) else node
            if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    and target.value.id in aliases):
                continue
            module = aliases[target.value.id]
            if target.attr not in known[module]:
                problems.append(f"{name}.py: {module}.{target.attr} is not in {module}.py's core")
            elif isinstance(node, ast.Call) and signatures[module].get(target.attr) is not None:
                for keyword in node.keywords:
                    if keyword.arg is not None and keyword.arg not in signatures[module][target.attr]:
                        problems.append(f"{name}.py: {module}.{target.attr}(... {keyword.arg}=...): the core's "
                                        f"{target.attr} takes no {keyword.arg}")
    return sorted(set(problems))


def run_program(folder, argv, world, cwd, timeout=300, environ=True, script="train_gpt.py", env=None):
    """`torchrun --nproc_per_node=world train_gpt.py *argv` (without `environ`: `python3 train_gpt.py *argv`) of the
    train_gpt.py in `folder` (the cut cores, or the repository), run in `cwd` by forked processes (no interpreter
    start-up: each rank gets torchrun's environment, drops this process's copies of the repository's modules so that
    `folder`'s are imported, and runs the file as __main__). Returns [(exit code, stdout, stderr)] by rank; a rank
    still running after `timeout` seconds is killed. `script`: another file of `folder` (benchmarks/gpu_check.py,
    long_seq.py) run the same way; `env`: variables set in each rank's environment last."""
    import runpy
    import socket
    import torch._dynamo  # noqa: F401 (a process's first optimizer imports it, about 1 s: here once, then inherited)
    with socket.socket() as probe:  # a free port per launch
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    pids, outs = [], []
    for rank in range(world):
        outs.append([os.path.join(str(cwd), f"rank{rank}.{kind}") for kind in ("out", "err")])
        for path in outs[-1]:
            open(path, "w").close()
        pid = os.fork()
        if pid == 0:  # the rank
            code = 99
            try:
                import torch
                torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP thread pool
                for fd, path in enumerate(outs[-1], 1):
                    os.dup2(os.open(path, os.O_WRONLY), fd)
                sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
                os.chdir(str(cwd))
                os.environ["OMP_NUM_THREADS"] = "1"
                if environ:
                    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                else:
                    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
                        os.environ.pop(name, None)
                os.environ.update(env or {})
                for name in CORES:
                    sys.modules.pop(name, None)
                sys.path.insert(0, str(folder))
                sys.argv = [os.path.join(str(folder), script)] + list(argv)
                runpy.run_path(sys.argv[0], run_name="__main__")
                code = 0
            except SystemExit as e:
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 98
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    codes = exit_codes(pids, timeout)
    # errors="replace": a text model's sample is the bytes it drew, which need not be UTF-8
    return [(code, open(out, errors="replace").read(), open(err).read()) for code, (out, err) in zip(codes, outs)]


def exit_codes(pids, timeout):
    """Each forked process's exit code, in order; one still running `timeout` seconds from now is killed (97)."""
    deadline, codes = time.monotonic() + timeout, []
    for pid in pids:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = 97 << 8
                break
            time.sleep(0.01)
        codes.append(os.waitstatus_to_exitcode(status))
    return codes

