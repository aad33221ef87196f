"""Torch executor of exchange-plan ``Route``s: gather rows, ``all_to_all_single``, place or accumulate.

Shape legend (one chunk m of the Pipeliner, §4.4):
    t      local tokens            H, M   head shards, chunks      d  head dim
    qp     q_piece = hq/(H*M)      kp     kv_piece (kv heads per piece)
    local Q/O/dQ chunk view   (t*H*M, qp, d)      rows from ``q_rows(units, heads, m)``
    local K/V/dK/dV view      (t*kv_pieces, kp, d) rows from ``kv_rows(units, heads, m)``
    arranged Q/O/dO/dQ        (q_route.target_len, qp, d)
    arranged KV (K|V stacked) (kv_route.target_len, 2*kp, d)
A route moves *units*; one unit is one row of the views above, so split sizes are row counts.

Forward routes place (arranged[recv_rows] = received; recv_rows is a permutation of the arranged rows,
so every row is written once; when it fills the arranged buffer, as one gather: received[recv_inverse]). The inverse Q route (O, dQ) copies: every local Q row has
exactly one source over the chunks (a plan invariant, ``plan.exchange.validate``), so its target starts uninitialised
-- no memset, no atomics. Chunk m's returns fill chunk m's rows of the chunk view (local unit u = row u*M + m), so
they are copied as one gather into unit order (``recv_inverse``: local unit -> received row) and one dense copy into
that strided (t*H, qp, d) view, not by ``index_put_`` (~4x slower per byte on an H200). The inverse K|V route accumulates (``index_add_``: several destinations and chunks
feed one local row), casting the received rows to the target's dtype so a float32 target sums low-precision
fragments in float32. A ``PendingExchange`` drops its received rows as soon as they are placed or copied:
the receive buffer of chunk m is freed before chunk m computes, not one chunk later. Index tensors are int32 where the plan's
bounds allow (int64 otherwise). The planner hands over row *runs* (``plan.exchange.runtime_tables``, O(runs) on the
host); ``expand_runs`` turns them into index tensors on the device, once per plan at its first use on the
training thread (a few device kernels of known output size: no host sync), and the results live in a
small LRU (``DeviceTables``). Every exchange is launched with ``async_op=True``; its ``PendingExchange``
is waited on only right before the tensor is used.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Dict, Optional, Tuple  # noqa: F401

import numpy as np
import torch
import torch.distributed as dist

from ..plan.exchange import RankTables, RouteSplits
from .kernels import VarlenBatch, host_to_device

__all__ = ["RouteIndex", "PendingExchange", "ExchangeStats", "ChunkRoutes", "RelayRoutes", "DeviceTables", "device_tables",
           "expand_runs", "set_table_cache_size", "start_exchange", "upload_tables"]


@dataclass
class ExchangeStats:
    """Per-rank instrumentation of one or more operator calls (accumulates; reset by making a new one).

    bytes_sent[kind]  bytes this rank sent to *other* ranks (self excluded), per kind:
                      forward "q", "kv", "o"; backward "do", "dq", "dkv" (+ "q_bwd", "kv_bwd", "o_bwd"
                      when the backward re-exchanges instead of saving arranged tensors).
    kernel_seconds    thread CPU time spent inside attention kernel calls (fwd + bwd)
    saved_bytes       bytes the last forward kept alive for backward (``plan.model.memory`` predicts it)
    deferred_bytes    the largest fp32 arranged dK|dV the backward kept alive one chunk longer for its relay
                      inverse (``plan.model.memory.deferred_relay_bytes`` predicts it; 0 when none was)
    wait_seconds[kind] host wall time blocked waiting for that kind's exchanges to arrive. Meaningful on CPU
                      gloo only (its wait blocks until the data is there); a CUDA/NCCL wait only orders
                      streams, so there it measures nothing (``benchmarks/bench_exchange_wait_cpu.py``).
    """

    bytes_sent: Dict[str, int] = field(default_factory=dict)
    kernel_seconds: float = 0.0
    kernel_calls: int = 0
    saved_bytes: int = 0
    deferred_bytes: int = 0
    wait_seconds: Dict[str, float] = field(default_factory=dict)

    def add_wait(self, kind: str, seconds: float) -> None:
        self.wait_seconds[kind] = self.wait_seconds.get(kind, 0.0) + float(seconds)

    def add_bytes(self, kind: str, num_bytes: int) -> None:
        self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + int(num_bytes)

    def kept_for_relay(self, dkv_arr: torch.Tensor) -> None:
        """A backward kept ``dkv_arr`` alive one chunk longer for its relay inverse (``deferred_bytes``)."""
        self.deferred_bytes = max(self.deferred_bytes, dkv_arr.numel() * dkv_arr.element_size())

    def timed_kernel(self, fn, *args):
        """Run ``fn(*args)`` and add its thread CPU time to ``kernel_seconds``."""
        start = time.thread_time()
        result = fn(*args)
        self.kernel_seconds += time.thread_time() - start
        self.kernel_calls += 1
        return result


@dataclass(frozen=True)
class RouteIndex:
    """One route of one chunk on the device.

    send_rows  int32 [n_send]  rows of the source buffer, grouped by destination rank
    recv_rows  int32 [n_recv]  rows of the target buffer the received rows land on (forward: a permutation
               of the arranged rows, placed; inverse: local rows, copied (Q) or accumulated (K|V))
    splits     send/recv rows per rank (Python ints) and rows sent to other ranks
    accumulate the inverse K|V route adds (several destinations and chunks feed one local row); the inverse Q
               route copies (each local row has one source); forward routes place
    target_rows rows of a forward route's target buffer when its receive rows fill only part of it (the KV
               route of a relaying pool: the relay route places the rest); None: every row is received
    recv_inverse int32 [n_recv] the inverse permutation of recv_rows (target row -> received row) of a forward
               route whose receive rows fill its target: placing is then a gather (``index_select``, ~4x an
               ``index_put_`` on an H200); None: placed by ``index_put_``. On the inverse Q route: local unit
               -> received row, and ``into`` is given chunk m's (t*H, qp, d) view of the output
    """

    send_rows: torch.Tensor
    recv_rows: torch.Tensor
    splits: RouteSplits
    accumulate: bool
    target_rows: Optional[int] = None
    recv_inverse: Optional[torch.Tensor] = None

    def num_target_rows(self) -> int:
        return sum(self.splits.recv) if self.target_rows is None else self.target_rows


@dataclass(frozen=True)
class ChunkRoutes:
    q_fwd: RouteIndex  # local chunk view -> arranged Q
    kv_fwd: RouteIndex  # local K/V chunk views -> arranged K|V
    q_inv: RouteIndex  # arranged -> local chunk view (O, dQ)
    kv_inv: RouteIndex  # arranged K|V -> local K/V chunk views (dK|dV, accumulating)


@dataclass(frozen=True)
class RelayRoutes:
    """The relay route on the device (``plan.exchange``, "Relay"); the same rows for every chunk."""

    fwd: RouteIndex  # arranged K|V rows this rank holds -> the arranged K|V of its node's other destinations
    inv: RouteIndex  # their dK|dV of those rows -> added into this rank's arranged dK|dV

    @property
    def receives(self) -> bool:
        """This rank gets relayed rows (so it waits for the relay before its remote entries)."""
        return sum(self.fwd.splits.recv) > 0


@dataclass(frozen=True, eq=False)
class DeviceEntrySet:
    """An ``EntrySet`` on the device: one kernel call over some of the varlen entries."""

    q_rows: torch.Tensor  # arranged-Q rows of the set's queries (gather Q, scatter O / lse)
    k_gather: torch.Tensor  # arranged-KV row of every packed key row of the set
    batch: VarlenBatch
    # the local set (its rows are all this rank's own): the same rows in the self segment of the Q / K|V
    # dispatch's send buffer, read before the dispatch is waited; None where the route does not fill its target
    q_self: Optional[torch.Tensor] = None
    k_self: Optional[torch.Tensor] = None
    # (first row, rows) when ``q_rows`` is one slice of the arranged buffers (host ints, ``EntryLens.q_span``): the set
    # reads its queries as a view and writes its outputs with one dense copy
    q_span: Optional[Tuple[int, int]] = None


@dataclass(frozen=True, eq=False)
class DeviceTables:
    """Everything one RankPlan indexes with, on one device."""

    chunks: Tuple[ChunkRoutes, ...]
    batch: VarlenBatch
    k_gather: torch.Tensor  # int32 [nk]: arranged-KV row of every packed key row
    nbytes: int
    # backward, a kv piece's first chunk: arranged dK|dV = packed rows ``k_first`` (every arranged row's first packed
    # row), then the packed rows ``k_repeat`` (all the others, in order) added into arranged rows ``k_repeat_rows``:
    # no zero fill, fewer index_add_ rows. None where some arranged row is no entry's key (``RankTables.kv_rows_read``)
    k_first: torch.Tensor = None  # [nkv]
    k_repeat: torch.Tensor = None  # [nk - nkv]
    k_repeat_rows: torch.Tensor = None  # [nk - nkv] = k_gather[k_repeat]
    local: Optional[DeviceEntrySet] = None  # local-first split (``RankTables.local``); None: no local entry
    remote: Optional[DeviceEntrySet] = None
    heads: Optional[DeviceEntrySet] = None  # keys before split entries' self-sourced tails (no mask)
    relay: Optional[RelayRoutes] = None  # None: the pool has no relay


def expand_runs(start: torch.Tensor, count: torch.Tensor, stride: int, total: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of runs on ``start``'s device: run i = ``start[i] + stride*arange(count[i])``, concatenated.

    start, count  int64 [n] on the device, every count > 0 (``RowRuns`` drops empty runs)
    total         sum(count), known on the host: every output size is known, nothing is read back (no sync)
    Returns ``dtype`` [total]. Fill with the stride, write each run's jump from the previous run's last row at
    its first slot, cumulative sum: the partial sums are the rows themselves, so they stay inside the
    rows' bound (no int32 overflow when the rows fit int32)."""
    out = torch.full((total,), stride, dtype=dtype, device=start.device)
    if total == 0:
        return out
    last = start + stride * (count - 1)
    jump = start - torch.cat([last.new_zeros(1), last[:-1]])
    out.scatter_(0, torch.cumsum(count, 0) - count, jump.to(dtype))
    return out.cumsum_(0)


