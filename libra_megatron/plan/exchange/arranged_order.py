"""The arranged-Q order of a plan: every destination's varlen entries grouped by kind (remote, split, local).

Pure numpy. The builder first lays a destination's arranged Q buffer out in hosted order (tiles by head shard,
then block; ``builder``), where local, split and remote entries (``local_entries``) interleave, so each entry set
of the Pipeliner's local-first split (``runtime.entry_kernels``: the remote set, the local set = split and local
entries, the split entries' heads) would read its queries with a gather and write its outputs with an
``index_put_``. ``group_entries_by_kind`` re-lays the buffer out as

    [ remote entries | split entries | local entries ]      (each group in hosted order)

so every set is one contiguous slice of the arranged buffers (``runtime_tables.EntryLens.q_span``): the runtime reads it as a view
and writes its outputs with one dense copy. Only arranged-Q positions move: the Q route's runs are cut where an
entry's rows leave their tile's run and re-targeted, the entries re-ordered with their key ranges; what each
rank sends and receives, the K/V route, the relay, the kinds and every byte total are unchanged (a permutation
of the arranged rows of every destination, applied to both sides of the plan).
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

from .local_entries import LOCAL, REMOTE, SPLIT
from .tables import UnitRuns, Varlen, segment_starts

__all__ = ["group_entries_by_kind", "KIND_ORDER"]

KIND_ORDER = (REMOTE, SPLIT, LOCAL)  # the groups of an arranged Q buffer, first to last
_RANK_OF_KIND = np.argsort(np.array(KIND_ORDER))  # kind -> its group's position


def group_entries_by_kind(q: UnitRuns, varlen: Varlen, kinds: np.ndarray, q_len: np.ndarray,
                          head_split: int) -> Tuple[UnitRuns, Varlen]:
    """(Q runs, varlen) with every destination's entries in ``KIND_ORDER`` groups (module docstring).

    q        the Q route's runs, sorted by (dst, tgt_start), partitioning every destination's arranged rows
    varlen   the entries, grouped by destination in arranged-row order, partitioning the same rows
    kinds    int8 [n] every entry's kind (``tables.pool_kinds``)
    q_len    int64 [W] arranged Q rows per destination; head_split: the Q units' stride H
    Returns the inputs themselves when the entries are grouped already."""
    W, n = q_len.shape[0], varlen.q_start.shape[0]
    dst = np.repeat(np.arange(W, dtype=np.int64), np.diff(varlen.dst_ptr))
    group = _RANK_OF_KIND[np.asarray(kinds, dtype=np.int64)]
    order = np.lexsort((np.arange(n), group, dst))
    if np.array_equal(order, np.arange(n)):
        return q, varlen
    new_start = np.empty(n, dtype=np.int64)
    new_start[order] = segment_starts(dst[order], varlen.q_len[order], W)
    base = np.concatenate([[0], np.cumsum(q_len)[:-1]]).astype(np.int64)  # destination d's rows: base[d] + row
    run_at = base[q.dst] + q.tgt_start  # ascending: runs sorted by (dst, tgt_start)
    entry_at = base[dst] + varlen.q_start  # ascending: entries in arranged order
    cut = np.union1d(run_at, entry_at)  # pieces: one run, one entry each
    end = np.append(cut[1:], int(q_len.sum()))
    run = np.searchsorted(run_at, cut, side="right") - 1
    entry = np.searchsorted(entry_at, cut, side="right") - 1
    tgt = new_start[entry] + cut - entry_at[entry]
    pieces = (q.src[run], q.dst[run], q.src_start[run] + (cut - run_at[run]) * head_split, end - cut, tgt)
    by_tgt = np.lexsort((tgt, q.dst[run]))
    src, dst_p, src_start, count, tgt = (x[by_tgt] for x in pieces)
    run = run[by_tgt]
    # a run's pieces that stay back to back in the new order, on both sides, are one run again (two pieces of one
    # run can meet in the new order with the rows of a piece that moved away between their sources)
    joins = (run[1:] == run[:-1]) & (tgt[:-1] + count[:-1] == tgt[1:]) & \
        (src_start[:-1] + count[:-1] * head_split == src_start[1:])
    first = np.flatnonzero(np.concatenate([[True], ~joins]))
    merged = UnitRuns(src=src[first], dst=dst_p[first], src_start=src_start[first],
                      count=np.add.reduceat(count, first), tgt_start=tgt[first])
    entries = Varlen(dst_ptr=varlen.dst_ptr, q_start=new_start[order], q_len=varlen.q_len[order],
                     kv_offset=varlen.kv_offset[order], k_len=varlen.k_len[order])
    return merged, entries
