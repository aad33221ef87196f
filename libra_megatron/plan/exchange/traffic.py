"""Bytes per link, per worker and per Pipeliner phase of an ExchangePlan, read off the plan itself (§4.4).

Pure numpy. ``plan_traffic(plan)`` turns ``ExchangePlan.peer_units`` -- the (Q, KV) units every (src, dst)
pair moves, counted from the run tables every rank's routes are cut from (``validate_plan`` checks them
against the routes) -- into bytes per layer forward. Self transfers are dropped (they never leave a GPU).

Arrival order, as ``runtime.libra_attn._fwd`` executes it (chunk m of M, F = chunks that send K/V,
``HeadLayout.kv_send_chunks``):
    dispatch m   Q rows of head piece m of every migrated tile (Q/M), plus K/V/F when chunk m sends K/V
    compute m    the varlen kernel over chunk m's pieces
    return m     O rows of piece m (O/M)
Dispatch m+1 is issued before compute m and return m is waited after compute m+1; with local-first, the
local entries of chunk m compute while dispatch m is in flight. ``phase_seconds`` gives every transfer's
link seconds per worker, which ``plan.model.timing.pipeline_seconds`` lays on the Pipeliner's timeline. A plan's
relay hop (``ExchangePlan.relay_units``) travels per K/V-sending chunk after its dispatch, on its own link
(``relay_timing``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Tuple

import numpy as np

from ..gc_pause import paused_gc
from ..layout import HeadLayout
from ..model import PhaseTiming, RelayTiming, price_ops
from .op_lists import phase_ops, rank_inputs

__all__ = ["PlanTraffic", "plan_traffic", "traffic_of_units", "chunk_phase_bytes", "plan_worker_seconds", "LayerTiming",
           "LayerPricing", "plan_layer_timing"]


@dataclass(frozen=True, eq=False)
class PlanTraffic:
    """Remote bytes of one pool plan per layer forward.

    q, kv   float64 [W, W]  bytes worker src (row) sends to dst (column), diagonal 0 (kv: the KV route)
    heads   the plan's HeadLayout (M chunks, which chunks send K/V)
    relay   float64 [W, W]  K/V bytes relay src forwards to dst (None: the plan has no relay)
    """

    q: np.ndarray
    kv: np.ndarray
    heads: HeadLayout
    relay: Optional[np.ndarray] = None

    @property
    def o(self) -> np.ndarray:
        """float64 [W, W]: O goes back from the destination to the Q-home of every Q unit."""
        return self.q.T

    @property
    def num_workers(self) -> int:
        return int(self.q.shape[0])

    @property
    def kv_both(self) -> np.ndarray:
        """float64 [W, W]: K/V bytes of both hops (KV route and relay)."""
        return self.kv if self.relay is None else self.kv + self.relay

    def bytes_sent(self) -> np.ndarray:
        """float64 [W, 3]: (Q, KV, O) bytes each worker sends to others (= ``RankPlan.bytes_sent``)."""
        return np.stack([m.sum(axis=1) for m in (self.q, self.kv_both, self.o)], axis=1)

    def link_bytes(self, node_of_worker: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(intra [W], inter [W]): per worker and link class, max(bytes sent, bytes received)."""
        node = np.asarray(node_of_worker)
        total = self.q + self.kv_both + self.o
        same = node[:, None] == node[None, :]
        out = []
        for mask in (same, ~same):
            part = np.where(mask, total, 0.0)
            out.append(np.maximum(part.sum(axis=1), part.sum(axis=0)))
        return out[0], out[1]

    def phase_link_bytes(self, node_of_worker: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(intra, inter), each float64 [W, 2, M]: ``chunk_phase_bytes`` of every worker's traffic with peers
        on its own node (intra) and on other nodes (inter)."""
        node = np.asarray(node_of_worker)
        same = node[:, None] == node[None, :]
        out = []
        for mask in (same, ~same):
            q, kv = np.where(mask, self.q, 0.0), np.where(mask, self.kv, 0.0)
            out.append(chunk_phase_bytes(q.sum(axis=1), q.sum(axis=0), kv.sum(axis=1), kv.sum(axis=0), self.heads))
        return out[0], out[1]

    def phase_seconds(self, node_of_worker: np.ndarray, model) -> Tuple[np.ndarray, np.ndarray]:
        """(dispatch, ret), each float64 [W, M]: link seconds of every chunk's dispatch and return per worker,
        ``model.comm_seconds`` (``StepTimeModel`` or ``plan.model.StepTimeModel``) applied to each phase's bytes."""
        seconds = model.comm_seconds(*self.phase_link_bytes(node_of_worker))
        return seconds[:, 0], seconds[:, 1]

    def relay_timing(self, node_of_worker: np.ndarray, model):
        """``plan.model.timing.RelayTiming`` of the relay hop (None without one): per K/V-sending chunk, the link
        seconds of max(bytes sent, received) per link class (its share of the relay bytes, as the KV route's)."""

        if self.relay is None:
            return None
        node = np.asarray(node_of_worker)
        same = node[:, None] == node[None, :]
        none = np.zeros(self.num_workers)
        per_class = []
        for mask in (same, ~same):  # a dispatch phase of K/V only: no Q moves on the relay
            part = np.where(mask, self.relay, 0.0)
            per_class.append(chunk_phase_bytes(none, none, part.sum(axis=1), part.sum(axis=0), self.heads)[:, 0])
        moves = self.relay > 0
        sends = self.heads.kv_send_chunks()
        return RelayTiming(seconds=model.comm_seconds(*per_class), partners=moves | moves.T,
                           receives=moves.any(axis=0)[:, None] & sends[None, :])


@lru_cache(maxsize=64)
def _kv_share(heads: HeadLayout) -> np.ndarray:
    """float64 [M]: the share of a worker's K/V bytes each chunk's dispatch carries (1/F on the F K/V-sending
    chunks; read-only). Cached per head layout: the time-aware search prices thousands of rows per pool."""
    sends = heads.kv_send_chunks().astype(np.float64)
    share = sends / sends.sum()
    share.setflags(write=False)
    return share


def chunk_phase_bytes(q_sent, q_received, kv_sent, kv_received, heads: HeadLayout) -> np.ndarray:
    """float64 [n, 2, M]: max(bytes sent, bytes received) on one link class of every chunk's dispatch (index 0:
    Q/M, plus K/V/F on the F chunks of ``heads.kv_send_chunks()``) and return (index 1: O/M; a worker sends
    back the O of the Q it received), from the per-worker totals [n] of that class (module docstring). Totals
    of any shape [...] give [..., 2, M] (the time-aware search prices both link classes in one call)."""
    M, kv_share = heads.num_chunks, _kv_share(heads)
    q_sent, q_received, kv_sent, kv_received = (np.asarray(x, dtype=np.float64)[..., None]
                                                for x in (q_sent, q_received, kv_sent, kv_received))
    dispatch = np.maximum(q_sent / M + kv_sent * kv_share, q_received / M + kv_received * kv_share)
    ret = np.broadcast_to(np.maximum(q_sent, q_received) / M, dispatch.shape)
    return np.stack([dispatch, ret], axis=-2)


def plan_traffic(plan) -> PlanTraffic:
    """``PlanTraffic`` of an ``ExchangePlan`` built by ``build_exchange_plan``."""
    return traffic_of_units(plan.peer_units, plan.heads, plan.relay_units)


def traffic_of_units(peer_units, heads: HeadLayout, relay_units=None) -> PlanTraffic:
    """``PlanTraffic`` of (Q, KV) units per (src, dst) pair, int [2, W, W] (``ExchangePlan.peer_units``), and
    the relay's arranged-KV rows per pair, int [W, W] (``ExchangePlan.relay_units``; None: no relay)."""
    units = np.asarray(peer_units, dtype=np.float64).copy()
    diag = np.arange(units.shape[1])
    units[:, diag, diag] = 0.0
    relay = None if relay_units is None else np.asarray(relay_units, dtype=np.float64) * heads.kv_bytes_per_token()
    return PlanTraffic(q=units[0] * heads.q_bytes_per_token(), kv=units[1] * heads.kv_bytes_per_token(), heads=heads,
                       relay=relay)


def plan_worker_seconds(plan, model) -> np.ndarray:
    """float64 [W]: compute + exposed communication of every worker of an ExchangePlan's forward: the Pipeliner
    timeline over its local / remote loads (``hosted_pair_heads``) and its per-chunk link seconds
    (``plan.exchange.traffic``, and its relay hop), each worker priced alone -- what the placements search with
    and the simulator's ``forward_*`` figures; the whole layer, peers coupled, is ``plan_layer_timing``."""
    traffic, nodes = plan_traffic(plan), model.nodes(plan.num_workers)
    dispatch, ret = traffic.phase_seconds(nodes, model)
    local, remote = (model.compute_seconds(x) for x in plan.hosted_pair_heads)
    return model.worker_seconds(local, remote, dispatch, ret, plan.local_lead, traffic.relay_timing(nodes, model))


@dataclass(frozen=True, eq=False)
class LayerTiming:
    """One pool plan's attention layer under the whole-layer event model (``plan.model.events``): the forward
    and the backward ``PhaseTiming`` (seconds, compute, exposed per worker), in one save mode."""

    forward: PhaseTiming
    backward: PhaseTiming
    save_mode: str

    @property
    def seconds(self) -> np.ndarray:
        """float64 [W]: forward + backward seconds per worker."""
        return self.forward.seconds + self.backward.seconds


class LayerPricing:
    """The layer of an ExchangePlan as the runtime runs it, priced a phase at a time: every rank's op lists of the
    phase (``plan.exchange.schedule``, call for call ``runtime.libra_attn``) played with the peers coupled
    (``plan.model.events.price_ops``) on ``model``'s nodes and rates, each phase built and priced on its first read
    (the dense placement stops after the forward of a candidate a bound already rules out). ``save_mode``
    "arranged" | "refetch"; ``cache``: ``op_lists.phase_ops``' op-list cache, shared by candidate plans of one pool.
    Runs with automatic garbage collection paused (``plan.gc_pause``)."""

    def __init__(self, plan, model, save_mode: str = "arranged", relay_comm: str = "relay", cache=None):
        self.plan, self.model, self.save_mode, self.relay_comm, self.cache = plan, model, save_mode, relay_comm, cache
        self._inputs = None
        self._byte_rows = {}  # ``op_lists.phase_ops``' byte rows, shared by the plan's two phases
        self._phases = {}

    def phase(self, name: str) -> PhaseTiming:
        """``PhaseTiming`` of "forward" or "backward"."""
        if name not in self._phases:
            with paused_gc():
                if self._inputs is None:
                    self._inputs = rank_inputs(self.plan)
                ops = phase_ops(self._inputs, name, self.save_mode, self.relay_comm, self.cache, self._byte_rows)
                self._phases[name] = price_ops(ops, self.model, self.model.nodes(self.plan.num_workers))
        return self._phases[name]

    def layer(self) -> LayerTiming:
        return LayerTiming(self.phase("forward"), self.phase("backward"), self.save_mode)


def plan_layer_timing(plan, model, save_mode: str = "arranged", relay_comm: str = "relay", cache=None) -> LayerTiming:
    """The layer of an ExchangePlan as the runtime runs it, forward and backward (``LayerPricing``)."""
    return LayerPricing(plan, model, save_mode, relay_comm, cache).layer()
