"""Reference for the run tables (tests only): the row tables as the runtime built them before runs.

Before run tables, ``plan.exchange.runtime_tables`` expanded every route into unit arrays on the host and mapped each
unit with the row formulas ``q_rows`` / ``kv_rows`` (O(units)). This module keeps that computation, from
the routes' expanded ``send_index`` / ``recv_index`` and the varlen metadata, so tests can check that the
run tables, expanded on the host (``RowRuns.expand``) or on the device (``runtime.routes``), give exactly
the same rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np

from ..plan.exchange import RankPlan, kv_rows, q_rows

__all__ = ["UnitTables", "unit_tables", "self_sourced_rows", "local_entries_by_units",
           "entry_kinds_by_units"]


@dataclass(frozen=True)
class UnitTables:
    """The unit-based tables of one RankPlan, int64 host arrays (see ``plan.exchange.runtime_tables`` for meanings)."""

    q_send: Tuple[np.ndarray, ...]  # per chunk m
    kv_send: Tuple[np.ndarray, ...]  # per chunk m
    q_arranged: np.ndarray
    kv_arranged: np.ndarray
    k_gather: np.ndarray
    cu_q: np.ndarray
    cu_k: np.ndarray
    relay_send: np.ndarray = None  # arranged-KV rows forwarded / received along the relay route (None: no relay)
    relay_recv: np.ndarray = None


def unit_tables(plan: RankPlan) -> UnitTables:
    heads, M = plan.heads, plan.heads.num_chunks
    qr, kr = plan.q_route, plan.kv_route
    k_gather = [np.arange(o, o + n, dtype=np.int64) for o, n in zip(plan.seq_kv_offset, plan.seq_k_len)]
    return UnitTables(
        q_send=tuple(q_rows(qr.send_index, heads, m) for m in range(M)),
        kv_send=tuple(kv_rows(kr.send_index, heads, m) for m in range(M)),
        q_arranged=np.asarray(qr.recv_index, dtype=np.int64), kv_arranged=np.asarray(kr.recv_index, dtype=np.int64),
        k_gather=np.concatenate(k_gather) if k_gather else np.zeros(0, dtype=np.int64),
        cu_q=np.asarray(plan.cu_seqlens_q, dtype=np.int64),
        cu_k=np.concatenate([[0], np.cumsum(plan.seq_k_len, dtype=np.int64)]),
        relay_send=None if plan.relay_route is None else np.asarray(plan.relay_route.send_index, dtype=np.int64),
        relay_recv=None if plan.relay_route is None else np.asarray(plan.relay_route.recv_index, dtype=np.int64),
    )


def self_sourced_rows(route, rank: int) -> np.ndarray:
    """bool [target_len]: the target rows of a forward route that this rank sends itself (expanded units)."""
    lo = int(route.recv_splits[:rank].sum())
    mask = np.zeros(route.target_len, dtype=bool)
    mask[route.recv_index[lo: lo + int(route.recv_splits[rank])]] = True
    return mask


def local_entries_by_units(plan: RankPlan) -> np.ndarray:
    """bool [n_seqs]: entries whose every arranged Q row and key row is self-sourced, row by row (the O(units)
    reference of ``plan.exchange.local_entries.rank_local_entries``)."""
    q_self, kv_self = self_sourced_rows(plan.q_route, plan.rank), self_sourced_rows(plan.kv_route, plan.rank)
    cu = np.asarray(plan.cu_seqlens_q, dtype=np.int64)
    return np.array([q_self[cu[i]:cu[i + 1]].all() and kv_self[o:o + n].all()
                     for i, (o, n) in enumerate(zip(plan.seq_kv_offset, plan.seq_k_len))], dtype=bool)


def entry_kinds_by_units(plan: RankPlan):
    """(kinds, tail) of ``plan.exchange.local_entries.rank_entry_kinds`` row by row on the expanded routes: kind 1 (local)
    when every Q and key row is self-sourced, 2 (split) when the Q rows are and the self-sourced suffix of the
    key rows holds at least the queries (but not all keys), else 0; tail = first row of that suffix."""
    q_self, kv_self = self_sourced_rows(plan.q_route, plan.rank), self_sourced_rows(plan.kv_route, plan.rank)
    cu = np.asarray(plan.cu_seqlens_q, dtype=np.int64)
    kinds, tails = [], []
    for i, (o, n) in enumerate(zip(plan.seq_kv_offset.tolist(), plan.seq_k_len.tolist())):
        foreign = np.flatnonzero(~kv_self[o:o + n])
        tail = o if foreign.size == 0 else o + int(foreign[-1]) + 1
        q_ok = bool(q_self[cu[i]:cu[i + 1]].all())
        kind = 1 if q_ok and tail == o else 2 if q_ok and o + n - tail >= cu[i + 1] - cu[i] else 0
        kinds.append(kind)
        tails.append(tail)
    return np.array(kinds, dtype=np.int8), np.array(tails, dtype=np.int64)
