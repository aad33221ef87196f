"""Row tables of one RankPlan as *runs*, in the runtime's buffer rows (numpy only; the runtime expands them).

Everything ``runtime.libra_attn_func`` indexes with, as arithmetic runs of rows (``RowRuns``): O(runs) on
the host, so the background planner builds them in microseconds even for a rank that sends millions of
units; the runtime expands them into index tensors on the device once per plan (``runtime.routes``).
``rank_tables(plan)`` is cached per plan object and thread-safe. A route's unit runs map to row runs with
the row formulas ``exchange.q_rows`` / ``exchange.kv_rows``, which are affine inside a run:
    Q run  (u0, stride H, n)  ->  rows u0*M + m, stride H*M                        (every chunk m)
    KV run (u0, stride G, n)  ->  rows (u0//G)*kvp + piece[u0 % G, m], stride kvp  (one KV class per run)
Rows are bounded by the plan (view sizes, target lengths, checked by ``Route`` on construction), not by a
scan: a table expands to int32 when its bound fits, else int64. Split sizes are Python ints.

Per chunk m (local views: Q/O/dQ (t*H*M, qp, d), K/V (t*kvp, kp, d); arranged buffers per chunk):
    q_send[m]   rows of the local Q view sent by the Q route, grouped by destination; the inverse route
                returns O / dQ rows into the same rows (index_add, ``Route.inverse``)
    kv_send[m]  rows of the local K/V views sent by the KV route; returned dK|dV rows accumulate there
                (chunks that read the same kv pieces share one ``RowRuns``)
Chunk-independent:
    q_arranged / kv_arranged  the routes' recv runs: forward, received row i lands on arranged row
                recv_index[i] (a permutation; with a relay, kv_arranged and relay_recv together); inverse,
                the arranged rows sent back home in that order
    relay_send / relay_recv  the relay route (``plan.exchange``, "Relay"; None without one): arranged-KV rows
                this rank forwards, grouped by destination, and the arranged-KV rows relayed rows land on;
                the inverse adds dK|dV of relayed rows into the relay's arranged dK|dV
    k_gather    arranged-KV row of every packed key row of the varlen call: entry i reads rows
                [seq_kv_offset[i], +seq_k_len[i]), one run per entry
    cu_q, cu_k  int32 [n+1] varlen offsets; q_lens / k_lens for the exact backend's per-entry loop
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Tuple

import numpy as np

from ..errors import PlanError
from .records import IndexRuns, RankPlan, Route
from .local_entries import REMOTE, SPLIT, rank_entry_kinds

__all__ = ["RankTables", "RankSizes", "RouteSplits", "RowRuns", "rank_tables", "build_rank_tables", "rank_sizes"]

_INT32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True, eq=False)
class RowRuns:
    """Row indices as runs: run i = ``start[i] + stride*arange(count[i])``, concatenated; no empty run.

    start, count  int64 [n] (host, read-only)     stride  int
    total         sum(count): rows after expansion (host int, so the device expansion needs no sync)
    bound         every row lies in [0, bound) (from the plan); the expansion's dtype follows from it
    """

    start: np.ndarray
    count: np.ndarray
    stride: int
    total: int
    bound: int

    @staticmethod
    def of(runs: IndexRuns, bound: int, scale: int = 1, offset=0) -> "RowRuns":
        """Rows ``scale*index + offset`` of ``runs`` (``offset``: int, or int64 [n] per run), empty runs dropped."""
        keep = runs.count > 0
        start = runs.start * scale + offset
        return RowRuns.make(start[keep], runs.count[keep], runs.stride * scale, bound)

    @staticmethod
    def make(start, count, stride: int, bound: int) -> "RowRuns":
        start, count = _frozen(start), _frozen(count)
        return RowRuns(start, count, int(stride), int(count.sum()), int(bound))

    @property
    def num_runs(self) -> int:
        return int(self.start.shape[0])

    @property
    def dtype(self):
        """int32 when every row fits (the device index dtype), else int64 (the bound, not the values, decides)."""
        return np.int32 if self.bound <= _INT32_MAX + 1 else np.int64

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the expanded rows (what the device holds)."""
        return self.total * self.itemsize

    def expand(self) -> np.ndarray:
        """The rows on the host, in ``dtype`` (tests and host tools; the runtime expands on the device)."""
        return IndexRuns(self.start, self.count, self.stride).expand().astype(self.dtype)


