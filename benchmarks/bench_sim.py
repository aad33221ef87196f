"""Simulator wall time: serial vs forked windows, and where the time goes, measured in one run.

Run:  .venv/bin/python benchmarks/bench_sim.py --trace data/traces/linux-6.12-files.qwen.txt [--windows 4]

Setting: L=256K, GBS=128, DP=32, CP=8, P in {4, 8}, H in {1, 2}, B=4096, qwen3-30b-a3b heads. Prints the
seconds per window for jobs=1 and jobs=2 side by side (and their ratio), the share of wall time spent in
``plan.tiles.placement.place_tiles``, and checks that both runs produce identical JSON.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from libra_megatron.cli import ArgumentParser, run_cli  # noqa: E402
from libra_megatron.plan.traces import load_traces  # noqa: E402
from libra_megatron.sim.__main__ import build_parser, spec_from_args  # noqa: E402
from libra_megatron.sim.runner import run_simulation  # noqa: E402


def _spec(trace: str, windows: int):
    args = build_parser().parse_args([
        "--trace", trace, "--seq-len", "262144", "--gbs", "128", "--dp", "32", "--cp", "8",
        "--pool-size", "4", "8", "--head-split", "1", "2", "--block-size", "4096", "--model", "qwen3-30b-a3b",
        "--max-windows", str(windows), "--no-progress"])
    return spec_from_args(args)


def _timed(docs, spec, jobs: int):
    start = time.perf_counter()
    report = run_simulation(docs, spec, jobs=jobs).to_json()
    report.pop("runtime_seconds")
    return time.perf_counter() - start, report


def _placement_share(docs, spec) -> float:
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.runcall(run_simulation, docs, spec)
    total = time.perf_counter() - start
    stats = pstats.Stats(prof)
    placed = sum(v[3] for k, v in stats.stats.items() if k[2] == "place_tiles")
    return placed / total


def run(argv=None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True, action="append")
    parser.add_argument("--windows", type=int, default=4)
    args = parser.parse_args(argv)
    docs = load_traces(args.trace)
    spec = _spec(args.trace[0], args.windows)
    serial, rep1 = _timed(docs, spec, 1)
    forked, rep2 = _timed(docs, spec, 2)
    n = rep1["num_windows"]
    print(f"windows={n} candidates={len(rep1['candidates'])}")
    print(f"{'jobs=1 s/window':>16} {'jobs=2 s/window':>16} {'speedup':>8} {'identical':>10}")
    print(f"{serial / n:16.2f} {forked / n:16.2f} {serial / forked:8.2f} {str(rep1 == rep2):>10}")
    print(f"share of serial wall time in place_tiles (profiled run): {_placement_share(docs, spec):.0%}")



def main(argv=None) -> None:
    run_cli("bench_sim.py", run, argv)


if __name__ == "__main__":
    main()
