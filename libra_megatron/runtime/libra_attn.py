"""``libra_attn_func``: attention of a sequence pool executed from an ExchangePlan (§4.3.3, §4.4).

Shape legend (one rank):
    t       local tokens (this rank's CP shard of its packed sequence, under the plan's token layout)
    hq/hkv  query / kv heads            d   head dim           H, M  head shards, Pipeliner chunks
    qp      q_piece = hq/(H*M)          kp  kv_piece           kvp   kv pieces per token = hkv/kp
    q (t, hq, d) | (t, 1, hq, d)        k, v (t, hkv, d) | (t, 1, hkv, d)        out like q
    chunk views: q/o/dq (t*H*M, qp, d); k/v/dk/dv (t*kvp, kp, d)
    arranged (destination side, chunk m): q/o/do/dq (nq, qp, d); kv = K|V stacked (nkv, 2*kp, d);
    packed K/V for the kernel (nk, kp, d) = arranged rows [seq_kv_offset, +seq_k_len) per varlen entry.

Forward, per chunk m: gather Q and K|V rows, all_to_all along ``q_route`` / ``kv_route``, place into the
arranged buffers, one varlen causal kernel call over all hosted tiles, return O along ``q_route.inverse()``.
Pipeliner: chunk m+1 is dispatched and chunk m-1 returned (async) while chunk m computes.
Backward mirrors it: dO travels the Q route, the kernel backward runs at the destination, dQ returns along
``q_route.inverse()`` and dK|dV along ``kv_route.inverse()`` (index_add: several destinations contribute
to the same local K/V rows). K/V travel once per step (``HeadLayout.kv_send_chunks``): a chunk that reads
the kv piece of the chunk before it reuses that chunk's arranged K|V, and dK|dV of a piece is summed at
the destination over its chunks and returned once, after the last (``kv_return_chunks``).
"""
from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from ..config import KernelBackendName
from ..plan.exchange import RankPlan, kv_rows, q_rows
from .checks import check_plan_consistency
from .kernels import VarlenBatch, resolve_backend
from .routes import ExchangeStats, RouteIndex, route_index, start_exchange

__all__ = ["libra_attn_func", "SaveMode", "ExchangeStats"]


class SaveMode(str, enum.Enum):
    """What the forward keeps for backward (see docs/runtime.md for measured memory)."""

    ARRANGED = "arranged"  # keep arranged Q, K|V, O and lse at the destination: no extra backward traffic
    REFETCH = "refetch"  # keep only lse; backward re-exchanges Q, K|V and O (+dO) along the plan's routes


# ============================================================================ per-plan device tables
@dataclass(frozen=True)
class _ChunkRoutes:
    q_fwd: RouteIndex  # local chunk view -> arranged Q
    kv_fwd: RouteIndex  # local K/V chunk views -> arranged K|V
    q_inv: RouteIndex  # arranged -> local chunk view (O, dQ)
    kv_inv: RouteIndex  # arranged K|V -> local K/V chunk views (dK|dV, accumulating)


@dataclass(frozen=True)
class _PlanTensors:
    chunks: Tuple[_ChunkRoutes, ...]
    batch: VarlenBatch
    k_gather: torch.Tensor  # int64 [nk]: arranged-KV row of every packed key row


_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _chunk_routes(plan: RankPlan, m: int, device) -> _ChunkRoutes:
    heads, r = plan.heads, plan.rank
    qr, kr = plan.q_route, plan.kv_route
    qi, ki = qr.inverse(), kr.inverse()
    return _ChunkRoutes(
        q_fwd=route_index(qr, r, q_rows(qr.send_index, heads, m), qr.recv_index, device),
        kv_fwd=route_index(kr, r, kv_rows(kr.send_index, heads, m), kr.recv_index, device),
        q_inv=route_index(qi, r, qi.send_index, q_rows(qi.recv_index, heads, m), device),
        kv_inv=route_index(ki, r, ki.send_index, kv_rows(ki.recv_index, heads, m), device),
    )


