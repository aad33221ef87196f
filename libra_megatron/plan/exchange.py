"""Exchange plans (§4.3.3, §4.4): transport-neutral routes that execute a tile assignment.

SCHEMA (owned here; the runtime imports only these records):

Units. All routes move *units*. A Q unit is ``local_token * H + h``: one token of the rank's local buffer
on head shard h. A KV unit is ``local_token * G + c``: one token on KV class c (``HeadLayout``: the kv heads
a shard reads; G = min(H, hkv), c = h when H <= hkv). The runtime maps a unit to a row of the tensor view
of chunk m with ``HeadLayout``-derived formulas (see ``q_rows`` / ``kv_rows``):
    q  (t, hq, d)  viewed as (t*H*M, q_piece, d):          row = unit*M + m
    k/v (t, hkv, d) viewed as (t*kv_pieces, kv_piece, d):  row = (unit//G)*kv_pieces + kv_piece_of_class[unit%G, m]
So every chunk moves the same units; chunk m carries the m-th head piece of every tile (§4.4). K/V go
once per step: only the chunks in ``heads.kv_send_chunks()`` run the KV route; a chunk that reads the same
kv piece as the chunk before it reuses that chunk's arranged K/V, and the inverse KV route runs at the
``heads.kv_return_chunks()`` with dK/dV summed over the chunks that shared the piece.

Route. One all_to_all pattern seen from one rank (see ``Route``). Forward routes gather from the local
buffer, exchange, and *place* into an arranged buffer (a permutation). ``Route.inverse()`` is the
backward route: it gathers from the arranged buffer and *accumulates* into the local buffer (index_add),
which sums dK/dV fragments fetched by several destinations.

Relay (issue 14). With ``timing.kv_relay`` (nodes from ``timing.nodes``), a home run of K/V that several
destinations on one *other* node fetch crosses nodes once: the destination there that needs the most of it (the relay,
lowest rank on ties) fetches it along the KV route, and the others copy their prefix of it from the relay's
arranged buffer along the *relay route* (units = arranged-KV rows, stride 1; inverse = their dK/dV added
into the relay's arranged dK/dV before it goes home). The KV route's receive runs and the relay route's
together place every arranged-KV row exactly once. Which home runs relay is chosen per plan, the fastest
under the Pipeliner timeline of: every home run, or only those of the workers within 5% / 1% of the
unrelayed plan's slowest (``RELAY_SENDER_CUTS``: a relay's receivers wait for it, so relaying only the
slow senders takes their fan-out off the critical path without holding up everyone else's receivers); no
relay when each prices the pool's slowest worker slower.

RankPlan. What one rank executes: its Q route (Q dispatch; inverse = O return, dQ return), its KV route
(KV fetch, deduplicated per (doc, KV class, destination); inverse = dK/dV return), its relay route (None
when the pool has no relay) and the varlen metadata of the tiles it hosts, over its arranged buffers.

ExchangePlan. The pool-wide plan: one RankPlan per worker, the tile assignment it realises, byte totals
and a fingerprint every rank can compare before the first collective.
"""
from __future__ import annotations

import functools
import hashlib
import threading
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np

from .errors import PlanError
from .kv_refs import home_runs_in_prefix
from .layout import HeadLayout
from .local_entries import LOCAL, SPLIT, entry_pair_heads, pool_entry_kinds

__all__ = ["IndexRuns", "Route", "RankPlan", "ExchangePlan", "q_rows", "kv_rows", "build_exchange_plan",
           "RELAY_SENDER_CUTS"]

RELAY_SENDER_CUTS = (0.95, 0.99)  # relay candidates besides every home run (module docstring, "Relay")


def q_rows(units: np.ndarray, heads: HeadLayout, chunk: int) -> np.ndarray:
    """Rows of the chunk view (t*H*M, q_piece, d) of a local Q/O/dQ buffer for the given units."""
    return np.asarray(units, dtype=np.int64) * heads.num_chunks + chunk


