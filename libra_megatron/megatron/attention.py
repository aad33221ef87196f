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

Knobs. ``kernel_backend`` and ``save_mode`` come from the carrier (``libra_kernel_backend`` /
``libra_save_mode``, set by the Libra batch path from the run's LibraConfig and the planner's per-plan
``save_mode=auto`` decision), else from the constructor, else auto / arranged. A constructor value that
contradicts the carrier is an error (nothing is overridden silently).

Verification. The first Libra layer that executes a given carrier passes ``verify=True`` to
``libra_attn_func`` (every pool rank does so in the same call: same model, same layer order), later
layers ``verify=False``: one small gloo all_gather per microbatch, none per layer (``runtime.checks``).

Pools off. Without a plan (or with a one-worker plan) and CP = 1 the module is plain per-sample causal
attention through the same varlen kernels. Sample boundaries come from host data: the carrier's
``libra_pool_segments[libra_position]``, else a CPU ``cu_seqlens_q``; a CUDA ``cu_seqlens_q`` without host
segments (a foreign carrier) is read once per carrier and cached on it, never once per layer. The varlen
metadata built from them (numpy offsets, pinned copies to the device) is also built once per carrier and
cached on it: every later layer reuses it. No boundaries = the whole sequence is one causal sample. Dropout is
not supported (varlen kernels).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..config import KernelBackendName, SaveModeName

__all__ = ["LibraCoreAttention", "local_causal_attention_thd", "local_varlen_batch", "carrier_varlen_batch",
           "host_sample_bounds"]

_SUPPORTED_MASKS = (AttnMaskType.causal, AttnMaskType.padding_causal)
_VERIFIED_ATTR = "_libra_verified_plan"  # the plan a carrier's first Libra layer verified
_BOUNDS_ATTR = "_libra_host_bounds"  # host sample boundaries cached on a foreign carrier
_LOCAL_BATCH_ATTR = "_libra_local_batch"  # ((tokens, device), VarlenBatch) of the pools-off path, per carrier


def host_sample_bounds(packed_seq_params, num_tokens: int) -> Optional[tuple]:
    """Sample boundaries (0, ..., num_tokens) of the local tokens as host ints, or None (one sample).

    Reads the carrier's host segments, a CPU ``cu_seqlens_q``, or (once per carrier, cached on it) a device
    ``cu_seqlens_q``. Raises ValueError when they do not rise from 0 to ``num_tokens``.
    """
    if packed_seq_params is None:
        return None
    segments = getattr(packed_seq_params, "libra_pool_segments", None)
    if segments is not None:
        seg = np.asarray(segments[int(getattr(packed_seq_params, "libra_position", 0))], dtype=np.int64)
        bounds = tuple(int(x) for x in np.concatenate([[0], np.cumsum(seg)]))
    elif getattr(packed_seq_params, _BOUNDS_ATTR, None) is not None:
        bounds = getattr(packed_seq_params, _BOUNDS_ATTR)
    else:
        cu = getattr(packed_seq_params, "cu_seqlens_q", None)
        if cu is None:
            return None
        bounds = tuple(int(x) for x in torch.as_tensor(cu).tolist())  # CPU: free; CUDA: once per carrier
        setattr(packed_seq_params, _BOUNDS_ATTR, bounds)
    if bounds[0] != 0 or bounds[-1] != num_tokens or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"cu_seqlens must rise from 0 to the local token count {num_tokens}, got {list(bounds)}")
    return bounds


def local_varlen_batch(bounds: Optional[tuple], num_tokens: int, device):
    """The ``VarlenBatch`` of the samples ``bounds`` (host offsets (0, ..., t), None: one sample of t tokens)."""
    from ..runtime.kernels import VarlenBatch  # lazy: keeps module import light

    bounds = (0, num_tokens) if bounds is None else bounds
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return VarlenBatch.from_lengths(lens, lens, device)


def local_causal_attention_thd(q, k, v, bounds: Optional[tuple], softmax_scale: float,
                               backend=KernelBackendName.AUTO, deterministic: bool = False,
                               batch=None) -> torch.Tensor:
    """Block-diagonal causal attention over packed samples through the runtime's varlen kernels.

    q (t, hq, d), k/v (t, hkv, d) (GQA never expanded), bounds: host sample offsets (0, ..., t) or None
    (one sample); ``batch``: their ``local_varlen_batch`` when the caller caches it. Returns (t, hq, d) in
    q's dtype. Cost O(sum_j l_j^2); no host read of device data.
    """
    from ..runtime.kernels import varlen_attn_func  # lazy: keeps module import light

    batch = local_varlen_batch(bounds, q.shape[0], q.device) if batch is None else batch
    return varlen_attn_func(q, k, v, batch, softmax_scale, backend, deterministic=deterministic)


