"""The relay's exchanges (``plan.exchange``, "Relay"), issued on the pool's relay group (``runtime.libra_attn``).

Shape legend (one rank):
    kp      kv_piece (kv heads of one chunk piece)          d   head dim
    kv_arr  arranged K|V of a chunk (nkv, 2*kp, d), the input dtype
    dkv_arr arranged dK|dV (nkv, 2*kp, d), the accumulation dtype (fp32; fp64 for fp64 inputs)

A rank forwards the relayed rows it holds along ``relay.fwd`` once its chunk's dispatch is placed, and in backward
sends their dK|dV back along ``relay.inv``. Every rank of the pool takes part in both collectives, also a rank that
sends no row on the route: on a relay group of its own (the launcher's twin group), that rank issues its exchange
*early* (``relay_early``: the forward's with the chunk's dispatch, the backward's before the chunk's kernel), with
an empty send buffer, so the ranks waiting for relayed rows or for their dK|dV never wait for its other work. That
group carries only the relay's exchanges, in chunk order on every rank, so issuing early changes no collective's
partners. When the relay shares the pool's group (``relay_group=None``) every rank issues in the common order.
``plan.exchange.schedule`` lists the same calls (``_Rank.relay``, ``_Rank.relay_early``); the relay receive
buffer a backward issue-early allocates before the kernel is in ``plan.model.memory.relay_transient_bytes``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .routes import RouteIndex, start_exchange

__all__ = ["relay_forward", "relay_back", "relay_early"]


def relay_forward(cx, kv_arr: torch.Tensor, kind: str = "kv"):
    """Forward the relayed rows of an arranged K|V (the chunk's dispatch has been placed); None without a relay.
    Returns the pending exchange: ``into(kv_arr)`` places what this rank receives."""
    relay = cx.tables.relay
    if relay is None:
        return None
    return start_exchange(kv_arr.index_select(0, relay.fwd.send_rows), relay.fwd, cx.relay_group, cx.stats, kind)


def relay_back(cx, dkv_arr: torch.Tensor):
    """Backward of the relay, issued: the dK|dV of relayed rows go to their relay, which adds them into its arranged
    dK|dV before it returns dK|dV home. The pending exchange (``into(dkv_arr)`` adds them), None without a relay."""
    relay = cx.tables.relay
    if relay is None:
        return None
    return start_exchange(dkv_arr.index_select(0, relay.inv.send_rows), relay.inv, cx.relay_group, cx.stats, "dkv")


def relay_early(cx, route: Optional[RouteIndex], like: torch.Tensor, dtype: torch.dtype, kind: str):
    """The exchange of a relay route this rank sends no row on, issued now with an empty (0, 2*kp, d) send buffer of
    ``dtype`` (allocated like ``like``; no gather); None where there is no relay, this rank sends rows, or the relay
    runs on the pool's own group (an early issue would reorder that group's collectives between ranks)."""
    if route is None or sum(route.splits.send) or cx.relay_group is cx.group:
        return None
    heads = cx.plan.heads
    send = like.new_empty((0, 2 * heads.kv_piece, heads.head_dim), dtype=dtype)
    return start_exchange(send, route, cx.relay_group, cx.stats, kind)
