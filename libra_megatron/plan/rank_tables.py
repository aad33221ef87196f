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
    q_arranged / kv_arranged  the routes' recv_index: forward, received row i lands on arranged row
                recv_index[i] (a permutation); inverse, the arranged rows sent back home in that order
    k_gather    arranged-KV row of every packed key row of the varlen call
    cu_q, cu_k  int32 [n+1] varlen offsets; q_lens / k_lens for the exact backend's per-entry loop
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Tuple

import numpy as np

from .exchange import RankPlan, Route, kv_rows, q_rows  # noqa: F401  (kv_rows: the rule _kv_send implements)

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
        """Bytes of the distinct arrays (chunks sharing kv pieces share one kv_send array)."""
        arrays = [*self.q_send, *self.kv_send, self.q_arranged, self.kv_arranged, self.k_gather, self.cu_q, self.cu_k]
        return int(sum(a.nbytes for a in {id(a): a for a in arrays}.values()))


def _i32(x: np.ndarray, bound: int) -> np.ndarray:
    """int32 copy of index array ``x`` whose values are known to lie in [0, bound) (plan invariants, checked
    by ``validate_plan``): the bound, not a scan of millions of values, proves the cast is exact."""
    if bound > _INT32_MAX:
        raise ValueError(f"row index bound {bound} does not fit int32")
    out = np.ascontiguousarray(x, dtype=np.int32)
    out.setflags(write=False)
    return out


def _affine_rows(column: np.ndarray, H: int, kvp: int):
    """(a, b) with column[h] == a*h + b and kvp == a*H, else None. Then kv_rows(u) = a*u + b for every unit
    u = token*H + h (rows = token*kvp + column[h] = a*(token*H + h) + b): no division per unit."""
    a = kvp // H if kvp % H == 0 else None
    if a is None or not np.array_equal(column, a * np.arange(H) + column[0]):
        return None
    return a, int(column[0])


def _kv_send(units: np.ndarray, heads, bound: int) -> Tuple[np.ndarray, ...]:
    """``kv_rows(units, heads, m)`` for every chunk m as int32 (rows < ``bound``), one array per distinct kv
    piece column: chunks that read the same kv pieces (shared kv heads) share it. Same values as kv_rows."""
    H, M, kvp = heads.head_split, heads.num_chunks, heads.kv_pieces_per_token
    pieces = heads.kv_piece_index()  # [H, M]
    units32 = _i32(units, bound)  # units < t*H <= rows bound
    by_column, out = {}, []
    for m in range(M):
        column = pieces[:, m]
        key = column.tobytes()
        if key not in by_column:
            affine = _affine_rows(column, H, kvp)
            if affine is not None:
                a, b = affine
                rows = units32 if (a, b) == (1, 0) else _i32(units32 * np.int32(a) + np.int32(b), bound)
            else:
                token, shard = np.divmod(units32, np.int32(H))
                rows = _i32(token * np.int32(kvp) + column.astype(np.int32)[shard], bound)
            by_column[key] = rows
        out.append(by_column[key])
    return tuple(out)


def _k_gather(plan: RankPlan, bound: int) -> np.ndarray:
    """Arranged-KV row of every packed key row: entry i reads rows [seq_kv_offset[i], +seq_k_len[i])."""
    k_len = np.asarray(plan.seq_k_len, dtype=np.int64)
    total = int(k_len.sum())
    _i32(np.zeros(0), max(bound, total))
    first = np.cumsum(k_len) - k_len
    out = np.arange(total, dtype=np.int32)
    out += np.repeat((np.asarray(plan.seq_kv_offset, np.int64) - first).astype(np.int32), k_len)
    out.setflags(write=False)
    return out


def _cumsum0(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


def build_rank_tables(plan: RankPlan) -> RankTables:
    """All tables of ``plan`` (no caching; see ``rank_tables``)."""
    heads, r, M = plan.heads, plan.rank, plan.heads.num_chunks
    qr, kr = plan.q_route, plan.kv_route
    q_lens = np.diff(np.asarray(plan.cu_seqlens_q, dtype=np.int64))
    k_lens = np.asarray(plan.seq_k_len, dtype=np.int64)
    q_view_rows = plan.local_tokens * heads.head_split * M
    kv_view_rows = plan.local_tokens * heads.kv_pieces_per_token
    cu_q, cu_k = _cumsum0(q_lens), _cumsum0(k_lens)
    q_splits, kv_splits = RouteSplits.of(qr, r), RouteSplits.of(kr, r)
    return RankTables(
        q_send=tuple(_i32(q_rows(qr.send_index, heads, m), q_view_rows) for m in range(M)),
        kv_send=_kv_send(kr.send_index, heads, max(kv_view_rows, plan.local_tokens * heads.head_split)),
        q_arranged=_i32(qr.recv_index, qr.target_len), kv_arranged=_i32(kr.recv_index, kr.target_len),
        k_gather=_k_gather(plan, kr.target_len), cu_q=_i32(cu_q, int(cu_q[-1]) + 1),
        cu_k=_i32(cu_k, int(cu_k[-1]) + 1),
        q_lens=tuple(q_lens.tolist()), k_lens=tuple(k_lens.tolist()),
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
