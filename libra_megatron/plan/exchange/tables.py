"""Pool-wide run tables of an exchange plan (what ``builder`` computes once per pool; RankPlans are cut from them).

A *run* moves ``count`` units of one source worker, starting at unit ``src_start`` with stride H (Q) or
G (KV) (consecutive local tokens on one head shard or KV class), into rows [tgt_start, tgt_start+count) of the arranged
buffer of worker ``dst``. Q runs are whole tiles; KV runs are (referenced group, home fragment)
pairs. The pool-wide run tables are small (O(tiles + groups*homes)); a rank's routes are cut from them on
first access, as runs too (one rank usually needs only its own RankPlan; nothing here is O(units)).

"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np

from ..layout import HeadLayout
from ..model import entry_pair_heads
from .local_entries import LOCAL, SPLIT, pool_entry_kinds
from .records import IndexRuns, RankPlan, Route, frozen_int64

__all__ = ["UnitRuns", "Varlen", "RunIndex", "PlanTables", "LazyRankPlans", "bytes_sent", "pair_units", "peer_units",
           "hosted_pair_heads", "pool_kinds", "fingerprint", "segment_starts"]


def segment_starts(keys: np.ndarray, lengths: np.ndarray, num_keys: int) -> np.ndarray:
    """Exclusive cumsum of ``lengths`` restarted at every key (keys sorted non-decreasing): each item's first row in
    its key's buffer (the builder's arranged rows, the regrouped entries' starts)."""
    incl = np.cumsum(lengths)
    base = np.concatenate([[0], incl])[np.searchsorted(keys, np.arange(num_keys), side="left")]
    return incl - lengths - base[keys]


@dataclass(frozen=True, eq=False)
class UnitRuns:
    """Pool-wide table of unit runs, int64 arrays of equal length; one stride (H for Q, G for KV) for all."""

    src: np.ndarray
    dst: np.ndarray
    src_start: np.ndarray
    count: np.ndarray
    tgt_start: np.ndarray

    def arrays(self) -> Tuple[np.ndarray, ...]:
        return (self.src, self.dst, self.src_start, self.count, self.tgt_start)

    def remote_units(self) -> np.ndarray:
        """int64 [n]: units of each run that cross workers (0 for self runs)."""
        return np.where(self.src != self.dst, self.count, 0)


@dataclass(frozen=True, eq=False)
class Varlen:
    """Merged varlen entries of all destinations, grouped by destination (CSR ``dst_ptr``)."""

    dst_ptr: np.ndarray  # int64 [W+1]
    q_start: np.ndarray  # arranged-Q row of each entry's first query
    q_len: np.ndarray
    kv_offset: np.ndarray
    k_len: np.ndarray



class RunIndex:
    """A run table sorted twice: by (src, dst, tgt) for the send side, by (dst, src, tgt) for receive.

    Runs arrive sorted by (dst, tgt), so a *stable* sort on the small integer key (dst, src) or
    (src, dst) keeps tgt order inside every pair (radix sort when W*W fits 16 bits).
    """

    def __init__(self, runs: UnitRuns, num_workers: int):
        self.num_workers = num_workers
        assert np.all(np.diff(runs.dst) >= 0), "runs must arrive sorted by destination"
        self.by_src = self._sorted(runs, runs.src * num_workers + runs.dst, runs.src)
        self.by_dst = self._sorted(runs, runs.dst * num_workers + runs.src, runs.dst)

    def _sorted(self, runs: UnitRuns, pair_key: np.ndarray, key: np.ndarray):
        small = pair_key.astype(np.uint16) if self.num_workers ** 2 <= 1 << 16 else pair_key
        perm = np.argsort(small, kind="stable")
        arrays = UnitRuns(*(x[perm] for x in runs.arrays()))
        ptr = np.searchsorted(key[perm], np.arange(self.num_workers + 1), side="left")
        return arrays, ptr

    def route(self, rank: int, stride: int, source_len: int, target_len: int) -> Route:
        """The forward route of ``rank``: send its runs by destination, place received runs."""
        W = self.num_workers
        send, sptr = self.by_src
        recv, rptr = self.by_dst
        s = slice(sptr[rank], sptr[rank + 1])
        r = slice(rptr[rank], rptr[rank + 1])
        return Route(
            send_runs=IndexRuns(send.src_start[s], send.count[s], stride),
            send_splits=np.bincount(send.dst[s], weights=send.count[s], minlength=W).astype(np.int64),
            recv_splits=np.bincount(recv.src[r], weights=recv.count[r], minlength=W).astype(np.int64),
            recv_runs=IndexRuns(recv.tgt_start[r], recv.count[r], 1),
            source_len=int(source_len),
            target_len=int(target_len),
        )



