"""Import direction (docs/architecture.md, STYLE.md): plan/ and sim/ are torch-free; only megatron/ imports
megatron; no import circle anywhere in libra_megatron; plan's rooms are entered through their faces; no file
over 500 lines; the default rates are stated once."""
import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "libra_megatron"
PATCHES = PACKAGE.parent / "patches"  # installs as libra_megatron.patches (setup.py package_dir)

FRESH_IMPORT = r"""
import importlib, pkgutil, sys
names = []
for pkg_name in ("libra_megatron.plan", "libra_megatron.sim"):
    try:
        pkg = importlib.import_module(pkg_name)
    except ModuleNotFoundError:
        continue
    names.append(pkg_name)
    for info in pkgutil.walk_packages(pkg.__path__, pkg_name + "."):
        importlib.import_module(info.name)
        names.append(info.name)
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron"))
print("IMPORTED", " ".join(names), "BAD", bad[:5])
sys.exit(1 if bad else 0)
"""


def test_plan_and_sim_import_without_torch_or_megatron():
    root = str(PACKAGE.parent)
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", FRESH_IMPORT], capture_output=True, text=True, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for module in ("plan.model.workload", "plan.sequences.vrsp", "plan.tiles.placement", "plan.tiles.tiles",
                   "plan.exchange.builder", "sim.runner"):
        assert "libra_megatron." + module in proc.stdout


def _module_parts(path: Path):
    if PATCHES in path.parents:
        return ("libra_megatron", "patches") + path.relative_to(PATCHES).with_suffix("").parts
    return path.relative_to(PACKAGE.parent).with_suffix("").parts


