"""The package's module layout: no import cycles among mlx_mtp's modules.

Every import counts, at the top of a module or inside a function: an import
moved into a function to dodge a cycle still ties the two modules together
(docs/design.md, "Layout"). metal/ and convert/ are mlx_mtp.metal and
mlx_mtp.convert (pyproject's package-dir).
"""

import ast
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"mlx_mtp": ROOT / "mlx_mtp", "mlx_mtp.metal": ROOT / "metal",
            "mlx_mtp.convert": ROOT / "convert"}


def project_modules() -> dict:
    """Dotted module name -> source file, for every module of the package."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _from_module(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` statement in `module` names."""
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    return base


def _imported(module: str, is_package: bool, node, modules) -> set:
    """The project modules one import statement names."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = _from_module(module, is_package, node)
        # `from pkg import name`: the submodule pkg.name when there is one, else pkg
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                   for a in node.names]
    found = set()
    for target in targets:
        while target and target not in modules:  # `import a.b.c` of a non-module c
            target = target.rpartition(".")[0]
        if target:
            found.add(target)
    return found


def import_graph() -> dict:
    """Module -> the project modules it imports anywhere in its source."""
    modules = project_modules()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[module] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module] |= _imported(module, is_package, node, modules) - {module}
    return graph


def find_cycle(graph: dict):
    """One import cycle as a list of modules (first == last), or None."""
    state = {}  # module -> "open" while on the path, "done" after
    path = []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_graph_sees_known_imports():
    graph = import_graph()
    assert "mlx_mtp.cache" in graph["mlx_mtp.cycle"]
    assert "mlx_mtp.metal" in graph["mlx_mtp.cycle"]  # `from . import metal`
    assert "mlx_mtp.convert.interrupts" in graph["mlx_mtp.convert.common"]  # in functions


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_hides_a_lazy_export():
    """The package's functions load on first use (PEP 562 `__getattr__`);
    importing a submodule binds its name on the package, so a submodule named
    like an export would hide the function. Only `generate.py` (the CLI's
    `-m` entry) shares a name, and no project module imports it."""
    import mlx_mtp

    graph = import_graph()
    for name in mlx_mtp._EXPORTS:
        module = f"mlx_mtp.{name}"
        importers = sorted(m for m, deps in graph.items() if module in deps)
        assert not importers, f"{importers} import {module}, hiding mlx_mtp.{name}()"
    code = ("import mlx_mtp, mlx_mtp.cli, mlx_mtp.server, mlx_mtp.distributed;"
            "assert all(callable(getattr(mlx_mtp, n)) for n in mlx_mtp._EXPORTS), "
            "[n for n in mlx_mtp._EXPORTS if not callable(getattr(mlx_mtp, n))]")
    import subprocess

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def cycle_files() -> list:
    """The project files one greedy depth-2 cycle runs through: one
    `Batch.step()` in steady state (a cycle launched, the one before it read,
    its tokens handed out as events), eager so that the cycle's own Python
    runs (a compiled cycle runs the same graph without it), on the demo
    model's Qwen3.5 family, on this machine's kernel backend."""

    import mlx_mtp
    from mlx_mtp.batch import make_batch

    model, tok = mlx_mtp.load()
    batch = make_batch(model, draft_tokens=2, compiled=False)
    batch.add([batch.prepare(tok.encode("def f(x):"), None, 40)])
    for _ in range(3):
        list(batch.step())
    files = set()

    def record(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        if event == "call" and ROOT in path.parents and "tests" not in path.parts:
            files.add(path.relative_to(ROOT).as_posix())

    sys.setprofile(record)
    try:
        events = list(batch.step())
    finally:
        sys.setprofile(None)
    assert events and batch.current is not None  # a cycle read, the next one launched
    return sorted(files)


def test_the_documented_walk_of_one_cycle_is_the_trace(monkeypatch):
    """docs/design.md ("One cycle, file by file") names exactly the files one
    decode cycle runs through, on the CPU's kernel backend (pinned: a Mac's
    or a GPU's would add the self-check and launch files)."""
    monkeypatch.setenv("MLX_MTP_KERNELS", "ref")
    files = cycle_files()
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("### One cycle, file by file", 1)[1].split("\n#", 1)[0]
    listed = sorted(set(re.findall(r"^\s*((?:mlx_mtp|metal)/[\w/]+\.py)", section, re.M)))
    assert listed == files, (listed, files)


