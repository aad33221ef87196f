"""Attention-workload proxies and the lower bounds every balancer is measured against (§2.3, §3.2).

Pure numpy. Units: workloads are query-key pair counts up to a constant factor -- Eq. 2 uses
``sum_j l_j^2`` per packed sequence; Eq. 6 (``TileSet.tile_flops``) counts causal pairs per tile.
Imbalance is reported as ``R - 1`` with ``R = max / mean`` (§3.2).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = [
    "sequence_flops",
    "causal_pairs",
    "entry_pair_heads",
    "attention_flops",
    "check_pool_split",
    "balanced_step_seconds",
    "pool_lower_bound",
    "pool_lower_bound_counting",
    "worker_lower_bound",
    "imbalance",
    "clt_expected_imbalance",
]


def sequence_flops(seq_segments: Sequence[Sequence[int]]) -> np.ndarray:
    """Eq. 2 / Eq. 4: ``F_i = sum_j l_ij^2`` for every packed sequence i. float64 (n,).

    ``seq_segments[i]`` are the document lengths (tokens, > 0) packed into sequence i.
    Integer-valued float64 is exact up to 2**53 (far above (1M tokens)^2 * 1024 sequences).
    """
    out = np.empty(len(seq_segments), dtype=np.float64)
    for i, seg in enumerate(seq_segments):
        lengths = np.asarray(seg, dtype=np.float64).reshape(-1)
        if (lengths <= 0).any():
            raise ValueError(f"sequence {i}: document lengths must be positive, got min {lengths.min()}")
        out[i] = float(np.dot(lengths, lengths))
    return out


def check_pool_split(num_sequences: int, pool_size: int) -> int:
    """K = GBS / P; ValueError names P and the arithmetic when P does not divide the number of sequences."""
    if pool_size < 1:
        raise ValueError(f"pool_size (P) must be >= 1, got {pool_size}")
    if num_sequences % pool_size:
        raise ValueError(
            f"pool_size (P) {pool_size} must divide the number of packed sequences (GBS) "
            f"{num_sequences} ({num_sequences} % {pool_size} = {num_sequences % pool_size})"
        )
    return num_sequences // pool_size


def pool_lower_bound(flops, pool_size: int) -> float:
    """Lower bound on the heaviest pool load of ANY grouping into K = n/P pools of exactly P sequences.

    ``max(sum(F)/K, max_i F_i + (sum of the P-1 smallest other F))``: the heaviest pool is at least
    the mean pool, and the pool that receives the largest sequence also receives P-1 others.
    """
    flops = np.sort(np.asarray(flops, dtype=np.float64).reshape(-1))
    num_pools = check_pool_split(flops.size, pool_size)
    if flops.size == 0:
        return 0.0
    mean_bound = float(flops.sum()) / num_pools
    outlier_bound = float(flops[-1] + flops[: pool_size - 1].sum())
    return max(mean_bound, outlier_bound)


def worker_lower_bound(work, num_workers: int) -> float:
    """Lower bound on the max worker load when indivisible ``work`` items go to ``num_workers``: max(sum/W, max)."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    work = np.asarray(work, dtype=np.float64).reshape(-1)
    if work.size == 0:
        return 0.0
    return max(float(work.sum()) / num_workers, float(work.max()))


def imbalance(loads) -> float:
    """``R - 1 = max(loads) / mean(loads) - 1`` (§3.2). 0 for perfect balance; 0 when all loads are 0."""
    loads = np.asarray(loads, dtype=np.float64).reshape(-1)
    if loads.size == 0:
        raise ValueError("imbalance() needs at least one load")
    mean = float(loads.mean())
    if mean == 0.0:
        return 0.0
    return float(loads.max()) / mean - 1.0


def clt_expected_imbalance(cv: float, pool_size: int, num_sequences: int) -> float:
    """Eq. 3: ``E[R] - 1 ~= CV/sqrt(P) * sqrt(2 ln(D/P))`` for random grouping of D = GBS sequences.

    An analytical approximation (CLT + Gaussian maximum), not a bound; 0 when there is one pool.
    """
    if pool_size < 1 or num_sequences < pool_size:
        raise ValueError(
            f"need 1 <= pool_size (P) <= num_sequences (D), got P={pool_size}, D={num_sequences}"
        )
    num_pools = num_sequences / pool_size
    if num_pools <= 1:
        return 0.0
    return float(cv) / math.sqrt(pool_size) * math.sqrt(2.0 * math.log(num_pools))


def pool_lower_bound_counting(flops, pool_size: int) -> float:
    """A tighter lower bound on the heaviest pool (>= ``pool_lower_bound``), by counting heavy sequences.

    For j in [0, P) and x in [1, K], any grouping puts j+1 or more of the T = j*K + x heaviest sequences
    into at least x pools (pigeonhole). Those x pools hold at least the x*(j+1) lightest of the top T
    plus x*(P-j-1) further sequences, each at least as heavy as the lightest outside the top T; the
    heaviest of the x pools carries at least their average. (j=0, x=1 is the outlier bound.)
    """
    desc = np.sort(np.asarray(flops, dtype=np.float64).reshape(-1))[::-1]
    num_pools = check_pool_split(desc.size, pool_size)
    if desc.size == 0:
        return 0.0
    prefix = np.concatenate([[0.0], np.cumsum(desc)])
    j = np.arange(pool_size)[:, None]
    x = np.arange(1, num_pools + 1)[None, :]
    top = j * num_pools + x
    heavy_part = prefix[top] - prefix[top - x * (j + 1)]
    light_part = prefix[desc.size] - prefix[desc.size - x * (pool_size - j - 1)]
    counting = float(((heavy_part + light_part) / x).max())
    return max(pool_lower_bound(flops, pool_size), counting)


def causal_pairs(a: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Eq. 6 inner sum: sum_{q=a}^{e-1} (q+1) causal query-key pairs for doc-local rows [a, e)."""
    a = np.asarray(a, dtype=np.int64)
    e = np.asarray(e, dtype=np.int64)
    return e * (e + 1) // 2 - a * (a + 1) // 2


def entry_pair_heads(q_len, k_len, q_heads_per_shard: int) -> np.ndarray:
    """Eq. 6 load of varlen entries: bottom-right causal pairs of q_len queries over k_len keys x heads."""
    n = np.asarray(q_len, dtype=np.int64)
    e = np.asarray(k_len, dtype=np.int64)
    return (n * (e - n) + n * (n + 1) // 2) * int(q_heads_per_shard)


def attention_flops(pair_heads, head_dim: int) -> np.ndarray:
    """Forward attention FLOPs of ``pair_heads`` (causal pairs x query heads): 4 * d * pair_heads (2*d for Q K^T
    and 2*d for P V per pair and head)."""
    return 4.0 * head_dim * np.asarray(pair_heads, dtype=np.float64)
