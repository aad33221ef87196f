"""Variable-length causal attention kernels behind one enum-keyed table.

Shape legend:
    nq  total query rows of the varlen batch        nk  total key rows (packed K)
    hq  query heads of the call                     hkv key/value heads (hq % hkv == 0)
    d   head dim                                    n   number of varlen entries
    q (nq, hq, d)   k, v (nk, hkv, d)   out (nq, hq, d)   lse (hq, nq) float32 (fp64 for fp64 inputs)
    cu_q / cu_k  int32 [n+1] on the tensors' device (flash-attn's convention)
Causal alignment is bottom-right: query row r of an entry with q_len rows and k_len keys sees keys
[0, k_len - q_len + r].

Backends (``KernelBackendName``):
    flash        flash-attn 2.6-2.8 varlen (``kernels/flash_attn.py``)         fp16/bf16, CUDA
    torch_flash  torch's aten FlashAttention-2 varlen (``kernels/torch_flash.py``) fp16/bf16, CUDA
    torch        exact reference in pure torch (``kernels/torch_ref.py``)       any dtype, any device
    auto         flash if it imports and the call is fp16/bf16 on CUDA with d % 8 == 0 and d <= 256; else
                 torch_flash on CUDA under the same conditions; else torch. The choice is logged once per
                 (device type, dtype, head dim); fp32 on CUDA takes the exact path with that log line.
``fwd`` returns (out, lse) and ``bwd`` takes (dout, q, k, v, out, lse) and returns (dq, dk, dv): the
quantities flash-attn's varlen backward consumes, so the runtime swaps backends freely. A batch without
entries never reaches a kernel (flash-attn rejects batch size 0).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch

from ...config import KernelBackendName
from .flash_attn import flash_available, flash_bwd, flash_fwd
from .torch_flash import torch_flash_available, torch_flash_bwd, torch_flash_fwd
from .torch_ref import torch_bwd, torch_fwd

__all__ = ["VarlenBatch", "KernelBackend", "resolve_backend", "varlen_fwd", "varlen_bwd", "varlen_attn_func",
           "flash_available", "torch_flash_available", "host_to_device", "device_capability"]

logger = logging.getLogger(__name__)
_FLAG = "--libra-kernel-backend (kernel_backend)"
_HALF = (torch.float16, torch.bfloat16)


def host_to_device(array: np.ndarray, device) -> torch.Tensor:
    """Copy a host array to ``device`` without a host sync (pinned, non_blocking for CUDA)."""
    tensor = torch.from_numpy(np.array(array, copy=True))
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class VarlenBatch:
    """Varlen metadata of one kernel call. ``cu_q``/``cu_k`` int32 [n+1] on the tensors' device;
    ``bounds`` is the same data as host ints (the exact backend's per-entry loop reads only these)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    bounds: Tuple[Tuple[int, int, int, int], ...]  # (q0, q1, k0, k1) per entry

    @property
    def num_entries(self) -> int:
        return len(self.bounds)

    @staticmethod
    def from_lengths(q_lens, k_lens, device) -> "VarlenBatch":
        """From per-entry query / key lengths (host ints or int arrays; never a device tensor)."""
        q_lens = [int(x) for x in q_lens]
        k_lens = [int(x) for x in k_lens]
        cq = np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64)]).astype(np.int32)
        ck = np.concatenate([[0], np.cumsum(k_lens, dtype=np.int64)]).astype(np.int32)
        bounds = tuple((int(cq[i]), int(cq[i + 1]), int(ck[i]), int(ck[i + 1])) for i in range(len(q_lens)))
        return VarlenBatch(cu_q=host_to_device(cq, device), cu_k=host_to_device(ck, device),
                           max_q=max(q_lens, default=0), max_k=max(k_lens, default=0), bounds=bounds)


# ============================================================================ table
@dataclass(frozen=True)
class KernelBackend:
    """One backend: ``fwd``/``bwd`` as in the module docstring, ``unsupported(device, dtype, head_dim)``
    returns why a call cannot run on it (None when it can)."""

    name: KernelBackendName
    raw_fwd: Callable
    raw_bwd: Callable
    unsupported: Callable[[torch.device, torch.dtype, int], Optional[str]]

    def fwd(self, q, k, v, batch: VarlenBatch, scale: float, causal: bool = True):
        """``causal`` False: every query sees all of its entry's keys (key blocks that precede all its queries)."""
        if batch.num_entries == 0:
            lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            return torch.zeros_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype)
        if causal:
            return self.raw_fwd(q, k, v, batch, scale)
        return self.raw_fwd(q, k, v, batch, scale, causal=False)

    def bwd(self, dout, q, k, v, out, lse, batch: VarlenBatch, scale: float, deterministic: bool = False):
        """``deterministic``: Megatron-LM's --deterministic-mode (TransformerConfig.deterministic_mode), passed
        to the kernel's backward (flash-attn's ``deterministic=``; see each backend)."""
        if batch.num_entries == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        return self.raw_bwd(dout, q, k, v, out, lse, batch, scale, deterministic=deterministic)


def device_capability(device) -> Optional[Tuple[int, int]]:
    """(major, minor) of a CUDA ``device``, None when no CUDA runtime answers (tests fake it here)."""
    try:
        return tuple(torch.cuda.get_device_capability(device))
    except Exception:  # noqa: BLE001 - no usable CUDA runtime
        return None


