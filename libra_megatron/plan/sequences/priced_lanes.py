"""Priced lanes (issue 26, PP > 1): each lane's pool grouping and microbatch order chosen by priced pool seconds.

Pure Python + numpy. At PP > 1 the shipped sync placement (``lanes.place_for_sync``) deals Algorithm 1's pools to
lanes and orders each lane's microbatches by F = sum l^2, a proxy that cannot see exchange time or the floor a
long document puts under a pool. Here the lanes are cut as at PP = 1 (Algorithm 1 into groups of GA*P plus
swaps, on F), and inside every lane the candidate groupings (``lane_groupings``: like with like, Algorithm 1 over
the lane) are priced pool by pool -- seconds of the plan TAP makes for the pool, forward and backward, from the
time model -- and the lane keeps the grouping and microbatch order whose simulated pipeline is shortest
(``choose_lane``). A lane decides from its own pools only: lanes meet at the step's gradient reduction, so the
choice of one lane does not change another's time.

Not yet run by the Megatron sampler: it emits a window's order before its pools are planned, and this needs the
plans of every candidate pool of a lane first (the planner's look-ahead). ``benchmarks/bench_pp_priced_lanes.py``
measures what it would gain under the model. Every order is a permutation of the window (the multiset is kept).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np

from .lanes import lane_members, like_with_like, microbatch_orders
from .sync import SyncLayout, run_lane_pipelines
from .vrsp import place_alg1

__all__ = ["GROUPINGS", "lane_groupings", "microbatch_orders", "choose_lane", "assemble_order"]

GROUPINGS = ("like", "alg1")


def lane_groupings(flops, layout: SyncLayout) -> List[Dict[str, np.ndarray]]:
    """Per lane, every candidate grouping of its GA*P sequences: {name: int64 [GA, P] window positions}. Lanes
    as ``place_for_sync`` cuts them at PP = 1 (Algorithm 1 into groups of GA*P, then swaps on F)."""
    flops = np.asarray(flops, dtype=np.float64).reshape(-1)
    ga, pool = layout.num_microbatches, layout.pool_size
    if flops.size != ga * layout.data_parallel_size:
        raise ValueError(f"the window has {flops.size} sequences but GA*DP = {ga}*{layout.data_parallel_size}")
    out = []
    for lane in lane_members(flops, layout):
        out.append({"like": like_with_like(flops, lane, pool),
                    "alg1": lane[place_alg1(flops[lane], pool)].reshape(ga, pool)})
    return out


def choose_lane(priced: Dict[str, Tuple[np.ndarray, np.ndarray]], layout: SyncLayout) -> Tuple[str, np.ndarray, float]:
    """(grouping name, microbatch order [GA], makespan) of one lane: ``priced[name]`` = (forward, backward)
    seconds [GA] of that grouping's pools (one attention layer, the pool's slowest worker per phase). Every
    grouping's every ``microbatch_orders`` candidate runs through the lane's pipeline (``run_lane_pipelines``);
    the shortest wins, ties keeping the earlier grouping (``GROUPINGS`` order) and order."""
    unknown = sorted(set(priced) - set(GROUPINGS))
    if unknown:
        raise ValueError(f"unknown groupings {unknown}: priced lanes compares {GROUPINGS}")
    best = None
    for name in (g for g in GROUPINGS if g in priced):
        fwd, bwd = (np.asarray(x, dtype=np.float64).reshape(-1) for x in priced[name])
        if fwd.size != layout.num_microbatches or bwd.size != fwd.size:
            raise ValueError(f"grouping {name!r}: {fwd.size} forward / {bwd.size} backward seconds for "
                             f"GA = {layout.num_microbatches} pools")
        orders = microbatch_orders(fwd + bwd)
        spans = run_lane_pipelines(np.stack([fwd[o] for o in orders], axis=1), layout,
                                   np.stack([bwd[o] for o in orders], axis=1)).makespan
        k = int(np.argmin(spans))
        if best is None or spans[k] < best[2]:
            best = (name, orders[k], float(spans[k]))
    if best is None:
        raise ValueError(f"no grouping priced: expected some of {GROUPINGS}, got {sorted(priced)}")
    return best


def assemble_order(chosen: Sequence[np.ndarray], layout: SyncLayout) -> np.ndarray:
    """The window's run order (GA-major, pool-minor: pool g*lanes + j is lane j's g-th microbatch) from every
    lane's chosen pools in run order, ``chosen[j]`` int64 [GA, P]."""
    ga, lanes, pool = layout.num_microbatches, layout.num_lanes, layout.pool_size
    if len(chosen) != lanes:
        raise ValueError(f"{len(chosen)} lanes chosen, the layout has {lanes}")
    grid = np.stack([np.asarray(c, dtype=np.int64).reshape(ga, pool) for c in chosen], axis=1)  # [GA, lanes, P]
    return grid.reshape(-1)