def _imports(path: Path):
    """Absolute module names imported by a file (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ".".join(_module_parts(path)[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
                out += [prefix] + [prefix + "." + alias.name for alias in node.names]
            else:
                out += [node.module] + [node.module + "." + alias.name for alias in node.names]
    return out


def _files(sub: str = ""):
    return sorted((PACKAGE / sub).rglob("*.py")) if (PACKAGE / sub).exists() else []


def _top(name: str) -> str:
    return name.split(".")[0]


def test_only_megatron_and_testing_packages_import_megatron():
    allowed = {PACKAGE / "megatron", PACKAGE / "testing"}
    offenders = [
        (str(f.relative_to(PACKAGE)), m)
        for f in _files()
        if not any(a in f.parents for a in allowed)
        for m in _imports(f)
        if _top(m) == "megatron"
    ]
    assert offenders == []


def test_runtime_imports_neither_megatron_nor_the_megatron_glue():
    offenders = [
        (str(f.relative_to(PACKAGE)), m)
        for f in _files("runtime")
        for m in _imports(f)
        if _top(m) == "megatron" or m.startswith("libra_megatron.megatron")
    ]
    assert offenders == []


def test_plan_and_sim_import_neither_torch_nor_runtime():
    offenders = [
        (str(f.relative_to(PACKAGE)), m)
        for sub in ("plan", "sim")
        for f in _files(sub)
        for m in _imports(f)
        if _top(m) in ("torch", "megatron") or m.startswith(("libra_megatron.runtime", "libra_megatron.megatron"))
    ]
    assert offenders == []


def test_patches_resolve_as_libra_megatron_patches():
    assert "libra_megatron.patches._base" in _imports(PATCHES / "get_batch.py")
    assert "libra_megatron.megatron_lm.missing_package_error" in _imports(PATCHES / "_base.py")


def test_import_scanner_sees_relative_and_absolute_imports():
    # the checker itself must be able to fail: it resolves both import styles
    assert "numpy" in _imports(PACKAGE / "plan" / "model" / "workload.py")
    sample = PACKAGE / "plan" / "tiles" / "placement.py"
    assert "libra_megatron.plan.tiles.alg2" in _imports(sample)
    assert "libra_megatron.plan.exchange" in _imports(sample)
    assert "libra_megatron.config.TilePlacement" in _imports(sample)


def test_nothing_outside_testing_imports_testing():
    """testing/ is the test harness (CPU shims, gloo runner, CPU driver): product code never depends on it."""
    testing = PACKAGE / "testing"
    product = _files() + sorted(PATCHES.rglob("*.py"))  # patches/ ships with the package
    product += sorted((PACKAGE.parent / "scripts").glob("*.py"))  # and scripts/pretrain_gpt_libra.py is product
    offenders = [
        (str(f.relative_to(PACKAGE.parent)), m)
        for f in product
        if testing not in f.parents
        for m in _imports(f)
        if m.startswith("libra_megatron.testing")
    ]
    assert offenders == []
    # the scanner resolves the relative imports testing/ itself uses
    assert "libra_megatron.testing.cpu_shims" in _imports(testing / "train_cpu.py")


# ---- the module graph: no circle, faces, sizes -------------------------------------------------------------------

ROOMS = ("sequences", "tiles", "exchange", "model")  # plan's sub-packages (docs/architecture.md)
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = _module_parts(path)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(files=None):
    """{module: set of modules it imports} over ``files`` (default: every file of libra_megatron and patches/),
    lazy imports included. An import points at the longest module of the set it names (``from .x import f`` ->
    ``.x``; ``from .room import f`` -> the room's ``__init__``); the parent packages Python initialises on the
    way are not edges (a package's own files are loaded while it initialises)."""
    files = files if files is not None else _files() + sorted(PATCHES.rglob("*.py"))
    modules = {_module_name(f): f for f in files}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for imported in _imports(path):
            parts = imported.split(".")
            for cut in range(len(parts), 0, -1):
                target = ".".join(parts[:cut])
                if target in modules:
                    if target != name:
                        edges.add(target)
                    break
        graph[name] = edges
    return graph


def _cycles(graph):
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1
        stack.append(root); on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1
                    stack.append(child); on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop(); on_stack.discard(member); component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_circle_in_libra_megatron():
    graph = _graph()
    assert len(graph) > 80  # every file was scanned
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_circle(tmp_path):
    # the checker must be able to fail: two files of a package importing each other, and a longer ring
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_rooms_are_entered_through_their_faces():
    """Outside ``plan/<room>/``, libra_megatron imports a room by its ``__init__`` only."""
    offenders = []
    for name, targets in _graph().items():
        for target in targets:
            parts = target.split(".")
            if len(parts) == 4 and parts[:2] == ["libra_megatron", "plan"] and parts[2] in ROOMS:
                room = ".".join(parts[:3])
                if name != room and not name.startswith(room + "."):
                    offenders.append((name, target))
    assert offenders == []
    # the rule can fail: a room's private module seen from outside is an offender
    sample = _graph([PACKAGE / "plan" / "tiles" / "placement.py", PACKAGE / "plan" / "tiles" / "alg2.py"])
    assert "libra_megatron.plan.tiles.alg2" in sample["libra_megatron.plan.tiles.placement"]


def test_plan_rooms_import_in_one_direction():
    """sequences and tiles may use exchange and model; exchange uses model; model uses no other room."""
    allowed = {"sequences": {"model"}, "tiles": {"exchange", "model"}, "exchange": {"model"}, "model": set()}
    offenders = []
    for name, targets in _graph().items():
        parts = name.split(".")
        if len(parts) < 3 or parts[:2] != ["libra_megatron", "plan"] or parts[2] not in ROOMS:
            continue
        for target in targets:
            t = target.split(".")
            if t[:2] == ["libra_megatron", "plan"] and len(t) > 2 and t[2] in ROOMS and t[2] != parts[2] \
                    and t[2] not in allowed[parts[2]]:
                offenders.append((name, target))
            if t[:2] == ["libra_megatron", "plan"] and len(t) > 2 and t[2] == "pool":
                offenders.append((name, target))
    assert offenders == []


def test_no_file_over_500_lines():
    long = {str(f.relative_to(PACKAGE)): n for f in _files()
            if (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_default_rates_are_stated_once():
    """The default rates are assigned in plan/model/rates.py and nowhere else; the simulator's flags read them."""
    names = {"DEFAULT_ATTN_TFLOPS", "DEFAULT_INTRA_NODE_GBPS", "DEFAULT_INTER_NODE_GBPS", "DEFAULT_GPUS_PER_NODE"}
    homes = []
    for f in _files():
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                homes += [(str(f.relative_to(PACKAGE)), t.id) for t in targets
                          if isinstance(t, ast.Name) and t.id in names]
    assert sorted(homes) == sorted(("plan/model/rates.py", n) for n in names)
    assert "libra_megatron.plan.model.DEFAULT_ATTN_TFLOPS" in _imports(PACKAGE / "sim" / "__main__.py")


RATE_FIELDS = {"attn_tflops", "intra_node_gbps", "inter_node_gbps", "gpus_per_node", "collective_us",
               "intra_message_us", "inter_message_us", "kernel_launch_us", "kernel_entry_us", "copy_gbps",
               "gather_gbps", "place_gbps", "add_gbps", "widen_gbps", "elementwise_gbps", "copy_launch_us"}


def _literal_rate_defaults(tree) -> list:
    """Rate defaults written as number literals: ``field: float = 50.0`` in a class body, ``def f(...,
    inter_node_gbps=50.0)`` and ``add_argument("--inter-node-gbps", default=50.0)``."""
    def number(node) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in RATE_FIELDS \
                and node.value is not None and number(node.value) \
                and not (node.target.id == "gpus_per_node" and node.value.value == 0):  # 0: "one node", a switch
            out.append(node.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.args + node.args.kwonlyargs
            defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults + node.args.kw_defaults
            out += [a.arg for a, d in zip(args, defaults) if a.arg in RATE_FIELDS and d is not None and number(d)]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args \
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).lstrip("-").replace("-", "_") in RATE_FIELDS:
            out += [node.args[0].value for k in node.keywords if k.arg == "default" and number(k.value)]
    return out


def test_no_rate_default_is_written_as_a_number_outside_rates():
    """Every default of a time-model rate (``StepTimeModel``'s fields, the simulator's and harness' flags) reads
    ``plan/model/rates.py``: a literal ``inter_node_gbps: float = 50.0`` elsewhere is a second home."""
    found = {str(f.relative_to(PACKAGE)): _literal_rate_defaults(ast.parse(f.read_text(encoding="utf-8")))
             for f in _files() if f.name != "rates.py"}
    assert {k: v for k, v in found.items() if v} == {}
    probe = ast.parse("class C:\n    copy_gbps: float = 3.0\ndef f(attn_tflops=1.0): pass\n"
                      "p.add_argument('--inter-node-gbps', default=50.0)\n")
    assert sorted(map(str, _literal_rate_defaults(probe))) == ["--inter-node-gbps", "attn_tflops", "copy_gbps"]
