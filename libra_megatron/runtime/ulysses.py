"""Ulysses (DeepSpeed-style head all-to-all) baseline: CP only, no cross-group exchange.

Shape legend (one CP rank c of CP ranks; L = CP*t tokens of the packed sequence):
    q (t, hq, d) | (t, 1, hq, d)     k, v (t, hkv, d) | (t, 1, hkv, d)    local shard under the token layout
    after seq->head all-to-all:  (L, h/CP, d) in global token order (every rank holds all tokens, h/CP heads)
    cu_seqlens  int [n+1]  raw-sample boundaries of the whole packed sequence (0 .. L)
When hkv is not a multiple of CP, K/V heads are first repeated to hq (GQA expansion; gradients sum back).

No host sync: ``cu_seqlens`` must be host data (list, numpy or a CPU tensor); the token orders and the
varlen batch it implies are built once per (boundaries, layout, CP, device) and kept in a small LRU.
"""
from __future__ import annotations

import collections
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..config import KernelBackendName, TokenLayoutKind
from ..plan.layout import TokenLayout
from .kernels import VarlenBatch, host_to_device, varlen_attn_func
from .routes import ExchangeStats

__all__ = ["ulysses_attn_func"]


def _all_to_all_equal(x: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single with equal splits along dim 0 (x (CP, ...) -> (CP, ...))."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_head(x, order: torch.Tensor, group):
    """(t, h, d) local tokens -> (L, h/CP, d) all tokens in global order, this rank's head slice."""
    cp, (t, h, d) = dist.get_world_size(group), x.shape
    send = x.reshape(t, cp, h // cp, d).transpose(0, 1)
    gathered = _all_to_all_equal(send, group).reshape(cp * t, h // cp, d)
    return gathered.index_select(0, order)


def _head_to_seq(y, gathered_pos: torch.Tensor, group):
    """Inverse of ``_seq_to_head``: (L, h/CP, d) global order -> (t, h, d) local tokens, all heads."""
    cp = dist.get_world_size(group)
    L, hs, d = y.shape
    back = _all_to_all_equal(y.index_select(0, gathered_pos).reshape(cp, L // cp, hs, d), group)
    return back.transpose(0, 1).reshape(L // cp, cp * hs, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, gathered_pos, group, stats, kind):
        ctx.order, ctx.gathered_pos, ctx.group = order, gathered_pos, group
        if stats is not None:
            cp = dist.get_world_size(group)
            stats.add_bytes(kind, x.numel() * x.element_size() * (cp - 1) // cp)
        return _seq_to_head(x, order, group)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad.contiguous(), ctx.gathered_pos, ctx.group), None, None, None, None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, order, gathered_pos, group, stats, kind):
        ctx.order, ctx.gathered_pos, ctx.group = order, gathered_pos, group
        if stats is not None:
            cp = dist.get_world_size(group)
            stats.add_bytes(kind, y.numel() * y.element_size() * (cp - 1) // cp)
        return _head_to_seq(y, gathered_pos, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad.contiguous(), ctx.order, ctx.group), None, None, None, None, None


def _orders(layout: TokenLayout, device):
    """(order, gathered_pos): gathered[order] is global order; global[gathered_pos] is gathered order."""
    gathered_pos = np.concatenate([layout.local_to_global(c) for c in range(layout.cp)])
    order = np.argsort(gathered_pos)
    return host_to_device(order.astype(np.int32), device), host_to_device(gathered_pos.astype(np.int32), device)


_TABLES: "collections.OrderedDict" = collections.OrderedDict()
_TABLES_CAPACITY = 8


def _tables(bounds: tuple, token_layout, cp: int, device):
    """(order, gathered_pos, VarlenBatch) of one packed sequence, LRU-cached (built on first use only)."""
    key = (bounds, TokenLayoutKind(token_layout), cp, str(device))
    hit = _TABLES.get(key)
    if hit is None:
        lens = np.diff(bounds)
        order, gathered_pos = _orders(TokenLayout(token_layout, bounds[-1], cp), device)
        hit = _TABLES[key] = (order, gathered_pos, VarlenBatch.from_lengths(lens, lens, device))
        while len(_TABLES) > _TABLES_CAPACITY:
            _TABLES.popitem(last=False)
    _TABLES.move_to_end(key)
    return hit


def _host_bounds(cu_seqlens) -> tuple:
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type != "cpu":
        raise ValueError(f"ulysses_attn_func needs host cu_seqlens (list, numpy or CPU tensor), got a tensor on "
                         f"{cu_seqlens.device}: reading it would synchronise the device in every layer")
    return tuple(int(x) for x in np.asarray(cu_seqlens).reshape(-1))


def ulysses_attn_func(q, k, v, cu_seqlens, cp_group, *, token_layout=TokenLayoutKind.CONTIGUOUS,
                      softmax_scale: Optional[float] = None, backend=KernelBackendName.AUTO,
                      qkv_format: str = "thd", stats: Optional[ExchangeStats] = None) -> torch.Tensor:
    """Per-sample causal attention of one packed sequence split over ``cp_group`` (Ulysses).

    Arguments:
        q: (t, hq, d) ("thd") or (t, 1, hq, d) ("sbhd"); k, v: (t, hkv, d) likewise. Same dtype/device.
           This CP rank's shard under ``token_layout`` (contiguous | zigzag). hq % CP == 0.
        cu_seqlens: (n+1,) host ints (list / numpy / CPU tensor), raw-sample boundaries of the whole packed
            sequence, cu_seqlens[-1] == CP*t.
        stats: optional ``ExchangeStats``; kernel thread time and remote bytes ("q", "kv", "o") are added.
    Returns: out like q.
    """
    if qkv_format == "sbhd":
        out = ulysses_attn_func(q.squeeze(1), k.squeeze(1), v.squeeze(1), cu_seqlens, cp_group,
                                token_layout=token_layout, softmax_scale=softmax_scale, backend=backend, stats=stats)
        return out.unsqueeze(1)
    if qkv_format != "thd":
        raise ValueError(f"qkv_format must be 'thd' or 'sbhd', got {qkv_format!r}")
    cp = dist.get_world_size(cp_group)
    hq, hkv = q.shape[1], k.shape[1]
    if hq % cp:
        raise ValueError(f"Ulysses needs num_attention_heads {hq} divisible by the CP size {cp} ({hq} % {cp} = {hq % cp})")
    bounds = _host_bounds(cu_seqlens)
    if bounds[-1] != cp * q.shape[0]:
        raise ValueError(f"cu_seqlens[-1] = {bounds[-1]} must equal CP*t = {cp}*{q.shape[0]}")
    if hkv % cp:  # GQA expansion: every rank needs the kv head of each of its query heads
        k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    order, gathered_pos, batch = _tables(bounds, token_layout, cp, q.device)
    args = (order, gathered_pos, cp_group, stats)
    qh, kh, vh = (_SeqToHead.apply(x.contiguous(), *args, kind) for x, kind in ((q, "q"), (k, "kv"), (v, "kv")))
    out_h = varlen_attn_func(qh, kh, vh, batch, softmax_scale, backend, stats)
    return _HeadToSeq.apply(out_h, *args, "o")
