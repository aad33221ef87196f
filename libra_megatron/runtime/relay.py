"""The relay's exchanges (``plan.exchange``, "Relay"), issued on the pool's relay group (``runtime.libra_attn``).

Shape legend (one rank):
    kp      kv_piece (kv heads of one chunk piece)          d   head dim
    kv_arr  arranged K|V of a chunk (nkv, 2*kp, d), the input dtype
    dkv_arr arranged dK|dV (nkv, 2*kp, d), the accumulation dtype (fp32; fp64 for fp64 inputs)

A rank forwards the relayed rows it holds along ``relay.fwd`` once its chunk's dispatch is placed, and in backward
sends their dK|dV back along ``relay.inv``. Every rank of the pool takes part in both collectives, also a rank that
sends no row on the route: in forward, on a relay group of its own (the launcher's twin group), that rank issues
its exchange *early* (``relay_early``), with the chunk's dispatch and an empty send buffer, so the ranks waiting for
relayed rows never wait for its local work. That group carries only the relay's exchanges, in chunk order on every
rank, so issuing early changes no collective's partners; when the relay shares the pool's group
(``relay_group=None``) every rank issues in the common order. The receive buffer it allocates early holds rows of
the arranged K|V, within the forward's bound on receive buffers (``runtime.libra_attn``). The backward's inverse is
not issued early: its fp32 receive buffer would live across the chunk's kernel, which the memory rule of
``save_mode=auto`` would have to count (on linux 1M it tipped a pool into REFETCH, slower than what it saved).
``plan.exchange.schedule`` lists the same calls (``_Rank.relay``, ``_Rank.relay_early``).
"""
from __future__ import annotations

import torch

from .routes import start_exchange

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


def relay_early(cx, like: torch.Tensor):
    """The forward relay's exchange when this rank sends no row on it, issued now with an empty (0, 2*kp, d) send
    buffer allocated like ``like`` (no gather); None where there is no relay, this rank sends rows, or the relay
    runs on the pool's own group (an early issue would reorder that group's collectives between ranks)."""
    relay = cx.tables.relay
    if relay is None or sum(relay.fwd.splits.send) or cx.relay_group is cx.group:
        return None
    heads = cx.plan.heads
    send = like.new_empty((0, 2 * heads.kv_piece, heads.head_dim))
    return start_exchange(send, relay.fwd, cx.relay_group, cx.stats, "kv")