def _flash_kernel_unsupported(device, dtype, head_dim) -> Optional[str]:
    """The conditions shared by flash-attn and torch's vendored FlashAttention-2 (both need Ampere or newer)."""
    if device.type != "cuda":
        return f"needs CUDA tensors, got device {device}"
    if dtype not in _HALF:
        return f"supports fp16/bf16 only, got {dtype} (use kernel_backend torch for exact fp32/fp64)"
    if head_dim % 8 or head_dim > 256:
        return f"needs head_dim % 8 == 0 and head_dim <= 256, got {head_dim}"
    capability = device_capability(device)
    if capability is None or capability[0] < 8:
        shown = "unknown" if capability is None else f"sm{capability[0]}{capability[1]}"
        return f"needs an sm80+ (Ampere or newer) GPU, got {shown} on {device}"
    return None


def _flash_unsupported(device, dtype, head_dim) -> Optional[str]:
    if not flash_available():
        return "flash_attn (2.6, 2.7 or 2.8) cannot be imported"
    return _flash_kernel_unsupported(device, dtype, head_dim)


def _torch_flash_unsupported(device, dtype, head_dim) -> Optional[str]:
    reason = _flash_kernel_unsupported(device, dtype, head_dim)
    if reason is None and not torch_flash_available(device):
        return "this torch build/device has no FlashAttention (CUDA sm80+ build without ROCm needed)"
    return reason


_BACKENDS: Dict[KernelBackendName, KernelBackend] = {
    KernelBackendName.FLASH: KernelBackend(KernelBackendName.FLASH, flash_fwd, flash_bwd, _flash_unsupported),
    KernelBackendName.TORCH_FLASH: KernelBackend(KernelBackendName.TORCH_FLASH, torch_flash_fwd, torch_flash_bwd,
                                                 _torch_flash_unsupported),
    KernelBackendName.TORCH: KernelBackend(KernelBackendName.TORCH, torch_fwd, torch_bwd, lambda *_: None),
}
_AUTO_ORDER = (KernelBackendName.FLASH, KernelBackendName.TORCH_FLASH, KernelBackendName.TORCH)
_LOGGED: set = set()


def _auto(device, dtype, head_dim) -> KernelBackend:
    for name in _AUTO_ORDER:
        if _BACKENDS[name].unsupported(device, dtype, head_dim) is None:
            chosen = _BACKENDS[name]
            break
    key = (device.type, dtype, head_dim, chosen.name)
    if key not in _LOGGED:
        _LOGGED.add(key)
        skipped = {n.value: _BACKENDS[n].unsupported(device, dtype, head_dim) for n in _AUTO_ORDER[:-1]}
        logger.info("Libra kernel backend auto -> %s for %s %s head_dim %d (skipped: %s)", chosen.name.value,
                    device.type, dtype, head_dim, {k: v for k, v in skipped.items() if v} or "none")
    return chosen


def resolve_backend(name, device, dtype: torch.dtype = torch.float32, head_dim: int = 128) -> KernelBackend:
    """The backend that runs a call of (device, dtype, head_dim). Explicit names that cannot run it raise
    ValueError naming the flag and the reason (never a crash inside a kernel)."""
    name, device = KernelBackendName(name), torch.device(device)
    if name is KernelBackendName.AUTO:
        return _auto(device, dtype, head_dim)
    reason = _BACKENDS[name].unsupported(device, dtype, head_dim)
    if reason is not None:
        raise ValueError(f"{_FLAG} = {name.value} {reason}")
    return _BACKENDS[name]


def varlen_fwd(q, k, v, batch: VarlenBatch, softmax_scale: float, backend=KernelBackendName.AUTO):
    """Bottom-right causal varlen attention. q (nq, hq, d), k/v (nk, hkv, d) -> (out (nq, hq, d), lse (hq, nq))."""
    return resolve_backend(backend, q.device, q.dtype, q.shape[-1]).fwd(q, k, v, batch, softmax_scale)


def varlen_bwd(dout, q, k, v, out, lse, batch: VarlenBatch, softmax_scale: float, backend=KernelBackendName.AUTO,
               deterministic: bool = False):
    """Gradients of ``varlen_fwd``: (dq (nq, hq, d), dk (nk, hkv, d), dv (nk, hkv, d))."""
    return resolve_backend(backend, q.device, q.dtype, q.shape[-1]).bwd(dout, q, k, v, out, lse, batch, softmax_scale,
                                                                        deterministic)


class _VarlenAttnFunction(torch.autograd.Function):
    """Autograd wrapper of one backend's varlen fwd/bwd (saves q, k, v, out, lse only when grad is needed).
    ``stats`` (an ``ExchangeStats`` or None) accumulates kernel thread time of forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, batch: VarlenBatch, scale: float, backend: KernelBackend, stats, deterministic: bool):
        out, lse = _call(stats, backend.fwd, q, k, v, batch, scale)
        ctx.batch, ctx.scale, ctx.backend, ctx.stats, ctx.deterministic = batch, scale, backend, stats, deterministic
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _call(ctx.stats, ctx.backend.bwd, dout.contiguous(), q, k, v, out, lse, ctx.batch, ctx.scale,
                           ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None


def _call(stats, fn, *args):
    return fn(*args) if stats is None else stats.timed_kernel(fn, *args)


def varlen_attn_func(q, k, v, batch: VarlenBatch, softmax_scale=None, backend=KernelBackendName.AUTO, stats=None,
                     deterministic: bool = False):
    """Differentiable bottom-right causal varlen attention: q (nq, hq, d), k/v (nk, hkv, d) -> (nq, hq, d).
    ``deterministic`` reaches the backend's backward (``KernelBackend.bwd``)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    chosen = resolve_backend(backend, q.device, q.dtype, q.shape[-1])
    return _VarlenAttnFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), batch, scale, chosen, stats,
                                     bool(deterministic))