_TORCH_INT = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


def _expand_all(tables: RankTables, device):
    """(device rows of every distinct ``RowRuns`` by id, [cu_q, cu_k of the whole batch, then of every entry
    set]): the run tables and varlen offsets go up in one pinned non-blocking copy and are expanded there, once
    per plan (GPU work; no host sync)."""
    runs = tables.distinct_runs()
    offsets = [tables.cu_q, tables.cu_k] + [c for part in tables.entry_sets() for c in (part.cu_q, part.cu_k)]
    parts = [*offsets, *(r.start for r in runs), *(r.count for r in runs)]
    sizes = [int(p.shape[0]) for p in parts]
    flat = host_to_device(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]), device)
    pieces = torch.split(flat, sizes)
    n, k = len(runs), len(offsets)
    rows = {id(r): expand_runs(pieces[k + i], pieces[k + n + i], r.stride, r.total, _TORCH_INT[np.dtype(r.dtype)])
            for i, r in enumerate(runs)}
    return rows, [p.to(torch.int32) for p in pieces[:k]]


def _varlen_batch(cu_q, cu_k, host) -> VarlenBatch:
    """Device offsets plus the host copy's lengths and bounds (``host``: RankTables or EntrySet)."""
    return VarlenBatch(cu_q=cu_q, cu_k=cu_k, max_q=max(host.q_lens, default=0), max_k=max(host.k_lens, default=0),
                       bounds=_bounds(host))


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """inverse[perm[i]] = i of a permutation on the device: its argsort (one small sort per plan, at upload;
    no host sync), in the permutation's dtype."""
    return torch.argsort(perm).to(perm.dtype)


