"""CPU fakes of the GPU kernels the ``flash`` and ``torch_flash`` backends call, built like the real ones.

flash-attn: fake ``flash_attn`` packages whose ``flash_attn_interface._flash_attn_varlen_forward/_backward``
have the exact signatures, defaults and return values of the real wrappers at v2.6.3 (plain functions),
v2.7.4.post1 and v2.8.3 (``torch.library.custom_op`` ops, here registered for CPU). aten: fake
``_flash_attention_forward/_backward`` ops defined from the schemas of torch 2.5 (philox_* outputs),
2.7-2.11 (rng_state/unused) and 2.12-2.13 (+ block_table, num_splits).

Every fake records the arguments it received (after Python/schema binding) and computes attention *from
those arguments* with a dense fp64 per-entry masked softmax -- a wrong cu_seqlens, scale or causal flag
changes its result, so comparing with the exact backend checks that each argument arrived.
"""
from __future__ import annotations

import inspect
import sys
import types
from typing import List, Optional, Tuple

import torch

CALLS: List[tuple] = []  # (name, {argument: value}) in call order


def _record(name: str, fn, args, kwargs) -> dict:
    bound = inspect.signature(fn).bind(*args, **kwargs)  # the fake's own, real signature
    bound.apply_defaults()
    CALLS.append((name, dict(bound.arguments)))
    return dict(bound.arguments)


def _entries(cu_q, cu_k):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def dense_varlen(q, k, v, cu_q, cu_k, scale: float, causal: bool, bottom_right: bool = True):
    """fp64 autograd-ready dense attention per entry: (out (nq, hq, d), lse (hq, nq))."""
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for q0, q1, k0, k1 in _entries(cu_q, cu_k):
        qe, ke, ve = q[q0:q1], k[k0:k1].repeat_interleave(group, 1), v[k0:k1].repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qe, ke) * scale
        if causal:
            shift = (k1 - k0) - (q1 - q0) if bottom_right else 0
            i, j = torch.arange(q1 - q0)[:, None], torch.arange(k1 - k0)[None, :]
            s = s.masked_fill((j > i + shift)[None], float("-inf"))
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), ve))
    return torch.cat(outs), torch.cat(lses, dim=1)


def dense_grads(dout, q, k, v, cu_q, cu_k, scale, causal):
    """Analytic fp64 gradients of ``dense_varlen`` (kernels run below autograd, so no autograd here):
    P = softmax(S), dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = scale dS K, dK = scale dS^T Q."""
    q, k, v, dout = (x.double() for x in (q, k, v, dout))
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q0, q1, k0, k1 in _entries(cu_q, cu_k):
        qe, do = q[q0:q1], dout[q0:q1]
        ke, ve = k[k0:k1].repeat_interleave(group, 1), v[k0:k1].repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qe, ke) * scale
        if causal:
            i, j = torch.arange(q1 - q0)[:, None], torch.arange(k1 - k0)[None, :]
            s = s.masked_fill((j > i + (k1 - k0) - (q1 - q0))[None], float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        o = torch.einsum("hqk,khd->qhd", p, ve)
        ds = p * (torch.einsum("qhd,khd->hqk", do, ve) - (do * o).sum(-1).transpose(0, 1)[..., None])
        dq[q0:q1] = scale * torch.einsum("hqk,khd->qhd", ds, ke)
        n, hkv = k1 - k0, k.shape[1]
        dk[k0:k1] = (scale * torch.einsum("hqk,qhd->khd", ds, qe)).reshape(n, hkv, group, -1).sum(2)
        dv[k0:k1] = torch.einsum("hqk,qhd->khd", p, do).reshape(n, hkv, group, -1).sum(2)
    return [dq, dk, dv]


def _forward_values(q, k, v, cu_q, cu_k, scale, causal):
    out, lse = dense_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, scale, causal)
    return out.to(q.dtype), lse.float()


# ============================================================================ flash-attn 2.6.3
def _fa263_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False,
                   block_table=None, leftpad_k=None, seqused_k=None):
    args = _record("fa_fwd", _fa263_forward, (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              dropout_p, softmax_scale, causal),
                   dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        return_softmax=return_softmax, block_table=block_table, leftpad_k=leftpad_k,
                        seqused_k=seqused_k))
    out, lse = _forward_values(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, args["causal"])
    return out, q, k, v, out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)


def _fa263_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    deterministic, rng_state=None):
    _record("fa_bwd", _fa263_backward, (dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                        softcap, alibi_slopes, deterministic), dict(rng_state=rng_state))
    for dst, src in zip((dq, dk, dv), dense_grads(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)):
        dst.copy_(src)
    return dq, dk, dv, torch.empty(0)


# ============================================================================ flash-attn 2.7.4 / 2.8.3
def _register_custom_ops(namespace: str):
    """The two ops exactly as flash-attn 2.7.4.post1 / 2.8.3 declare them, with device_types='cpu'."""

    @torch.library.custom_op(f"{namespace}::_flash_attn_varlen_forward", mutates_args=(), device_types="cpu")
    def _flash_attn_varlen_forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
        window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
        alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
        block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
        seqused_k: Optional[torch.Tensor] = None, zero_tensors: bool = False,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        CALLS.append(("fa_fwd", dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
                                     softmax_scale=softmax_scale, causal=causal, window_size_left=window_size_left,
                                     window_size_right=window_size_right, softcap=softcap,
                                     alibi_slopes=alibi_slopes, return_softmax=return_softmax,
                                     block_table=block_table, leftpad_k=leftpad_k, seqused_k=seqused_k,
                                     zero_tensors=zero_tensors)))
        out, lse = _forward_values(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        return out, lse, torch.empty(0, dtype=q.dtype), torch.empty(2, dtype=torch.int64)

    @torch.library.custom_op(f"{namespace}::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"),
                             device_types="cpu")
    def _flash_attn_varlen_backward(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
        dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
        max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
        window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
        rng_state: Optional[torch.Tensor] = None, zero_tensors: bool = False,
    ) -> torch.Tensor:
        CALLS.append(("fa_bwd", dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=softmax_lse, dq=dq, dk=dk, dv=dv,
                                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
                                     softmax_scale=softmax_scale, causal=causal, window_size_left=window_size_left,
                                     window_size_right=window_size_right, softcap=softcap,
                                     alibi_slopes=alibi_slopes, deterministic=deterministic, rng_state=rng_state,
                                     zero_tensors=zero_tensors)))
        grads = dense_grads(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        for dst, src in zip((dq, dk, dv), grads):
            dst.copy_(src)
        return torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32)

    return _flash_attn_varlen_forward, _flash_attn_varlen_backward