def kv_rows(units: np.ndarray, heads: HeadLayout, chunk: int) -> np.ndarray:
    """Rows of the chunk view (t*kv_pieces, kv_piece, d) of a local K/V buffer for the given KV units."""
    units = np.asarray(units, dtype=np.int64)
    G = heads.num_kv_classes
    piece = heads.kv_piece_of_class()[units % G, chunk]
    return (units // G) * heads.kv_pieces_per_token + piece


@dataclass(frozen=True, eq=False)
class IndexRuns:
    """An index array stored as arithmetic runs: run i is ``start[i] + stride * arange(count[i])``, and the
    array is the runs concatenated in order. Storing and checking it is O(runs); ``expand()`` is O(indices).

    start   int64 [n]  first index of every run
    count   int64 [n]  indices in every run (>= 0)
    stride  int        step inside a run (H for Q units, G for KV units, 1 for arranged rows)
    """

    start: np.ndarray
    count: np.ndarray
    stride: int

    def __post_init__(self) -> None:
        start, count = _frozen(np.array(self.start, dtype=np.int64)), _frozen(np.array(self.count, dtype=np.int64))
        if start.ndim != 1 or start.shape != count.shape:
            raise PlanError(f"runs need 1-D start and count of one length, got {start.shape} and {count.shape}")
        if (count < 0).any() or int(self.stride) < 0:
            raise PlanError(f"runs need counts >= 0 and a stride >= 0 (stride {self.stride})")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "count", count)
        object.__setattr__(self, "stride", int(self.stride))

    @property
    def num_runs(self) -> int:
        return int(self.start.shape[0])

    @functools.cached_property
    def num_indices(self) -> int:
        return int(self.count.sum())

    def index_range(self) -> Tuple[int, int]:
        """(lowest index, highest index + 1) over the non-empty runs; (0, 0) when there is none."""
        keep = self.count > 0
        if not keep.any():
            return 0, 0
        start = self.start[keep]
        last = start + self.stride * (self.count[keep] - 1)
        return int(start.min()), int(last.max()) + 1

    def expand(self) -> np.ndarray:
        """The index array, int64 [num_indices], read-only."""
        return _frozen(_expand(self.start, self.count, self.stride))

    @staticmethod
    def of_index(index: np.ndarray) -> "IndexRuns":
        """Any index array as runs of one index each (for hand-made routes; the builder makes long runs)."""
        index = np.asarray(index, dtype=np.int64).reshape(-1)
        return IndexRuns(index, np.ones_like(index), 1)


@dataclass(frozen=True, eq=False)
class Route:
    """One all_to_all exchange as seen by one rank, in units, stored as runs (O(runs), not O(units)).

    send_runs   IndexRuns  source units to send, grouped by destination in rank order (target order
                           inside each destination: the order the destination receives them in)
    send_splits int64 [W]  units sent to each rank (self included)
    recv_splits int64 [W]  units received from each rank (self included)
    recv_runs   IndexRuns  where each received unit lands in the target buffer, grouped by source
    source_len  int        rows of the source buffer
    target_len  int        rows of the target buffer
    accumulate  bool       False: target[recv_index] = received (recv_index is a permutation of
                           range(target_len)); True: target = zeros.index_add(recv_index, received)
    ``send_index`` / ``recv_index`` are the runs expanded (int64, built on first access and cached): for
    validation and the numpy test executor; the runtime expands the runs itself (``plan.rank_tables``).
    Checked on construction, O(runs): split shapes and signs, run totals == split totals, every index
    inside its buffer.
    """

    send_runs: IndexRuns
    send_splits: np.ndarray
    recv_splits: np.ndarray
    recv_runs: IndexRuns
    source_len: int
    target_len: int
    accumulate: bool = False

    def __post_init__(self) -> None:
        send = _frozen(np.array(self.send_splits, dtype=np.int64))
        recv = _frozen(np.array(self.recv_splits, dtype=np.int64))
        object.__setattr__(self, "send_splits", send)
        object.__setattr__(self, "recv_splits", recv)
        object.__setattr__(self, "source_len", int(self.source_len))
        object.__setattr__(self, "target_len", int(self.target_len))
        if send.ndim != 1 or send.shape != recv.shape or (send < 0).any() or (recv < 0).any():
            raise PlanError(f"route splits must be two [W] arrays of counts >= 0, got {send.shape} and {recv.shape}")
        for side, runs, splits, length in (("send", self.send_runs, send, self.source_len),
                                           ("recv", self.recv_runs, recv, self.target_len)):
            if runs.num_indices != int(splits.sum()):
                raise PlanError(f"route {side} runs hold {runs.num_indices} units, its splits sum to {int(splits.sum())}")
            lo, hi = runs.index_range()
            if lo < 0 or hi > length:
                raise PlanError(f"route {side} runs reach [{lo}, {hi}), outside the buffer of {length} rows")

    @functools.cached_property
    def send_index(self) -> np.ndarray:
        """int64 [sum(send_splits)]: ``send_runs`` expanded."""
        return self.send_runs.expand()

    @functools.cached_property
    def recv_index(self) -> np.ndarray:
        """int64 [sum(recv_splits)]: ``recv_runs`` expanded."""
        return self.recv_runs.expand()

    def inverse(self) -> "Route":
        """The backward route: arranged -> local, accumulating (§ backward, issue 3)."""
        return Route(
            send_runs=self.recv_runs,
            send_splits=self.recv_splits,
            recv_splits=self.send_splits,
            recv_runs=self.send_runs,
            source_len=self.target_len,
            target_len=self.source_len,
            accumulate=True,
        )

    def remote_units_sent(self, rank: int) -> int:
        """Units this rank sends to other ranks (self excluded)."""
        return int(self.send_splits.sum() - self.send_splits[rank])


