"""Every rank's ``RankSizes`` of an exchange plan at once, from its pool-wide tables (issue 25).

Pure numpy. ``runtime_tables.rank_sizes(rank_plan)`` reads one ``RankPlan``: its routes' split sizes, its varlen
lengths, which entries are local, remote or split (``local_entries.rank_entry_kinds``) and whether every arranged
K|V row is some entry's key. The dense placement prices three candidate plans of a pool, W ranks each, so cutting
W ``RankPlan``s from the tables and reading them one by one cost a third of a pricing. ``pool_rank_sizes`` reads
the same fields straight from the tables the RankPlans are cut from (``tables.PlanTables``):

    split sizes   one W x W matrix per route (units of src -> dst, from the route's runs); rank r sends row r
                  and receives column r -- ``RouteSplits.of(route, r)``
    entries       the merged varlen entries grouped by destination; query lengths from the entries' query starts
                  as ``RankPlan.cu_seqlens_q`` lists them (the next entry's start, the rank's arranged Q at the end)
    entry kinds   ``local_entries.pool_entry_kinds`` over all destinations (the same rule as the per-rank view)
    rows read     ``runtime_tables.kv_rows_read`` of each rank's entries

``tests/plan/test_pool_sizes.py`` checks every field against ``rank_sizes`` of every rank on real pools (relay,
split entries, several chunks). ``sizes_key`` is what the op lists of ``plan.exchange.schedule`` read of a
``RankSizes``, as a hashable tuple: equal keys, equal op lists (with the rank's other inputs: ``op_lists.layer_ops``).
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

from .local_entries import REMOTE, SPLIT, pool_entry_kinds
from .runtime_tables import EntryLens, RankSizes, RouteSplits, kv_rows_read, rank_sizes

__all__ = ["pool_rank_sizes", "sizes_key"]


def _split_matrix(index, W: int) -> np.ndarray:
    """int64 [W, W]: units run ``index`` (a ``tables.RunIndex``) moves from src (row) to dst (column)."""
    runs = index.by_dst[0]
    flat = np.bincount(runs.src * W + runs.dst, weights=runs.count, minlength=W * W)
    return flat.astype(np.int64).reshape(W, W)


def _splits(matrix: np.ndarray, rank: int) -> Tuple[RouteSplits, RouteSplits]:
    """(forward, inverse) ``RouteSplits`` of ``rank`` (``RouteSplits.of`` and ``.inverse`` of its route)."""
    send, recv = tuple(matrix[rank].tolist()), tuple(matrix[:, rank].tolist())
    forward = RouteSplits(send, recv, sum(send) - send[rank], rank)
    return forward, forward.inverse(rank)


def _query_lengths(varlen, q_len: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """int64 [n]: each entry's query rows as ``RankPlan.cu_seqlens_q`` gives them (np.diff of the entries' starts
    followed by the destination's arranged Q rows)."""
    nxt = np.empty_like(varlen.q_start)
    nxt[:-1] = varlen.q_start[1:]
    last = np.ones(dst.size, dtype=bool)
    last[:-1] = dst[1:] != dst[:-1]
    nxt[last] = q_len[dst[last]]
    return nxt - varlen.q_start