def _plan_tensors(plan: RankPlan, device: torch.device) -> _PlanTensors:
    """Index tensors of ``plan`` on ``device``, built once per (plan object, device) and cached."""
    per_plan = _TABLES.setdefault(plan, {})
    if device not in per_plan:
        q_lens = np.diff(plan.cu_seqlens_q)
        starts = np.repeat(plan.seq_kv_offset, plan.seq_k_len)
        within = np.arange(int(plan.seq_k_len.sum())) - np.repeat(np.cumsum(plan.seq_k_len) - plan.seq_k_len,
                                                                  plan.seq_k_len)
        per_plan[device] = _PlanTensors(
            chunks=tuple(_chunk_routes(plan, m, device) for m in range(plan.heads.num_chunks)),
            batch=VarlenBatch.from_lengths(q_lens, plan.seq_k_len, device),
            k_gather=torch.as_tensor((starts + within).astype(np.int64), device=device),
        )
    return per_plan[device]


# ============================================================================ operator state
@dataclass
class _Ctx:
    """Everything the chunk helpers share within one call (no tensors owned by autograd here)."""

    plan: RankPlan
    tables: _PlanTensors
    group: object
    scale: float
    backend: object
    stats: Optional[ExchangeStats]

    def kernel(self, fn, *args):
        if self.stats is None:
            return fn(*args)
        return self.stats.timed_kernel(fn, *args)


def _views(q, k, v, heads):
    """Chunk views: q (t*H*M, qp, d); k, v (t*kvp, kp, d)."""
    t, d = q.shape[0], heads.head_dim
    qv = q.reshape(t * heads.head_split * heads.num_chunks, heads.q_piece, d)
    kv_shape = (t * heads.kv_pieces_per_token, heads.kv_piece, d)
    return qv, k.reshape(kv_shape), v.reshape(kv_shape)


def _dispatch_q(cx: _Ctx, src_view, m: int, kind: str):
    idx = cx.tables.chunks[m].q_fwd
    return start_exchange(src_view.index_select(0, idx.send_rows), idx, cx.group, cx.stats, kind)


def _dispatch_kv(cx: _Ctx, k_view, v_view, m: int, kind: str):
    idx = cx.tables.chunks[m].kv_fwd
    send = torch.cat([k_view.index_select(0, idx.send_rows), v_view.index_select(0, idx.send_rows)], dim=1)
    return start_exchange(send, idx, cx.group, cx.stats, kind)


def _return(cx: _Ctx, arranged, m: int, which: str, kind: str):
    idx = getattr(cx.tables.chunks[m], which)
    return start_exchange(arranged.index_select(0, idx.send_rows), idx, cx.group, cx.stats, kind)


def _packed_kv(cx: _Ctx, kv_arr):
    """Arranged K|V (nkv, 2*kp, d) -> packed K, V (nk, kp, d) in varlen-entry order."""
    kp = cx.plan.heads.kv_piece
    packed = kv_arr.index_select(0, cx.tables.k_gather)
    return packed[:, :kp], packed[:, kp:]


# ============================================================================ forward
def _fwd_chunk(cx: _Ctx, q_arr, kv_arr):
    """Kernel forward of one chunk at the destination: (o_arr (nq, qp, d), lse (qp, nq))."""
    k_pk, v_pk = _packed_kv(cx, kv_arr)
    return cx.kernel(cx.backend.fwd, q_arr, k_pk, v_pk, cx.tables.batch, cx.scale)


def _fwd(cx: _Ctx, q, k, v, keep_arranged: bool):
    """Pipelined forward. Returns (out like q, per-chunk saved tensors [(q_arr, kv_arr, o_arr, lse)])."""
    heads = cx.plan.heads
    qv, kv_, vv = _views(q, k, v, heads)
    out_view = torch.zeros_like(qv)
    saved: List[tuple] = []
    sends = heads.kv_send_chunks()  # K/V once per step: a chunk reading the previous chunk's kv piece reuses it
    incoming = (_dispatch_q(cx, qv, 0, "q"), _dispatch_kv(cx, kv_, vv, 0, "kv"))
    outgoing = kv_arr = None
    for m in range(heads.num_chunks):
        current = incoming
        if m + 1 < heads.num_chunks:  # dispatch m+1 before computing m (§4.4)
            incoming = (_dispatch_q(cx, qv, m + 1, "q"), _dispatch_kv(cx, kv_, vv, m + 1, "kv") if sends[m + 1] else None)
        q_arr = current[0].placed()
        kv_arr = current[1].placed() if current[1] is not None else kv_arr
        o_arr, lse = _fwd_chunk(cx, q_arr, kv_arr)
        returning = _return(cx, o_arr, m, "q_inv", "o")
        if outgoing is not None:
            outgoing.into(out_view)  # chunk m-1's O arrived while chunk m computed
        outgoing = returning
        saved.append((q_arr, kv_arr, o_arr, lse) if keep_arranged else (lse,))
    outgoing.into(out_view)
    return out_view.view_as(q), saved


