"""Priced lanes (issue 26): at PP > 1 each lane's pool grouping and microbatch order chosen by priced pool seconds;
at PP = 1 the lanes' pools swapped until the lanes' priced totals are even (``balance_lane_seconds``).

Pure Python + numpy. At PP > 1 a lane is a pipeline, so uneven microbatches cost bubbles, and what a pool
instance costs is not its F = sum l^2: a long document's K/V prefix, the exchange TAP needs and the per-token
copies are priced by the whole-layer model, not by F. Here the lanes are cut as at PP = 1 (Algorithm 1 into
groups of GA*P plus swaps, on F), and inside every lane the candidate groupings (``lane_groupings``: like with
like, Algorithm 1 over the lane) are priced pool by pool -- ``pool_seconds(pools)`` gives every pool's forward
and backward seconds -- and the lane keeps the grouping and microbatch order whose simulated pipeline is
shortest (``choose_lanes``). A lane decides from its own pools only: lanes meet at the step's gradient
reduction, so the choice of one lane does not change another's time.

``place_for_pipelines`` is what ``place_sequences(..., SYNC, layout, pool_seconds)`` runs at PP > 1: the priced
lanes, Algorithm 1's order and the sampler order are scored by the same sync model with the same pool seconds
(``priced_step_seconds``) and the fastest is kept (ties: that order), so it is never slower than Algorithm 1's or
the sampler's under the model it is given. (The F-proxy sync order, ``lanes.place_for_sync``, was a fourth
candidate; under priced pools it never won -- 18 simulated windows of both traces at PP 2 / 4 / VPP 2, and 12
GBS-1024 layouts of the VRSP benchmark -- and its ~1 ms now pays for the balancing below.) The lanes were cut
by F, so their pipelines are not even in seconds: ``balance_lane_pipelines`` then swaps the winner's pools whole
between the lane whose pipeline is longest and the one shortest (each lane re-ordered, every swap priced by both
pipelines), and the result is kept where the model finds it faster (``fastest_balanced``). The sampler and
the simulator give it ``plan.sequences.pool_proxy`` (priced pools without plans: VRSP runs before the planner);
``benchmarks/bench_pp_priced_lanes.py`` gives it the plans' own priced seconds to measure what the proxy leaves.
Every order is a permutation of the window (the multiset is kept). Deterministic.
"""
from __future__ import annotations

import functools
import itertools
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from .lanes import LANE_SWAPS_PER_GROUP, lane_members, like_with_like, microbatch_orders, swap_heaviest_with_lightest
from .sync import SyncLayout, run_lane_pipelines
from .vrsp import place_alg1, place_contiguous

__all__ = ["GROUPINGS", "CANDIDATES", "lane_groupings", "microbatch_orders", "choose_lanes", "assemble_order",
           "priced_lane_order", "priced_step_seconds", "place_for_pipelines", "fastest_balanced",
           "balance_lane_pipelines", "balance_lane_seconds", "PoolSeconds"]

PoolSeconds = Callable[[np.ndarray], Tuple[np.ndarray, np.ndarray]]  # pools [n, P] -> (forward [n], backward [n])
CANDIDATES = ("priced lanes", "alg1", "sampler")  # place_for_pipelines' orders, in tie-break order
EXHAUSTIVE_GA = 5  # up to this many microbatches a lane tries every order (5! = 120), after microbatch_orders'
PIPELINE_SWAP_CANDIDATES = 16  # pool swaps priced per round of balance_lane_pipelines (all of them up to GA = 4)
PIPELINE_SWAP_ROUNDS = 8  # at most this many swaps per balance_lane_pipelines call
# lanes of at most this many microbatches are evened (fastest_balanced): whole pools are coarse there (wikipedia 256K
# GA 4: the step -0.7..-7.4% per window); at GBS 1024 (GA 8-32) the same pass gained 0-0.17% for 1.5 ms at GA 32
PIPELINE_BALANCE_GA = 5

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


