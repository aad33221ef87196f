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
which returns the module attribute itself, uncalled, when it builds the model -- after ``parse_args``):

    libra_gpt_spec           each layer is built from the run's flags when the model is built
                             (``libra_gpt_spec_from_args``): the layer Megatron-LM itself would build --
                             backend from --transformer-impl, MoE from --num-experts, grouped GEMM from
                             --moe-grouped-gemm, --qk-layernorm, --normalization -- with LibraCoreAttention.
                             What configs/*.args use.
    libra_te_spec,           the same with the Transformer Engine backend forced (older names; a missing TE is
    libra_te_moe_spec        an ImportError naming the package)
    libra_local_spec         local backend, dense, no qk-layernorm          (fixed objects, for tests and
    libra_local_qk_spec      local backend, dense, qk-layernorm (Qwen3)      megatron-core users)
    libra_local_moe_spec     local backend, MoE (SequentialMLP experts), qk-layernorm

e.g. ``pretrain_gpt.py --spec libra_megatron.megatron.spec libra_gpt_spec ...``.
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
    "spec_uses_libra_attention",
    "libra_gpt_spec_from_args",
    "libra_gpt_spec",
    "libra_te_spec",
    "libra_te_moe_spec",
    "libra_local_spec",
    "libra_local_qk_spec",
    "libra_local_moe_spec",
]

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
def _te_layer_spec(**kwargs):
    """``get_gpt_layer_with_transformer_engine_spec(**kwargs)``; ImportError naming the package without TE."""
    try:
        import transformer_engine  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken TE install fails the same way as a missing one
        raise ImportError(
            "libra_megatron.megatron.spec: --transformer-impl transformer_engine needs transformer_engine, which "
            f"failed to import ({type(exc).__name__}: {exc}); install it, or use --transformer-impl local"
        ) from exc
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(**kwargs)


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


def libra_gpt_spec_from_args(args, backend: Optional[str] = None) -> ModuleSpec:
    """The GPT layer spec Megatron-LM's ``gpt_builder`` builds for ``args``, with ``LibraCoreAttention``.

    Read from ``args`` (Megatron-LM's parsed flags): ``--transformer-impl`` (``backend`` overrides it),
    ``--num-experts``, ``--moe-grouped-gemm``, ``--moe-use-legacy-grouped-gemm``, ``--qk-layernorm``,
    ``--qk-l2-norm``, ``--normalization`` (local backend). Every layer gets the same spec, so a mixed
    dense/MoE ``--moe-layer-freq`` is rejected (ValueError) rather than silently built all-MoE.
    """
    impl = backend or getattr(args, "transformer_impl", "transformer_engine")
    num_experts = getattr(args, "num_experts", None) or None
    freq = getattr(args, "moe_layer_freq", 1)
    if num_experts and freq not in (1, None):
        raise ValueError(f"--moe-layer-freq {freq}: libra_gpt_spec builds one layer spec for every layer (all "
                         f"MoE); build a block spec and call swap_core_attention on it for mixed layers")
    common = dict(num_experts=num_experts, moe_grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)),
                  qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
                  qk_l2_norm=bool(getattr(args, "qk_l2_norm", False)))
    if getattr(args, "moe_use_legacy_grouped_gemm", False):  # core_v0.16 only: core_v0.19 has no such flag/kwarg
        common["moe_use_legacy_grouped_gemm"] = True
    if impl == "transformer_engine":
        return swap_core_attention(_te_layer_spec(**common))
    if impl == "local":
        return _local_spec(normalization=getattr(args, "normalization", "LayerNorm"), **common)
    raise ValueError(f"--transformer-impl {impl}: libra_gpt_spec supports 'transformer_engine' and 'local'")


def _megatron_lm_args():
    """The parsed flags of the running Megatron-LM program (``megatron.training.get_args()``)."""
    try:
        from megatron.training import get_args

        return get_args()
    except (ImportError, AssertionError) as exc:
        raise ValueError(
            "libra_megatron.megatron.spec: libra_gpt_spec / libra_te_spec / libra_te_moe_spec are built from "
            "Megatron-LM's parsed arguments when gpt_builder reads --spec; outside a Megatron-LM run call "
            f"libra_gpt_spec_from_args(args) ({type(exc).__name__}: {exc})"
        ) from exc


class _LayerFromRunArgs(TransformerLayer):
    """Layer class of ``libra_gpt_spec``: builds the layer that ``libra_gpt_spec_from_args`` gives for the
    running program's flags, at model-build time (``TransformerBlock`` calls it once per layer with the
    layer's config, number, process groups and vp stage). ``__new__`` returns that layer, a plain
    ``TransformerLayer`` (or MoE/TE variant), so this class never appears in a model."""

    backend: Optional[str] = None  # None: --transformer-impl decides

    def __new__(cls, *args, submodules=None, **kwargs):  # noqa: D102 - see the class docstring
        from megatron.core.transformer.spec_utils import build_module

        spec = libra_gpt_spec_from_args(_megatron_lm_args(), backend=cls.backend)
        return build_module(spec, *args, **kwargs)


class _TELayerFromRunArgs(_LayerFromRunArgs):
    backend = "transformer_engine"


def spec_uses_libra_attention(spec: Any) -> bool:
    """True when ``spec`` builds its layers with LibraCoreAttention: one of the specs built from the run's flags
    (``libra_gpt_spec``, ``libra_te_spec``: ``swap_core_attention`` puts it into every layer or raises), or a
    spec tree with LibraCoreAttention in some core_attention slot (start-up check of ``--spec``)."""
    module = getattr(spec, "module", None)
    if isinstance(module, type) and issubclass(module, _LayerFromRunArgs):
        return True
    return count_core_attention(spec) > 0


# Megatron-LM's import_module reads vars(module)[NAME], so these are real module attributes; what they build
# is decided when the model is built, after parse_args. libra_te_spec / libra_te_moe_spec: the older names
# (TE backend forced); both read --num-experts and --moe-grouped-gemm like libra_gpt_spec.
libra_gpt_spec = ModuleSpec(module=_LayerFromRunArgs)
libra_te_spec = ModuleSpec(module=_TELayerFromRunArgs)
libra_te_moe_spec = libra_te_spec

_MOE_SPEC_EXPERTS = 8  # the spec only needs "MoE or not"; the expert count comes from the config
libra_local_spec = _local_spec()
libra_local_qk_spec = _local_spec(qk_layernorm=True, normalization="RMSNorm")
libra_local_moe_spec = _local_spec(num_experts=_MOE_SPEC_EXPERTS, qk_layernorm=True, normalization="RMSNorm")
