"""Every benchmark script imports cleanly (its module-level code and imports still match the package).

Benchmarks are run by hand for the README numbers; this catches a renamed helper before a user does.
"""
import importlib.util
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.rglob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=[str(p.relative_to(BENCH)) for p in SCRIPTS])
def test_benchmark_script_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)  # __main__ guard: defines, does not run
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
