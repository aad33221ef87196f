"""Variance-Reduced Sequence Placement (§4.2): group the GBS packed sequences of one step into pools.

Pure Python + numpy. This module holds the three placers that need no layout; ``placement.place_sequences``
picks one (or ``lanes.place_for_sync``). Input ``flops`` (float64, GBS) are Eq. 4 workloads ``F_i`` (see
``workload.sequence_flops``). Output is a permutation ``order`` of ``range(GBS)`` in GA-major,
pool-minor order: pool k holds the original sequences ``order[k*P:(k+1)*P]``. The multiset of
sequences is preserved by construction (a permutation), so each optimizer step sees the same samples.

Methods (``SequencePlacement``):
  CONTIGUOUS  identity (sampler order).
  ALG1        Algorithm 1 exactly: sort by (-F_i, i); min-heap of (load_k, k) over non-full pools.
  REFINED     ALG1, then pairwise swaps between the heaviest pool and one of the 16 lightest pools
              while they lower the heaviest load (steepest descent on the pair maximum). Never worse
              than ALG1; on the shared traces within 0.01-0.03 pp of ``pool_lower_bound_counting``.
  SYNC        balance what the step waits for under ``plan.sequences.sync`` (lane totals, then each lane's
              microbatches): ``plan.sequences.lanes.place_for_sync``. It needs the step's ``SyncLayout``; without one
              (a single GA step: lanes are the instances) it is REFINED.
"""
from __future__ import annotations

import heapq
from typing import Tuple

import numpy as np

from ..model import check_pool_split

__all__ = ["pool_loads", "place_contiguous", "place_alg1", "place_refined"]

_MAX_SWAPS_PER_POOL = 8  # refinement stops after 8*K swaps (it almost always stops far earlier)
_SWAP_PARTNERS = 16  # the heaviest pool swaps with one of the 16 lightest pools


def _as_flops(flops) -> np.ndarray:
    flops = np.asarray(flops, dtype=np.float64).reshape(-1)
    if not np.isfinite(flops).all() or (flops < 0).any():
        raise ValueError("sequence flops must be finite and >= 0")
    return flops


def pool_loads(flops, order, pool_size: int) -> np.ndarray:
    """Aggregate workload of every pool: ``loads[k] = sum(F[order[k*P:(k+1)*P]])``. float64 (K,)."""
    flops = _as_flops(flops)
    order = np.asarray(order, dtype=np.int64).reshape(-1)
    num_pools = check_pool_split(order.size, pool_size)
    return flops[order].reshape(num_pools, pool_size).sum(axis=1)


def place_contiguous(flops: np.ndarray, pool_size: int) -> np.ndarray:
    return np.arange(flops.size, dtype=np.int64)


def place_alg1(flops: np.ndarray, pool_size: int) -> np.ndarray:
    """Algorithm 1 line by line. Stable sort of -F gives (decreasing F, increasing i).

    Heap entries (load_k, k) are distinct, so replacing the popped root (``heapreplace``) pops the same
    pools in the same order as a pop followed by a push.
    """
    num_pools = flops.size // pool_size
    by_weight = np.argsort(-flops, kind="stable")
    heap = [(0.0, k) for k in range(num_pools)]  # already a valid heap: sorted
    members = [[] for _ in range(num_pools)]
    weights = flops.tolist()
    for i in by_weight.tolist():
        load, k = heap[0]
        members[k].append(i)
        if len(members[k]) < pool_size:
            heapq.heapreplace(heap, (load + weights[i], k))
        else:
            heapq.heappop(heap)
    return np.asarray(members, dtype=np.int64).reshape(-1)


def _best_swap(weights: np.ndarray, loads: np.ndarray, heavy: int, heavy_load: float):
    """Best single swap between pool ``heavy`` and one of the lightest pools: (new pair max, a, pool, b).

    ``weights`` (K, P) holds F of every pool member. Swapping item a of the heavy pool with item b of
    pool k moves d = F_a - F_b of work and leaves loads (L_h - d, L_k + d); the smallest max(...) wins,
    first index in (a, partner, b) order on ties. Partners are the ``_SWAP_PARTNERS`` lightest pools
    (all pools when K is at most that), which keeps a step O(P^2 * partners) at GBS=1024. Swaps with
    d <= 0 are not masked: they score max(...) >= L_h, so they never pass the caller's ``< L_h`` test
    and never tie with a swap that does.
    """
    partners = loads.argsort(kind="stable")[:_SWAP_PARTNERS]
    if not loads[partners[-1]] < heavy_load:  # else the heaviest pool is not among them
        partners = partners[partners != heavy]
    pool_size = weights.shape[1]
    delta = weights[heavy][:, None] - weights[partners].reshape(1, -1)
    pair_max = np.maximum(heavy_load - delta, loads[partners].repeat(pool_size) + delta)
    best = int(pair_max.argmin())
    slot_a, flat_b = divmod(best, delta.shape[1])
    pool_index, slot_b = divmod(flat_b, pool_size)
    return float(pair_max.flat[best]), slot_a, int(partners[pool_index]), slot_b


def _refine_by_swaps(flops: np.ndarray, order: np.ndarray, pool_size: int) -> np.ndarray:
    """Steepest-descent swaps on the heaviest pool; each accepted swap strictly lowers the sorted load vector."""
    grid = order.reshape(-1, pool_size).copy()
    if grid.shape[0] < 2:
        return order
    weights = flops[grid]
    loads = weights.sum(axis=1)
    for _ in range(_MAX_SWAPS_PER_POOL * grid.shape[0]):
        heavy = int(loads.argmax())
        heavy_load = float(loads[heavy])
        pair_max, slot_a, other, slot_o = _best_swap(weights, loads, heavy, heavy_load)
        if not pair_max < heavy_load:
            break
        _swap(grid, weights, loads, (heavy, slot_a), (other, slot_o))
    return grid.reshape(-1)


def _swap(grid: np.ndarray, weights: np.ndarray, loads: np.ndarray, a: Tuple[int, int], b: Tuple[int, int]) -> None:
    """Exchange the sequences at grid cells ``a`` and ``b`` and move their weight difference between pools."""
    weight_a, weight_b = float(weights[a]), float(weights[b])
    moved = weight_a - weight_b
    grid[a], grid[b] = grid[b], grid[a]
    weights[a], weights[b] = weight_b, weight_a
    loads[a[0]] -= moved
    loads[b[0]] += moved


def place_refined(flops: np.ndarray, pool_size: int) -> np.ndarray:
    start = place_alg1(flops, pool_size)
    refined = _refine_by_swaps(flops, start, pool_size)
    # exact re-check (incremental float updates could drift for non-integer inputs)
    if pool_loads(flops, refined, pool_size).max() <= pool_loads(flops, start, pool_size).max():
        return refined
    return start
