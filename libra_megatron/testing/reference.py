"""Independent single-process references for the runtime tests (fp64 by default).

Shape legend: L = tokens of one packed sequence, hq/hkv = query/kv heads, d = head dim.
    q (L, hq, d)   k, v (L, hkv, d)   segments = document lengths, sum == L

``reference_attention`` builds a dense block-diagonal causal mask over the whole packed sequence and runs
plain softmax attention -- deliberately nothing like the varlen kernels or the exchange plan, so it can
catch their bugs. Gradients come from autograd. Also: helpers that split a packed sequence into the CP
shards of a ``TokenLayout`` and back, used to feed each rank its local tokens.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["block_causal_mask", "reference_attention", "reference_forward_backward", "shard_tokens", "unshard_tokens"]


def block_causal_mask(segments: Sequence[int], device=None) -> torch.Tensor:
    """bool (L, L): True where query i may attend key j (same document and j <= i)."""
    seg = torch.as_tensor(np.asarray(segments, dtype=np.int64), device=device)
    doc = torch.repeat_interleave(torch.arange(seg.numel(), device=device), seg)
    pos = torch.arange(doc.numel(), device=device)
    return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


def reference_attention(q, k, v, segments: Sequence[int], softmax_scale: Optional[float] = None):
    """Per-document causal attention over one packed sequence. Differentiable; (L, hq, d) out."""
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    ke = k.repeat_interleave(group, dim=1)
    ve = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, ke) * scale
    s = s.masked_fill(~block_causal_mask(segments, q.device)[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), ve)


def reference_forward_backward(q, k, v, dout, segments, softmax_scale=None, dtype=torch.float64):
    """(out, dq, dk, dv) of ``reference_attention`` in ``dtype``, gradients of sum(out * dout)."""
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    out = reference_attention(*leaves, segments, softmax_scale)
    out.backward(dout.to(dtype))
    return (out.detach(),) + tuple(x.grad for x in leaves)


def shard_tokens(x: torch.Tensor, layout, cp_rank: int) -> torch.Tensor:
    """Rows of packed sequence ``x`` (L, ...) held by ``cp_rank`` under ``layout``, in local order."""
    idx = torch.as_tensor(layout.local_to_global(cp_rank), device=x.device)
    return x.index_select(0, idx)


def unshard_tokens(shards: Sequence[torch.Tensor], layout) -> torch.Tensor:
    """Inverse of ``shard_tokens`` over all CP ranks: (L, ...) in global order."""
    out = torch.empty((layout.seq_len,) + tuple(shards[0].shape[1:]), dtype=shards[0].dtype)
    for c, shard in enumerate(shards):
        out[torch.as_tensor(layout.local_to_global(c))] = shard
    return out