# ============================================================================ backward
def _bwd_inputs(cx: _Ctx, m: int, dout_view, saved, local):
    """Launch the exchanges chunk m's backward needs: dO (always), and Q, K|V, O in REFETCH mode."""
    pending = {"do": _dispatch_q(cx, dout_view, m, "do")}
    if local is not None:
        qv, kv_, vv, ov = local
        pending["q"] = _dispatch_q(cx, qv, m, "q_bwd")
        if cx.plan.heads.kv_send_chunks()[m]:
            pending["kv"] = _dispatch_kv(cx, kv_, vv, m, "kv_bwd")
        pending["o"] = _dispatch_q(cx, ov, m, "o_bwd")
    return pending


def _bwd_chunk(cx: _Ctx, pending, saved_m, kv_arr, dkv_arr):
    """Kernel backward of one chunk at the destination: (dq_arr (nq, qp, d), kv_arr, dkv_arr (nkv, 2*kp, d)).
    ``kv_arr``/``dkv_arr`` come from the previous chunk when it read the same kv piece (None otherwise):
    the arranged K|V is reused and its dK|dV keeps accumulating until the piece's last chunk."""
    if "q" in pending:
        q_arr, o_arr = pending["q"].placed(), pending["o"].placed()
        kv_arr = pending["kv"].placed() if "kv" in pending else kv_arr
        (lse,) = saved_m
    else:
        q_arr, kv_arr, o_arr, lse = saved_m
    do_arr = pending["do"].placed()
    k_pk, v_pk = _packed_kv(cx, kv_arr)
    dq_arr, dk_pk, dv_pk = cx.kernel(cx.backend.bwd, do_arr, q_arr, k_pk, v_pk, o_arr, lse, cx.tables.batch, cx.scale)
    dkv_arr = kv_arr.new_zeros(kv_arr.shape) if dkv_arr is None else dkv_arr
    dkv_arr.index_add_(0, cx.tables.k_gather, torch.cat([dk_pk, dv_pk], dim=1))
    return dq_arr, kv_arr, dkv_arr


def _bwd(cx: _Ctx, dout, saved, local, k_shape: torch.Size):
    """Pipelined backward -> (dq like dout, dk, dv of ``k_shape``).
    ``local`` = (q, k, v, out) chunk views in REFETCH mode, else None."""
    heads = cx.plan.heads
    dout_view = dout.reshape(-1, heads.q_piece, heads.head_dim)
    dq_view = torch.zeros_like(dout_view)
    kp = heads.kv_piece
    dkv_local = dout.new_zeros((k_shape[0] * heads.kv_pieces_per_token, 2 * kp, heads.head_dim))
    incoming = _bwd_inputs(cx, 0, dout_view, saved, local)
    outgoing, kv_arr, dkv_arr = [], None, None
    returns = heads.kv_return_chunks()  # dK|dV of a kv piece goes home after the last chunk reading it
    for m in range(heads.num_chunks):
        current = incoming
        if m + 1 < heads.num_chunks:
            incoming = _bwd_inputs(cx, m + 1, dout_view, saved, local)
        dq_arr, kv_arr, dkv_arr = _bwd_chunk(cx, current, saved[m], kv_arr, dkv_arr)
        returning = [(_return(cx, dq_arr, m, "q_inv", "dq"), dq_view)]
        if returns[m]:
            returning.append((_return(cx, dkv_arr, m, "kv_inv", "dkv"), dkv_local))
            kv_arr = dkv_arr = None
        for pending, target in outgoing:
            pending.into(target)
        outgoing = returning
    for pending, target in outgoing:
        pending.into(target)
    dkv_local = dkv_local.view(-1, 2, kp, heads.head_dim)
    return dq_view.view_as(dout), dkv_local[:, 0].reshape(k_shape), dkv_local[:, 1].reshape(k_shape)