_OPS = {}


def fake_flash_attn(version: str) -> Tuple[types.ModuleType, types.ModuleType]:
    """(flash_attn, flash_attn.flash_attn_interface) fakes for ``version`` (2.6.3, 2.7.4.post1, 2.8.3, ...)."""
    pkg = types.ModuleType("flash_attn")
    pkg.__version__ = version
    pkg.__path__ = []
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    if version.startswith("2.6") or version.startswith("2.5"):
        iface._flash_attn_varlen_forward, iface._flash_attn_varlen_backward = _fa263_forward, _fa263_backward
    else:
        tag = "".join(ch for ch in version if ch.isdigit())[:3]
        if tag not in _OPS:
            _OPS[tag] = _register_custom_ops(f"libra_fake_fa{tag}")
        iface._flash_attn_varlen_forward, iface._flash_attn_varlen_backward = _OPS[tag]
    pkg.flash_attn_interface = iface
    return pkg, iface


def install_flash_attn(monkeypatch, version: str):
    pkg, iface = fake_flash_attn(version)
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    return pkg


# ============================================================================ aten flash (torch 2.5 .. 2.13)
_ATEN_FWD_25 = ("_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? cum_seq_k, "
                "SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, bool return_debug_mask, *, "
                "float? scale=None, SymInt? window_size_left=None, SymInt? window_size_right=None, "
                "Tensor? seqused_k=None, Tensor? alibi_slopes=None) -> (Tensor output, Tensor softmax_logsumexp, "
                "Tensor philox_seed, Tensor philox_offset, Tensor debug_attn_mask)")
_ATEN_BWD_25 = ("_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
                "Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, "
                "bool is_causal, Tensor philox_seed, Tensor philox_offset, *, float? scale=None, "
                "SymInt? window_size_left=None, SymInt? window_size_right=None) -> (Tensor, Tensor, Tensor)")
ATEN_SCHEMAS = {
    "2.5": (_ATEN_FWD_25, _ATEN_BWD_25),
    "2.7": (_ATEN_FWD_25.replace("Tensor philox_seed, Tensor philox_offset", "Tensor rng_state, Tensor unused"),
            _ATEN_BWD_25.replace("Tensor philox_seed, Tensor philox_offset", "Tensor rng_state, Tensor unused")),
}
ATEN_SCHEMAS["2.13"] = (ATEN_SCHEMAS["2.7"][0].replace(
    "Tensor? alibi_slopes=None)", "Tensor? alibi_slopes=None, Tensor? block_table=None, int? num_splits=None)"),
    ATEN_SCHEMAS["2.7"][1])


def _aten_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                  *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                  block_table=None, num_splits=None):
    CALLS.append(("aten_fwd", dict(query=query, key=key, value=value, cum_seq_q=cum_seq_q, cum_seq_k=cum_seq_k,
                                   max_q=max_q, max_k=max_k, dropout_p=dropout_p, is_causal=is_causal,
                                   return_debug_mask=return_debug_mask, scale=scale)))
    out, lse = _forward_values(query, key, value, cum_seq_q, cum_seq_k, scale, is_causal)
    uint64 = getattr(torch, "uint64", torch.int64)
    return out, lse, torch.zeros(2, dtype=uint64), torch.zeros((), dtype=uint64), torch.empty(0, dtype=query.dtype)


def _aten_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, rng_a, rng_b, *, scale=None, window_size_left=None, window_size_right=None):
    CALLS.append(("aten_bwd", dict(grad_out=grad_out, query=query, key=key, value=value, out=out, logsumexp=logsumexp,
                                   cum_seq_q=cum_seq_q, cum_seq_k=cum_seq_k, max_q=max_q, max_k=max_k,
                                   dropout_p=dropout_p, is_causal=is_causal, rng=(rng_a, rng_b), scale=scale)))
    grads = dense_grads(grad_out, query, key, value, cum_seq_q, cum_seq_k, scale, is_causal)
    return tuple(g.to(x.dtype) for g, x in zip(grads, (query, key, value)))


_LIBS = {}


def fake_aten_ops(version: str):
    """(forward op, backward op) defined from the torch ``version`` schemas, with CPU kernels."""
    if version not in _LIBS:
        namespace = "libra_fake_aten_" + version.replace(".", "_")
        lib = torch.library.Library(namespace, "DEF")
        fwd_schema, bwd_schema = ATEN_SCHEMAS[version]
        lib.define(fwd_schema)
        lib.define(bwd_schema)
        lib.impl("_flash_attention_forward", _aten_forward, "CPU")
        lib.impl("_flash_attention_backward", _aten_backward, "CPU")
        ops = getattr(torch.ops, namespace)
        _LIBS[version] = (lib, ops._flash_attention_forward, ops._flash_attention_backward)
    return _LIBS[version][1:]