def pool_rank_sizes(plan) -> Tuple[RankSizes, ...]:
    """``rank_sizes(plan.for_rank(r))`` for every rank r of an ``ExchangePlan`` (module docstring); a plan without
    pool-wide tables (one assembled from RankPlans) is read rank by rank."""
    tables = getattr(plan.ranks, "_tables", None)
    if tables is None:
        return tuple(rank_sizes(plan.for_rank(r)) for r in range(plan.num_workers))
    W, v = tables.q.num_workers, tables.varlen
    dst = np.repeat(np.arange(W, dtype=np.int64), np.diff(v.dst_ptr))
    q_lens = _query_lengths(v, tables.q_len, dst) if dst.size else dst
    kv = tables.kv.by_dst[0]
    if tables.relay is not None:  # relayed rows come from another worker of the node: foreign
        relay = tables.relay.by_dst[0]
        kv_runs = tuple(np.concatenate([a, b]) for a, b in zip((kv.src, kv.dst, kv.tgt_start, kv.count),
                                                                (relay.src, relay.dst, relay.tgt_start, relay.count)))
    else:
        kv_runs = (kv.src, kv.dst, kv.tgt_start, kv.count)
    q = tables.q.by_dst[0]
    kinds, tail = pool_entry_kinds((q.src, q.dst, q.tgt_start, q.count), kv_runs, tables.q_len, tables.kv_len, dst,
                                   v.q_start, v.q_start + q_lens, v.kv_offset, v.kv_offset + v.k_len)
    split = kinds == SPLIT
    local_k = np.where(split, v.k_len - tail, v.k_len)  # a split entry's local keys: its self-sourced tail
    spans = [_spans(keep, dst, v.q_start, q_lens, W) for keep in (kinds != REMOTE, kinds == REMOTE, split)]
    q_matrix, kv_matrix = _split_matrix(tables.q, W), _split_matrix(tables.kv, W)
    relay_matrix = None if tables.relay is None else _split_matrix(tables.relay, W)
    out = []
    for r in range(W):
        lo, hi = int(v.dst_ptr[r]), int(v.dst_ptr[r + 1])
        ql, kl, kind = q_lens[lo:hi], v.k_len[lo:hi], kinds[lo:hi]
        q_splits, q_back = _splits(q_matrix, r)
        kv_splits, kv_back = _splits(kv_matrix, r)
        fields = dict(q_lens=tuple(ql.tolist()), k_lens=tuple(kl.tolist()), q_splits=q_splits, kv_splits=kv_splits,
                      q_back_splits=q_back, kv_back_splits=kv_back, kv_target_len=int(tables.kv_len[r]),
                      kv_rows_read=kv_rows_read(v.kv_offset[lo:hi], kl, int(tables.kv_len[r])))
        if relay_matrix is not None:
            fields["relay_splits"], fields["relay_back_splits"] = _splits(relay_matrix, r)
        if (kind != REMOTE).any():
            fields["local"] = EntryLens.of(ql, kind != REMOTE, local_k[lo:hi], spans[0][r])
            fields["remote"] = EntryLens.of(ql, kind == REMOTE, kl, spans[1][r])
            if split[lo:hi].any():
                fields["heads"] = EntryLens.of(ql, split[lo:hi], tail[lo:hi], spans[2][r])
        out.append(RankSizes(**fields))
    return tuple(out)


def _spans(keep: np.ndarray, dst: np.ndarray, q_start: np.ndarray, q_lens: np.ndarray, W: int) -> list:
    """Per rank, ``runtime_tables.q_span`` of its entries ``keep`` (bool [n], entries grouped by rank), all ranks at
    once: (first row, rows) where the rank's kept entries are consecutive, else None."""
    idx = np.flatnonzero(keep)
    out = [None] * W
    if not idx.size:
        return out
    d = dst[idx]
    first = np.flatnonzero(np.concatenate([[True], d[1:] != d[:-1]]))
    last = np.append(first[1:], idx.size) - 1
    rows = np.add.reduceat(q_lens[idx], first)
    whole = idx[last] - idx[first] == last - first  # consecutive entries
    for r, start, n, ok in zip(d[first].tolist(), q_start[idx[first]].tolist(), rows.tolist(), whole.tolist()):
        out[r] = (start, n) if ok else None
    return out


def _lens(entries) -> tuple:
    return None if entries is None else (entries.q_lens, entries.k_lens, entries.q_span is not None)


def _route(splits) -> tuple:
    return None if splits is None else (splits.send, splits.recv)


def sizes_key(sizes: RankSizes) -> tuple:
    """Everything ``plan.exchange.schedule`` reads of ``sizes``, as a hashable tuple (the inverse splits and the
    remote row counts follow from the forward splits and the rank)."""
    return (sizes.q_lens, sizes.k_lens, _route(sizes.q_splits), _route(sizes.kv_splits), _route(sizes.relay_splits),
            sizes.kv_target_len, sizes.kv_rows_read, _lens(sizes.local), _lens(sizes.remote), _lens(sizes.heads))
