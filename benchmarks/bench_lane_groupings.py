"""Extra pool groupings per lane at PP > 1 (issue 26), priced by the simulator before anything ships.

The shipped priced lanes (``plan.sequences.priced_lanes``) try two groupings of every lane's GA*P sequences --
like with like, and Algorithm 1 inside the lane -- price each pool with the pool proxy, keep per lane the grouping
and microbatch order whose pipeline is shortest, then keep the fastest of that order, Algorithm 1's and the
sampler's under the same proxy, its lanes' pipelines then evened by whole-pool swaps. This script adds candidate
groupings to the first step and runs the same guard (public ``choose_lanes`` / ``assemble_order`` /
``fastest_balanced``), then prices every resulting order with the simulator's plans (``sim.runner.sync_timings``:
whole layer, peers coupled):

    halves     each pool takes P/2 consecutive sequences of the lane's heavier half (by F) and the mirror P/2 of its
               lighter half: microbatches more even than like with like, each half still homogeneous
    pairswap   like-with-like pools i and GA-1-i exchange their second halves

It prints step / lower bound per window and over the windows for: shipped, Algorithm 1, the sampler order and
shipped plus each extra grouping. The shipped column is recomputed here and checked equal to the placement's.

    .venv/bin/python benchmarks/bench_lane_groupings.py --trace data/traces/wikipedia-flexsp.txt --pp 2 [--vpp 2]
        [--windows 8] [--model qwen3-30b-a3b]      (256K, GBS 128, DP 32, CP 8, configs/libra/256k.yaml)
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from libra_megatron.plan.sequences.lanes import lane_members, like_with_like  # noqa: E402
from libra_megatron.plan.sequences.priced_lanes import (GROUPINGS, assemble_order, choose_lanes,  # noqa: E402
                                                        fastest_balanced, lane_groupings)
from libra_megatron.plan.sequences.vrsp import place_alg1, place_contiguous  # noqa: E402
from libra_megatron.sim import runner  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pp_priced_lanes import simulated_windows  # noqa: E402


def halves(flops, lane, pool, ga):
    ranked = lane[np.argsort(-flops[lane], kind="stable")]
    half = pool // 2
    heavy = ranked[: ga * half].reshape(ga, half)
    light = ranked[ga * half:].reshape(ga, pool - half)[::-1]
    return np.concatenate([heavy, light], axis=1)


def pair_swap(flops, lane, pool, ga):
    grid = like_with_like(flops, lane, pool).copy()
    half = pool // 2
    for i in range(ga // 2):
        j = ga - 1 - i
        grid[i, half:], grid[j, half:] = grid[j, half:].copy(), grid[i, half:].copy()
    return grid


EXTRA = {"halves": halves, "pairswap": pair_swap}
VARIANTS = {"shipped": (), "+halves": ("halves",), "+pairswap": ("pairswap",)}  # extra groupings beside GROUPINGS


def guarded_order(flops, layout, pool_seconds, extra):
    """``place_for_pipelines`` with the shipped ``priced_lanes.lane_groupings`` of every lane plus the groupings
    ``extra``: the priced lanes, then the fastest of them, Algorithm 1's and the sampler's under ``pool_seconds``
    (ties: the earlier), its lanes' pipelines evened (``fastest_balanced``)."""
    ga, pool = layout.num_microbatches, layout.pool_size
    grids = np.stack([np.stack([shipped[n] for n in GROUPINGS] + [EXTRA[n](flops, lane, pool, ga) for n in extra])
                      for lane, shipped in zip(lane_members(flops, layout), lane_groupings(flops, layout))])
    lanes = grids.shape[0]
    fwd, bwd = (np.asarray(x, dtype=np.float64).reshape(lanes, grids.shape[1], ga).transpose(1, 2, 0)
                for x in pool_seconds(grids.reshape(-1, pool)))
    grouping, order = choose_lanes(fwd, bwd, layout)
    priced = assemble_order([grids[j, grouping[j]][order[:, j]] for j in range(lanes)], layout)
    alg1 = place_alg1(flops, pool)
    candidates = (priced, alg1, place_contiguous(flops, pool))
    return fastest_balanced(candidates, layout, pool_seconds)[0]


def main(argv=None) -> None:
    args, spec, corpus, num_windows, ev, cand, layout = simulated_windows(__doc__, argv)
    names = ("placed", "alg1", "contiguous") + tuple(VARIANTS)
    totals = dict.fromkeys(names + ("lower_bound",), 0.0)
    start = time.perf_counter()
    for w in range(num_windows):
        win = runner._window_data(corpus, w, spec)
        pool_seconds = runner.window_pool_seconds(corpus, win.ids, cand.pool_size, spec)
        orders = runner._orders(win.flops, cand.pool_size, spec, pool_seconds)
        for variant, groupings in VARIANTS.items():
            orders[variant] = guarded_order(win.flops, layout, pool_seconds, groupings)
        assert np.array_equal(orders["shipped"], orders["placed"]), "the recomputed shipped order differs"
        timings, _ = runner.sync_timings(cand, ev, win, orders, spec)
        for name in totals:
            totals[name] += timings[name].seconds
        bound = timings["lower_bound"].seconds
        print(f"window {w}: " + "  ".join(f"{n} {timings[n].seconds / bound:.3f}" for n in names), flush=True)
    print(f"PP={args.pp} VPP={args.vpp} {args.model}, {os.path.basename(args.trace)}, step / lower bound over "
          f"{num_windows} windows: "
          + ", ".join(f"{n} {totals[n] / totals['lower_bound']:.3f}" for n in names)
          + f" ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