def choose_lanes(fwd, bwd, layout: SyncLayout) -> Tuple[np.ndarray, np.ndarray]:
    """(grouping int64 [lanes], microbatch order int64 [GA, lanes]) of every lane: ``fwd``, ``bwd`` [G, GA, lanes]
    = seconds of grouping g's pools (one attention layer, the pool's slowest worker per phase). Every grouping's
    every candidate order (``microbatch_orders``, and every permutation up to ``EXHAUSTIVE_GA`` microbatches) runs
    through the lane's pipeline (``run_lane_pipelines``, all in one call); the shortest wins, ties keeping the
    earlier grouping (``GROUPINGS`` order), then the earlier order."""
    fwd, bwd = (np.asarray(x, dtype=np.float64) for x in (fwd, bwd))
    if fwd.ndim != 3 or fwd.shape != bwd.shape or fwd.shape[1] != layout.num_microbatches:
        raise ValueError(f"choose_lanes needs forward and backward seconds [groupings, GA = {layout.num_microbatches}, "
                         f"lanes], got {fwd.shape} and {bwd.shape}")
    groupings, ga, lanes = fwd.shape
    # one column per (grouping, lane), grouping-major, each at its shortest order (the earlier on ties)
    spans, orders = _shortest_pipelines(fwd.transpose(1, 0, 2).reshape(ga, -1), bwd.transpose(1, 0, 2).reshape(ga, -1),
                                        layout)
    grouping = spans.reshape(groupings, lanes).argmin(axis=0)  # the first minimum: the earlier grouping
    chosen = orders.reshape(ga, groupings, lanes)[:, grouping, np.arange(lanes)]  # [GA, lanes]
    return grouping.astype(np.int64), chosen.astype(np.int64)


def _lane_orders(total: np.ndarray) -> np.ndarray:
    """int64 [O, GA, ...]: ``microbatch_orders`` of ``total`` [GA, ...], then every permutation of the GA microbatches
    when GA <= ``EXHAUSTIVE_GA`` (few microbatches per lane -- deep pipelines, large DP -- are where the order matters
    most: wikipedia 256K PP=4, GA 4: 2.114 -> 2.091 x the bound, PP=2 1.900 -> 1.868)."""
    orders = np.stack(microbatch_orders(total))
    ga = total.shape[0]
    if ga > EXHAUSTIVE_GA:
        return orders
    perms = _permutations(ga).reshape((-1, ga) + (1,) * (total.ndim - 1))
    return np.concatenate([orders, np.broadcast_to(perms, (perms.shape[0],) + total.shape)])


@functools.lru_cache(maxsize=8)
def _permutations(ga: int) -> np.ndarray:
    """int64 [GA!, GA]: every order of GA microbatches, lexicographic (read-only: it is shared)."""
    out = np.array(list(itertools.permutations(range(ga))), dtype=np.int64).reshape(-1, ga)
    out.setflags(write=False)
    return out