@dataclass(frozen=True)
class RouteSplits:
    """Split sizes of one route as Python ints (what ``all_to_all_single`` takes).

    The self segment (rows a rank sends to itself) is send rows [self_send_offset, +self_rows) of the send
    buffer and received rows [self_recv_offset, +self_rows): the runtime places it before the exchange arrives.
    """

    send: Tuple[int, ...]
    recv: Tuple[int, ...]
    remote_send_rows: int  # rows sent to other ranks (self excluded), for byte accounting
    rank: int = 0

    @staticmethod
    def of(route: Route, rank: int) -> "RouteSplits":
        return RouteSplits(tuple(int(x) for x in route.send_splits), tuple(int(x) for x in route.recv_splits),
                           route.remote_units_sent(rank), int(rank))

    def inverse(self, rank: int) -> "RouteSplits":
        """Splits of ``Route.inverse()``: what was received is sent back."""
        return RouteSplits(self.recv, self.send, sum(self.recv) - self.recv[rank], int(rank))

    @cached_property
    def send_total(self) -> int:
        """Rows sent, self segment included (the op lists read it several times per rank)."""
        return sum(self.send)

    @cached_property
    def recv_total(self) -> int:
        """Rows received, self segment included."""
        return sum(self.recv)

    @property
    def self_rows(self) -> int:
        return self.send[self.rank] if self.send else 0

    @property
    def self_send_offset(self) -> int:
        return sum(self.send[: self.rank])

    @property
    def self_recv_offset(self) -> int:
        return sum(self.recv[: self.rank])


@dataclass(frozen=True, eq=False)
class EntryLens:
    """Per-entry lengths of some of a rank's varlen entries (host ints): all ``rank_sizes`` keeps of an ``EntrySet``."""

    q_lens: Tuple[int, ...]
    k_lens: Tuple[int, ...]
    # (first arranged-Q row, rows) when the set's entries are consecutive entries of the rank, so its queries are
    # one slice of the arranged buffers (``plan.exchange.arranged_order`` makes every set one); None otherwise
    q_span: Optional[Tuple[int, int]] = None

    @property
    def num_entries(self) -> int:
        return len(self.q_lens)

    @cached_property
    def q_total(self) -> int:
        return sum(self.q_lens)

    @cached_property
    def k_total(self) -> int:
        return sum(self.k_lens)

    @staticmethod
    def of(q_lens: np.ndarray, keep: np.ndarray, k_lens: np.ndarray, span=()) -> "EntryLens":
        """The entries ``keep``; ``span``: their ``q_span`` when the caller has it (``pool_sizes``), else computed."""
        return EntryLens(tuple(q_lens[keep].tolist()), tuple(k_lens[keep].tolist()),
                         q_span(q_lens, keep) if span == () else span)


def q_span(q_lens: np.ndarray, keep: np.ndarray) -> Optional[Tuple[int, int]]:
    """(first arranged-Q row, rows) of the entries ``keep`` (bool [n]) when they are consecutive and not empty, else
    None: the rank's entries partition its arranged Q rows in entry order."""
    idx = np.flatnonzero(keep)
    if idx.size == 0 or idx[-1] - idx[0] + 1 != idx.size:
        return None
    return int(q_lens[: idx[0]].sum()), int(q_lens[idx].sum())


@dataclass(frozen=True, eq=False, kw_only=True)
class EntrySet(EntryLens):
    """Some of a rank's varlen entries as one kernel call of their own (``plan.exchange.local_entries``).

    q_rows    arranged-Q rows of the set's entries in entry order (the call's queries are gathered from
              them and its outputs / lse scattered back to them)
    k_gather  arranged-KV row of every packed key row of the set (entry order)
    cu_q, cu_k  int32 [n+1] offsets of the call; q_lens / k_lens per entry (host ints)
    """

    q_rows: RowRuns
    k_gather: RowRuns
    cu_q: np.ndarray
    cu_k: np.ndarray

    @staticmethod
    def of(keep: np.ndarray, cu_q: np.ndarray, k_start: np.ndarray, k_lens: np.ndarray, q_bound: int,
           kv_bound: int) -> "EntrySet":
        """The entries ``keep`` with keys [k_start, +k_lens) of the arranged K|V (per entry, all entries given)."""
        every_q = np.diff(cu_q)
        q_lens = every_q[keep]
        return EntrySet(
            q_rows=RowRuns.make(cu_q[:-1][keep], q_lens, 1, q_bound),
            k_gather=RowRuns.make(k_start[keep], k_lens[keep], 1, kv_bound),
            cu_q=_cu32(q_lens), cu_k=_cu32(k_lens[keep]),
            q_lens=tuple(q_lens.tolist()), k_lens=tuple(k_lens[keep].tolist()), q_span=q_span(every_q, keep),
        )


