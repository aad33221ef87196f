"""Exchange plans (§4.3.3, §4.4): transport-neutral routes that execute a tile assignment.

SCHEMA (owned here; the runtime imports only these records; ``builder`` makes them):

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
into the relay's arranged dK/dV before it goes home); in the striped layout (``relay.relay_runs``) the home run is
cut into stripes, each fetched by one of those destinations and forwarded to the others that need it, so a rank
may both forward and receive rows of one home run. The KV route's receive runs and the relay route's
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
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from ..errors import PlanError
from ..layout import HeadLayout

__all__ = ["IndexRuns", "Route", "RankPlan", "ExchangePlan", "q_rows", "kv_rows", "expand_runs", "frozen_int64"]


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
        start, count = frozen_int64(np.array(self.start, dtype=np.int64)), frozen_int64(np.array(self.count, dtype=np.int64))
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
        return frozen_int64(expand_runs(self.start, self.count, self.stride))

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
    validation and the numpy test executor; the runtime expands the runs itself (``plan.exchange.runtime_tables``).
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
        send = frozen_int64(np.array(self.send_splits, dtype=np.int64))
        recv = frozen_int64(np.array(self.recv_splits, dtype=np.int64))
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
    local_lead: int = -1  # local chunks run before the first remote one (plan.model.timing.best_lead); -1: M - 1
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
    # (self included; O returns the Q units dst -> src). ``plan.exchange.traffic`` turns it into bytes per link and chunk.
    hosted_pair_heads: np.ndarray = None  # float64 [2, W]: Eq. 6 load each destination hosts in (local, remote)
    # varlen entries (``plan.exchange.local_entries``: local ones run while the dispatch is in flight); sums to the loads
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


def expand_runs(start: np.ndarray, count: np.ndarray, stride: int) -> np.ndarray:
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



def frozen_int64(x: np.ndarray) -> np.ndarray:
    """``x`` as a read-only contiguous int64 array."""
    x = np.ascontiguousarray(x, dtype=np.int64)
    x.setflags(write=False)
    return x

