"""Planner latency at the two reference shapes: build_tiles, place_tiles, build_exchange_plan, one RankPlan.

Segments: linux-6.12 document lengths (real trace), Megatron-style packing (concatenate, cut every L).
Prints medians over --repeats runs of each stage, measured in this one run, and the share of the budget.

    .venv/bin/python benchmarks/bench_plan_exchange.py [--repeats 15] [--method alg2] [--validate]
                                                       [--tiling uniform|adaptive] [--kv-fetch group|prefix]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from libra_megatron.plan.exchange import build_exchange_plan, validate_plan
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.tiles import build_tiles, place_tiles

from libra_megatron.testing.traces import packed_trace_segments

SHAPES = {  # name: (L, P, CP, B, H, M, budget_ms for the whole pool plan)
    "1M": (1 << 20, 8, 16, 8192, 4, 2, 50.0),
    "256K": (1 << 18, 8, 8, 4096, 1, 4, 20.0),
}


def packed_segments(L: int, P: int, rng) -> list:
    """P packed sequences of L tokens from the real Linux trace (GPTDataset-style packing)."""
    return packed_trace_segments(rng, P, L)


def time_ms(fn, repeats: int):
    samples, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), out


def bench(name: str, repeats: int, method: str, seed: int, validate: bool, tiling: str = "adaptive",
          kv_fetch: str = "prefix") -> None:
    L, P, CP, B, H, M, budget = SHAPES[name]
    layout, heads = TokenLayout("zigzag", L, CP), HeadLayout(32, 8, 128, H, M)  # Qwen3-8B heads
    segs = packed_segments(L, P, np.random.default_rng(seed))
    t_tiles, tiles = time_ms(lambda: build_tiles(segs, layout, heads, B, tiling=tiling, kv_fetch=kv_fetch), repeats)
    t_place, placement = time_ms(lambda: place_tiles(tiles, 0.03, method), repeats)
    t_exch, plan = time_ms(lambda: build_exchange_plan(tiles, placement.assignment), repeats)
    t_rank, _ = time_ms(lambda: build_exchange_plan(tiles, placement.assignment).ranks[0], repeats)
    total = t_tiles + t_place + t_exch
    print(f"{name}: L={L} P={P} CP={CP} B={B} H={H} M={M} tiles={tiles.num_tiles} workers={tiles.num_workers} "
          f"method={method} tiling={tiling} kv_fetch={kv_fetch}")
    print(f"  build_tiles {t_tiles:7.2f} ms | place_tiles {t_place:7.2f} ms | build_exchange_plan {t_exch:7.2f} ms"
          f" | total {total:7.2f} ms = {total / budget:.2f} x budget {budget:.0f} ms")
    print(f"  build_exchange_plan + materialise rank 0: {t_rank:7.2f} ms "
          f"({t_rank / t_exch:.1f}x the pool-wide build); R=max/mean {placement.max_over_mean:.3f}; "
          f"bytes q/kv/o {plan.bytes_q}/{plan.bytes_kv}/{plan.bytes_o}")
    if validate:
        t_all, _ = time_ms(lambda: list(build_exchange_plan(tiles, placement.assignment).ranks), 1)
        t_val, _ = time_ms(lambda: validate_plan(plan, tiles), 1)
        print(f"  materialise all {tiles.num_workers} rank plans {t_all:9.1f} ms | validate_plan {t_val:9.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--method", default="alg2", choices=["home", "alg2", "refined"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--validate", action="store_true", help="also time all rank plans + validate_plan (slow)")
    ap.add_argument("--tiling", default="adaptive", choices=["uniform", "adaptive"], help="uniform = the paper")
    ap.add_argument("--kv-fetch", default="prefix", choices=["group", "prefix"], help="group = the paper")
    args = ap.parse_args()
    for name in SHAPES:
        bench(name, args.repeats, args.method, args.seed, args.validate, args.tiling, args.kv_fetch)


if __name__ == "__main__":
    main()