@dataclass(frozen=True, eq=False)
class RankSizes:
    """A rank's split sizes and varlen lengths (``rank_sizes``): what the op lists of ``plan.exchange.schedule``
    read. ``RankTables`` adds the row tables; its entry sets are ``EntrySet``s."""

    q_lens: Tuple[int, ...]
    k_lens: Tuple[int, ...]
    q_splits: RouteSplits
    kv_splits: RouteSplits
    q_back_splits: RouteSplits
    kv_back_splits: RouteSplits
    kv_target_len: int  # arranged KV rows (nkv)
    kv_rows_read: bool = True  # every arranged KV row is some entry's key (``kv_rows_read``)
    # local-first split (``plan.exchange.local_entries``): None when no entry is local or split, else the sets
    local: Optional[EntryLens] = None  # causal: local entries, and the self-sourced key tails of split entries
    remote: Optional[EntryLens] = None  # causal: remote entries
    heads: Optional[EntryLens] = None  # no mask: split entries' keys before their tail (None: no split entry)
    # relay route (None: the pool has no relay)
    relay_splits: Optional[RouteSplits] = None
    relay_back_splits: Optional[RouteSplits] = None

    @property
    def num_entries(self) -> int:
        return len(self.q_lens)

    @cached_property
    def k_total(self) -> int:
        """Packed key rows of all the rank's entries."""
        return sum(self.k_lens)


@dataclass(frozen=True, eq=False, kw_only=True)
class RankTables(RankSizes):
    q_send: Tuple[RowRuns, ...]
    kv_send: Tuple[RowRuns, ...]
    q_arranged: RowRuns
    kv_arranged: RowRuns
    k_gather: RowRuns
    cu_q: np.ndarray
    cu_k: np.ndarray
    q_target_len: int  # arranged Q rows (nq)
    relay_send: Optional[RowRuns] = None  # relay route rows (None: the pool has no relay)
    relay_recv: Optional[RowRuns] = None

    def entry_sets(self) -> Tuple[EntrySet, ...]:
        return tuple(x for x in (self.local, self.remote, self.heads) if x is not None)

    def distinct_runs(self) -> Tuple[RowRuns, ...]:
        """Every distinct row table once (chunks sharing kv pieces share one ``kv_send`` entry)."""
        tables = [*self.q_send, *self.kv_send, self.q_arranged, self.kv_arranged, self.k_gather]
        if self.relay_send is not None:
            tables += [self.relay_send, self.relay_recv]
        for part in self.entry_sets():
            tables += [part.q_rows, part.k_gather]
        return tuple({id(t): t for t in tables}.values())

    def _offsets_nbytes(self) -> int:
        return int(sum(x.nbytes for x in [self.cu_q, self.cu_k] + [c for p in self.entry_sets() for c in (p.cu_q, p.cu_k)]))

    def nbytes(self) -> int:
        """Bytes of the expanded index tables on the device (distinct tables + varlen offsets + the inverse
        permutations of ``inverse_nbytes``)."""
        return sum(t.nbytes for t in self.distinct_runs()) + self._offsets_nbytes() + self.inverse_nbytes()

    def inverse_nbytes(self) -> int:
        """Bytes of the tables the runtime derives on the device (``runtime.routes.upload_tables``), each entry in
        its source table's dtype: the inverse permutations it places forward routes with (a gather through them
        is ~4x an ``index_put_`` on an H200, docs/gpu.md) -- the arranged Q rows', the arranged K|V rows' when no
        relay route fills part of that buffer, and the local units' the O / dQ returns are gathered with; the
        local entry set's rows in the dispatches' send buffers; and, where every arranged KV row is read
        (``kv_rows_read``), the backward's first / repeated packed key rows (nkv + 2 * (nk - nkv))."""
        kv_fills = self.relay_send is None
        out = self.q_arranged.nbytes + (self.kv_arranged.nbytes if kv_fills else 0)
        out += self.q_send[0].nbytes  # one unit order for every chunk's returns
        if self.local is not None:
            out += self.local.q_rows.total * self.q_arranged.itemsize
            out += self.local.k_gather.total * self.kv_arranged.itemsize if kv_fills else 0
        if not self.kv_rows_read:
            return out
        repeats = self.k_gather.total - self.kv_target_len
        return out + (self.kv_target_len + 2 * repeats) * self.k_gather.itemsize

    def host_nbytes(self) -> int:
        """Bytes of the run tables themselves (what the planner builds and keeps)."""
        return sum(t.start.nbytes + t.count.nbytes for t in self.distinct_runs()) + self._offsets_nbytes()