# ============================================================================ autograd
class _LibraAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(autograd_ctx, q, k, v, cx: _Ctx, save_mode: SaveMode):
        needs_grad = any(autograd_ctx.needs_input_grad[:3])
        keep_arranged = needs_grad and save_mode is SaveMode.ARRANGED
        out, saved = _fwd(cx, q, k, v, keep_arranged)
        autograd_ctx.cx, autograd_ctx.save_mode, autograd_ctx.k_shape = cx, save_mode, k.shape
        if not needs_grad:
            return out
        flat = [t for chunk in saved for t in chunk]
        autograd_ctx.chunk_len = len(saved[0])
        extra = [q, k, v, out] if save_mode is SaveMode.REFETCH else []
        autograd_ctx.save_for_backward(*flat, *extra)
        if cx.stats is not None:
            distinct = {id(t): t for t in flat}.values()  # chunks that reuse a kv piece save the same K|V
            cx.stats.saved_bytes = sum(t.numel() * t.element_size() for t in distinct)
        return out

    @staticmethod
    def backward(autograd_ctx, dout):
        cx, n = autograd_ctx.cx, autograd_ctx.chunk_len
        tensors = autograd_ctx.saved_tensors
        M = cx.plan.heads.num_chunks
        saved = [tuple(tensors[m * n : (m + 1) * n]) for m in range(M)]
        local = None
        if autograd_ctx.save_mode is SaveMode.REFETCH:
            q, k, v, out = tensors[M * n :]
            local = _views(q, k, v, cx.plan.heads) + (out.reshape(-1, cx.plan.heads.q_piece, cx.plan.heads.head_dim),)
        dq, dk, dv = _bwd(cx, dout.contiguous(), saved, local, autograd_ctx.k_shape)
        return dq, dk, dv, None, None


# ============================================================================ public API
def libra_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RankPlan, group, *,
                    softmax_scale: Optional[float] = None, backend=KernelBackendName.AUTO, qkv_format: str = "thd",
                    save_mode=SaveMode.ARRANGED, stats: Optional[ExchangeStats] = None) -> torch.Tensor:
    """Causal attention over the packed sequences of a sequence pool, executed from ``plan``.

    Arguments:
        q: (t, hq, d) for qkv_format="thd", or (t, 1, hq, d) for "sbhd" (s = t, b = 1). fp16/bf16/fp32/fp64.
           This rank's local tokens: its CP shard of its packed sequence under the plan's token layout.
        k, v: (t, hkv, d) or (t, 1, hkv, d), same dtype and device as q; hkv | hq (GQA).
        plan: this rank's ``RankPlan`` (``plan.rank`` == rank in ``group``); all ranks must hold RankPlans
            of the same ExchangePlan (checked: same fingerprint).
        group: the sequence pool's process group (P*CP ranks).
        softmax_scale: default 1/sqrt(d).
        backend: ``KernelBackendName`` (auto | flash | torch).
        save_mode: ``SaveMode.ARRANGED`` (keep destination tensors) or ``SaveMode.REFETCH``.
        stats: optional ``ExchangeStats`` accumulating bytes sent per kind, kernel time, saved bytes.
    Returns:
        out: same shape, dtype and device as q -- attention output for exactly this rank's local tokens.
    Raises:
        PlanError on *every* rank (never a hang) if any rank's plan does not fit its tensors or group, or
        the ranks' plan fingerprints differ. ValueError for a bad qkv_format / backend.
    """
    if qkv_format not in ("thd", "sbhd"):
        raise ValueError(f"qkv_format must be 'thd' or 'sbhd', got {qkv_format!r}")
    if qkv_format == "sbhd":
        if q.dim() != 4 or q.shape[1] != 1:
            raise ValueError(f"qkv_format='sbhd' needs (t, 1, h, d) with b=1, got q of shape {tuple(q.shape)}")
        out = libra_attn_func(q.squeeze(1), k.squeeze(1), v.squeeze(1), plan, group, softmax_scale=softmax_scale,
                              backend=backend, save_mode=save_mode, stats=stats)
        return out.unsqueeze(1)
    check_plan_consistency(q, k, v, plan, group)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    cx = _Ctx(plan=plan, tables=_plan_tensors(plan, q.device), group=group, scale=scale,
              backend=resolve_backend(backend, q.device), stats=stats)
    return _apply(q, k, v, cx, SaveMode(save_mode))


def _apply(q, k, v, cx: _Ctx, save_mode: SaveMode):
    return _LibraAttnFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), cx, save_mode)