@dataclass(frozen=True, eq=False)
class RankPlan:
    """Everything rank ``rank`` of the pool needs to run ``libra_attn_func`` for one pool instance.

    Arranged buffers (destination side): ``q_route.target_len`` Q units in hosted-tile order and
    ``kv_route.target_len`` KV units, every fetched KV group (doc, class) contiguous in doc order.
    Varlen batch over the hosted tiles (one entry per (tile run, doc fragment)):
        cu_seqlens_q  int64 [n_seqs+1]  query rows [cu_q[i], cu_q[i+1]) of the arranged Q buffer
        seq_kv_offset int64 [n_seqs]    first arranged-KV row of the doc's group (doc position 0)
        seq_k_len     int64 [n_seqs]    key prefix length e: keys = arranged KV[off : off+e]
    Causal alignment is bottom-right: query row r of entry i sits at doc position
    e - q_len + r and sees keys [0, e - q_len + r].
    """

    rank: int
    num_workers: int
    local_tokens: int
    heads: HeadLayout
    q_route: Route
    kv_route: Route
    cu_seqlens_q: np.ndarray
    seq_kv_offset: np.ndarray
    seq_k_len: np.ndarray
    fingerprint: str
    bytes_sent: Tuple[int, int, int] = (0, 0, 0)  # (q, kv, o) bytes this rank sends to others per layer (kv:
    # both hops)
    local_lead: int = -1  # local chunks run before the first remote one (plan.timing.best_lead); -1: M - 1
    relay_route: Optional[Route] = None  # arranged KV -> arranged KV (module docstring); None: no relay in the pool

    @property
    def num_seqs(self) -> int:
        return int(self.seq_k_len.shape[0])

    @property
    def max_seqlen_q(self) -> int:
        return int(np.diff(self.cu_seqlens_q).max(initial=0))

    @property
    def max_seqlen_k(self) -> int:
        return int(self.seq_k_len.max(initial=0))


@dataclass(frozen=True, eq=False)
class ExchangePlan:
    """Pool-wide plan: ``ranks[w]`` for every worker w, plus the assignment it realises."""

    ranks: Tuple[RankPlan, ...]
    assignment: np.ndarray  # int64 [num_tiles]: destination worker of every tile
    fingerprint: str
    bytes_q: int = 0  # pool totals per layer forward, remote only
    bytes_kv: int = 0
    bytes_o: int = 0
    arranged_q_units: np.ndarray = None  # int64 [W]: Q units each destination hosts (its arranged Q rows)
    arranged_kv_units: np.ndarray = None  # int64 [W]: KV units each destination fetches (its arranged KV rows)
    peer_units: np.ndarray = None  # int64 [2, W, W]: (Q, KV) units worker src sends to dst per layer forward
    # (self included; O returns the Q units dst -> src). ``plan.traffic`` turns it into bytes per link and chunk.
    hosted_pair_heads: np.ndarray = None  # float64 [2, W]: Eq. 6 load each destination hosts in (local, remote)
    # varlen entries (``plan.local_entries``: local ones run while the dispatch is in flight); sums to the loads
    local_lead: np.ndarray = None  # int64 [W]: every rank's ``RankPlan.local_lead`` (None: not timed, -1 each)
    relay_units: np.ndarray = None  # int64 [W, W]: arranged-KV rows relay src forwards to dst (None: no relay)

    @property
    def num_workers(self) -> int:
        return len(self.ranks)

    @property
    def heads(self) -> HeadLayout:
        """The HeadLayout every rank plan shares (read without building a RankPlan when they are lazy)."""
        tables = getattr(self.ranks, "_tables", None)
        return tables.heads if tables is not None else self.ranks[0].heads

    def for_rank(self, rank: int) -> RankPlan:
        if not 0 <= rank < len(self.ranks):
            raise PlanError(f"rank {rank} is outside the pool of {len(self.ranks)} workers")
        return self.ranks[rank]


# ====================================================================================== builder
# A *run* moves ``count`` units of one source worker, starting at unit ``src_start`` with stride H (Q) or
# G (KV) (consecutive local tokens on one head shard or KV class), into rows [tgt_start, tgt_start+count) of the arranged
# buffer of worker ``dst``. Q runs are whole tiles; KV runs are (referenced group, home fragment)
# pairs. The pool-wide run tables are small (O(tiles + groups*homes)); a rank's routes are cut from them on
# first access, as runs too (one rank usually needs only its own RankPlan; nothing here is O(units)).