def _frozen(x) -> np.ndarray:
    out = np.array(x, dtype=np.int64)
    out.setflags(write=False)
    return out


def _q_send(route: Route, heads, bound: int) -> Tuple[RowRuns, ...]:
    """``q_rows(send_index, heads, m)`` for every chunk m: unit u -> row u*M + m, affine inside every run."""
    M = heads.num_chunks
    return tuple(RowRuns.of(route.send_runs, bound, scale=M, offset=m) for m in range(M))


def _kv_send(route: Route, heads, bound: int) -> Tuple[RowRuns, ...]:
    """``kv_rows(send_index, heads, m)`` for every chunk m, one ``RowRuns`` per distinct kv piece column (chunks
    that read the same kv pieces share it). KV units are ``token*G + class``; a run of stride G stays in one
    class c, so its rows are ``token*kvp + piece[c, m]``: start (u0//G)*kvp + piece[c, m], stride kvp."""
    runs, G, kvp = route.send_runs, heads.num_kv_classes, heads.kv_pieces_per_token
    if runs.stride % G and (runs.count > 1).any():
        raise PlanError(f"KV route runs of stride {runs.stride} cross KV classes (G = {G})")
    token, klass = np.divmod(runs.start, G)
    step = runs.stride // G * kvp if runs.stride % G == 0 else 0  # stride irrelevant when every run is one unit
    pieces = heads.kv_piece_of_class()  # [G, M]
    by_column, out = {}, []
    for m in range(heads.num_chunks):
        column = pieces[:, m]
        key = column.tobytes()
        if key not in by_column:
            keep = runs.count > 0
            start = token * kvp + column[klass]
            by_column[key] = RowRuns.make(start[keep], runs.count[keep], step, bound)
        out.append(by_column[key])
    return tuple(out)


def _k_gather(plan: RankPlan) -> RowRuns:
    """Arranged-KV row of every packed key row: entry i reads rows [seq_kv_offset[i], +seq_k_len[i])."""
    runs = IndexRuns(plan.seq_kv_offset, plan.seq_k_len, 1)
    return RowRuns.of(runs, plan.kv_route.target_len)


def _cu32(lengths: np.ndarray) -> np.ndarray:
    cu = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    if cu[-1] > _INT32_MAX:
        raise ValueError(f"varlen offsets reach {int(cu[-1])}, which does not fit int32 (flash-attn's cu_seqlens)")
    out = cu.astype(np.int32)
    out.setflags(write=False)
    return out


def build_rank_tables(plan: RankPlan) -> RankTables:
    """All tables of ``plan`` (no caching; see ``rank_tables``). O(runs + varlen entries), no unit array."""
    heads, M = plan.heads, plan.heads.num_chunks
    qr, kr = plan.q_route, plan.kv_route
    q_lens, k_lens = _entry_lens(plan)
    q_view_rows = plan.local_tokens * heads.head_split * M
    kv_view_rows = plan.local_tokens * heads.kv_pieces_per_token
    local, remote, head_set = _entry_split(plan, q_lens, k_lens)
    return RankTables(
        q_send=_q_send(qr, heads, q_view_rows), kv_send=_kv_send(kr, heads, kv_view_rows),
        q_arranged=RowRuns.of(qr.recv_runs, qr.target_len), kv_arranged=RowRuns.of(kr.recv_runs, kr.target_len),
        k_gather=_k_gather(plan), cu_q=_cu32(q_lens), cu_k=_cu32(k_lens), q_target_len=int(qr.target_len),
        local=local, remote=remote, heads=head_set, **_relay_rows(plan), **_size_fields(plan, q_lens, k_lens),
    )


def _entry_lens(plan: RankPlan) -> Tuple[np.ndarray, np.ndarray]:
    """int64 per-entry query and key lengths of ``plan``'s varlen call."""
    return np.diff(np.asarray(plan.cu_seqlens_q, dtype=np.int64)), np.asarray(plan.seq_k_len, dtype=np.int64)


def _size_fields(plan: RankPlan, q_lens: np.ndarray, k_lens: np.ndarray) -> dict:
    """The ``RankSizes`` fields of ``plan`` but its entry sets: lengths, the routes' splits and their inverses."""
    r = plan.rank
    q_splits, kv_splits = RouteSplits.of(plan.q_route, r), RouteSplits.of(plan.kv_route, r)
    out = dict(q_lens=tuple(q_lens.tolist()), k_lens=tuple(k_lens.tolist()), q_splits=q_splits, kv_splits=kv_splits,
               q_back_splits=q_splits.inverse(r), kv_back_splits=kv_splits.inverse(r),
               kv_target_len=int(plan.kv_route.target_len),
               kv_rows_read=kv_rows_read(plan.seq_kv_offset, plan.seq_k_len, int(plan.kv_route.target_len)))
    if plan.relay_route is not None:
        splits = RouteSplits.of(plan.relay_route, r)
        out.update(relay_splits=splits, relay_back_splits=splits.inverse(r))
    return out