ROWS, COPIES = "mlx_mtp.rows", {("dataclasses", "replace"), ("copy", "copy"),
                                ("copy", "deepcopy"), ("copy", "replace")}


def row_builders(module: str, is_package: bool, source: str) -> list:
    """The functions of one module that could make a `rows.Request` without
    `Batch.prepare`'s checks: any use of the class, by whatever name an
    import bound it to (a call, `functools.partial`, `__new__`, handed on;
    not an annotation, not `isinstance`), and, in a module importing the
    class or its module, a copy of a request (`dataclasses.replace`,
    `copy.copy`, ... of a name saying request: elsewhere, as in the
    server's handler, a request is an HTTP request)."""
    tree = ast.parse(source)
    classes, row_modules, copiers = set(), set(), set()  # local names bound by imports
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _from_module(module, is_package, node)
            for a in node.names:
                local = a.asname or a.name
                if base == ROWS and a.name == "Request":
                    classes.add(local)
                elif f"{base}.{a.name}" == ROWS:
                    row_modules.add(local)
                elif (base, a.name) in COPIES:
                    copiers.add(local)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == ROWS:
                    row_modules.add(a.asname or a.name)
    annotations = set()  # nodes inside annotations and isinstance's classes
    for node in ast.walk(tree):
        notes = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            notes = [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                            args.vararg, args.kwarg) if a is not None]
            notes.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            notes = [node.annotation]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
            notes = [node.args[1]]
        for note in notes:
            if note is not None:
                annotations.update(ast.walk(note))
    where = {}  # node -> the innermost function holding it
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                where[node] = fn.name

    def dotted(node) -> str:
        return (node.id if isinstance(node, ast.Name) else
                f"{dotted(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) else "")

    def names_a_request(node) -> bool:
        name = dotted(node).rpartition(".")[2].lower()
        return "request" in name or name.startswith("req")

    found = []
    for node in ast.walk(tree):
        if node in annotations:
            continue
        uses_class = (isinstance(node, ast.Name) and node.id in classes
                      and isinstance(node.ctx, ast.Load)) or (
            isinstance(node, ast.Attribute) and node.attr == "Request"
            and dotted(node.value) in row_modules)
        copies = (classes or row_modules) and isinstance(node, ast.Call) and node.args \
            and names_a_request(node.args[0]) and (
            dotted(node.func) in copiers
            or tuple(dotted(node.func).rsplit(".", 1)) in COPIES)
        if uses_class or copies:
            found.append(where.get(node, "<module>"))
    return found


def test_rows_are_built_only_by_batch_prepare():
    """One front door for a row: `Batch.prepare` is the one place in the
    package that makes a `Request` (api.py, decode.py and the server lane
    call it), so every row's arguments pass the same checks."""
    builders = []
    for module, path in project_modules().items():
        for fn in row_builders(module, path.name == "__init__.py", path.read_text()):
            builders.append((path.relative_to(ROOT).as_posix(), fn))
    assert builders == [("mlx_mtp/batch.py", "prepare")], builders


@pytest.mark.parametrize("source", [
    "from .rows import Request\ndef f(): return Request([1])",
    "from .rows import Request as R\ndef f(): return R([1])",
    "from . import rows as r\ndef f(): return r.Request([1])",
    "import mlx_mtp.rows\ndef f(): return mlx_mtp.rows.Request([1])",
    "from .rows import Request\ndef f(): return functools.partial(Request, [1])",
    "from .rows import Request\ndef f(): return object.__new__(Request)",
    "from .rows import Request\nMAKE = Request\ndef f(): return MAKE([1])",
    "import dataclasses\nfrom .rows import Request\n"
    "def f(request: Request): return dataclasses.replace(request, prompt=[1])",
    "from dataclasses import replace as r\nfrom . import rows\n"
    "def f(req): return r(req, prompt=[1])",
    "import copy\nfrom .rows import Request\ndef f(self): return copy.copy(self.request)",
])
def test_the_front_door_detector_sees_every_way_to_build_a_row(source):
    assert row_builders("mlx_mtp.api", False, source), source


def test_the_front_door_detector_passes_what_builds_no_row():
    source = ("import urllib.request\nfrom dataclasses import replace\n"
              "from .rows import Request\nfrom typing import List\n"
              "def f(x: Request, args) -> List[Request]:\n"
              "    urllib.request.Request('http://x')\n    replace(args, seed=1)\n"
              "    y: Request = x\n    return isinstance(x, Request)\n")
    assert row_builders("mlx_mtp.api", False, source) == []
    # (an HTTP request copied where the row class is not imported)
    source = "import copy\ndef fork(request): return copy.copy(request)"
    assert row_builders("mlx_mtp.server.handler", False, source) == []


def test_the_server_lane_reads_nothing_private_of_the_generator():
    """lane.py asks the generation thread (generation.py) through its public
    methods (`fetch`, `store`, `render`, `from_rank0`, ...), never through
    mlx_lm's or our private attributes: the seam stays one interface."""
    tree = ast.parse((ROOT / "mlx_mtp" / "server" / "lane.py").read_text())
    private = sorted({f"{node.value.id}.{node.attr}" for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and node.attr.startswith("_")
                      and not node.attr.startswith("__")
                      and isinstance(node.value, ast.Name) and node.value.id == "gen"}
                     | {f"self.gen.{node.attr}" for node in ast.walk(tree)
                        if isinstance(node, ast.Attribute) and node.attr.startswith("_")
                        and isinstance(node.value, ast.Attribute)
                        and node.value.attr == "gen"})
    assert not private, private


ENGINE = ("mlx_mtp/batch.py", "mlx_mtp/cycle.py", "mlx_mtp/rows.py", "mlx_mtp/stats.py",
          "mlx_mtp/held_cache.py", "mlx_mtp/sampling.py", "mlx_mtp/cache.py",
          "mlx_mtp/model.py", "mlx_mtp/prefill.py", "mlx_mtp/depth.py", "mlx_mtp/families/",
          "metal/")


@contextmanager
def host_reads():
    """Records where arrays move to the host while it is open: the code
    objects calling numpy's converters (`np.array`, `np.asarray`,
    `np.asanyarray`, what `np.stack` calls, `np.ascontiguousarray`: of
    anything, the engine's files convert only device arrays), `np.concatenate`
    of an MLX array (it converts in C, unseen by a profiler: wrapped), or an
    MLX array's `.tolist()` / `.item()` or implicit reads (`bool(x)`, `int(x)`,
    `float(x)`, `__index__`: nanobind methods, which a profiler does not see:
    wrapped). A read made inside numpy is the caller's, outside numpy."""
    import mlx.core as mx
    import numpy as np

    numpy_dir = str(Path(np.__file__).parent)
    converters = (np.array, np.asarray, np.asanyarray, np.ascontiguousarray)
    codes = []

    def note(frame):
        while frame is not None and frame.f_code.co_filename.startswith(numpy_dir):
            frame = frame.f_back
        codes.append(frame.f_code)

    methods = {name: getattr(mx.array, name)
               for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")}

    def wrapped(method):
        def read(self, *a, **k):
            note(sys._getframe(1))
            return method(self, *a, **k)
        return read

    concatenate = np.concatenate

    def concatenate_read(arrays, *a, **k):
        if any(isinstance(x, mx.array) for x in arrays):
            note(sys._getframe(1))
        return concatenate(arrays, *a, **k)

    def record(frame, event, arg):
        if event == "c_call" and any(arg is c for c in converters):
            note(frame)

    for name, method in methods.items():
        setattr(mx.array, name, wrapped(method))
    np.concatenate = concatenate_read
    sys.setprofile(record)
    try:
        yield codes
    finally:
        sys.setprofile(None)
        np.concatenate = concatenate
        for name, method in methods.items():
            setattr(mx.array, name, method)


def transfers(guided: bool) -> set:
    """Where one steady-state `Batch.step()` at depth 2 moves arrays to the
    host (`host_reads` made by the engine's files: (file, function)), greedy
    or with a grammar on its row; eager, so the cycle's Python runs."""
    import mlx_mtp
    from mlx_mtp.batch import make_batch

    model, tok = mlx_mtp.load()
    batch = make_batch(model, draft_tokens=2, compiled=False)
    constraint = mlx_mtp.constrain(regex=r"[a-z =:()\n]+") if guided else None
    batch.add([batch.prepare(tok.encode("def f(x):"), None, 40, constraint=constraint,
                             tokenizer=tok)])
    for _ in range(3):
        list(batch.step())
    with host_reads() as codes:
        events = list(batch.step())
    assert events
    sites = set()
    for code in codes:
        path = Path(code.co_filename)
        if ROOT in path.parents:
            name = path.relative_to(ROOT).as_posix()
            if name.startswith(ENGINE):
                sites.add((name, code.co_name))
    return sites


def test_only_the_batch_reads_the_device(monkeypatch):
    """One place reads the device: in a steady-state cycle every host
    transfer the engine makes is the batch's, its cycle's one read
    (`Batch._read`) and, under a grammar, the drafts read between a drafted
    cycle's two graphs (`Batch._launch`, for the masks); the graphs (cycle.py)
    read nothing."""
    monkeypatch.setenv("MLX_MTP_KERNELS", "ref")
    monkeypatch.delenv("MLX_MTP_CHECK_COUNTS", raising=False)  # (its check reads counters)
    assert transfers(guided=False) == {("mlx_mtp/batch.py", "_read")}
    assert transfers(guided=True) == {("mlx_mtp/batch.py", "_read"),
                                      ("mlx_mtp/batch.py", "_launch")}


def test_the_host_read_detector_sees_every_kind_of_read():
    """`host_reads` sees each way a device array reaches the host (in the
    function that asks, also through numpy's own functions), and not a
    device-side call nor numpy work on host arrays."""
    import operator

    import mlx.core as mx
    import numpy as np

    def branch(x):
        if x[0]:
            return 1

    kinds = [np.array, np.asarray, np.asanyarray, np.ascontiguousarray,
             lambda x: np.stack([x, x]), lambda x: np.concatenate([x, x]),
             lambda x: x.tolist(), lambda x: x[0].item(), lambda x: bool(x[0]),
             lambda x: int(x[0]), lambda x: float(x[0]), lambda x: operator.index(x[0]),
             lambda x: [0, 1, 2][x[0]], branch]
    for kind in kinds:
        def reads(x, kind=kind):
            kind(x)
            mx.add(x, x)
        with host_reads() as codes:
            reads(mx.array([1, 2]))
        asks = getattr(kind, "__code__", reads.__code__)  # (a numpy function: its caller)
        assert codes and set(codes) == {asks}, (kind, [c.co_name for c in codes])

    with host_reads() as codes:
        y = np.arange(2)
        np.concatenate([y, y]), np.add(y, y), mx.add(mx.array(1), 1)
    assert codes == []
    x = mx.array(3)  # (restored)
    assert x.item() == 3 and x.tolist() == 3 and int(x) == 3 and bool(x) and float(x) == 3
    assert operator.index(x) == 3 and np.concatenate([x[None], x[None]]).tolist() == [3, 3]
