"""Torch executor of exchange-plan ``Route``s: gather rows, ``all_to_all_single``, place or accumulate.

Shape legend (one chunk m of the Pipeliner, §4.4):
    t      local tokens            H, M   head shards, chunks      d  head dim
    qp     q_piece = hq/(H*M)      kp     kv_piece (kv heads per piece)
    local Q/O/dQ chunk view   (t*H*M, qp, d)      rows from ``q_rows(units, heads, m)``
    local K/V/dK/dV view      (t*kv_pieces, kp, d) rows from ``kv_rows(units, heads, m)``
    arranged Q/O/dO/dQ        (q_route.target_len, qp, d)
    arranged KV (K|V stacked) (kv_route.target_len, 2*kp, d)
A route moves *units*; one unit is one row of the views above, so split sizes are row counts.

Forward routes place (``target[recv_rows] = received``), inverse routes accumulate (``index_add``),
exactly as ``plan.exchange.Route`` specifies. Every exchange is launched with ``async_op=True`` and
returns a ``PendingExchange`` that is waited on only right before its tensor is needed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from ..plan.exchange import Route

__all__ = ["RouteIndex", "PendingExchange", "ExchangeStats", "route_index", "start_exchange"]


@dataclass
class ExchangeStats:
    """Per-rank instrumentation of one or more operator calls (accumulates; reset by making a new one).

    bytes_sent[kind]  bytes this rank sent to *other* ranks (self excluded), per kind:
                      forward "q", "kv", "o"; backward "do", "dq", "dkv" (+ "q_bwd", "kv_bwd", "o_bwd"
                      when the backward re-exchanges instead of saving arranged tensors).
    kernel_seconds    thread CPU time spent inside attention kernel calls (fwd + bwd)
    saved_bytes       bytes of tensors saved for backward by the last forward (activation memory)
    """

    bytes_sent: Dict[str, int] = field(default_factory=dict)
    kernel_seconds: float = 0.0
    kernel_calls: int = 0
    saved_bytes: int = 0

    def add_bytes(self, kind: str, num_bytes: int) -> None:
        self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + int(num_bytes)

    def timed_kernel(self, fn, *args):
        """Run ``fn(*args)`` and add its thread CPU time to ``kernel_seconds``."""
        start = time.thread_time()
        result = fn(*args)
        self.kernel_seconds += time.thread_time() - start
        self.kernel_calls += 1
        return result


@dataclass(frozen=True)
class RouteIndex:
    """One route of one chunk, as device tensors.

    send_rows  int64 [n_send]  rows of the source buffer, grouped by destination rank
    recv_rows  int64 [n_recv]  rows of the target buffer for the received rows, in arrival order
    send_splits / recv_splits  rows per rank (Python ints, as ``all_to_all_single`` wants)
    remote_rows                rows sent to other ranks (self excluded), for byte accounting
    """

    send_rows: torch.Tensor
    recv_rows: torch.Tensor
    send_splits: List[int]
    recv_splits: List[int]
    target_len: int
    accumulate: bool
    remote_rows: int


def route_index(route: Route, rank: int, send_rows: np.ndarray, recv_rows: np.ndarray, device) -> RouteIndex:
    """Device copy of ``route`` with its unit indices already mapped to buffer rows."""
    return RouteIndex(
        send_rows=torch.tensor(np.asarray(send_rows, dtype=np.int64), device=device),
        recv_rows=torch.tensor(np.asarray(recv_rows, dtype=np.int64), device=device),
        send_splits=[int(x) for x in route.send_splits],
        recv_splits=[int(x) for x in route.recv_splits],
        target_len=int(route.target_len),
        accumulate=bool(route.accumulate),
        remote_rows=route.remote_units_sent(rank),
    )


class PendingExchange:
    """An in-flight all_to_all. ``wait()`` returns the received rows (arrival order)."""

    def __init__(self, work, received: torch.Tensor, index: RouteIndex, send: Optional[torch.Tensor] = None):
        self._work = work
        self._send = send  # keep the send buffer alive until the collective is done (async NCCL)
        self.received = received
        self.index = index

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work, self._send = None, None
        return self.received

    def placed(self) -> torch.Tensor:
        """Wait, then return a fresh target buffer (target_len rows) filled by the route's rule."""
        received = self.wait()
        target = received.new_zeros((self.index.target_len,) + tuple(received.shape[1:]))
        return self.into(target)

    def into(self, target: torch.Tensor) -> torch.Tensor:
        """Wait, then place (forward route) or accumulate (inverse route) into ``target`` in place."""
        received = self.wait()
        if self.index.accumulate:
            target.index_add_(0, self.index.recv_rows, received)
        else:
            target.index_copy_(0, self.index.recv_rows, received)
        return target


def start_exchange(send: torch.Tensor, index: RouteIndex, group, stats: Optional[ExchangeStats], kind: str,
                   async_op: bool = True) -> PendingExchange:
    """Launch the all_to_all of ``send`` (rows already gathered by ``index.send_rows``, grouped by rank).

    A single-rank group skips the collective (the rows are already where they go).
    """
    send = send.contiguous()
    if stats is not None:
        row_bytes = send[0].numel() * send.element_size() if send.shape[0] else 0
        stats.add_bytes(kind, index.remote_rows * row_bytes)
    if len(index.send_splits) == 1:
        return PendingExchange(None, send, index)
    received = send.new_empty((sum(index.recv_splits),) + tuple(send.shape[1:]))
    work = dist.all_to_all_single(received, send, output_split_sizes=index.recv_splits,
                                  input_split_sizes=index.send_splits, group=group, async_op=async_op)
    return PendingExchange(work if async_op else None, received, index, send)
