"""Layer-spec helpers that put ``LibraCoreAttention`` into megatron-core GPT specs.

For megatron-core users::

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = libra_gpt_layer_spec(get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"))
    model = GPTModel(config, transformer_layer_spec=spec, ...)

``swap_core_attention`` walks any spec tree -- a layer ``ModuleSpec`` (TE or local backend, dense or
MoE, with or without qk-layernorm), a ``TransformerBlockSubmodules`` with ``layer_specs`` (e.g. from
``get_gpt_decoder_block_spec``), or a block ``ModuleSpec`` -- and replaces every self-attention
``core_attention`` builder. The input spec is not modified (a deep copy is returned).

For Megatron-LM's ``--spec MODULE NAME`` (``gpt_builders.py`` does ``import_module((MODULE, NAME))``,
which returns the module attribute itself, uncalled), this module defines spec *objects*:

    libra_local_spec         local backend, dense, no qk-layernorm
    libra_local_qk_spec      local backend, dense, qk-layernorm (Qwen3)
    libra_local_moe_spec     local backend, MoE (SequentialMLP experts), qk-layernorm
    libra_te_spec            Transformer Engine backend, dense, qk-layernorm (Qwen3)
    libra_te_moe_spec        Transformer Engine backend, MoE, qk-layernorm

e.g. ``pretrain_gpt.py --spec libra_megatron.megatron.spec libra_te_spec ...``. The TE specs are built
only when Transformer Engine imports; otherwise they are placeholder layer specs whose construction
raises ``ImportError`` naming the missing package (so ``--spec`` fails clearly, not with a None).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..config import KernelBackendName
from .attention import LibraCoreAttention

__all__ = [
    "swap_core_attention",
    "libra_gpt_layer_spec",
    "libra_core_attention_builder",
    "count_core_attention",
    "libra_local_spec",
    "libra_local_qk_spec",
    "libra_local_moe_spec",
    "libra_te_spec",
    "libra_te_moe_spec",
]

_MOE_SPEC_EXPERTS = 8  # the spec only needs "MoE or not"; the expert count comes from the config


def libra_core_attention_builder(pool_group=None, kernel_backend: Optional[KernelBackendName] = None):
    """A ``CoreAttentionBuilder`` for LibraCoreAttention: the class, or a ModuleSpec binding extra kwargs."""
    params = {}
    if pool_group is not None:
        params["pool_group"] = pool_group
    if kernel_backend is not None:
        params["kernel_backend"] = KernelBackendName(kernel_backend)
    return ModuleSpec(module=LibraCoreAttention, params=params) if params else LibraCoreAttention


def _walk(node: Any, visit, seen: set) -> int:
    """Depth-first over ModuleSpec / dataclass submodules / lists; ``visit(holder)`` on core_attention holders."""
    if node is None or isinstance(node, type) or id(node) in seen:
        return 0
    seen.add(id(node))
    if isinstance(node, ModuleSpec):
        return _walk(node.submodules, visit, seen)
    if isinstance(node, (list, tuple)):
        return sum(_walk(item, visit, seen) for item in node)
    if not dataclasses.is_dataclass(node):
        return 0
    found = 0
    for f in dataclasses.fields(node):
        if f.name == "core_attention":
            visit(node)
            found += 1
        else:
            found += _walk(getattr(node, f.name), visit, seen)
    return found


def _replace(builder):
    def visit(holder) -> None:
        if "MLA" in type(holder).__name__:
            raise ValueError(
                f"swap_core_attention: multi-latent attention ({type(holder).__name__}) is not supported by "
                "Libra (its Q/K and V head dims differ); use a standard SelfAttention spec"
            )
        holder.core_attention = builder

    return visit


def swap_core_attention(spec, core_attention=None):
    """Deep copy of ``spec`` with every self-attention ``core_attention`` replaced.

    ``core_attention`` defaults to ``LibraCoreAttention``. Raises ValueError when the spec has no
    core attention to replace (e.g. a non-attention spec) or uses multi-latent attention.
    """
    builder = LibraCoreAttention if core_attention is None else core_attention
    out = copy.deepcopy(spec)
    if _walk(out, _replace(builder), set()) == 0:
        raise ValueError(f"swap_core_attention: no core_attention found in spec of type {type(spec).__name__}")
    return out


def libra_gpt_layer_spec(base_spec, *, pool_group=None, kernel_backend: Optional[KernelBackendName] = None):
    """``base_spec`` (any GPT layer/block spec) with LibraCoreAttention; optional builder kwargs bound."""
    return swap_core_attention(base_spec, libra_core_attention_builder(pool_group, kernel_backend))


def count_core_attention(spec, builder=LibraCoreAttention) -> int:
    """How many core_attention slots of ``spec`` hold ``builder`` (class, or ModuleSpec of that class)."""
    hits = []

    def visit(holder) -> None:
        value = holder.core_attention
        module = value.module if isinstance(value, ModuleSpec) else value
        hits.append(module is builder)

    _walk(spec, visit, set())
    return sum(hits)


# ---------------------------------------------------------------- Megatron-LM --spec objects
class _TransformerEngineMissingLayer(TransformerLayer):
    """Placeholder layer of the TE specs when Transformer Engine is not importable."""

    def __init__(self, *args, **kwargs):  # noqa: D401 - raising constructor
        raise ImportError(
            "libra_megatron.megatron.spec: libra_te_spec / libra_te_moe_spec need transformer_engine, "
            f"which failed to import ({_TE_ERROR}); use libra_local_qk_spec or install Transformer Engine"
        )


_TE_ERROR = ""


def _te_spec(num_experts: Optional[int]):
    global _TE_ERROR
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return swap_core_attention(get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, qk_layernorm=True))
    except Exception as exc:  # noqa: BLE001 - any TE import/build failure makes the spec a placeholder
        _TE_ERROR = f"{type(exc).__name__}: {exc}"
        return ModuleSpec(module=_TransformerEngineMissingLayer)


def _local_spec(**kwargs):
    """Local-backend spec with Libra attention. megatron-core's ``LocalSpecProvider.layer_norm(rms_norm=True)``
    rewrites the module global ``backends.LNImpl``; it is restored so importing this module has no side effect."""
    from megatron.core.models import backends

    saved = getattr(backends, "LNImpl", None)
    try:
        return swap_core_attention(get_gpt_layer_local_spec(**kwargs))
    finally:
        if saved is not None:
            backends.LNImpl = saved


libra_local_spec = _local_spec()
libra_local_qk_spec = _local_spec(qk_layernorm=True, normalization="RMSNorm")
libra_local_moe_spec = _local_spec(num_experts=_MOE_SPEC_EXPERTS, qk_layernorm=True, normalization="RMSNorm")
libra_te_spec = _te_spec(None)
libra_te_moe_spec = _te_spec(_MOE_SPEC_EXPERTS)
