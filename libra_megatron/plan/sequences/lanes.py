"""Sync-aware VRSP (``SequencePlacement.SYNC``): balance what the step waits for (``plan.sequences.sync``).

Pure Python + numpy. A *lane* is the P DP replicas that form a pool at every GA step (lane j = replicas
j*P .. j*P+P-1, ``plan.sequences.sync``). Pools meet every attention layer, lanes only at the step's gradient
reduction, so at PP=1 the step waits for the heaviest lane *total* over its GA microbatches, not for the
heaviest pool instance of every GA step (what ``refined``/``alg1`` balance). With PP, each lane is a
pipeline and uneven microbatches inside it also cost (bubbles).

``place_for_sync(flops, layout)`` at PP=1:
  1. lanes: the GBS sequences are split into DP/P lanes of exactly GA*P sequences by Algorithm 1 (LPT with
     exact cardinality, ``vrsp.place_alg1(flops, GA*P)``), then swaps between the heaviest and the
     lightest lane, each the pair whose difference is nearest half the gap (sorted search, O(n log n) per
     swap), while they lower the heaviest lane; this balances lane totals;
  2. pools: at PP=1 only lane totals count, so a lane's GA*P sequences are cut into its GA pool instances
     like with like (sorted by F, consecutive groups of P): a pool of similar sequences needs little tile
     migration, so TAP moves fewer bytes (the simulator: wikipedia 256K 2.79 vs 3.78 x the lower bound with
     Algorithm 1 inside lanes, linux 1.093 vs 1.139, 6 windows);
  3. the order is emitted GA-major, pool-minor: pool k = g*DP/P + j is lane j's g-th instance, so it runs
     at GA step g on lane j (``plan.sequences.assign_to_ranks``);
  4. guard: the order is scored under the same model with pool time = pool FLOPs
     (ideal TAP) against Algorithm 1's per-instance order, which wins if it is strictly better
     (``plan.sequences.sync.pool_step_timing``).
With PP > 1 the pool instances themselves are Algorithm 1's (already flat microbatches; a pool's simulated
time is not proportional to its F when a long document floors it, so re-cutting pools by F alone can lose):
they are dealt to lanes by exact-cardinality LPT over pool loads plus the same swaps, and each lane's
microbatches are put in the order (as dealt, lightest first, heaviest first, lightest at both ends) whose
pipeline is shortest under the proxy; the guard of step 4 follows. (Like-with-like pools at PP=2, 6 windows:
wikipedia 3.17 vs 4.55 x the lower bound, but linux 1.325 vs 1.142: uneven microbatches cost bubbles, and
the planner's F proxy cannot see the exchange bytes that would decide between them; ``place_sequences`` with the
sampler's pool prices runs ``plan.sequences.priced_lanes`` instead, which can.)
When an EP group ties lanes (``SyncLayout.ep_ties_lanes``), tied lanes wait for each other at every MoE
layer, so balancing lane totals does not help: the per-instance ``refined`` order is used. Deterministic
(stable sorts, fixed tie-breaks); the output is a permutation, so the step's sample multiset is kept.
"""
from __future__ import annotations

import bisect
import math
from typing import Optional

import numpy as np

from .vrsp import place_alg1, place_refined, pool_loads
from .sync import SyncLayout, pool_step_timing, run_lane_pipelines

__all__ = ["place_for_sync", "lane_loads", "sync_proxy_seconds", "lane_members", "like_with_like",
           "microbatch_orders", "priced_lanes_apply"]


