"""When is a rank's own plan ready? Pool plan + that rank's RankPlan + its row run tables, at 1M tokens.

What the background planner thread does per pool when it knows the rank's worker id (``worker=``,
passed by ``build_planner_from_args``): ``plan_pool`` (tiles, Alg. 2, exchange plan), then
``exchange.for_rank(w)`` and ``plan.exchange.runtime_tables.rank_tables`` (row runs, O(runs)). The pool's window
arrives -> the first pool's own plan is ready after exactly this much work (later pools of the window
queue behind it while earlier microbatches compute). Not on the planner thread, so not in "ready": the
runtime expands the run tables into index tensors at the plan's first use (``runtime.routes``; device
work on a GPU); the "expand" columns time that expansion with torch on the CPU, one thread.

Per case: P=8, CP=16 (128 workers), M=4, tau=0.03, zigzag, real linux-6.12 and wikipedia (both ship in
data/traces) pools after refined VRSP over GBS=128 windows; H=4, B=8192 with the paper's microbenchmark
heads and Qwen3-8B's, and the shipped 1M config (Qwen3-30B-A3B heads, H=2, B=4096). Every worker of
every pool is timed on a fresh ExchangePlan (nothing cached). Clock: thread CPU time (robust on a shared
box) and wall.
Also: ``rank_ready_s`` of the first pool of a submitted window through the real ``BackgroundPlanner``.

    .venv/bin/python benchmarks/bench_plan_ready.py [--pools 4] [--workers all|N] [--tiling uniform|adaptive]
                                                    [--kv-fetch group|prefix] [--gc auto|manual]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_balance import pack  # noqa: E402
from bench_planner import FULL_GC, between_pools, pools_of, set_gc_mode  # noqa: E402
from libra_megatron.config import LibraConfig  # noqa: E402
from libra_megatron.plan.exchange import build_exchange_plan, build_rank_tables  # noqa: E402
from libra_megatron.plan.layout import HeadLayout, TokenLayout  # noqa: E402
from libra_megatron.plan.pool import plan_pool  # noqa: E402
from libra_megatron.plan.traces import find_trace, load_trace  # noqa: E402
from libra_megatron.runtime.routes import upload_tables  # noqa: E402

L, P, CP, M = 1 << 20, 8, 16, 4
CASES = {  # label: ((hq, hkv, d), H, B)
    "paper 128/4/256 H=4": ((128, 4, 256), 4, 8192),
    "qwen3-8b H=4": ((32, 8, 128), 4, 8192),
    "q30b shipped H=2": ((32, 4, 128), 2, 4096),  # Qwen3-30B-A3B at configs/libra/1m.yaml's H and B
}
BUDGET_MS = 50.0


def _timed(fn):
    cpu, wall = time.thread_time(), time.perf_counter()
    out = fn()
    return out, (time.thread_time() - cpu) * 1e3, (time.perf_counter() - wall) * 1e3


def per_worker(pool, config, layout, heads, workers):
    """[(pool ms, rank ms, tables ms, total ms, expand ms, full-GC ms inside total)] CPU time per worker, and
    the same in wall time."""
    between_pools()
    gc_before = FULL_GC.ms
    plan, pool_cpu, pool_wall = _timed(lambda: plan_pool(pool, config, layout, heads, validate=False))
    pool_gc = FULL_GC.ms - gc_before
    cpu_rows, wall_rows = [], []
    for w in workers:
        fresh = build_exchange_plan(plan.tiles, plan.placement.assignment)
        gc_before = FULL_GC.ms
        rank_plan, r_cpu, r_wall = _timed(lambda: fresh.for_rank(w))
        tables, t_cpu, t_wall = _timed(lambda: build_rank_tables(rank_plan))
        gc_ms = pool_gc + FULL_GC.ms - gc_before
        _, e_cpu, e_wall = _timed(lambda: upload_tables(tables, "cpu"))
        cpu_rows.append((pool_cpu, r_cpu, t_cpu, pool_cpu + r_cpu + t_cpu, e_cpu, gc_ms))
        wall_rows.append((pool_wall, r_wall, t_wall, pool_wall + r_wall + t_wall, e_wall, gc_ms))
    return np.array(cpu_rows), np.array(wall_rows)


def planner_first_ready(pools, config, layout, heads, worker: int) -> list:
    """rank_ready_s (ms) of the first pool of each window submitted to a real BackgroundPlanner."""
    from libra_megatron.megatron.planner import BackgroundPlanner

    out = []
    with BackgroundPlanner(config, layout, heads, worker=worker, mode="thread") as planner:
        planner.warm_up()
        for window in (pools[i:i + 4] for i in range(0, len(pools), 4)):
            planner.submit_many(window)
            out.append(planner.get_pool(window[0]).rank_ready_s * 1e3)
            for pool in window[1:]:
                planner.get_pool(pool)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pools", type=int, default=4)
    ap.add_argument("--workers", default="all", help="'all' (128) or a number of evenly spaced workers")
    ap.add_argument("--tiling", default="adaptive", choices=["uniform", "adaptive"], help="uniform = the paper")
    ap.add_argument("--kv-fetch", default="prefix", choices=["group", "prefix"], help="group = the paper")
    ap.add_argument("--gc", choices=["auto", "manual"], default="auto",
                    help="auto: Python's garbage collector as is; manual: off, collected between pools "
                         "(Megatron's --manual-gc)")
    args = ap.parse_args()
    set_gc_mode(args.gc)
    torch.set_num_threads(1)  # thread CPU time sees only this thread: keep torch's expansion on it
    workers = list(range(P * CP)) if args.workers == "all" else list(np.linspace(0, P * CP - 1, int(args.workers),
                                                                                    dtype=int))
    layout = TokenLayout("zigzag", L, CP)
    traces = {}
    for name in ("linux-6.12-files.qwen.txt", "wikipedia-flexsp.txt"):
        try:
            traces[name.split("-")[0]] = pools_of(pack(load_trace(find_trace(name)), L), args.pools)
        except ValueError as exc:  # find_trace: not in $LIBRA_TRACE_DIR or data/traces
            print(f"({name}: {exc}; skipped)")
    print(f"1M M={M} P={P} CP={CP} tiling={args.tiling} kv_fetch={args.kv_fetch} gc={args.gc}; load average "
          f"{os.getloadavg()[0]:.1f}; ms per (pool, worker); expand = torch CPU expansion, not in ready; gc max = the "
          f"most full-GC time inside one worker's ready time")
    print(f"{'trace':<10}{'case':<21}{'clock':<6}{'pool':>7}{'rank':>7}{'tables':>8}{'ready med':>11}{'p90':>8}"
          f"{'max':>8}{'<=50ms':>8}{'expand med':>12}{'max':>8}{'gc max':>8}")
    for trace, pools in traces.items():
        for label, (dims, H, B) in CASES.items():
            heads = HeadLayout(*dims, H, M, elem_bytes=2)
            config = LibraConfig(pool_size=P, head_split=H, block_size=B, num_chunks=M, tiling=args.tiling,
                                 kv_fetch=args.kv_fetch)
            rows = [per_worker(pool, config, layout, heads, workers) for pool in pools]
            for clock, idx in (("cpu", 0), ("wall", 1)):
                r = np.concatenate([x[idx] for x in rows])
                ok = float(np.mean(r[:, 3] <= BUDGET_MS))
                print(f"{trace:<10}{label:<21}{clock:<6}{np.median(r[:, 0]):>7.1f}{np.median(r[:, 1]):>7.1f}"
                      f"{np.median(r[:, 2]):>8.1f}{np.median(r[:, 3]):>11.1f}{np.percentile(r[:, 3], 90):>8.1f}"
                      f"{r[:, 3].max():>8.1f}{ok:>8.0%}{np.median(r[:, 4]):>12.1f}{r[:, 4].max():>8.1f}"
                      f"{r[:, 5].max():>8.1f}")
            ready = planner_first_ready(pools, config, layout, heads, worker=0)
            print(f"{trace:<10}{label:<21}BackgroundPlanner(worker=0, thread): first pool of a window ready after "
                  f"{', '.join(f'{x:.1f}' for x in ready)} ms (wall)")


if __name__ == "__main__":
    main()
