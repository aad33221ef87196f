"""Exchange plans (§4.3.3, §4.4): transport-neutral routes that execute a tile assignment.

SCHEMA (owned here; the runtime imports only these records):

Units. All routes move *units*. A Q unit (and a KV unit) is ``local_token * H + h``: one token of the
rank's local buffer on head shard h. The runtime maps a unit to a row of the tensor view of chunk m
with ``HeadLayout``-derived formulas (see ``q_rows`` / ``kv_rows``):
    q  (t, hq, d)  viewed as (t*H*M, q_piece, d):           row = unit*M + m
    k/v (t, hkv, d) viewed as (t*kv_pieces, kv_piece, d):   row = (unit//H)*kv_pieces + kv_piece_index[unit%H, m]
So every chunk moves the same units; chunk m carries the m-th head piece of every tile (§4.4).

Route. One all_to_all pattern seen from one rank (see ``Route``). Forward routes gather from the local
buffer, exchange, and *place* into an arranged buffer (a permutation). ``Route.inverse()`` is the
backward route: it gathers from the arranged buffer and *accumulates* into the local buffer (index_add),
which sums dK/dV fragments fetched by several destinations.

RankPlan. What one rank executes: its Q route (Q dispatch; inverse = O return, dQ return), its KV route
(KV fetch, deduplicated per (sample, head shard, destination); inverse = dK/dV return) and the varlen
metadata of the tiles it hosts, over its arranged buffers.

ExchangePlan. The pool-wide plan: one RankPlan per worker, the tile assignment it realises, byte totals
and a fingerprint every rank can compare before the first collective.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Tuple

import numpy as np

from .errors import PlanError
from .layout import HeadLayout

__all__ = ["Route", "RankPlan", "ExchangePlan", "q_rows", "kv_rows"]


def q_rows(units: np.ndarray, heads: HeadLayout, chunk: int) -> np.ndarray:
    """Rows of the chunk view (t*H*M, q_piece, d) of a local Q/O/dQ buffer for the given units."""
    return np.asarray(units, dtype=np.int64) * heads.num_chunks + chunk


def kv_rows(units: np.ndarray, heads: HeadLayout, chunk: int) -> np.ndarray:
    """Rows of the chunk view (t*kv_pieces, kv_piece, d) of a local K/V buffer for the given units."""
    units = np.asarray(units, dtype=np.int64)
    piece = heads.kv_piece_index()[units % heads.head_split, chunk]
    return (units // heads.head_split) * heads.kv_pieces_per_token + piece


@dataclass(frozen=True, eq=False)
class Route:
    """One all_to_all exchange as seen by one rank, in units.

    send_index  int64 [sum(send_splits)]  source rows to send, grouped by destination in rank order
    send_splits int64 [W]                  units sent to each rank (self included)
    recv_splits int64 [W]                  units received from each rank (self included)
    recv_index  int64 [sum(recv_splits)]  where received unit i lands in the target buffer
    source_len  int                        rows of the source buffer
    target_len  int                        rows of the target buffer
    accumulate  bool                       False: target[recv_index] = received (recv_index is a
                                           permutation of range(target_len));
                                           True: target = zeros.index_add(recv_index, received)
    """

    send_index: np.ndarray
    send_splits: np.ndarray
    recv_splits: np.ndarray
    recv_index: np.ndarray
    source_len: int
    target_len: int
    accumulate: bool = False

    def inverse(self) -> "Route":
        """The backward route: arranged -> local, accumulating (§ backward, issue 3)."""
        return Route(
            send_index=self.recv_index,
            send_splits=self.recv_splits,
            recv_splits=self.send_splits,
            recv_index=self.send_index,
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
    ``kv_route.target_len`` KV units, every fetched KV group contiguous in sample order.
    Varlen batch over the hosted tiles (one entry per (tile run, sample fragment)):
        cu_seqlens_q  int64 [n_seqs+1]  query rows [cu_q[i], cu_q[i+1]) of the arranged Q buffer
        seq_kv_offset int64 [n_seqs]    first arranged-KV row of the sample's group (sample position 0)
        seq_k_len     int64 [n_seqs]    key prefix length e: keys = arranged KV[off : off+e]
    Causal alignment is bottom-right: query row r of entry i sits at sample position
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
    bytes_sent: Tuple[int, int, int] = (0, 0, 0)  # (q, kv, o) bytes this rank sends to others per layer

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
    extra: dict = field(default_factory=dict)

    @property
    def num_workers(self) -> int:
        return len(self.ranks)

    def for_rank(self, rank: int) -> RankPlan:
        if not 0 <= rank < len(self.ranks):
            raise PlanError(f"rank {rank} is outside the pool of {len(self.ranks)} workers")
        return self.ranks[rank]
