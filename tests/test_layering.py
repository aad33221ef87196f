"""Import direction (STYLE.md): plan/ and sim/ are torch-free; only megatron/ imports megatron."""
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
    for module in ("plan.workload", "plan.sequences", "plan.placement", "plan.tiles"):
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
    assert "numpy" in _imports(PACKAGE / "plan" / "workload.py")
    sample = PACKAGE / "plan" / "placement.py"
    assert "libra_megatron.plan.tiles" in _imports(sample)
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