def carrier_varlen_batch(packed_seq_params, num_tokens: int, device):
    """The pools-off varlen metadata of a carrier: built by its first layer, cached on it for every later one."""
    key = (num_tokens, str(device))
    cached = getattr(packed_seq_params, _LOCAL_BATCH_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    batch = local_varlen_batch(host_sample_bounds(packed_seq_params, num_tokens), num_tokens, device)
    if packed_seq_params is not None:
        setattr(packed_seq_params, _LOCAL_BATCH_ATTR, (key, batch))
    return batch


class LibraCoreAttention(MegatronModule):
    """Core attention executing Libra's TAP plan (§4.3) across the sequence pool, or plain attention.

    Constructor arguments mirror ``DotProductAttention`` (megatron-core 0.16.1) plus:
        pool_group      explicit pool process group (see module docstring for the lookup order)
        check_group     group the once-per-microbatch plan verification gathers over (default: the
                        groups module's gloo twin of the pool group when it is initialised, else the pool group)
        kernel_backend  ``KernelBackendName``, or None: the carrier's, else AUTO
        save_mode       ``SaveModeName`` arranged | refetch, or None: the carrier's, else arranged
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, *, pool_group=None, check_group=None,
                 kernel_backend: Optional[KernelBackendName] = None, save_mode: Optional[SaveModeName] = None):
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
        self.kernel_backend = None if kernel_backend is None else KernelBackendName(kernel_backend)
        self.save_mode = None if save_mode is None else SaveModeName(save_mode)
        if self.save_mode is SaveModeName.AUTO:
            raise ValueError("LibraCoreAttention(save_mode='auto'): auto is decided per plan by the planner and "
                             "travels on the carrier; pass arranged, refetch or None")
        self._pool_group = pool_group
        self._check_group = check_group
        # --deterministic-mode reaches the kernels' backward (flash-attn's deterministic=, see runtime.kernels)
        self.deterministic = bool(getattr(config, "deterministic_mode", False))

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

    def relay_group(self):
        """Group of a relaying plan's relay exchanges: the groups module's twin of the pool group when the pool group
        comes from there and it made one (``kv_relay: auto``), else None (the pool group itself)."""
        if self._pool_group is None and getattr(self.pg_collection, "libra_pool", None) is None:
            from . import groups

            return groups.get_pool_relay_group()
        return None

    def check_group(self):
        """Group of the plan verification: explicit, else the groups module's gloo twin (when the pool group
        comes from there), else the pool group itself."""
        if self._check_group is not None:
            return self._check_group
        if self._pool_group is None and getattr(self.pg_collection, "libra_pool", None) is None:
            from . import groups

            return groups.get_pool_check_group()
        return self.pool_group()

    # ------------------------------------------------------------------ knobs
    def _knob(self, packed_seq_params, attr: str, mine, kind, default):
        """The carrier's value of a knob, else the constructor's, else ``default``; a conflict is an error."""
        carried = getattr(packed_seq_params, attr, None)
        carried = None if carried is None else kind(carried)
        if carried is not None and mine is not None and carried is not mine:
            raise ValueError(f"LibraCoreAttention was built with {attr.replace('libra_', '')}={mine.value} but the "
                             f"batch carries {carried.value} (from the run's Libra config); drop one of them")
        return carried or mine or default

    def resolved_knobs(self, packed_seq_params) -> tuple:
        """(kernel backend, save mode) this module runs with for ``packed_seq_params``."""
        backend = self._knob(packed_seq_params, "libra_kernel_backend", self.kernel_backend, KernelBackendName,
                             KernelBackendName.AUTO)
        mode = self._knob(packed_seq_params, "libra_save_mode", self.save_mode, SaveModeName, SaveModeName.ARRANGED)
        return backend, mode

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
        if self.training and self.dropout_p > 0:
            raise ValueError(f"LibraCoreAttention runs attention without dropout (varlen kernels); set "
                             f"--attention-dropout 0 (got {self.dropout_p})")
        plan = getattr(packed_seq_params, "libra_plan", None)
        backend, mode = self.resolved_knobs(packed_seq_params)
        if plan is not None and plan.num_workers > 1:
            out = self._forward_plan(q, k, v, plan, packed_seq_params, backend, mode)
        else:
            out = self._forward_local(q, k, v, packed_seq_params, backend)
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

    def _forward_local(self, q, k, v, packed_seq_params, backend):
        """Plain per-sample causal attention on this rank's tokens (pools off, CP = 1)."""
        if self._cp_size() > 1:
            raise ValueError(
                f"LibraCoreAttention with context_parallel_size {self._cp_size()} > 1 needs a Libra plan "
                "(packed_seq_params.libra_plan); none was given"
            )
        if q.dim() == 4:  # (s, b, h, d), b > 1, no cu_seqlens: one causal sample per batch row
            s, b = q.shape[:2]
            flat = [x.transpose(0, 1).reshape(b * s, x.shape[2], x.shape[3]) for x in (q, k, v)]
            out = local_causal_attention_thd(*flat, tuple(range(0, b * s + 1, s)), self.softmax_scale, backend,
                                             self.deterministic)
            return out.reshape(b, s, -1).transpose(0, 1)
        batch = carrier_varlen_batch(packed_seq_params, q.shape[0], q.device)
        return local_causal_attention_thd(q, k, v, None, self.softmax_scale, backend, self.deterministic, batch=batch)

    def _forward_plan(self, q, k, v, plan, packed_seq_params, backend, mode):
        """Execute this rank's ``RankPlan`` with the runtime operator (Q dispatch, KV fetch, O return)."""
        if q.dim() != 3:
            raise ValueError(f"Libra plans need micro batch size 1 (sbhd b=1 or thd), got query {tuple(q.shape)}")
        # Shape/rank/fingerprint checks happen inside libra_attn_func on *every* rank (a check raised
        # here on one rank only would leave its peers waiting in the first collective).
        from ..runtime import libra_attn_func  # lazy: keeps module import light

        verify = getattr(packed_seq_params, _VERIFIED_ATTR, None) is not plan  # a fresh carrier or a new plan
        out = libra_attn_func(q, k, v, plan, self.pool_group(), softmax_scale=self.softmax_scale, backend=backend,
                              qkv_format="thd", save_mode=mode.value, verify=verify, check_group=self.check_group(),
                              deterministic=self.deterministic, relay_group=self.relay_group())
        setattr(packed_seq_params, _VERIFIED_ATTR, plan)
        return out