@dataclass(frozen=True, eq=False)
class _UnitRuns:
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
class _Varlen:
    """Merged varlen entries of all destinations, grouped by destination (CSR ``dst_ptr``)."""

    dst_ptr: np.ndarray  # int64 [W+1]
    q_start: np.ndarray  # arranged-Q row of each entry's first query
    q_len: np.ndarray
    kv_offset: np.ndarray
    k_len: np.ndarray


def _expand(start: np.ndarray, count: np.ndarray, stride: int) -> np.ndarray:
    """Concatenation of ``start[i] + stride*arange(count[i])`` over i, int64, vectorised.

    One output buffer and two passes (an expanded route holds millions of units at 1M tokens):
    fill with ``stride``, put each piece's jump from the previous piece's last value at its first slot,
    then an in-place cumulative sum."""
    count = np.asarray(count, dtype=np.int64)
    total = int(count.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    keep = count > 0
    start, count = np.asarray(start, dtype=np.int64)[keep], count[keep]
    last = start + stride * (count - 1)
    out = np.full(total, stride, dtype=np.int64)
    out[np.cumsum(count) - count] = start - np.concatenate([[0], last[:-1]])
    np.cumsum(out, out=out)
    return out


def _segment_starts(keys: np.ndarray, lengths: np.ndarray, num_keys: int) -> np.ndarray:
    """Exclusive cumsum of ``lengths`` restarted at every key (keys sorted non-decreasing)."""
    incl = np.cumsum(lengths)
    key_first = np.searchsorted(keys, np.arange(num_keys), side="left")
    base = np.concatenate([[0], incl])[key_first]
    return incl - lengths - base[keys]


def _hosted_order(tiles, assignment: np.ndarray) -> np.ndarray:
    """Tile ids sorted by (destination, head shard, block) -- the hosted order of every destination."""
    t = np.arange(tiles.num_tiles, dtype=np.int64)
    return np.lexsort((t // tiles.head_split, t % tiles.head_split, assignment)).astype(np.int64)


def _q_runs(tiles, assignment: np.ndarray, order: np.ndarray):
    """One Q run per tile, in hosted order; returns (runs, q_target_len per destination)."""
    H, W = tiles.head_split, tiles.num_workers
    block, head = order // H, order % H
    count = tiles.block_end[block] - tiles.block_start[block]
    dst = assignment[order]
    tgt = _segment_starts(dst, count, W)
    runs = _UnitRuns(
        src=tiles.block_home[block], dst=dst, src_start=tiles.block_local_start[block] * H + head,
        count=count, tgt_start=tgt,
    )
    return runs, np.bincount(dst, weights=count, minlength=W).astype(np.int64)


def _fragment_entries(tiles, order: np.ndarray):
    """Expand hosted tiles into (tile, doc fragment) entries, in hosted order.

    Returns int64 arrays: entry_tile (index into ``order``), head, doc, a, e (doc-local query rows
    [a, e)), row_in_block (first query row of the fragment inside its tile), kv_end (key rows it needs).
    """
    H = tiles.head_split
    block = order // H
    nfrag = tiles.frag_ptr[block + 1] - tiles.frag_ptr[block]
    frag = _expand(tiles.frag_ptr[block], nfrag, 1)
    entry_tile = np.repeat(np.arange(order.size, dtype=np.int64), nfrag)
    doc = tiles.frag_doc[frag]
    a, e = tiles.frag_q_start[frag], tiles.frag_q_end[frag]
    row_in_block = tiles.doc_start[doc] + a - tiles.block_start[block[entry_tile]]
    return dict(
        entry_tile=entry_tile, head=order[entry_tile] % H, doc=doc, a=a, e=e, row_in_block=row_in_block,
        kv_end=tiles.frag_kv_end[frag],
    )


def _home_local_starts(tiles) -> np.ndarray:
    """Per doc-home run: the local token index of its first row at its worker."""
    layout = tiles.layout
    bounds = layout.boundaries()
    chunk_local = np.array([c.local_start for c in layout.cp_chunks()], dtype=np.int64)
    owner = np.repeat(np.arange(tiles.num_docs, dtype=np.int64), np.diff(tiles.doc_home_ptr))
    gstart = tiles.doc_start[owner] + tiles.doc_home_offset
    chunk = np.searchsorted(bounds, gstart, side="right") - 1
    return chunk_local[chunk] + gstart - bounds[chunk]


def _kv_and_varlen(tiles, assignment: np.ndarray, order: np.ndarray, q_tgt: np.ndarray):
    """KV runs (deduplicated per (group, destination), rows [0, largest kv_end of the destination's tiles)),
    KV target lengths per destination, merged varlen entries, and the referenced pairs as int64
    [5, n_pairs] rows (dst, KV class, doc, arranged KV offset, prefix length), sorted by (dst, class, doc)."""
    H, G, W, S = tiles.head_split, tiles.num_kv_classes, tiles.num_workers, tiles.num_docs
    ent = _fragment_entries(tiles, order)
    it = ent["entry_tile"]
    dst = assignment[order][it]
    doc, head = ent["doc"], ent["head"]
    klass = tiles.heads.kv_class_of_shard()[head]
    group_key = (dst * G + klass) * S + doc  # shards of one KV class share the group (H > hkv)
    perm = np.argsort(group_key, kind="stable")
    sorted_key = group_key[perm]
    new_pair = np.ones(sorted_key.size, dtype=bool)
    new_pair[1:] = sorted_key[1:] != sorted_key[:-1]
    first = perm[new_pair]
    pair_dst, pair_class, pair_doc = dst[first], klass[first], doc[first]
    pair_len = np.maximum.reduceat(ent["kv_end"][perm], np.flatnonzero(new_pair)) if perm.size else perm
    pair_off = _segment_starts(pair_dst, pair_len, W)
    entry_pair = np.empty(perm.size, dtype=np.int64)
    entry_pair[perm] = np.cumsum(new_pair) - 1
    key = (dst * H + head) * S + doc  # non-decreasing in hosted order
    varlen = _merge_entries(dst, key, ent["a"], ent["e"], q_tgt[it] + ent["row_in_block"], pair_off[entry_pair], W)
    kv = _kv_runs(tiles, pair_dst, pair_class, pair_doc, pair_off, pair_len)
    kv_len = np.bincount(pair_dst, weights=pair_len, minlength=W).astype(np.int64)
    pairs = np.stack([pair_dst, pair_class, pair_doc, pair_off, pair_len])
    return kv, kv_len, varlen, pairs


def _merge_entries(dst, key, a, e, q_start, kv_off, num_workers: int) -> _Varlen:
    """Merge consecutive entries of one (destination, head, doc) whose query rows continue (e == next a)."""
    start = np.ones(key.size, dtype=bool)
    start[1:] = (key[1:] != key[:-1]) | (e[:-1] != a[1:])
    idx = np.flatnonzero(start)
    last = np.concatenate([idx[1:], [key.size]]) - 1
    m_dst = dst[idx]
    q_len = (q_start[last] + (e[last] - a[last])) - q_start[idx]
    dst_ptr = np.searchsorted(m_dst, np.arange(num_workers + 1), side="left").astype(np.int64)
    return _Varlen(dst_ptr=dst_ptr, q_start=q_start[idx], q_len=q_len, kv_offset=kv_off[idx], k_len=e[last])


def _kv_runs(tiles, pair_dst, pair_class, pair_doc, pair_off, pair_len) -> _UnitRuns:
    """Expand every referenced (group, destination) pair into the doc's home runs clipped to its prefix
    (KV units: local token * G + class, so a KV run's stride is G)."""
    G = tiles.num_kv_classes
    pair, home, count = home_runs_in_prefix(tiles, pair_doc, pair_len)
    return _UnitRuns(
        src=tiles.doc_home_worker[home], dst=pair_dst[pair],
        src_start=_home_local_starts(tiles)[home] * G + pair_class[pair],
        count=count, tgt_start=pair_off[pair] + tiles.doc_home_offset[home],
    )


def _relay_runs(kv: _UnitRuns, nodes: np.ndarray, senders: Optional[np.ndarray] = None):
    """(hop-1 KV runs, relay runs or None) (module docstring, "Relay"); ``senders`` (bool [W]): relay only the
    home runs of these workers (None: every worker's).

    KV runs of one home run (same src and src_start: same K/V class, same first row) fetched by several
    destinations on one node other than the source's keep only the longest (the relay R; lowest rank on ties)
    on the KV route; every other destination w gets a relay run R -> w of its own count, from R's arranged
    rows [tgt_R, +count_w) to its rows [tgt_w, +count_w). Relay runs come sorted by (dst, tgt)."""
    node = np.asarray(nodes, dtype=np.int64)
    cross = np.flatnonzero(node[kv.src] != node[kv.dst])
    if senders is not None:
        cross = cross[np.asarray(senders, dtype=bool)[kv.src[cross]]]
    if cross.size < 2:
        return kv, None
    src, start, dnode = kv.src[cross], kv.src_start[cross], node[kv.dst[cross]]
    order = cross[np.lexsort((kv.dst[cross], -kv.count[cross], dnode, start, src))]
    key = np.stack([kv.src[order], kv.src_start[order], node[kv.dst[order]]])
    first = np.ones(order.size, dtype=bool)
    first[1:] = (key[:, 1:] != key[:, :-1]).any(axis=0)
    if first.all():
        return kv, None
    lead = order[np.maximum.accumulate(np.where(first, np.arange(order.size), 0))]  # the relay's run
    moved = order[~first]
    relay_of = lead[~first]
    relay = _UnitRuns(src=kv.dst[relay_of], dst=kv.dst[moved], src_start=kv.tgt_start[relay_of],
                      count=kv.count[moved], tgt_start=kv.tgt_start[moved])
    by_dst = np.lexsort((relay.tgt_start, relay.dst))
    keep = np.ones(kv.src.size, dtype=bool)
    keep[moved] = False
    return _UnitRuns(*(x[keep] for x in kv.arrays())), _UnitRuns(*(x[by_dst] for x in relay.arrays()))


# ------------------------------------------------------------------ per-rank routes (runs)
class _RunIndex:
    """A run table sorted twice: by (src, dst, tgt) for the send side, by (dst, src, tgt) for receive.

    Runs arrive sorted by (dst, tgt), so a *stable* sort on the small integer key (dst, src) or
    (src, dst) keeps tgt order inside every pair (radix sort when W*W fits 16 bits).
    """

    def __init__(self, runs: _UnitRuns, num_workers: int):
        self.num_workers = num_workers
        assert np.all(np.diff(runs.dst) >= 0), "runs must arrive sorted by destination"
        self.by_src = self._sorted(runs, runs.src * num_workers + runs.dst, runs.src)
        self.by_dst = self._sorted(runs, runs.dst * num_workers + runs.src, runs.dst)

    def _sorted(self, runs: _UnitRuns, pair_key: np.ndarray, key: np.ndarray):
        small = pair_key.astype(np.uint16) if self.num_workers ** 2 <= 1 << 16 else pair_key
        perm = np.argsort(small, kind="stable")
        arrays = _UnitRuns(*(x[perm] for x in runs.arrays()))
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


def _frozen(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.int64)
    x.setflags(write=False)
    return x


@dataclass(frozen=True, eq=False)
class _PlanTables:
    """Everything ``build_exchange_plan`` computes pool-wide; RankPlans are cut from it on demand."""

    heads: HeadLayout
    local_tokens: int
    q: _RunIndex
    kv: _RunIndex
    q_len: np.ndarray  # int64 [W] arranged Q units per destination
    kv_len: np.ndarray  # int64 [W] arranged KV units per destination
    varlen: _Varlen
    bytes_sent: np.ndarray  # int64 [W, 3]
    fingerprint: str
    local_lead: np.ndarray = None  # int64 [W] or None
    relay: Optional[_RunIndex] = None  # relay runs (arranged KV rows -> arranged KV rows); None: no relay

    def rank_plan(self, rank: int) -> RankPlan:
        H, G = self.heads.head_split, self.heads.num_kv_classes
        v, lo, hi = self.varlen, self.varlen.dst_ptr[rank], self.varlen.dst_ptr[rank + 1]
        cu = np.concatenate([v.q_start[lo:hi], [self.q_len[rank]]]) if hi > lo else np.zeros(1, np.int64)
        return RankPlan(
            rank=rank, num_workers=self.q.num_workers, local_tokens=self.local_tokens, heads=self.heads,
            q_route=self.q.route(rank, H, self.local_tokens * H, self.q_len[rank]),
            kv_route=self.kv.route(rank, G, self.local_tokens * G, self.kv_len[rank]),
            cu_seqlens_q=_frozen(cu), seq_kv_offset=_frozen(v.kv_offset[lo:hi]), seq_k_len=_frozen(v.k_len[lo:hi]),
            fingerprint=self.fingerprint, bytes_sent=tuple(int(b) for b in self.bytes_sent[rank]),
            local_lead=-1 if self.local_lead is None else int(self.local_lead[rank]),
            relay_route=None if self.relay is None else
            self.relay.route(rank, 1, self.kv_len[rank], self.kv_len[rank]),
        )


class _LazyRankPlans(Sequence):
    """Tuple-like ``ExchangePlan.ranks``: RankPlan w is built on first access and cached.

    Thread-safe: the background planner may build a rank's plan while the training thread asks for it;
    the lock makes both see the same RankPlan object, built once.
    """

    def __init__(self, tables: _PlanTables):
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


def _bytes_sent(q: _UnitRuns, kv: _UnitRuns, heads: HeadLayout, num_workers: int,
                relay: Optional[_UnitRuns] = None) -> np.ndarray:
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


def _pair_units(runs: _UnitRuns, num_workers: int) -> np.ndarray:
    """int64 [W, W]: units every (src, dst) pair of a run table moves (self included)."""
    W = num_workers
    return np.bincount(runs.src * W + runs.dst, weights=runs.count, minlength=W * W).reshape(W, W).astype(np.int64)


def _peer_units(q: _UnitRuns, kv: _UnitRuns, num_workers: int) -> np.ndarray:
    """int64 [2, W, W]: (Q, KV) units every (src, dst) pair of the run tables moves (self included)."""
    return np.stack([_pair_units(q, num_workers), _pair_units(kv, num_workers)])


def _hosted_pair_heads(q: _UnitRuns, kv: _UnitRuns, q_len, kv_len, varlen: _Varlen, heads: HeadLayout,
                       relay: Optional[_UnitRuns] = None) -> np.ndarray:
    """float64 [2, W]: (local, remote) Eq. 6 load per destination (``plan.local_entries``): local entries, and
    the self-sourced key tails of split entries, run before any dispatch arrives (relayed rows are foreign)."""
    W = q_len.shape[0]
    dst = np.repeat(np.arange(W, dtype=np.int64), np.diff(varlen.dst_ptr))
    both = kv if relay is None else _UnitRuns(*(np.concatenate([a, b]) for a, b in zip(kv.arrays(), relay.arrays())))
    kinds, tail = pool_entry_kinds((q.src, q.dst, q.tgt_start, q.count),
                                   (both.src, both.dst, both.tgt_start, both.count),
                                   q_len, kv_len, dst, varlen.q_start, varlen.q_start + varlen.q_len,
                                   varlen.kv_offset, varlen.kv_offset + varlen.k_len)
    hps = heads.q_heads_per_shard
    load = entry_pair_heads(varlen.q_len, varlen.k_len, hps).astype(np.float64)
    tail_load = entry_pair_heads(varlen.q_len, varlen.k_len - tail, hps).astype(np.float64)
    local = np.where(kinds == LOCAL, load, np.where(kinds == SPLIT, tail_load, 0.0))
    out = np.stack([np.bincount(dst, weights=local, minlength=W), np.bincount(dst, weights=load - local, minlength=W)])
    out.setflags(write=False)
    return out


def _fingerprint(tiles, assignment: np.ndarray, q: _UnitRuns, pairs: np.ndarray, varlen: _Varlen,
                 relay: Optional[_UnitRuns] = None) -> str:
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


def _check_assignment(tiles, assignment) -> np.ndarray:
    assignment = np.asarray(assignment).reshape(-1)
    if assignment.shape[0] != tiles.num_tiles:
        raise PlanError(f"assignment has {assignment.shape[0]} entries, expected one per tile ({tiles.num_tiles})")
    if not np.issubdtype(assignment.dtype, np.integer):
        raise PlanError(f"assignment must be integer worker ids, got dtype {assignment.dtype}")
    bad = np.flatnonzero((assignment < 0) | (assignment >= tiles.num_workers))
    if bad.size:
        t = int(bad[0])
        raise PlanError(
            f"tile {t}: destination {int(assignment[t])} is outside the pool of {tiles.num_workers} workers"
        )
    return _frozen(assignment)


def build_exchange_plan(tiles, assignment: np.ndarray, timing=None) -> ExchangePlan:
    """Turn a tile assignment (``assignment[t]`` = destination worker of tile t) into an ExchangePlan.

    Per destination, hosted tiles are ordered by (h, sequence, block start); the arranged Q buffer is
    their query units in that order. Every referenced KV group g=(doc, h) (Eq. 7) is fetched once per
    destination, rows [0, p) in doc-position order with p the largest ``tiles.frag_kv_end`` of its tiles
    there (the whole doc under KvFetch.GROUP, the causal prefix under PREFIX), groups ordered by (h, doc).
    Varlen entries are (tile, doc fragment) pairs, consecutive entries of one group with continuing rows
    merged; an entry's keys are the first e rows of its group (bottom-right causal alignment).
    Byte totals follow Eq. 8: remote KV units * V_g/token + migrated tile tokens * (V_Q + V_O)/token.
    ``timing`` (a ``plan.timing.StepTimeModel``): every rank's Pipeliner lead is chosen under it
    (``plan.timing.best_lead``; it orders local and remote kernel calls, never a collective); with
    ``timing.kv_relay`` the K/V of other nodes is relayed over ``timing.nodes`` (module docstring, "Relay").
    Cost: O(tiles + fragments + referenced groups * homes) here; O(the rank's runs) per RankPlan on access.
    """
    return _build_exchange_plan(tiles, assignment, timing)


def _build_exchange_plan(tiles, assignment: np.ndarray, timing=None, relay_senders=None) -> ExchangePlan:
    """``build_exchange_plan``; ``relay_senders`` (bool [W], tests) relays exactly the home runs of these
    workers whenever ``timing.kv_relay`` (no pricing)."""
    assignment = _check_assignment(tiles, assignment)
    W, heads = tiles.num_workers, tiles.heads
    order = _hosted_order(tiles, assignment)
    q_runs, q_len = _q_runs(tiles, assignment, order)
    kv_runs, kv_len, varlen, pairs = _kv_and_varlen(tiles, assignment, order, q_runs.tgt_start)
    peers = _frozen(_peer_units(q_runs, kv_runs, W))
    hosted = _hosted_pair_heads(q_runs, kv_runs, q_len, kv_len, varlen, heads)
    relay = relay_units = lead = None
    if timing is not None:
        lead, seconds = _lead(peers, hosted, heads, timing)
        if timing.kv_relay:
            sets = [relay_senders] if relay_senders is not None else \
                [None] + _distinct([seconds >= cut * seconds.max() for cut in RELAY_SENDER_CUTS])
            best = None
            for senders in sets:
                hop1, runs = _relay_runs(kv_runs, timing.nodes(W), senders)
                if runs is None:
                    continue
                r_peers = _frozen(_peer_units(q_runs, hop1, W))
                r_units = _frozen(_pair_units(runs, W))
                r_hosted = _hosted_pair_heads(q_runs, hop1, q_len, kv_len, varlen, heads, runs)
                r_lead, r_seconds = _lead(r_peers, r_hosted, heads, timing, r_units)
                # relay unless the timeline prices the pool's slowest worker slower with it (ties relay: the
                # same step for fewer bytes between nodes); the fastest set wins, ties the earlier (more relayed)
                if relay_senders is None and (r_seconds.max() > seconds.max() * (1 + 1e-12) or
                                              (best is not None and r_seconds.max() >= best[0])):
                    continue
                best = (r_seconds.max(), hop1, r_peers, r_hosted, r_lead, r_units, runs)
            if best is not None:
                _, kv_runs, peers, hosted, lead, relay_units, relay = best
        lead = _frozen(lead)
    sent = _bytes_sent(q_runs, kv_runs, heads, W, relay)
    fp = _fingerprint(tiles, assignment, q_runs, pairs, varlen, relay)
    tables = _PlanTables(
        heads=heads, local_tokens=tiles.layout.local_len, q=_RunIndex(q_runs, W), kv=_RunIndex(kv_runs, W),
        q_len=q_len, kv_len=kv_len, varlen=varlen, bytes_sent=sent, fingerprint=fp, local_lead=lead,
        relay=None if relay is None else _RunIndex(relay, W),
    )
    totals = sent.sum(axis=0)
    return ExchangePlan(
        ranks=_LazyRankPlans(tables), assignment=assignment, fingerprint=fp,
        bytes_q=int(totals[0]), bytes_kv=int(totals[1]), bytes_o=int(totals[2]),
        arranged_q_units=_frozen(q_len), arranged_kv_units=_frozen(kv_len),
        peer_units=peers, hosted_pair_heads=hosted, local_lead=lead, relay_units=relay_units,
    )


def _distinct(masks: list) -> list:
    """``masks`` without the ones equal to an earlier one (the same relay set priced once)."""
    out = []
    for mask in masks:
        if not any(np.array_equal(mask, seen) for seen in out):
            out.append(mask)
    return out


def _lead(peer_units, hosted_pair_heads, heads: HeadLayout, timing, relay_units=None):
    """(int64 [W] leads, float64 [W] every worker's seconds with them) under ``timing``: every rank's
    ``plan.timing.best_lead`` from its local / remote loads and phase seconds; with a relay, also every relay
    sender at lead 0 (it issues its forwards before its local work, so its receivers start sooner), whichever
    prices the pool's slowest worker faster."""
    from .timing import best_lead, pipeline_seconds
    from .traffic import traffic_of_units

    traffic = traffic_of_units(peer_units, heads, relay_units)
    nodes = timing.nodes(traffic.num_workers)
    dispatch, ret = traffic.phase_seconds(nodes, timing)
    local, remote = (timing.compute_seconds(x) for x in hosted_pair_heads)
    relay = traffic.relay_timing(nodes, timing)
    lead = best_lead(local, remote, dispatch, ret, relay)
    seconds = pipeline_seconds(local, remote, dispatch, ret, timing.local_first, lead, relay)[0]
    if relay is not None:
        early = np.where(np.asarray(relay_units).sum(axis=1) > 0, 0, lead)
        other = pipeline_seconds(local, remote, dispatch, ret, timing.local_first, early, relay)[0]
        if other.max() < seconds.max():
            lead, seconds = early, other
    return lead, seconds
