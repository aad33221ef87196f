"""Local varlen entries (issue 14, Pipeliner §4.4): what a destination can compute before any exchange arrives.

Pure numpy. A destination's varlen entry i reads arranged-Q rows [q_lo, q_hi) and arranged-KV rows
[k_lo, k_hi). Every arranged row arrives over a forward route from one source worker; the rows whose source
is the destination itself travel in the all_to_all's *self segment*, which is already in this rank's send
buffer when the exchange is launched. An entry is **local** when none of its Q rows and none of its key rows
comes from another worker: the runtime places the self segment, computes the local entries while the
dispatch is in flight, and computes the remote entries after it arrived (``runtime.libra_attn._fwd``).

One rule, two views of the same run tables:
    ``rank_local_entries(rank_plan)``  per rank, from its routes (what the runtime executes)
    ``pool_local_entries(...)``        pool-wide, from the builder's run tables (what the simulator prices)
Both count foreign rows with ``foreign_rows_in`` over runs that partition the arranged buffer.
"""
from __future__ import annotations

import numpy as np

__all__ = ["foreign_rows_in", "rank_local_entries", "pool_local_entries", "route_foreign_rows", "entry_pair_heads"]


def foreign_rows_in(run_start, run_count, run_foreign, lo, hi) -> np.ndarray:
    """int64 [n]: rows of [lo[i], hi[i]) that lie in a foreign run.

    run_start, run_count  int64 [r]  runs that partition the buffer (any order; empty runs ignored)
    run_foreign           bool [r]   the run's rows come from another worker
    lo, hi                int64 [n]  row ranges inside the buffer
    """
    start = np.asarray(run_start, dtype=np.int64)
    count = np.asarray(run_count, dtype=np.int64)
    foreign = np.asarray(run_foreign, dtype=bool)
    keep = count > 0
    start, count, foreign = start[keep], count[keep], foreign[keep]
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    if start.size == 0:
        return np.zeros(lo.shape, dtype=np.int64)
    order = np.argsort(start, kind="stable")
    start, count, foreign = start[order], count[order], foreign[order]
    before = np.concatenate([[0], np.cumsum(np.where(foreign, count, 0))])

    def foreign_before(x: np.ndarray) -> np.ndarray:
        run = np.clip(np.searchsorted(start, x, side="right") - 1, 0, start.size - 1)
        inside = np.clip(x - start[run], 0, count[run])
        return before[run] + np.where(foreign[run], inside, 0)

    return foreign_before(hi) - foreign_before(lo)


def route_foreign_rows(route, rank: int, lo, hi) -> np.ndarray:
    """``foreign_rows_in`` for the target buffer of a forward ``Route`` of ``rank``: its receive runs are
    grouped by source in rank order, so the runs of the self segment are those starting inside
    [sum(recv_splits[:rank]), +recv_splits[rank]) of the received units."""
    runs = route.recv_runs
    first_unit = np.cumsum(runs.count) - runs.count
    self_lo = int(route.recv_splits[:rank].sum())
    self_hi = self_lo + int(route.recv_splits[rank])
    foreign = (first_unit < self_lo) | (first_unit >= self_hi)
    return foreign_rows_in(runs.start, runs.count, foreign, lo, hi)


def rank_local_entries(plan) -> np.ndarray:
    """bool [n_seqs]: the varlen entries of ``plan`` (a ``RankPlan``) that read only self-sourced rows."""
    cu = np.asarray(plan.cu_seqlens_q, dtype=np.int64)
    k_lo = np.asarray(plan.seq_kv_offset, dtype=np.int64)
    k_hi = k_lo + np.asarray(plan.seq_k_len, dtype=np.int64)
    q_foreign = route_foreign_rows(plan.q_route, plan.rank, cu[:-1], cu[1:])
    k_foreign = route_foreign_rows(plan.kv_route, plan.rank, k_lo, k_hi)
    return (q_foreign == 0) & (k_foreign == 0)


def pool_local_entries(q_runs, kv_runs, q_len, kv_len, entry_dst, q_lo, q_hi, k_lo, k_hi) -> np.ndarray:
    """bool [n]: ``rank_local_entries`` of every destination at once, from the builder's pool-wide tables.

    q_runs, kv_runs  (src, dst, tgt_start, count) int64 arrays: every run of the Q / KV routes
    q_len, kv_len    int64 [W]: arranged Q / KV rows of every destination
    entry_dst, q_lo, q_hi, k_lo, k_hi  int64 [n]: every varlen entry's destination and its row ranges
    """
    def foreign(runs, lengths, lo, hi):
        src, dst, tgt, count = (np.asarray(x, dtype=np.int64) for x in runs)
        base = np.concatenate([[0], np.cumsum(lengths)])[:-1].astype(np.int64)
        return foreign_rows_in(base[dst] + tgt, count, src != dst, base[entry_dst] + lo, base[entry_dst] + hi)

    return (foreign(q_runs, q_len, q_lo, q_hi) == 0) & (foreign(kv_runs, kv_len, k_lo, k_hi) == 0)


def entry_pair_heads(q_len, k_len, q_heads_per_shard: int) -> np.ndarray:
    """Eq. 6 load of varlen entries: bottom-right causal pairs of q_len queries over k_len keys x heads."""
    n = np.asarray(q_len, dtype=np.int64)
    e = np.asarray(k_len, dtype=np.int64)
    return (n * (e - n) + n * (n + 1) // 2) * int(q_heads_per_shard)
