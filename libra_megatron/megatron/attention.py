"""``LibraCoreAttention``: a megatron-core core-attention module that executes a Libra pool plan.

Shape legend (TP-local heads):
    sbhd  query (s, b, hq, d), key/value (s, b, hkv, d)  ->  output (s, b, hq*d)
    thd   query (t, hq, d),    key/value (t, hkv, d)     ->  output (t, hq*d)
s / t are the tokens this rank holds (its CP shard of one packed sequence, mbs = 1), d = head dim.

It satisfies megatron-core 0.16.1's ``CoreAttentionBuilder`` / ``CoreAttention`` protocols
(``megatron/core/transformer/attention.py``) with the constructor signature of ``DotProductAttention``
and ``TEDotProductAttention``, so a layer spec can name it in place of either.

Plan carrier. The step's plan arrives *explicitly* with the microbatch: ``packed_seq_params`` is a
``PackedSeqParams`` subclass (``libra_megatron.megatron.batch.LibraPackedSeqParams``) whose ``libra_plan``
attribute is this rank's ``RankPlan``. Nothing is read from module globals.

Pool process group, first match wins:
    1. ``pool_group=`` constructor argument, or a later ``set_pool_group(group)`` call;
    2. ``pg_collection.libra_pool`` when the ``ProcessGroupCollection`` carries one;
    3. ``libra_megatron.megatron.groups.get_pool_group()`` (initialised by ``initialize_pool_groups``).
The group is looked up only when a multi-worker plan is executed.

Pools off. Without a plan (or with a one-worker plan) and CP = 1 the module is plain per-sample causal
attention: samples are delimited by ``packed_seq_params.cu_seqlens_q`` (int32/int64, (n+1,), local
token offsets) when given, else the whole sequence is one causal sample. GQA is never expanded: the
kernel is ``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` per sample.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..config import KernelBackendName

__all__ = ["LibraCoreAttention", "local_causal_attention_thd"]

_SUPPORTED_MASKS = (AttnMaskType.causal, AttnMaskType.padding_causal)


def local_causal_attention_thd(q, k, v, cu_seqlens: Optional[torch.Tensor], softmax_scale: float,
                               dropout_p: float = 0.0) -> torch.Tensor:
    """Block-diagonal causal attention over packed samples, GQA without expanding K/V.

    q (t, hq, d), k/v (t, hkv, d), cu_seqlens (n+1,) sample offsets into t (None = one sample).
    Returns (t, hq, d) in q's dtype. Cost O(sum_j l_j^2) -- one SDPA call per sample.
    """
    t = q.shape[0]
    bounds = [0, t] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != t or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"cu_seqlens must rise from 0 to the local token count {t}, got {bounds}")
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))  # (h, l, d)
        outs.append(F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=softmax_scale, dropout_p=dropout_p, enable_gqa=gqa,
        ).transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else torch.zeros_like(q)


class LibraCoreAttention(MegatronModule):
    """Core attention executing Libra's TAP plan (§4.3) across the sequence pool, or plain attention.

    Constructor arguments mirror ``DotProductAttention`` (megatron-core 0.16.1) plus:
        pool_group      explicit pool process group (see module docstring for the lookup order)
        kernel_backend  ``KernelBackendName`` for the runtime operator (default AUTO)
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, *, pool_group=None,
                 kernel_backend: KernelBackendName = KernelBackendName.AUTO):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(f"LibraCoreAttention supports self attention only, got attention_type={attention_type!r}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type  # unused: the plan decides every CP/pool transfer
        self.pg_collection = pg_collection
        self.head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else float(softmax_scale)
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)
        self.kernel_backend = KernelBackendName(kernel_backend)
        self._pool_group = pool_group

    # ------------------------------------------------------------------ process groups
    def set_pool_group(self, group) -> None:
        """Use ``group`` as the pool process group (overrides pg_collection / groups module)."""
        self._pool_group = group

    def pool_group(self):
        """The pool process group, resolved in the documented order (explicit, pg_collection, groups)."""
        if self._pool_group is not None:
            return self._pool_group
        carried = getattr(self.pg_collection, "libra_pool", None)
        if carried is not None:
            return carried
        from . import groups  # lazy: only multi-worker plans need it

        return groups.get_pool_group()

    def _cp_size(self) -> int:
        cp = getattr(self.pg_collection, "cp", None)
        if cp is not None:
            return cp.size()
        return int(getattr(self.config, "context_parallel_size", 1) or 1)

    # ------------------------------------------------------------------ forward
    def forward(self, query, key, value, attention_mask=None, attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias=None, packed_seq_params=None):
        """Attention output, (s, b, hq*d) for sbhd or (t, hq*d) for thd (see shape legend)."""
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in _SUPPORTED_MASKS:
            raise ValueError(f"LibraCoreAttention needs a causal attn_mask_type, got {mask_type}")
        if attention_bias is not None:
            raise ValueError("LibraCoreAttention does not support attention_bias")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        q, k, v = (query, key, value) if thd else self._sbhd_to_thd(query, key, value, packed_seq_params)
        plan = getattr(packed_seq_params, "libra_plan", None)
        if plan is not None and plan.num_workers > 1:
            out = self._forward_plan(q, k, v, plan)
        else:
            out = self._forward_local(q, k, v, packed_seq_params)
        if thd:
            return out.reshape(out.shape[0], -1)
        return out.reshape(query.shape[0], query.shape[1], -1)

    def _sbhd_to_thd(self, query, key, value, packed_seq_params):
        s, b = query.shape[:2]
        if b == 1:
            return query.squeeze(1), key.squeeze(1), value.squeeze(1)
        if packed_seq_params is not None and self._cu_seqlens(packed_seq_params) is not None:
            raise ValueError(f"sbhd with packed samples (cu_seqlens) needs micro batch size 1, got b={b}")
        return query, key, value  # (s, b, h, d), b > 1: one causal sample per row (pools-off path only)

    @staticmethod
    def _cu_seqlens(packed_seq_params):
        return getattr(packed_seq_params, "cu_seqlens_q", None)

    def _forward_local(self, q, k, v, packed_seq_params):
        """Plain per-sample causal attention on this rank's tokens (pools off, CP = 1)."""
        if self._cp_size() > 1:
            raise ValueError(
                f"LibraCoreAttention with context_parallel_size {self._cp_size()} > 1 needs a Libra plan "
                "(packed_seq_params.libra_plan); none was given"
            )
        dropout = self.dropout_p if self.training else 0.0
        if q.dim() == 4:  # (s, b, h, d), b > 1, no cu_seqlens: one causal sample per batch row
            out = F.scaled_dot_product_attention(
                *(x.permute(1, 2, 0, 3) for x in (q, k, v)), is_causal=True, scale=self.softmax_scale,
                dropout_p=dropout, enable_gqa=q.shape[2] != k.shape[2],
            )
            return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)
        cu = None if packed_seq_params is None else self._cu_seqlens(packed_seq_params)
        return local_causal_attention_thd(q, k, v, cu, self.softmax_scale, dropout)

    def _forward_plan(self, q, k, v, plan):
        """Execute this rank's ``RankPlan`` with the runtime operator (Q dispatch, KV fetch, O return)."""
        if q.dim() != 3:
            raise ValueError(f"Libra plans need micro batch size 1 (sbhd b=1 or thd), got query {tuple(q.shape)}")
        if self.training and self.dropout_p > 0:
            raise ValueError(
                f"Libra plans run attention without dropout; set --attention-dropout 0 (got {self.dropout_p})"
            )
        # Shape/rank/fingerprint checks happen inside libra_attn_func on *every* rank (a check raised
        # here on one rank only would leave its peers waiting in the first collective).
        from ..runtime import libra_attn_func  # lazy: keeps module import light

        return libra_attn_func(q, k, v, plan, self.pool_group(), softmax_scale=self.softmax_scale,
                               backend=self.kernel_backend, qkv_format="thd")