@dataclass(frozen=True, eq=False)
class PlanTables:
    """Everything ``build_exchange_plan`` computes pool-wide; RankPlans are cut from it on demand."""

    heads: HeadLayout
    local_tokens: int
    q: RunIndex
    kv: RunIndex
    q_len: np.ndarray  # int64 [W] arranged Q units per destination
    kv_len: np.ndarray  # int64 [W] arranged KV units per destination
    varlen: Varlen
    bytes_sent: np.ndarray  # int64 [W, 3]
    fingerprint: str
    local_lead: np.ndarray = None  # int64 [W] or None
    relay: Optional[RunIndex] = None  # relay runs (arranged KV rows -> arranged KV rows); None: no relay

    def rank_plan(self, rank: int) -> RankPlan:
        H, G = self.heads.head_split, self.heads.num_kv_classes
        v, lo, hi = self.varlen, self.varlen.dst_ptr[rank], self.varlen.dst_ptr[rank + 1]
        cu = np.concatenate([v.q_start[lo:hi], [self.q_len[rank]]]) if hi > lo else np.zeros(1, np.int64)
        return RankPlan(
            rank=rank, num_workers=self.q.num_workers, local_tokens=self.local_tokens, heads=self.heads,
            q_route=self.q.route(rank, H, self.local_tokens * H, self.q_len[rank]),
            kv_route=self.kv.route(rank, G, self.local_tokens * G, self.kv_len[rank]),
            cu_seqlens_q=frozen_int64(cu), seq_kv_offset=frozen_int64(v.kv_offset[lo:hi]), seq_k_len=frozen_int64(v.k_len[lo:hi]),
            fingerprint=self.fingerprint, bytes_sent=tuple(int(b) for b in self.bytes_sent[rank]),
            local_lead=-1 if self.local_lead is None else int(self.local_lead[rank]),
            relay_route=None if self.relay is None else
            self.relay.route(rank, 1, self.kv_len[rank], self.kv_len[rank]),
        )