def kv_rows_read(kv_offset, k_len, num_rows: int) -> bool:
    """Whether the varlen entries (keys [kv_offset, +k_len) of the arranged K|V) read every one of its ``num_rows``
    rows: each group's run ends where the longest key prefix of its entries ends. True under a prefix fetch; a
    whole-group fetch holds rows past them. The backward then builds a piece's dK|dV sums from each row's first
    packed row instead of zeros (``runtime.routes.DeviceTables.k_first``)."""
    off = np.asarray(kv_offset, dtype=np.int64)
    end = off + np.asarray(k_len, dtype=np.int64)
    if off.size == 0:
        return num_rows == 0
    order = np.argsort(off, kind="stable")
    off, end = off[order], end[order]
    starts = np.flatnonzero(np.concatenate([[True], off[1:] != off[:-1]]))
    nxt = np.append(off[starts][1:], num_rows)
    return bool(off[0] == 0 and np.array_equal(np.maximum.reduceat(end, starts), nxt))


def _relay_rows(plan: RankPlan) -> dict:
    """The relay route's rows (arranged-KV rows on both sides, chunk-independent), or {}."""
    rt = plan.relay_route
    if rt is None:
        return {}
    return dict(relay_send=RowRuns.of(rt.send_runs, rt.source_len), relay_recv=RowRuns.of(rt.recv_runs, rt.target_len))


def _entry_parts(plan: RankPlan, k_lens: np.ndarray):
    """(keep, key start, key lengths) over all entries of the local, remote and heads sets of ``plan``
    (``plan.exchange.local_entries``), heads None when no entry is split; None when no entry is local or split."""
    kinds, tail = rank_entry_kinds(plan)
    if not (kinds != REMOTE).any():
        return None
    off = np.asarray(plan.seq_kv_offset, dtype=np.int64)
    end = off + k_lens
    split = kinds == SPLIT
    local_start = np.where(split, tail, off)  # a split entry's local keys: its self-sourced tail
    heads = (split, off, tail - off) if split.any() else None
    return (kinds != REMOTE, local_start, end - local_start), (kinds == REMOTE, off, k_lens), heads


def _entry_split(plan: RankPlan, q_lens: np.ndarray, k_lens: np.ndarray):
    """(local, remote, heads) ``EntrySet``s of ``plan`` (``_entry_parts``), or Nones when no entry is local or
    split; heads is None when no entry is split."""
    parts = _entry_parts(plan, k_lens)
    if parts is None:
        return None, None, None
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    bounds = (int(plan.q_route.target_len), int(plan.kv_route.target_len))
    return tuple(None if part is None else EntrySet.of(part[0], cu, part[1], part[2], *bounds) for part in parts)


def rank_sizes(plan: RankPlan) -> "RankSizes":
    """The split sizes and varlen lengths of ``plan``'s ``RankTables``, without their row tables: what the op lists of
    ``plan.exchange.schedule`` read (a pool's candidate placements are priced rank by rank, issue 25)."""
    q_lens, k_lens = _entry_lens(plan)
    parts = _entry_parts(plan, k_lens) or (None, None, None)
    local, remote, heads = (None if part is None else EntryLens.of(q_lens, part[0], part[2]) for part in parts)
    return RankSizes(local=local, remote=remote, heads=heads, **_size_fields(plan, q_lens, k_lens))


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


def seed_rank_tables(plan: RankPlan, tables: RankTables) -> RankTables:
    """Cache ``tables``, built by ``rank_tables`` from this plan in another process (the planner process pickles
    them with the plan), as ``plan``'s: the trainer's ``rank_tables(plan)`` then builds nothing. Tables already
    cached for ``plan`` win."""
    splits = getattr(tables, "q_splits", None)
    if not isinstance(tables, RankTables) or (splits.rank, len(splits.send)) != (plan.rank, plan.num_workers):
        raise ValueError(f"seed_rank_tables: {type(tables).__name__} "
                         f"{'' if splits is None else (splits.rank, len(splits.send))} is not the tables of rank "
                         f"{plan.rank} of {plan.num_workers} workers")
    with _LOCK:
        return _CACHE.setdefault(plan, tables)
