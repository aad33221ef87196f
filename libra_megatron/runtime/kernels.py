"""Variable-length causal attention kernels behind one enum-keyed table (flash-attn varlen | torch).

Shape legend:
    nq  total query rows of the varlen batch        nk  total key rows (packed K)
    hq  query heads of the call                     hkv key/value heads (hq % hkv == 0)
    d   head dim                                    n   number of varlen entries
    q (nq, hq, d)   k, v (nk, hkv, d)   out (nq, hq, d)   lse (hq, nq) float32 (fp64 for fp64 inputs)
    cu_seqlens_q / cu_seqlens_k  int32 [n+1]  (flash-attn's convention)
Causal alignment is bottom-right (flash-attn >= 2.1): query row r of an entry with q_len rows and k_len
keys sees keys [0, k_len - q_len + r].

``varlen_fwd`` returns (out, lse); ``varlen_bwd`` takes (dout, q, k, v, out, lse) and returns (dq, dk, dv):
exactly the quantities flash-attn's varlen backward consumes, so the runtime can swap backends freely.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch

from ..config import KernelBackendName

__all__ = ["VarlenBatch", "KernelBackend", "resolve_backend", "varlen_fwd", "varlen_bwd", "varlen_attn_func",
           "flash_available"]


@dataclass(frozen=True)
class VarlenBatch:
    """Varlen metadata of one kernel call. ``cu_q``/``cu_k`` int32 [n+1] on the tensors' device;
    ``bounds`` is the same data as Python ints for the torch backend's per-entry loop."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    bounds: Tuple[Tuple[int, int, int, int], ...]  # (q0, q1, k0, k1) per entry

    @staticmethod
    def from_lengths(q_lens, k_lens, device) -> "VarlenBatch":
        """Build from per-entry query / key lengths (Python ints or int arrays)."""
        q_lens = [int(x) for x in q_lens]
        k_lens = [int(x) for x in k_lens]
        cq, ck = [0], [0]
        for a, b in zip(q_lens, k_lens):
            cq.append(cq[-1] + a)
            ck.append(ck[-1] + b)
        bounds = tuple((cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(q_lens)))
        return VarlenBatch(
            cu_q=torch.tensor(cq, dtype=torch.int32, device=device),
            cu_k=torch.tensor(ck, dtype=torch.int32, device=device),
            max_q=max(q_lens, default=0), max_k=max(k_lens, default=0), bounds=bounds,
        )


# ============================================================================ torch reference backend
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything else computes in fp32 (exact-in-fp32 reference)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


ROW_TILE = 256  # query rows per torch-backend step: bounds memory to (hq, ROW_TILE, k_len) scores


def _row_tiles(q0: int, q1: int, k0: int, k1: int):
    """Split one entry into (r0, r1, kend, first_pos): query rows [r0, r1) see at most keys [k0, kend);
    ``first_pos`` = key position (entry-local) of row r0's last visible key. Keys a tile cannot see are
    never touched, so the work is ~ the causal pairs (Eq. 6), not the q_len x k_len rectangle."""
    offset = (k1 - k0) - (q1 - q0)
    for r0 in range(q0, q1, ROW_TILE):
        r1 = min(q1, r0 + ROW_TILE)
        kend = k0 + max(0, min(k1 - k0, offset + (r1 - q0)))
        yield r0, r1, kend, offset + (r0 - q0)


def _tile_scores(q, k, scale, first_pos):
    """q (R, hq, d), k (n, hq, d) -> masked scores (hq, R, n): row i sees key j iff j <= first_pos + i."""
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(q.shape[0], device=q.device) + first_pos
    mask = torch.arange(k.shape[0], device=q.device)[None, :] > qpos[:, None]
    return s.masked_fill(mask[None], float("-inf"))