class LazyRankPlans(Sequence):
    """Tuple-like ``ExchangePlan.ranks``: RankPlan w is built on first access and cached.

    Thread-safe: the background planner may build a rank's plan while the training thread asks for it;
    the lock makes both see the same RankPlan object, built once.
    """

    def __init__(self, tables: PlanTables):
        self._tables = tables
        self._cache: dict = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # locks do not pickle; plans stay picklable
        return {"_tables": self._tables, "_cache": dict(self._cache)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._tables.q.num_workers

    def __getitem__(self, rank):
        if isinstance(rank, slice):
            return tuple(self[i] for i in range(*rank.indices(len(self))))
        rank = int(rank)
        if rank < 0:
            rank += len(self)
        if not 0 <= rank < len(self):
            raise IndexError(f"rank {rank} is outside the pool of {len(self)} workers")
        plan = self._cache.get(rank)
        if plan is None:
            with self._lock:
                plan = self._cache.get(rank)
                if plan is None:
                    plan = self._cache[rank] = self._tables.rank_plan(rank)
        return plan

    def __iter__(self) -> Iterator[RankPlan]:
        return (self[i] for i in range(len(self)))

    def clear_cache(self) -> None:
        """Drop the RankPlans built so far (``validate_plan`` builds every rank's: pickled with them, a 256K pool's
        plan is ~390 MB instead of ~0.7): a plan handed to another process carries only what its receiver builds."""
        with self._lock:
            self._cache = {}


def bytes_sent(q: UnitRuns, kv: UnitRuns, heads: HeadLayout, num_workers: int,
                relay: Optional[UnitRuns] = None) -> np.ndarray:
    """int64 [W, 3]: (Q, KV, O) bytes each worker sends to other workers in one layer forward (KV: both hops)."""
    W = num_workers
    q_remote = q.remote_units()
    q_units = np.bincount(q.src, weights=q_remote, minlength=W)
    kv_units = np.bincount(kv.src, weights=kv.remote_units(), minlength=W)
    if relay is not None:
        kv_units = kv_units + np.bincount(relay.src, weights=relay.count, minlength=W)
    o_units = np.bincount(q.dst, weights=q_remote, minlength=W)  # outputs go back dst -> home
    per_unit = np.array([heads.q_bytes_per_token(), heads.kv_bytes_per_token(), heads.o_bytes_per_token()])
    return (np.stack([q_units, kv_units, o_units], axis=1).astype(np.int64) * per_unit).astype(np.int64)


def pair_units(runs: UnitRuns, num_workers: int) -> np.ndarray:
    """int64 [W, W]: units every (src, dst) pair of a run table moves (self included)."""
    W = num_workers
    return np.bincount(runs.src * W + runs.dst, weights=runs.count, minlength=W * W).reshape(W, W).astype(np.int64)


def peer_units(q: UnitRuns, kv: UnitRuns, num_workers: int) -> np.ndarray:
    """int64 [2, W, W]: (Q, KV) units every (src, dst) pair of the run tables moves (self included)."""
    return np.stack([pair_units(q, num_workers), pair_units(kv, num_workers)])


def pool_kinds(q: UnitRuns, kv: UnitRuns, q_len, kv_len, varlen: Varlen, relay: Optional[UnitRuns] = None):
    """(kinds int8 [n], tail - kv offset int64 [n]) of every varlen entry of every destination
    (``local_entries.pool_entry_kinds``; relayed rows are foreign)."""
    W = q_len.shape[0]
    dst = np.repeat(np.arange(W, dtype=np.int64), np.diff(varlen.dst_ptr))
    both = kv if relay is None else UnitRuns(*(np.concatenate([a, b]) for a, b in zip(kv.arrays(), relay.arrays())))
    return pool_entry_kinds((q.src, q.dst, q.tgt_start, q.count), (both.src, both.dst, both.tgt_start, both.count),
                            q_len, kv_len, dst, varlen.q_start, varlen.q_start + varlen.q_len,
                            varlen.kv_offset, varlen.kv_offset + varlen.k_len)


def hosted_pair_heads(q: UnitRuns, kv: UnitRuns, q_len, kv_len, varlen: Varlen, heads: HeadLayout,
                       relay: Optional[UnitRuns] = None) -> np.ndarray:
    """float64 [2, W]: (local, remote) Eq. 6 load per destination (``plan.exchange.local_entries``): local entries, and
    the self-sourced key tails of split entries, run before any dispatch arrives (relayed rows are foreign)."""
    W = q_len.shape[0]
    dst = np.repeat(np.arange(W, dtype=np.int64), np.diff(varlen.dst_ptr))
    kinds, tail = pool_kinds(q, kv, q_len, kv_len, varlen, relay)
    hps = heads.q_heads_per_shard
    load = entry_pair_heads(varlen.q_len, varlen.k_len, hps).astype(np.float64)
    tail_load = entry_pair_heads(varlen.q_len, varlen.k_len - tail, hps).astype(np.float64)
    local = np.where(kinds == LOCAL, load, np.where(kinds == SPLIT, tail_load, 0.0))
    out = np.stack([np.bincount(dst, weights=local, minlength=W), np.bincount(dst, weights=load - local, minlength=W)])
    out.setflags(write=False)
    return out


def fingerprint(tiles, assignment: np.ndarray, q: UnitRuns, pairs: np.ndarray, varlen: Varlen,
                 relay: Optional[UnitRuns] = None) -> str:
    """sha256 (first 128 bits, hex) over layout, heads, docs, assignment, Q runs, KV pairs and varlen.

    These determine every rank's arrays (KV runs are the referenced pairs expanded over the doc
    homes, which follow from the doc table and the layout), at a fraction of the bytes. sha256, not
    blake2b: it is hardware-accelerated on current x86/arm CPUs (measured ~3x faster on 400 KB here).
    """
    h = hashlib.sha256()
    lay, hd = tiles.layout, tiles.heads
    meta = [lay.seq_len, lay.cp, tiles.pool_size, hd.num_q_heads, hd.num_kv_heads, hd.head_dim,
            hd.head_split, hd.num_chunks, hd.elem_bytes, tiles.block_size]
    h.update(f"{lay.kind.value}/{tiles.tiling.value}/{tiles.kv_fetch.value}".encode())
    h.update(np.asarray(meta, dtype=np.int64).tobytes())
    relayed = () if relay is None else relay.arrays()  # the nodes decide them
    for arr in (tiles.doc_seq, tiles.doc_len, assignment, *q.arrays(), pairs, varlen.dst_ptr,
                varlen.q_start, varlen.q_len, varlen.kv_offset, varlen.k_len, *relayed):
        h.update(np.int64(arr.size).tobytes())
        h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
    return h.hexdigest()[:32]

