"""Row-index tables of one RankPlan, in the runtime's buffer rows (numpy only; the runtime uploads them).

Everything ``runtime.libra_attn_func`` indexes with, computed once per RankPlan on the host so that the
background planner can build it off the training thread (``rank_tables(plan)`` is cached per plan object
and thread-safe). Row formulas are ``exchange.q_rows`` / ``exchange.kv_rows``; arrays are int32 (every
row index of a 1M-token pool fits; checked), split sizes are Python ints.

Per chunk m (local views: Q/O/dQ (t*H*M, qp, d), K/V (t*kvp, kp, d); arranged buffers per chunk):
    q_send[m]   rows of the local Q view sent by the Q route, grouped by destination; the inverse route
                returns O / dQ rows into the same rows (index_add, ``Route.inverse``)
    kv_send[m]  rows of the local K/V views sent by the KV route; returned dK|dV rows accumulate there
Chunk-independent:
    q_place / kv_place   received rows -> arranged order: arranged = received[place] (inverse permutation)
    q_arranged / kv_arranged  arranged rows sent back, grouped by home (= the routes' recv_index)
    k_gather    arranged-KV row of every packed key row of the varlen call
    cu_q, cu_k  int32 [n+1] varlen offsets; q_lens / k_lens for the exact backend's per-entry loop
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Tuple

import numpy as np

from .exchange import RankPlan, Route, kv_rows, q_rows

__all__ = ["RankTables", "RouteSplits", "rank_tables"]

_INT32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True)
class RouteSplits:
    """Split sizes of one route as Python ints (what ``all_to_all_single`` takes)."""

    send: Tuple[int, ...]
    recv: Tuple[int, ...]
    remote_send_rows: int  # rows sent to other ranks (self excluded), for byte accounting

    @staticmethod
    def of(route: Route, rank: int) -> "RouteSplits":
        return RouteSplits(tuple(int(x) for x in route.send_splits), tuple(int(x) for x in route.recv_splits),
                           route.remote_units_sent(rank))

    def inverse(self, rank: int) -> "RouteSplits":
        """Splits of ``Route.inverse()``: what was received is sent back."""
        return RouteSplits(self.recv, self.send, sum(self.recv) - self.recv[rank])


@dataclass(frozen=True, eq=False)
class RankTables:
    q_send: Tuple[np.ndarray, ...]
    kv_send: Tuple[np.ndarray, ...]
    q_place: np.ndarray
    kv_place: np.ndarray
    q_arranged: np.ndarray
    kv_arranged: np.ndarray
    k_gather: np.ndarray
    cu_q: np.ndarray
    cu_k: np.ndarray
    q_lens: Tuple[int, ...]
    k_lens: Tuple[int, ...]
    q_splits: RouteSplits
    kv_splits: RouteSplits
    q_back_splits: RouteSplits
    kv_back_splits: RouteSplits
    q_target_len: int  # arranged Q rows (nq)
    kv_target_len: int  # arranged KV rows (nkv)

    @property
    def num_entries(self) -> int:
        return len(self.q_lens)

    def nbytes(self) -> int:
        arrays = [*self.q_send, *self.kv_send, self.q_place, self.kv_place,
                  self.q_arranged, self.kv_arranged, self.k_gather, self.cu_q, self.cu_k]
        return int(sum(a.nbytes for a in arrays))


def _i32(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    assert x.size == 0 or (int(x.min()) >= 0 and int(x.max()) <= _INT32_MAX), "row index exceeds int32"
    out = np.ascontiguousarray(x, dtype=np.int32)
    out.setflags(write=False)
    return out


def _k_gather(plan: RankPlan) -> np.ndarray:
    """Arranged-KV row of every packed key row: entry i reads rows [seq_kv_offset[i], +seq_k_len[i])."""
    k_len = np.asarray(plan.seq_k_len, dtype=np.int64)
    total = int(k_len.sum())
    first = np.cumsum(k_len) - k_len
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(plan.seq_kv_offset, np.int64) - first, k_len)


def _cumsum0(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


def build_rank_tables(plan: RankPlan) -> RankTables:
    """All tables of ``plan`` (no caching; see ``rank_tables``)."""
    heads, r, M = plan.heads, plan.rank, plan.heads.num_chunks
    qr, kr = plan.q_route, plan.kv_route
    q_lens = np.diff(np.asarray(plan.cu_seqlens_q, dtype=np.int64))
    k_lens = np.asarray(plan.seq_k_len, dtype=np.int64)
    q_splits, kv_splits = RouteSplits.of(qr, r), RouteSplits.of(kr, r)
    return RankTables(
        q_send=tuple(_i32(q_rows(qr.send_index, heads, m)) for m in range(M)),
        kv_send=tuple(_i32(kv_rows(kr.send_index, heads, m)) for m in range(M)),
        q_place=_i32(np.argsort(qr.recv_index, kind="stable")),
        kv_place=_i32(np.argsort(kr.recv_index, kind="stable")),
        q_arranged=_i32(qr.recv_index), kv_arranged=_i32(kr.recv_index),
        k_gather=_i32(_k_gather(plan)), cu_q=_i32(_cumsum0(q_lens)), cu_k=_i32(_cumsum0(k_lens)),
        q_lens=tuple(int(x) for x in q_lens), k_lens=tuple(int(x) for x in k_lens),
        q_splits=q_splits, kv_splits=kv_splits,
        q_back_splits=q_splits.inverse(r), kv_back_splits=kv_splits.inverse(r),
        q_target_len=int(qr.target_len), kv_target_len=int(kr.target_len),
    )


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def rank_tables(plan: RankPlan) -> RankTables:
    """Tables of ``plan``, built once per plan object (thread-safe; the planner thread may prebuild them)."""
    with _LOCK:
        cached = _CACHE.get(plan)
    if cached is not None:
        return cached
    tables = build_rank_tables(plan)
    with _LOCK:
        return _CACHE.setdefault(plan, tables)