def _self_rows(inverse: Optional[torch.Tensor], rows: torch.Tensor, splits: RouteSplits) -> Optional[torch.Tensor]:
    """Send-buffer rows of arranged ``rows`` that all lie in the self segment: received row ``inverse[row]``, less
    the segment's receive offset, plus its send offset (the all_to_all copies the segment in order). None without
    ``inverse`` (the route does not fill its target)."""
    if inverse is None:
        return None
    return inverse.index_select(0, rows.long()) + (splits.self_send_offset - splits.self_recv_offset)


def _first_and_repeats(k_gather: torch.Tensor, num_rows: int):
    """(k_first [num_rows], k_repeat [nk - num_rows], k_repeat_rows) of ``DeviceTables`` on the device, sizes known on
    the host: no host sync (the smallest position per row by ``scatter_reduce_``, the others by a stable sort)."""
    nk = k_gather.shape[0]
    pos = torch.arange(nk, dtype=k_gather.dtype, device=k_gather.device)
    first = torch.zeros(num_rows, dtype=k_gather.dtype, device=k_gather.device)
    first.scatter_reduce_(0, k_gather.long(), pos, "amin", include_self=False)
    is_first = first.index_select(0, k_gather) == pos
    repeat = torch.argsort(is_first.to(torch.uint8), stable=True)[: nk - num_rows].to(k_gather.dtype)
    return first, repeat, k_gather.index_select(0, repeat)