def _expand_kv(x, group: int):
    """(n, hkv, d) -> (n, hkv*group, d): query head i reads kv head i // group."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _torch_fwd(q, k, v, batch: VarlenBatch, scale: float):
    ct = _compute_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=ct, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=ct, device=q.device)
    for q0, q1, k0, k1 in batch.bounds:
        ke, ve = _expand_kv(k[k0:k1].to(ct), group), _expand_kv(v[k0:k1].to(ct), group)
        for r0, r1, kend, first in _row_tiles(q0, q1, k0, k1):
            if kend == k0:
                continue  # rows that see no key: out 0, lse -inf (flash-attn's convention)
            s = _tile_scores(q[r0:r1].to(ct), ke[: kend - k0], scale, first)
            lse_t = torch.logsumexp(s, dim=-1)  # (hq, R)
            p = torch.exp(s - lse_t.nan_to_num(neginf=0.0)[..., None])
            out[r0:r1] = torch.einsum("hqk,khd->qhd", p, ve[: kend - k0])
            lse[:, r0:r1] = lse_t
    return out.to(q.dtype), lse if ct == torch.float64 else lse.float()


def _torch_bwd(dout, q, k, v, out, lse, batch: VarlenBatch, scale: float):
    ct = _compute_dtype(q.dtype)
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    for q0, q1, k0, k1 in batch.bounds:
        ke, ve = _expand_kv(k[k0:k1].to(ct), group), _expand_kv(v[k0:k1].to(ct), group)
        for r0, r1, kend, first in _row_tiles(q0, q1, k0, k1):
            if kend == k0:
                continue
            n = kend - k0
            qt, dot, ot = (x[r0:r1].to(ct) for x in (q, dout, out))
            s = _tile_scores(qt, ke[:n], scale, first)
            p = torch.exp(s - lse[:, r0:r1].to(ct).nan_to_num(neginf=0.0)[..., None])  # (hq, R, n)
            dp = torch.einsum("qhd,khd->hqk", dot, ve[:n])
            delta = (dot * ot).sum(-1).transpose(0, 1)  # (hq, R)
            ds = p * (dp - delta[..., None]) * scale
            dq[r0:r1] = torch.einsum("hqk,khd->qhd", ds, ke[:n])
            dk[k0:kend] += torch.einsum("hqk,qhd->khd", ds, qt).reshape(n, hkv, group, -1).sum(2)
            dv[k0:kend] += torch.einsum("hqk,qhd->khd", p, dot).reshape(n, hkv, group, -1).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ============================================================================ flash-attn backend
def flash_available() -> bool:
    try:
        import flash_attn.flash_attn_interface  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def _flash_kwargs(fn, **common) -> dict:
    """Keyword arguments accepted by this flash-attn version (window_size vs window_size_left/right...)."""
    params = inspect.signature(fn).parameters
    extra = dict(window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0,
                 alibi_slopes=None, deterministic=False, return_softmax=False, dropout_p=0.0, rng_state=None)
    kw = {k: v for k, v in common.items() if k in params}
    kw.update({k: v for k, v in extra.items() if k in params and k not in kw})
    return kw


def _flash_fwd(q, k, v, batch: VarlenBatch, scale: float):
    from flash_attn import flash_attn_interface as fai

    fn = fai._flash_attn_varlen_forward
    kw = _flash_kwargs(fn, q=q, k=k, v=v, cu_seqlens_q=batch.cu_q, cu_seqlens_k=batch.cu_k,
                       max_seqlen_q=batch.max_q, max_seqlen_k=batch.max_k, softmax_scale=scale, causal=True)
    res = fn(**kw)
    # flash-attn >= 2.6 returns (out, lse, S_dmask, rng_state); older 2.x (out, q, k, v, out_padded, lse, ...)
    return (res[0], res[1]) if len(res) == 4 else (res[0], res[5])


def _flash_bwd(dout, q, k, v, out, lse, batch: VarlenBatch, scale: float):
    from flash_attn import flash_attn_interface as fai

    fn = fai._flash_attn_varlen_backward
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    kw = _flash_kwargs(fn, dout=dout.contiguous(), q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                       cu_seqlens_q=batch.cu_q, cu_seqlens_k=batch.cu_k, max_seqlen_q=batch.max_q,
                       max_seqlen_k=batch.max_k, softmax_scale=scale, causal=True)
    fn(**kw)
    return dq, dk, dv


# ============================================================================ table
@dataclass(frozen=True)
class KernelBackend:
    name: KernelBackendName
    fwd: Callable
    bwd: Callable


_BACKENDS: Dict[KernelBackendName, KernelBackend] = {
    KernelBackendName.TORCH: KernelBackend(KernelBackendName.TORCH, _torch_fwd, _torch_bwd),
    KernelBackendName.FLASH: KernelBackend(KernelBackendName.FLASH, _flash_fwd, _flash_bwd),
}


def resolve_backend(name, device: torch.device) -> KernelBackend:
    """AUTO -> flash when flash-attn imports and the tensors are on CUDA, else torch."""
    name = KernelBackendName(name)
    if name is KernelBackendName.AUTO:
        use_flash = device.type == "cuda" and flash_available()
        name = KernelBackendName.FLASH if use_flash else KernelBackendName.TORCH
    if name is KernelBackendName.FLASH and not flash_available():
        raise ValueError("--libra-kernel-backend (kernel_backend) = flash, but flash_attn cannot be imported")
    if name is KernelBackendName.FLASH and device.type != "cuda":
        raise ValueError(f"--libra-kernel-backend (kernel_backend) = flash needs CUDA tensors, got device {device}")
    return _BACKENDS[name]


def varlen_fwd(q, k, v, batch: VarlenBatch, softmax_scale: float, backend=KernelBackendName.AUTO):
    """Bottom-right causal varlen attention. q (nq, hq, d), k/v (nk, hkv, d) -> (out (nq, hq, d), lse (hq, nq))."""
    return resolve_backend(backend, q.device).fwd(q, k, v, batch, softmax_scale)


def varlen_bwd(dout, q, k, v, out, lse, batch: VarlenBatch, softmax_scale: float, backend=KernelBackendName.AUTO):
    """Gradients of ``varlen_fwd``: (dq (nq, hq, d), dk (nk, hkv, d), dv (nk, hkv, d))."""
    return resolve_backend(backend, q.device).bwd(dout, q, k, v, out, lse, batch, softmax_scale)


class _VarlenAttnFunction(torch.autograd.Function):
    """Autograd wrapper of one backend's varlen fwd/bwd (saves q, k, v, out, lse only when grad is needed).
    ``stats`` (an ``ExchangeStats`` or None) accumulates kernel thread time of forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, batch: VarlenBatch, scale: float, backend: KernelBackend, stats):
        out, lse = _call(stats, backend.fwd, q, k, v, batch, scale)
        ctx.batch, ctx.scale, ctx.backend, ctx.stats = batch, scale, backend, stats
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _call(ctx.stats, ctx.backend.bwd, dout.contiguous(), q, k, v, out, lse, ctx.batch, ctx.scale)
        return dq, dk, dv, None, None, None, None


def _call(stats, fn, *args):
    return fn(*args) if stats is None else stats.timed_kernel(fn, *args)


def varlen_attn_func(q, k, v, batch: VarlenBatch, softmax_scale=None, backend=KernelBackendName.AUTO, stats=None):
    """Differentiable bottom-right causal varlen attention: q (nq, hq, d), k/v (nk, hkv, d) -> (nq, hq, d)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _VarlenAttnFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), batch, scale,
                                     resolve_backend(backend, q.device), stats)