def _checked_seconds(pool_seconds: PoolSeconds, pools: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    fwd, bwd = (np.asarray(x, dtype=np.float64).reshape(-1) for x in pool_seconds(pools))
    n = pools.shape[0]
    if fwd.size != n or bwd.size != n:
        raise ValueError(f"pool_seconds gave {fwd.size} forward / {bwd.size} backward seconds for {n} pools")
    if not (np.isfinite(fwd).all() and np.isfinite(bwd).all() and (fwd >= 0).all() and (bwd >= 0).all()):
        raise ValueError("pool_seconds must give finite seconds >= 0 for every pool")
    return fwd, bwd


def priced_lane_order(flops, layout: SyncLayout, pool_seconds: PoolSeconds) -> np.ndarray:
    """The priced-lanes order (module docstring): int64 (GBS,) permutation, GA-major, pool-minor."""
    pool = layout.pool_size
    grid = np.stack([np.stack([g[name] for name in GROUPINGS]) for g in lane_groupings(flops, layout)])  # [lanes, G, GA, P]
    lanes, groupings, ga = grid.shape[:3]
    fwd, bwd = _checked_seconds(pool_seconds, grid.reshape(-1, pool))
    grouping, order = choose_lanes(fwd.reshape(lanes, groupings, ga).transpose(1, 2, 0),
                                   bwd.reshape(lanes, groupings, ga).transpose(1, 2, 0), layout)
    return assemble_order([grid[j, grouping[j]][order[:, j]] for j in range(lanes)], layout)


def priced_step_seconds(order, layout: SyncLayout, pool_seconds: PoolSeconds) -> float:
    """The step of ``order`` under the sync model (every lane's pipeline; the step waits for the slowest) with
    pool instance k's forward and backward seconds from ``pool_seconds``."""
    return float(_steps([order], layout, pool_seconds)[0])


def _steps(orders: Sequence[np.ndarray], layout: SyncLayout, pool_seconds: PoolSeconds) -> np.ndarray:
    """``priced_step_seconds`` of several orders: one ``pool_seconds`` call, one pipeline run."""
    ga, lanes = layout.num_microbatches, layout.num_lanes  # pool k = g*lanes + j: lane j's g-th microbatch
    pools = np.concatenate([np.asarray(o, dtype=np.int64).reshape(-1, layout.pool_size) for o in orders])
    fwd, bwd = (x.reshape(len(orders), ga, lanes).transpose(1, 0, 2).reshape(ga, -1)
                for x in _checked_seconds(pool_seconds, pools))
    return run_lane_pipelines(fwd, layout, bwd).makespan.reshape(len(orders), lanes).max(axis=1)


def place_for_pipelines(flops, layout: SyncLayout, pool_seconds: PoolSeconds, alg1=None) -> Tuple[np.ndarray, str]:
    """(order, the name in ``CANDIDATES`` of the order it came from): the fastest of the priced lanes, Algorithm
    1's order (``alg1`` when the caller has it) and the sampler order under ``priced_step_seconds`` (ties keep the
    earlier), its lanes then evened (``fastest_balanced``)."""
    flops = np.asarray(flops, dtype=np.float64).reshape(-1)
    alg1 = place_alg1(flops, layout.pool_size) if alg1 is None else np.asarray(alg1, dtype=np.int64)
    candidates = (priced_lane_order(flops, layout, pool_seconds), alg1, place_contiguous(flops, layout.pool_size))
    order, best = fastest_balanced(candidates, layout, pool_seconds)
    return order, CANDIDATES[best]


def fastest_balanced(candidates: Sequence[np.ndarray], layout: SyncLayout,
                     pool_seconds: PoolSeconds) -> Tuple[np.ndarray, int]:
    """(order, index of the candidate it came from): the fastest of ``candidates`` under ``priced_step_seconds``
    (the first of equal steps), then, where lanes run at most ``PIPELINE_BALANCE_GA`` microbatches, its lanes'
    pipelines evened by ``balance_lane_pipelines`` where that is strictly faster under the same prices (a floor on
    the gain, 1%, against the proxy's noise was priced: wikipedia 256K 30B PP=2 1.649 -> 1.666, linux 8B 1.176 ->
    1.175; not kept)."""
    steps = _steps(candidates, layout, pool_seconds)
    best = int(np.argmin(steps))
    if layout.num_microbatches <= PIPELINE_BALANCE_GA:
        balanced, step = balance_lane_pipelines(candidates[best], layout, pool_seconds)
        if step < steps[best]:
            return balanced, best
    return np.asarray(candidates[best], dtype=np.int64), best


def balance_lane_pipelines(order, layout: SyncLayout, pool_seconds: PoolSeconds) -> Tuple[np.ndarray, float]:
    """PP > 1: ``order``'s pools swapped whole between the lane whose pipeline is longest and the one shortest,
    each lane in its shortest microbatch order (``_lane_orders``), while a swap shortens the longer of the two
    (at most ``PIPELINE_SWAP_ROUNDS``; each round prices the ``PIPELINE_SWAP_CANDIDATES`` swaps whose summed
    seconds move nearest half the two lanes' gap, every one by both lanes' pipelines, in one run). Pools keep
    their sequences (priced once) and the step never gets longer under ``pool_seconds``: the lanes' pipelines are
    each the shortest of their candidate orders, which include the order given. Returns (int64 (GBS,), GA-major,
    pool-minor; its step under ``pool_seconds``: the longest lane's pipeline)."""
    ga, lanes = layout.num_microbatches, layout.num_lanes
    pools = _order_pools(order, layout, "balance_lane_pipelines")
    fwd, bwd = _checked_seconds(pool_seconds, pools)
    by_lane = np.arange(ga * lanes).reshape(ga, lanes).T.copy()  # [lanes, GA] pool indices, in run order
    span, run_order = _shortest_pipelines(fwd[by_lane.T], bwd[by_lane.T], layout)  # [lanes], [GA, lanes]
    for _ in range(PIPELINE_SWAP_ROUNDS):
        long, short = int(span.argmax()), int(span.argmin())
        if long == short:
            break
        trial_long, trial_short = _swap_trials(fwd + bwd, by_lane[long], by_lane[short])  # [S, GA] each
        trials = np.concatenate([trial_long, trial_short]).T  # [GA, 2S]
        spans, orders = _shortest_pipelines(fwd[trials], bwd[trials], layout)
        count = len(trial_long)
        pair = np.maximum(spans[:count], spans[count:])
        k = int(pair.argmin())  # the first of equal maxima
        if pair[k] >= span[long]:
            break
        for lane, trial, column in ((long, trial_long[k], k), (short, trial_short[k], count + k)):
            by_lane[lane], span[lane], run_order[:, lane] = trial, spans[column], orders[:, column]
    chosen = [pools[by_lane[j][run_order[:, j]]] for j in range(lanes)]
    return assemble_order(chosen, layout), float(span.max())


def _order_pools(order, layout: SyncLayout, caller: str) -> np.ndarray:
    """int64 [GA*DP/P, P]: the window's pools of ``order`` (GA-major, pool-minor); a wrong size is a ValueError."""
    order = np.asarray(order, dtype=np.int64).reshape(-1)
    expected = layout.num_microbatches * layout.data_parallel_size
    if order.size != expected:
        raise ValueError(f"{caller}: the order has {order.size} positions but GA*DP = {layout.num_microbatches}*"
                         f"{layout.data_parallel_size} = {expected}")
    return order.reshape(-1, layout.pool_size)


def _shortest_pipelines(fwd: np.ndarray, bwd: np.ndarray, layout: SyncLayout) -> Tuple[np.ndarray, np.ndarray]:
    """(makespan [C], microbatch order int64 [GA, C]) of every column's shortest candidate order (``_lane_orders``;
    ties: the earlier) for pools' seconds ``fwd``, ``bwd`` [GA, C] -- all of them in one pipeline run."""
    orders = _lane_orders(fwd + bwd)  # [O, GA, C]
    count, ga, columns = orders.shape
    cols_f = np.take_along_axis(fwd[None], orders, axis=1).transpose(1, 0, 2).reshape(ga, -1)
    cols_b = np.take_along_axis(bwd[None], orders, axis=1).transpose(1, 0, 2).reshape(ga, -1)
    spans = run_lane_pipelines(cols_f, layout, cols_b).makespan.reshape(count, columns)
    best = spans.argmin(axis=0)
    every = np.arange(columns)
    return spans[best, every], orders[best, :, every].T


def _swap_trials(total: np.ndarray, long: np.ndarray, short: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The two lanes (pool indices [GA]) after each candidate swap of one pool of ``long`` with one of ``short``:
    the ``PIPELINE_SWAP_CANDIDATES`` whose moved seconds (``total`` per pool) are nearest half the lanes' gap
    (stable: the earlier pair on ties). Returns ([S, GA], [S, GA])."""
    moved = total[long][:, None] - total[short][None, :]  # [GA, GA]
    half_gap = 0.5 * float(total[long].sum() - total[short].sum())
    pick = np.argsort(np.abs(moved - half_gap).reshape(-1), kind="stable")[:PIPELINE_SWAP_CANDIDATES]
    slot_long, slot_short = np.divmod(pick, short.size)
    rows = np.arange(pick.size)
    trial_long = np.repeat(long[None], pick.size, axis=0)
    trial_short = np.repeat(short[None], pick.size, axis=0)
    trial_long[rows, slot_long], trial_short[rows, slot_short] = short[slot_short], long[slot_long]
    return trial_long, trial_short


def balance_lane_seconds(order, layout: SyncLayout, pool_seconds: PoolSeconds) -> np.ndarray:
    """PP = 1 (a lane runs its pools one after another, so its time is their sum): ``order``'s pools swapped whole
    between the lane priced heaviest and the one priced lightest (forward + backward of ``pool_seconds``, priced
    once: a pool keeps its sequences, only its lane changes) by ``lanes.swap_heaviest_with_lightest`` -- the F
    lanes' own swap rule: each time the swap leaving the smaller pair maximum, while it lowers the heavier lane, at
    most ``LANE_SWAPS_PER_GROUP`` per lane. The heaviest lane never gets heavier under the prices, and the window's
    multiset and every pool are kept. int64 (GBS,), GA-major, pool-minor (pool g*lanes + j: lane j's g-th
    microbatch; at PP = 1 its position in the lane does not matter)."""
    ga, lanes = layout.num_microbatches, layout.num_lanes
    pools = _order_pools(order, layout, "balance_lane_seconds")
    fwd, bwd = _checked_seconds(pool_seconds, pools)
    by_lane = np.arange(ga * lanes).reshape(ga, lanes).T  # [lanes, GA] pool indices
    by_lane = swap_heaviest_with_lightest(fwd + bwd, by_lane, LANE_SWAPS_PER_GROUP * lanes)
    return pools[by_lane.T].reshape(-1)


def assemble_order(chosen: Sequence[np.ndarray], layout: SyncLayout) -> np.ndarray:
    """The window's run order (GA-major, pool-minor: pool g*lanes + j is lane j's g-th microbatch) from every
    lane's chosen pools in run order, ``chosen[j]`` int64 [GA, P]."""
    ga, lanes, pool = layout.num_microbatches, layout.num_lanes, layout.pool_size
    if len(chosen) != lanes:
        raise ValueError(f"{len(chosen)} lanes chosen, the layout has {lanes}")
    grid = np.stack([np.asarray(c, dtype=np.int64).reshape(ga, pool) for c in chosen], axis=1)  # [GA, lanes, P]
    return grid.reshape(-1)