def lane_loads(flops, order, data_parallel_size: int, pool_size: int) -> np.ndarray:
    """Sum of F over every lane's GA microbatches: float64 (DP/P,), lane j = pools k with k mod DP/P = j."""
    loads = pool_loads(flops, order, pool_size)
    return loads.reshape(-1, data_parallel_size // pool_size).sum(axis=0)


def sync_proxy_seconds(flops, order, layout: SyncLayout) -> float:
    """Step time under ``layout`` when a pool instance takes its summed F (TAP spreads it perfectly)."""
    loads = pool_loads(flops, order, layout.pool_size)
    return pool_step_timing(loads.reshape(layout.num_microbatches, layout.num_lanes), layout).seconds


def place_for_sync(flops, layout: SyncLayout, alg1: Optional[np.ndarray] = None) -> np.ndarray:
    """The SYNC order of ``flops`` (float64 (GBS,), GBS = GA*DP) under ``layout``: int64 (GBS,) permutation.
    ``alg1``: ``place_alg1(flops, P)`` when the caller has it already (computed here otherwise)."""
    flops = np.asarray(flops, dtype=np.float64).reshape(-1)
    gbs = layout.num_microbatches * layout.data_parallel_size
    if flops.size != gbs:
        raise ValueError(f"the window has {flops.size} sequences but GA*DP = {layout.num_microbatches}*"
                         f"{layout.data_parallel_size} = {gbs}")
    if not _lanes_run_apart(layout):  # nothing to gain from lanes: tied, a single lane, or lanes == instances
        return place_refined(flops, layout.pool_size)
    alg1 = place_alg1(flops, layout.pool_size) if alg1 is None else alg1
    if layout.pipeline_parallel_size > 1:
        by_lanes = _instances_to_lanes(flops, layout, alg1)
    else:
        by_lanes = _lanes_then_microbatches(flops, layout)
    if sync_proxy_seconds(flops, alg1, layout) < sync_proxy_seconds(flops, by_lanes, layout):
        return alg1
    return by_lanes


def _lanes_run_apart(layout: SyncLayout) -> bool:
    return not (layout.ep_ties_lanes or layout.num_lanes == 1 or layout.num_microbatches == 1)


def priced_lanes_apply(layout: SyncLayout) -> bool:
    """Whether the placement by priced pools (``plan.sequences.priced_lanes``) runs under ``layout``: lanes that run
    apart (no EP tie, several lanes, GA > 1) -- pipelines at PP > 1, the lanes' pool totals at PP = 1. With one lane (DP = P) the
    per-instance order stays: pricing it would make the step faster under the model (DP4 PP2 P4, 6 windows:
    linux 256K 1.166 -> 1.086, wikipedia 1.696 -> 1.540 x the bound) but its worst microbatch 3-5x the mean,
    which the paper's Fig. 12 and the ``libra/microbatch_*`` scalars hold against the sampler order (issue 26)."""
    return _lanes_run_apart(layout)


def lane_members(flops: np.ndarray, layout: SyncLayout) -> np.ndarray:
    """int64 [lanes, GA*P]: the window positions of every lane, as cut at PP = 1 (Algorithm 1 into groups of
    GA*P, then heaviest/lightest swaps on F)."""
    return _balanced_groups(flops, layout.num_microbatches * layout.pool_size, LANE_SWAPS_PER_GROUP)


def like_with_like(flops: np.ndarray, members: np.ndarray, pool_size: int) -> np.ndarray:
    """int64 [GA, P]: one lane's ``members`` cut like with like (sorted by F, decreasing; consecutive groups of P)."""
    return members[np.argsort(-flops[members], kind="stable")].reshape(-1, pool_size)


def microbatch_orders(seconds: np.ndarray) -> list:
    """The candidate microbatch orders along axis 0 of ``seconds`` [GA, ...] (each column a lane): as placed,
    lightest first, heaviest first, lightest at both ends (heaviest in the middle); int64 arrays of its shape."""
    seconds = np.asarray(seconds)
    ga = seconds.shape[0]
    rising = np.argsort(seconds, axis=0, kind="stable")
    ends = np.empty_like(rising)
    ends[: (ga + 1) // 2], ends[(ga + 1) // 2:] = rising[0::2], rising[1::2][::-1]
    placed = np.broadcast_to(np.arange(ga).reshape((ga,) + (1,) * (seconds.ndim - 1)), seconds.shape).copy()
    return [placed, rising, rising[::-1], ends]


def _lanes_then_microbatches(flops: np.ndarray, layout: SyncLayout) -> np.ndarray:
    ga, lanes, pool = layout.num_microbatches, layout.num_lanes, layout.pool_size
    grid = np.empty((ga, lanes, pool), dtype=np.int64)
    for lane, members in enumerate(lane_members(flops, layout)):  # at PP=1 only lane totals count: like with like
        grid[:, lane, :] = like_with_like(flops, members, pool)
    return grid.reshape(-1)


def _order_microbatches(flops: np.ndarray, grid: np.ndarray, layout: SyncLayout) -> np.ndarray:
    """Per lane, the microbatch order (``microbatch_orders``) that gives the shortest pipeline under the FLOPs
    proxy; the first of them on ties. ``grid`` [GA, lanes, P]."""
    loads = flops[grid].sum(axis=2)  # [GA, lanes]
    orders = microbatch_orders(loads)
    columns = np.concatenate([np.take_along_axis(loads, o, axis=0) for o in orders], axis=1)  # one simulation
    spans = run_lane_pipelines(columns, layout).makespan.reshape(len(orders), -1)
    best = spans.argmin(axis=0)  # [lanes]
    chosen = np.stack([orders[b][:, lane] for lane, b in enumerate(best.tolist())], axis=1)  # [GA, lanes]
    return np.take_along_axis(grid, chosen[:, :, None], axis=0)


def _instances_to_lanes(flops: np.ndarray, layout: SyncLayout, alg1: np.ndarray) -> np.ndarray:
    """PP > 1: Algorithm 1's pool instances, dealt to lanes (exact-cardinality LPT over pool loads, then swaps)
    and ordered inside each lane (``_order_microbatches``)."""
    ga, pool = layout.num_microbatches, layout.pool_size
    pools = alg1.reshape(-1, pool)  # [K, P]: Algorithm 1's order
    loads = flops[pools].sum(axis=1)
    by_lane = _balanced_groups(loads, ga, LANE_SWAPS_PER_GROUP)  # [lanes, GA] pool indices
    grid = pools[by_lane.T]  # [GA, lanes, P]
    return _order_microbatches(flops, grid, layout).reshape(-1)


def _balanced_groups(flops: np.ndarray, group_size: int, swaps_per_group: int) -> np.ndarray:
    """Algorithm 1 into groups of ``group_size``, then at most ``swaps_per_group`` * groups heaviest/lightest
    swaps: int64 [groups, group_size]."""
    start = place_alg1(flops, group_size).reshape(-1, group_size)
    return swap_heaviest_with_lightest(flops, start, swaps_per_group * start.shape[0]) if swaps_per_group else start


LANE_SWAPS_PER_GROUP = 8  # like plan.sequences: the loop almost always stops far earlier


def swap_heaviest_with_lightest(flops: np.ndarray, lanes: np.ndarray, max_swaps: int) -> np.ndarray:
    """Swaps between the heaviest and the lightest lane while they lower the heaviest (each strictly lowers
    the pair's maximum, so the sorted load vector falls and the loop ends). ``lanes`` [num_lanes, n]."""
    grid = lanes.copy()
    weights = flops[grid]
    loads = weights.sum(axis=1)
    for _ in range(max_swaps):
        heavy, light = int(loads.argmax()), int(loads.argmin())
        gap = float(loads[heavy] - loads[light])
        best = _nearest_half_gap(weights[heavy], weights[light], gap)
        if best is None:
            break
        slot_h, slot_l, moved = best
        grid[heavy, slot_h], grid[light, slot_l] = grid[light, slot_l], grid[heavy, slot_h]
        weights[heavy, slot_h], weights[light, slot_l] = weights[light, slot_l], weights[heavy, slot_h]
        loads[heavy] -= moved
        loads[light] += moved
    return grid


_SMALL_LANE = 16  # lanes of at most this many members are searched in plain Python (numpy's per-call cost dominates)


def _nearest_half_gap(heavy: np.ndarray, light: np.ndarray, gap: float):
    """(slot in heavy, slot in light, moved F) of the swap whose moved F = F_a - F_b is nearest gap/2 within
    (0, gap), i.e. the one leaving the smallest pair maximum; None if no swap lowers the heavier lane.

    Only the two neighbours of gap/2 in the light lane's sorted weights are scored for every a (a farther one is
    never nearer, and if a neighbour falls outside (0, gap) every weight beyond it does too); ties go to the first
    candidate in (left neighbours by a, then right neighbours by a) order. ``_nearest_half_gap_small`` is the same
    search, operation for operation, in plain Python for small lanes."""
    if not gap > 0:
        return None
    if light.size <= _SMALL_LANE:
        return _nearest_half_gap_small(heavy.tolist(), light.tolist(), gap)
    by_weight = np.argsort(light, kind="stable")
    sorted_light = light[by_weight]
    want = heavy - gap / 2.0  # the ideal F_b for every a
    right = np.minimum(np.searchsorted(sorted_light, want), light.size - 1)  # searchsorted gives 0 .. n
    left = np.maximum(right - 1, 0)
    candidates = np.concatenate([left, right])  # [2n]: both neighbours of every a
    moved = np.concatenate([heavy, heavy]) - sorted_light[candidates]
    score = np.where((moved > 0) & (moved < gap), np.abs(moved - gap / 2.0), np.inf)
    flat = int(score.argmin())
    if not np.isfinite(score.flat[flat]):
        return None
    return flat % heavy.size, int(by_weight[candidates[flat]]), float(moved[flat])


def _nearest_half_gap_small(heavy: list, light: list, gap: float):
    """``_nearest_half_gap`` (gap > 0) on Python lists: the same candidates, float operations and tie order."""
    by_weight = sorted(range(len(light)), key=light.__getitem__)  # stable, as argsort(kind="stable")
    sorted_light = [light[b] for b in by_weight]
    half, last = gap / 2.0, len(light) - 1
    rights = [min(bisect.bisect_left(sorted_light, f - half), last) for f in heavy]  # searchsorted, side="left"
    best, best_score = None, math.inf
    for block in ([max(r - 1, 0) for r in rights], rights):
        for a, (f, c) in enumerate(zip(heavy, block)):
            moved = f - sorted_light[c]
            if 0 < moved < gap:
                score = abs(moved - half)
                if score < best_score:
                    best, best_score = (a, by_weight[c], moved), score
    return best
