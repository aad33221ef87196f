"""Local varlen entries (issue 14, Pipeliner §4.4): what a destination can compute before any exchange arrives.

Pure numpy. A destination's varlen entry i reads arranged-Q rows [q_lo, q_hi) and arranged-KV rows
[k_lo, k_hi). Every arranged row arrives over a forward route from one source worker; the rows whose source
is the destination itself travel in the all_to_all's *self segment*, which is already in this rank's send
buffer when the exchange is launched. An entry is **local** when none of its Q rows and none of its key rows
comes from another worker: the runtime places the self segment, computes the local entries while the
dispatch is in flight, and computes the remote entries after it arrived (``runtime.libra_attn._fwd``).

An entry whose Q rows are self-sourced and whose key range ends in a self-sourced *tail* that covers its
queries is **split** (the ring-attention step, issue 14): its queries attend to the tail keys locally (a
causal call) and to the keys before the tail after the dispatch (a call without mask: they precede every
query); the two partial outputs merge by log-sum-exp. ``self_tail_start`` finds the tail.

One rule (``entry_kinds``), two views of the same run tables:
    ``rank_entry_kinds(rank_plan)``  per rank, from its routes (what the runtime executes)
    ``pool_entry_kinds(...)``        pool-wide, from the builder's run tables (what the simulator prices)
Both read runs that partition the arranged buffer with ``foreign_rows_in`` and ``self_tail_start`` (for
K/V, the KV route's receive runs and the relay route's, whose rows are always foreign).
"""
from __future__ import annotations

import numpy as np

__all__ = ["foreign_rows_in", "rank_local_entries", "self_tail_start", "entry_kinds",
           "rank_entry_kinds", "pool_entry_kinds", "REMOTE", "LOCAL", "SPLIT"]


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
        run = np.minimum(np.maximum(np.searchsorted(start, x, side="right") - 1, 0), start.size - 1)
        inside = np.minimum(np.maximum(x - start[run], 0), count[run])  # np.clip: ~40 us a call on small arrays
        return before[run] + np.where(foreign[run], inside, 0)

    return foreign_before(hi) - foreign_before(lo)


def self_tail_start(run_start, run_count, run_foreign, lo, hi) -> np.ndarray:
    """int64 [n]: the first row of the longest suffix of [lo[i], hi[i]) with no foreign row (hi when row
    hi-1 is foreign, lo when the whole range is self-sourced). Runs as in ``foreign_rows_in``."""
    start = np.asarray(run_start, dtype=np.int64)
    count = np.asarray(run_count, dtype=np.int64)
    foreign = np.asarray(run_foreign, dtype=bool) & (count > 0)
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    f_start, f_end = start[foreign], start[foreign] + count[foreign]
    if f_start.size == 0:
        return lo.copy()
    order = np.argsort(f_start, kind="stable")
    f_start, f_end = f_start[order], f_end[order]
    last = np.searchsorted(f_start, hi, side="left") - 1  # the last foreign run starting before hi
    end = np.where(last >= 0, np.minimum(f_end[np.maximum(last, 0)], hi), lo)
    return np.maximum(lo, end)


def entry_kinds(q_foreign, k_lo, tail, k_hi, q_len) -> np.ndarray:
    """int8 [n]: LOCAL (no foreign Q or key row), SPLIT (Q self-sourced, a self-sourced key tail [tail, k_hi)
    that covers the queries, foreign keys before it), or REMOTE."""
    q_self = np.asarray(q_foreign) == 0
    local = q_self & (tail == k_lo)
    split = q_self & ~local & (k_hi - tail >= q_len)
    return np.where(local, LOCAL, np.where(split, SPLIT, REMOTE)).astype(np.int8)


REMOTE, LOCAL, SPLIT = 0, 1, 2


def route_runs_foreign(route, rank: int):
    """(start, count, foreign) of a forward route's receive runs: runs are grouped by source in rank order,
    so the self segment's runs start inside [sum(recv_splits[:rank]), +recv_splits[rank]) received units."""
    runs = route.recv_runs
    first_unit = np.cumsum(runs.count) - runs.count
    self_lo = int(route.recv_splits[:rank].sum())
    self_hi = self_lo + int(route.recv_splits[rank])
    return runs.start, runs.count, (first_unit < self_lo) | (first_unit >= self_hi)


def rank_entry_kinds(plan):
    """(kinds int8 [n], tail int64 [n]) of a ``RankPlan``'s varlen entries: ``entry_kinds`` and the arranged-KV
    row where each entry's self-sourced key tail starts."""
    cu = np.asarray(plan.cu_seqlens_q, dtype=np.int64)
    k_lo = np.asarray(plan.seq_kv_offset, dtype=np.int64)
    k_hi = k_lo + np.asarray(plan.seq_k_len, dtype=np.int64)
    q_foreign = foreign_rows_in(*route_runs_foreign(plan.q_route, plan.rank), cu[:-1], cu[1:])
    kv_runs = route_runs_foreign(plan.kv_route, plan.rank)
    if plan.relay_route is not None:  # relayed rows come from another worker of the node: foreign
        relayed = plan.relay_route.recv_runs
        kv_runs = tuple(np.concatenate([a, b]) for a, b in
                        zip(kv_runs, (relayed.start, relayed.count, np.ones(relayed.num_runs, dtype=bool))))
    tail = self_tail_start(*kv_runs, k_lo, k_hi)
    return entry_kinds(q_foreign, k_lo, tail, k_hi, np.diff(cu)), tail


def rank_local_entries(plan) -> np.ndarray:
    """bool [n_seqs]: the varlen entries of ``plan`` (a ``RankPlan``) that read only self-sourced rows."""
    return rank_entry_kinds(plan)[0] == LOCAL


def pool_entry_kinds(q_runs, kv_runs, q_len, kv_len, entry_dst, q_lo, q_hi, k_lo, k_hi):
    """(kinds, tail - k_lo) of every destination's entries at once (``rank_entry_kinds``), from the builder's
    pool-wide tables.

    q_runs, kv_runs  (src, dst, tgt_start, count) int64 arrays: every run of the Q / KV routes
    q_len, kv_len    int64 [W]: arranged Q / KV rows of every destination
    entry_dst, q_lo, q_hi, k_lo, k_hi  int64 [n]: every varlen entry's destination and its row ranges
    """
    def runs(table, lengths):
        src, dst, tgt, count = (np.asarray(x, dtype=np.int64) for x in table)
        base = np.concatenate([[0], np.cumsum(lengths)])[:-1].astype(np.int64)
        return base[dst] + tgt, count, src != dst, base

    q_start, q_count, q_foreign_run, q_base = runs(q_runs, q_len)
    k_start, k_count, k_foreign_run, k_base = runs(kv_runs, kv_len)
    q_foreign = foreign_rows_in(q_start, q_count, q_foreign_run, q_base[entry_dst] + q_lo, q_base[entry_dst] + q_hi)
    lo, hi = k_base[entry_dst] + k_lo, k_base[entry_dst] + k_hi
    tail = self_tail_start(k_start, k_count, k_foreign_run, lo, hi)
    return entry_kinds(q_foreign, lo, tail, hi, np.asarray(q_hi) - np.asarray(q_lo)), tail - lo
