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



def _run_bench(name: str, *args: str) -> str:
    """A benchmark script's stdout, run as the README runs it (from the repository root); it must exit 0."""
    import subprocess

    out = subprocess.run([sys.executable, str(BENCH / name), *args], capture_output=True, text=True, timeout=600,
                         cwd=BENCH.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_planner_stall_benchmark_runs_the_shipped_yaml_through_a_planner_process():
    """The README's stall command, shrunk: the shipped 256K YAML (``num_chunks: auto``) planned by a planner process
    beside the stand-in loop; it must finish and print the process row with pools planned (it once stopped on a
    ValueError that only a run could show)."""
    stdout = _run_bench("bench_planner_stall.py", "--seconds", "0.5", "--rounds", "1", "--pools", "1",
                        "--modes", "process", "--cases", "256K", "--traces", "linux")
    rows = [line.split() for line in stdout.splitlines() if line.startswith("256K")]
    assert [r[2] for r in rows] == ["none", "process"], stdout
    assert int(rows[1][7]) > 0, stdout  # pools planned while the loop ran


def test_backward_local_first_study_still_hooks_the_schedule():
    """``bench_backward_local_first.py`` swaps ``plan.exchange.schedule._bwd_kernel`` for its candidate (it broke once
    when the schedule's functions were renamed): one real linux pool, and the candidate's layer differs from the
    shipped one, so the swap reached the op lists."""
    stdout = _run_bench("bench_backward_local_first.py", "--pools", "1", "--trace", "linux")
    pool = next(line.split() for line in stdout.splitlines() if line.strip().startswith("pool 0:"))
    shipped, every = float(pool[3]), float(pool[6])
    assert shipped > 0 and every != shipped, stdout


def test_pp_bounds_benchmark_finds_the_whale_window():
    """``bench_pp_bounds.py`` as docs/results.md runs it, without the shipped step (no planning): on the wikipedia
    trace at PP = 4 window 2 holds a pool no grouping avoids whose critical path alone is longer than the simulator's
    balanced bound, windows 0 and 1 do not; the summary is max(path, bound) over the bound."""
    stdout = _run_bench("bench_pp_bounds.py", "--trace", "data/traces/wikipedia-flexsp.txt", "--pp", "4",
                        "--windows", "3", "--no-step")
    ratios = [float(line.split("lower bound ")[1]) for line in stdout.splitlines() if line.startswith("window")]
    assert len(ratios) == 3 and ratios[0] < 1 and ratios[1] < 1 and ratios[2] > 1.1, stdout
    summary = float(stdout.split("max(path, lower bound) / lower bound ")[1].split()[0])
    assert 1.0 < summary < ratios[2], stdout
