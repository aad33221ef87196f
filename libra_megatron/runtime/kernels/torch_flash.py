"""``torch_flash`` backend: torch's own FlashAttention-2 varlen kernels (no flash-attn package needed).

Shape legend: q (nq, hq, d), k/v (nk, hkv, d) fp16/bf16 CUDA, d % 8 == 0, d <= 256; cu int32 [n+1];
lse (hq, nq) fp32 -- the same contract as the ``flash`` backend (CUDA builds; ROCm uses another layout
and is refused).

We call the aten ops directly (``torch.nn.attention.varlen`` wraps the same forward op, but its Python
API changed between releases). Schemas, from ``native_functions.yaml``:

torch 2.5 - 2.13 (outputs 3-4 are named philox_seed/philox_offset up to 2.6, rng_state/unused from 2.7;
2.12 adds ``Tensor? block_table=None, int? num_splits=None``):
    aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q,
        Tensor? cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal,
        bool return_debug_mask, *, float? scale=None, SymInt? window_size_left=None,
        SymInt? window_size_right=None, Tensor? seqused_k=None, Tensor? alibi_slopes=None, ...)
        -> (Tensor output, Tensor softmax_logsumexp, Tensor rng_state, Tensor unused, Tensor debug_attn_mask)
    aten::_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out,
        Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p,
        bool is_causal, Tensor rng_state, Tensor unused, *, float? scale=None, ...) -> (Tensor, Tensor, Tensor)
We pass the ten (forward) / fourteen (backward) positional arguments and ``scale=``, which every release
of the range accepts.

Causal alignment: with ``cum_seq_*`` the op runs ``pytorch_flash::mha_varlen_fwd`` (vendored
flash-attn 2.x), where ``is_causal`` sets ``window_size_right = 0`` on the flash-attn mask: bottom-right,
the alignment Libra needs (a query block sits at the end of its key prefix). torch's own
``torch/nn/attention/bias.py`` relies on it ("for this particular op it means lower right"); SDPA's
top-left ``is_causal`` is a property of SDPA, which refuses flash for causal q_len != k_len.
GQA: ``mha_varlen_fwd`` accepts hq % hkv == 0 and ``mha_varlen_bwd`` sums dK/dV over each group
(``at::sum_out`` of the expanded gradients), so K/V are passed unexpanded. ``expand_kv=True`` is the
fallback for a build without that support: K/V repeated to hq heads, the (nk, hq, d) gradients summed
back over the group in fp32 and cast once; the device check runs both.
Dropout is 0, so the backward never reads the rng tensors (``if (is_dropout) params.rng_state = ...``);
it gets fresh placeholders of the forward's shapes.
"""
from __future__ import annotations

import torch

__all__ = ["torch_flash_available", "torch_flash_fwd", "torch_flash_bwd", "aten_flash_ops"]


def aten_flash_ops():
    """(forward op, backward op). Tests replace these with CPU fakes built from the same schemas."""
    return torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward


def torch_flash_available(device: torch.device) -> bool:
    """CUDA build with FlashAttention compiled in, not ROCm (the sm80+ rule is the kernels' shared one)."""
    if device.type != "cuda" or getattr(torch.version, "hip", None):
        return False
    try:
        return bool(torch.backends.cuda.is_flash_attention_available())
    except Exception:  # noqa: BLE001 - no usable CUDA runtime
        return False


def _expanded(x, group: int):
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _reduce_group(dx_e, hkv: int, dtype):
    """(nk, hq, d) -> (nk, hkv, d): sum over each GQA group in fp32, cast once."""
    nk, hq, d = dx_e.shape
    return dx_e.view(nk, hkv, hq // hkv, d).sum(2, dtype=torch.float32).to(dtype)


def torch_flash_fwd(q, k, v, batch, scale: float, expand_kv: bool = False, causal: bool = True):
    """(out (nq, hq, d), lse (hq, nq) fp32). ``causal`` False: every query sees all of its entry's keys."""
    fwd_op, _ = aten_flash_ops()
    group = q.shape[1] // k.shape[1] if expand_kv else 1
    out, lse, _rng, _unused, _dbg = fwd_op(
        q, _expanded(k, group), _expanded(v, group), batch.cu_q, batch.cu_k, batch.max_q, batch.max_k,
        0.0, bool(causal), False, scale=scale,
    )
    return out, lse


def _rng_placeholders(device):
    uint64 = getattr(torch, "uint64", torch.int64)
    return torch.empty((2,), dtype=uint64, device=device), torch.empty((), dtype=uint64, device=device)


def torch_flash_bwd(dout, q, k, v, out, lse, batch, scale: float, expand_kv: bool = False,
                    deterministic: bool = False):
    """(dq, dk, dv) in the input dtype. The aten op has no ``deterministic`` argument: it reads
    ``torch.are_deterministic_algorithms_enabled()``, which Megatron-LM's --deterministic-mode turns on
    (``validate_args``); a deterministic call without it is refused rather than run non-deterministically."""
    if deterministic and not torch.are_deterministic_algorithms_enabled():
        raise ValueError("--deterministic-mode with --libra-kernel-backend torch_flash: torch's FlashAttention backward "
                         "is deterministic only under torch.use_deterministic_algorithms(True), which is off")
    _, bwd_op = aten_flash_ops()
    hkv = k.shape[1]
    group = q.shape[1] // hkv if expand_kv else 1
    rng, unused = _rng_placeholders(q.device)
    dq, dk, dv = bwd_op(
        dout.contiguous(), q, _expanded(k, group), _expanded(v, group), out, lse, batch.cu_q, batch.cu_k,
        batch.max_q, batch.max_k, 0.0, True, rng, unused, scale=scale,
    )
    if group > 1:
        dk, dv = _reduce_group(dk, hkv, k.dtype), _reduce_group(dv, hkv, v.dtype)
    return dq, dk, dv