def upload_tables(tables: RankTables, device) -> DeviceTables:
    """A plan's run tables as device index tensors (not cached; ``device_tables`` caches). No host sync."""
    rows, offsets = _expand_all(tables, device)
    q_arr, kv_arr = rows[id(tables.q_arranged)], rows[id(tables.kv_arranged)]
    relay = None
    if tables.relay_send is not None:
        out, into = rows[id(tables.relay_send)], rows[id(tables.relay_recv)]
        relay = RelayRoutes(fwd=RouteIndex(out, into, tables.relay_splits, accumulate=False),
                            inv=RouteIndex(into, out, tables.relay_back_splits, accumulate=True))
    kv_target = None if relay is None else tables.kv_target_len
    q_inverse, kv_inverse = _inverse(q_arr), (_inverse(kv_arr) if relay is None else None)
    M = len(tables.q_send)  # chunk m sends local unit u as row u*M + m: every chunk's returns share one unit order
    home_inverse = _inverse(torch.div(rows[id(tables.q_send[0])], M, rounding_mode="floor"))
    chunks = []
    for q_send, kv_send in zip(tables.q_send, tables.kv_send):
        q_rows, kv_rows = rows[id(q_send)], rows[id(kv_send)]
        chunks.append(ChunkRoutes(
            q_fwd=RouteIndex(q_rows, q_arr, tables.q_splits, accumulate=False, recv_inverse=q_inverse),
            kv_fwd=RouteIndex(kv_rows, kv_arr, tables.kv_splits, accumulate=False, target_rows=kv_target,
                              recv_inverse=kv_inverse),
            q_inv=RouteIndex(q_arr, q_rows, tables.q_back_splits, accumulate=False, recv_inverse=home_inverse),
            kv_inv=RouteIndex(kv_arr, kv_rows, tables.kv_back_splits, accumulate=True),
        ))
    sets = [DeviceEntrySet(rows[id(part.q_rows)], rows[id(part.k_gather)],
                           _varlen_batch(offsets[2 + 2 * i], offsets[3 + 2 * i], part), q_span=part.q_span)
            for i, part in enumerate(tables.entry_sets())]
    local, remote, heads = (sets + [None, None, None])[:3] if sets else (None, None, None)
    if tables.local is not None:
        local = replace(local, q_self=_self_rows(q_inverse, local.q_rows, tables.q_splits),
                        k_self=_self_rows(kv_inverse, local.k_gather, tables.kv_splits))
    k_gather = rows[id(tables.k_gather)]
    k_first = k_repeat = k_repeat_rows = None
    if tables.kv_rows_read:
        k_first, k_repeat, k_repeat_rows = _first_and_repeats(k_gather, tables.kv_target_len)
    return DeviceTables(chunks=tuple(chunks), batch=_varlen_batch(offsets[0], offsets[1], tables),
                        k_gather=k_gather, nbytes=tables.nbytes(), local=local, remote=remote,
                        heads=heads, relay=relay, k_first=k_first, k_repeat=k_repeat, k_repeat_rows=k_repeat_rows)


