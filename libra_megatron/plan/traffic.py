"""Bytes per link, per worker and per Pipeliner phase of an ExchangePlan, read off the plan itself (§4.4).

Pure numpy. ``plan_traffic(plan)`` turns ``ExchangePlan.peer_units`` -- the (Q, KV) units every (src, dst)
pair moves, counted from the run tables every rank's routes are cut from (``validate_plan`` checks them
against the routes) -- into bytes per layer forward. Self transfers are dropped (they never leave a GPU).

Arrival order, as ``runtime.libra_attn._fwd`` executes it (chunk m of M, F = chunks that send K/V,
``HeadLayout.kv_send_chunks``):
    dispatch m   Q rows of head piece m of every migrated tile (Q/M), plus K/V/F when chunk m sends K/V
    compute m    the varlen kernel over chunk m's pieces
    return m     O rows of piece m (O/M)
Dispatch m+1 is issued before compute m and return m is waited after compute m+1, so only the dispatch of
chunk 0 and the return of chunk M-1 cannot overlap attention compute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np

from .layout import HeadLayout

__all__ = ["PlanTraffic", "plan_traffic"]


@dataclass(frozen=True, eq=False)
class PlanTraffic:
    """Remote bytes of one pool plan per layer forward.

    q, kv   float64 [W, W]  bytes worker src (row) sends to dst (column), diagonal 0
    heads   the plan's HeadLayout (M chunks, which chunks send K/V)
    """

    q: np.ndarray
    kv: np.ndarray
    heads: HeadLayout

    @property
    def o(self) -> np.ndarray:
        """float64 [W, W]: O goes back from the destination to the Q-home of every Q unit."""
        return self.q.T

    @property
    def num_workers(self) -> int:
        return int(self.q.shape[0])

    def bytes_sent(self) -> np.ndarray:
        """float64 [W, 3]: (Q, KV, O) bytes each worker sends to others (= ``RankPlan.bytes_sent``)."""
        return np.stack([m.sum(axis=1) for m in (self.q, self.kv, self.o)], axis=1)

    def moved_bytes(self) -> np.ndarray:
        """float64 [3, W]: (Q, KV, O) bytes each worker sends plus receives."""
        return np.stack([m.sum(axis=1) + m.sum(axis=0) for m in (self.q, self.kv, self.o)])

    def link_bytes(self, node_of_worker: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(intra [W], inter [W]): per worker and link class, max(bytes sent, bytes received)."""
        node = np.asarray(node_of_worker)
        total = self.q + self.kv + self.o
        same = node[:, None] == node[None, :]
        out = []
        for mask in (same, ~same):
            part = np.where(mask, total, 0.0)
            out.append(np.maximum(part.sum(axis=1), part.sum(axis=0)))
        return out[0], out[1]

    def phase_bytes(self) -> np.ndarray:
        """float64 [W, 2, M]: bytes each worker moves (sent + received) in the dispatch (0) and the return (1)
        of every chunk, in the order the runtime issues them (module docstring)."""
        q, kv, o = self.moved_bytes()
        sends = self.heads.kv_send_chunks().astype(np.float64)
        M = self.heads.num_chunks
        dispatch = q[:, None] / M + kv[:, None] * sends[None, :] / sends.sum()
        ret = np.repeat(o[:, None] / M, M, axis=1)
        return np.stack([dispatch, ret], axis=1)

    def unhidable_share(self) -> np.ndarray:
        """float64 [W]: u = share of a worker's bytes in chunk 0's dispatch and chunk M-1's return, the two
        transfers no compute can hide (1/M for a worker that moves nothing)."""
        phases = self.phase_bytes()
        total = phases.sum(axis=(1, 2))
        edge = phases[:, 0, 0] + phases[:, 1, -1]
        return np.where(total > 0, edge / np.where(total > 0, total, 1.0), 1.0 / self.heads.num_chunks)


def plan_traffic(plan) -> PlanTraffic:
    """``PlanTraffic`` of an ``ExchangePlan`` built by ``build_exchange_plan``."""
    heads = plan.heads
    units = np.asarray(plan.peer_units, dtype=np.float64).copy()
    diag = np.arange(units.shape[1])
    units[:, diag, diag] = 0.0
    return PlanTraffic(q=units[0] * heads.q_bytes_per_token(), kv=units[1] * heads.kv_bytes_per_token(), heads=heads)
