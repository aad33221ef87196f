"""``flash`` backend: flash-attn 2.6-2.8 ``_flash_attn_varlen_forward`` / ``_flash_attn_varlen_backward``.

Shape legend: q (nq, hq, d), k/v (nk, hkv, d) fp16/bf16 CUDA, d % 8 == 0, d <= 256; cu_seqlens int32 [n+1];
lse (hq, nq) fp32 (flash-attn >= 2.4 returns it unpadded for varlen). Causal is bottom-right (>= 2.1).

Each supported release line is called exactly as its own ``flash_attn/flash_attn_interface.py`` defines
the two functions (read at tags v2.6.3, v2.7.4.post1 and v2.8.3; the release line is read from
``flash_attn.__version__``, never from ``inspect.signature``, which shows ``(*args, **kwargs)`` for the
``torch.library.custom_op`` wrappers of 2.7+):

2.6.x  plain functions
    _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False,
        block_table=None, leftpad_k=None, seqused_k=None)   (2.6.0: no defaults, no leftpad_k/seqused_k)
        -> (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
    _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, rng_state=None) -> (dq, dk, dv, softmax_d)
2.7.x / 2.8.x  ``torch.library.custom_op("flash_attn::_flash_attn_varlen_forward", mutates_args=())``
    _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
        return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None[, zero_tensors=False >= 2.7.3])
        -> (out, softmax_lse, S_dmask, rng_state)
    _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
        softcap, alibi_slopes, deterministic, rng_state=None[, zero_tensors=False])
        -> softmax_d; dq, dk, dv written in place (mutates_args=("dq", "dk", "dv"))
The calls below pass the arguments every release of the line accepts, the way flash-attn's own
``FlashAttnVarlenFunc`` passes them (leading ones by position, the rest by name).
"""
from __future__ import annotations

import functools
import re
from typing import Callable, Dict, Tuple

import torch

__all__ = ["flash_available", "flash_attn_version", "flash_fwd", "flash_bwd", "SUPPORTED_LINES"]


def _interface():
    from flash_attn import flash_attn_interface

    return flash_attn_interface


def flash_attn_version() -> Tuple[int, int]:
    """(major, minor) of the installed flash-attn; ImportError when it does not import."""
    import flash_attn

    match = re.match(r"(\d+)\.(\d+)", str(getattr(flash_attn, "__version__", "")))
    if match is None:
        raise ImportError(f"flash_attn.__version__ {getattr(flash_attn, '__version__', None)!r} is not a version")
    return int(match.group(1)), int(match.group(2))


@functools.lru_cache(maxsize=None)
def flash_available() -> bool:
    """True when flash-attn imports and its release line is one we call (2.6, 2.7, 2.8). Cached (a failed
    import is not retried per layer); tests that install a fake module call ``flash_available.cache_clear()``."""
    try:
        _interface()
        return flash_attn_version() in SUPPORTED_LINES
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False


# ------------------------------------------------------------------ 2.6.x
def _fwd_26(fai, q, k, v, batch, scale, causal=True):
    res = fai._flash_attn_varlen_forward(
        q, k, v, batch.cu_q, batch.cu_k, batch.max_q, batch.max_k, 0.0, scale,
        causal=bool(causal), window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False, block_table=None,
    )
    return res[0], res[5]  # (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)


def _bwd_26(fai, dout, q, k, v, out, lse, dq, dk, dv, batch, scale, deterministic):
    fai._flash_attn_varlen_backward(
        dout, q, k, v, out, lse, dq, dk, dv, batch.cu_q, batch.cu_k, batch.max_q, batch.max_k, 0.0, scale,
        True, (-1, -1), 0.0, None, deterministic, rng_state=None,
    )


# ------------------------------------------------------------------ 2.7.x, 2.8.x (custom ops)
def _fwd_27(fai, q, k, v, batch, scale, causal=True):
    out, lse, _s_dmask, _rng = fai._flash_attn_varlen_forward(
        q, k, v, batch.cu_q, batch.cu_k, batch.max_q, batch.max_k, 0.0, scale,
        causal=bool(causal), window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
        return_softmax=False, block_table=None,
    )
    return out, lse


def _bwd_27(fai, dout, q, k, v, out, lse, dq, dk, dv, batch, scale, deterministic):
    fai._flash_attn_varlen_backward(
        dout, q, k, v, out, lse, dq, dk, dv, batch.cu_q, batch.cu_k, batch.max_q, batch.max_k, 0.0, scale,
        True, -1, -1, 0.0, None, deterministic, rng_state=None,
    )


SUPPORTED_LINES: Dict[Tuple[int, int], Tuple[Callable, Callable]] = {
    (2, 6): (_fwd_26, _bwd_26),
    (2, 7): (_fwd_27, _bwd_27),
    (2, 8): (_fwd_27, _bwd_27),
}


def _calls():
    line = flash_attn_version()
    if line not in SUPPORTED_LINES:
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_LINES)
        raise ValueError(f"--libra-kernel-backend (kernel_backend) = flash: flash-attn {line[0]}.{line[1]} is not "
                         f"supported (supported release lines: {supported}); use torch_flash or torch")
    return SUPPORTED_LINES[line]


def flash_fwd(q, k, v, batch, scale: float, causal: bool = True):
    """(out (nq, hq, d), lse (hq, nq) fp32). ``causal`` False: every query sees all of its entry's keys."""
    return _calls()[0](_interface(), q, k, v, batch, scale, causal)


def flash_bwd(dout, q, k, v, out, lse, batch, scale: float, deterministic: bool = False):
    """(dq, dk, dv) in the input dtype; dk/dv of GQA are reduced over the group inside flash-attn.
    ``deterministic``: flash-attn's deterministic backward (Megatron-LM's --deterministic-mode)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _calls()[1](_interface(), dout.contiguous(), q, k, v, out, lse, dq, dk, dv, batch, scale, bool(deterministic))
    return dq, dk, dv