def _bounds(host):
    cq, ck = host.cu_q.tolist(), host.cu_k.tolist()  # host numpy arrays: no device involved
    return tuple((cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(host.q_lens)))


class _TableCache:
    """LRU of device tables keyed by (plan object, device); holds at most ``capacity`` plans' tables.

    The planner keeps many RankPlans alive (a window or two of microbatches); only the few in flight
    need device tables, so they are not tied to the plans' lifetime (which held GiBs before).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: "collections.OrderedDict" = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, plan, device, build) -> DeviceTables:
        key = (id(plan), str(device))
        with self._lock:
            hit = self._items.get(key)
            if hit is not None and hit[0] is plan:
                self._items.move_to_end(key)
                return hit[1]
        tables = build()
        with self._lock:
            self._items[key] = (plan, tables)  # the entry keeps the plan alive, so id() stays unique
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return tables

    def nbytes(self) -> int:
        with self._lock:
            return sum(t.nbytes for _, t in self._items.values())


_CACHE = _TableCache(capacity=4)


def set_table_cache_size(capacity: int) -> None:
    """Plans whose device tables stay cached (default 4; a Megatron-LM run sizes it to the microbatches its
    pipeline holds in flight, ``megatron.hooks``)."""
    if capacity < 1:
        raise ValueError(f"table cache size must be >= 1, got {capacity}")
    _CACHE.capacity = int(capacity)


def device_tables(plan, tables_fn, device) -> DeviceTables:
    """Device tables of ``plan`` (``tables_fn(plan)`` gives its host ``RankTables``), LRU-cached."""
    return _CACHE.get(plan, torch.device(device), lambda: upload_tables(tables_fn(plan), device))


def cached_table_bytes() -> int:
    return _CACHE.nbytes()


class PendingExchange:
    """An in-flight all_to_all. ``wait()`` returns the received rows (arrival order)."""

    def __init__(self, work, received: torch.Tensor, index: RouteIndex, send: Optional[torch.Tensor] = None,
                 stats: Optional[ExchangeStats] = None, kind: str = ""):
        self._work = work
        self._send = send  # keep the send buffer alive until the collective is done (async NCCL)
        self.received = received
        self.index = index
        self._stats, self._kind = stats, kind

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            start = time.perf_counter()
            self._work.wait()
            if self._stats is not None:
                self._stats.add_wait(self._kind, time.perf_counter() - start)
            self._work, self._send = None, None
        return self.received

    def _take(self) -> torch.Tensor:
        """Wait and hand over the received rows: the exchange keeps no reference to its receive buffer after."""
        received = self.wait()
        if received is None:
            raise RuntimeError("PendingExchange: the received rows were already placed")
        self.received = None
        return received

    def placed(self) -> torch.Tensor:
        """Wait, then return the arranged buffer of a forward route (every received row written once; with
        ``target_rows``, the other rows are left for the relay route)."""
        received = self._take()
        if self.index.recv_inverse is not None:  # every target row received: one gather
            return received.index_select(0, self.index.recv_inverse)
        target = received.new_empty((self.index.num_target_rows(),) + tuple(received.shape[1:]))
        return target.index_put_((self.index.recv_rows,), received)

    def self_source(self) -> torch.Tensor:
        """Before waiting: the send buffer, whose self segment holds the rows this rank sends itself."""
        return self._send if self._send is not None else self.received  # a one-rank group kept only send

    def self_placed(self) -> torch.Tensor:
        """Before waiting: a new arranged buffer with only the self segment placed, read from the send buffer
        (the rows this rank sends itself are already here). ``rest_placed`` fills the other rows."""
        sp = self.index.splits
        send = self.self_source()
        if self.index.recv_inverse is not None and sp.self_rows == self.index.num_target_rows():
            return send[sp.self_send_offset : sp.self_send_offset + sp.self_rows].index_select(0, self.index.recv_inverse)
        target = send.new_empty((self.index.num_target_rows(),) + tuple(send.shape[1:]))
        rows = self.index.recv_rows[sp.self_recv_offset : sp.self_recv_offset + sp.self_rows]
        return target.index_put_((rows,), send[sp.self_send_offset : sp.self_send_offset + sp.self_rows])

    def rest_placed(self, target: torch.Tensor) -> torch.Tensor:
        """Wait, then the whole arranged buffer: when the received rows fill it, one gather of them all (the self
        segment arrived too; a new buffer, ``target`` is dropped), else the rows other ranks sent placed into
        ``target`` from ``self_placed``."""
        received, sp, rows = self._take(), self.index.splits, self.index.recv_rows
        if self.index.recv_inverse is not None and sp.self_rows < self.index.num_target_rows():
            return received.index_select(0, self.index.recv_inverse)  # (else self_placed gathered every row)
        lo, hi = sp.self_recv_offset, sp.self_recv_offset + sp.self_rows
        for part in (slice(0, lo), slice(hi, None)):
            if rows[part].shape[0]:
                target.index_put_((rows[part],), received[part])
        return target

    def into(self, target: torch.Tensor) -> torch.Tensor:
        """Wait, then write the received rows of an inverse route into ``target`` (in target's dtype): added
        (``accumulate``: K|V) or copied (Q: each row has one source, so ``target`` may start uninitialised; with
        ``recv_inverse``, ``target`` is the chunk's (t*H, qp, d) view, filled by one gather and one copy)."""
        received = self._take().to(target.dtype)
        if self.index.accumulate:
            return target.index_add_(0, self.index.recv_rows, received)
        if self.index.recv_inverse is not None:
            return target.copy_(received.index_select(0, self.index.recv_inverse))
        return target.index_put_((self.index.recv_rows,), received)  # a copy (index_copy_ takes int64 only)


def start_exchange(send: torch.Tensor, index: RouteIndex, group, stats: Optional[ExchangeStats], kind: str,
                   async_op: bool = True) -> PendingExchange:
    """Launch the all_to_all of ``send`` (rows already gathered by ``index.send_rows``, grouped by rank).

    A single-rank group skips the collective (the rows are already where they go).
    """
    send = send.contiguous()
    if stats is not None:
        row_bytes = send[0].numel() * send.element_size() if send.shape[0] else 0
        stats.add_bytes(kind, index.splits.remote_send_rows * row_bytes)
    if len(index.splits.send) == 1:
        return PendingExchange(None, send, index)
    received = send.new_empty((sum(index.splits.recv),) + tuple(send.shape[1:]))
    work = dist.all_to_all_single(received, send, output_split_sizes=list(index.splits.recv),
                                  input_split_sizes=list(index.splits.send), group=group, async_op=async_op)
    return PendingExchange(work if async_op else None, received, index, send, stats, kind)
