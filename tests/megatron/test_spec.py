"""Spec helpers: swapping core attention in real megatron-core 0.16.1 GPT specs, and building models from them."""
from __future__ import annotations

import copy

import pytest

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from libra_megatron.megatron import spec as libra_spec
from libra_megatron.megatron.attention import LibraCoreAttention
from libra_megatron.megatron.spec import count_core_attention, libra_gpt_layer_spec, swap_core_attention

LOCAL_VARIANTS = [
    dict(),
    dict(qk_layernorm=True, normalization="RMSNorm"),
    dict(num_experts=4, qk_layernorm=True, normalization="RMSNorm"),
    dict(num_experts=4, moe_grouped_gemm=True),
]


@pytest.mark.parametrize("kwargs", LOCAL_VARIANTS, ids=lambda kw: ",".join(sorted(kw)) or "dense")
def test_swap_replaces_local_core_attention_and_keeps_the_input_spec(kwargs):
    base = get_gpt_layer_local_spec(**kwargs)
    before = copy.deepcopy(base)
    swapped = swap_core_attention(base)
    assert count_core_attention(swapped) == 1
    assert count_core_attention(base, DotProductAttention) == 1  # input untouched
    assert base.submodules.self_attention.submodules.core_attention is DotProductAttention
    assert repr(base) == repr(before)
    # everything else is the same spec: only core_attention differs
    sub, orig = swapped.submodules.self_attention.submodules, base.submodules.self_attention.submodules
    for name in ("linear_qkv", "linear_proj", "q_layernorm", "k_layernorm"):
        assert getattr(sub, name) is getattr(orig, name)
    assert repr(swapped.submodules.mlp) == repr(base.submodules.mlp)


def test_libra_gpt_layer_spec_binds_pool_group_and_backend_through_a_module_spec():
    group = object()
    swapped = libra_gpt_layer_spec(get_gpt_layer_local_spec(), pool_group=group, kernel_backend="torch")
    builder = swapped.submodules.self_attention.submodules.core_attention
    assert isinstance(builder, ModuleSpec) and builder.module is LibraCoreAttention
    assert builder.params["pool_group"] is group and builder.params["kernel_backend"].value == "torch"
    assert count_core_attention(swapped) == 1


def test_spec_without_core_attention_is_a_value_error():
    with pytest.raises(ValueError, match="no core_attention"):
        swap_core_attention(ModuleSpec(module=WrappedTorchNorm))


def test_multi_latent_attention_is_rejected_by_name():
    with pytest.raises(ValueError, match="multi-latent"):
        swap_core_attention(get_gpt_layer_local_spec(multi_latent_attention=True))


def test_module_level_specs_for_megatron_lm_dash_dash_spec_are_objects_not_functions():
    # Megatron-LM's import_module((MODULE, NAME)) returns vars(module)[NAME] uncalled.
    from megatron.core.transformer.spec_utils import import_module

    for name in ("libra_local_spec", "libra_local_qk_spec", "libra_local_moe_spec"):
        obj = import_module(("libra_megatron.megatron.spec", name))
        assert isinstance(obj, ModuleSpec) and count_core_attention(obj) == 1
    qk = libra_spec.libra_local_qk_spec.submodules.self_attention.submodules
    assert qk.q_layernorm is WrappedTorchNorm and qk.k_layernorm is WrappedTorchNorm


def _run_args(**overrides):
    """Megatron-LM's parsed flags as gpt_builder sees them (only the fields the spec reads)."""
    from types import SimpleNamespace

    base = dict(transformer_impl="local", num_experts=None, moe_grouped_gemm=False, moe_use_legacy_grouped_gemm=False,
                qk_layernorm=True, qk_l2_norm=False, normalization="RMSNorm", moe_layer_freq=1)
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_args_spec_honours_moe_grouped_gemm_on_the_local_backend(grouped):
    from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP

    spec = libra_spec.libra_gpt_spec_from_args(_run_args(num_experts=8, moe_grouped_gemm=grouped))
    assert spec.submodules.mlp.submodules.experts.module is (GroupedMLP if grouped else SequentialMLP)
    assert count_core_attention(spec) == 1
    attention = spec.submodules.self_attention.submodules
    assert attention.q_layernorm is WrappedTorchNorm and attention.k_layernorm is WrappedTorchNorm


def test_args_spec_follows_num_experts_and_qk_layernorm():
    dense = libra_spec.libra_gpt_spec_from_args(_run_args(qk_layernorm=False))
    assert "experts" not in repr(dense.submodules.mlp)
    assert dense.submodules.self_attention.submodules.q_layernorm is not WrappedTorchNorm
    assert count_core_attention(dense) == 1


def _recording_te_builder(calls):
    """A stand-in for get_gpt_layer_with_transformer_engine_spec with its real signature (calls bind to it)."""
    import inspect

    from megatron.core.models.gpt import gpt_layer_specs

    real = inspect.signature(gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec)

    def fake(*args, **kwargs):
        calls.append(real.bind(*args, **kwargs).arguments)
        return get_gpt_layer_local_spec(num_experts=kwargs.get("num_experts"), qk_layernorm=kwargs.get("qk_layernorm"))

    return fake


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_te_backend_gets_the_runs_moe_flags(grouped, monkeypatch):
    """The TE layer spec is requested with the run's --num-experts / --moe-grouped-gemm / --qk-layernorm."""
    import sys
    import types

    calls = []
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setattr("megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec",
                        _recording_te_builder(calls))
    args = _run_args(transformer_impl="local", num_experts=16, moe_grouped_gemm=grouped)
    spec = libra_spec.libra_gpt_spec_from_args(args, backend="transformer_engine")
    assert count_core_attention(spec) == 1
    assert [(c["num_experts"], c["moe_grouped_gemm"], c["qk_layernorm"]) for c in calls] == [(16, grouped, True)]


def test_spec_names_are_module_attributes_building_layers_from_the_run():
    """Megatron-LM's import_module reads vars(module)[NAME]; the backend of each name."""
    from megatron.core.transformer.spec_utils import import_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    backends = {name: import_module(("libra_megatron.megatron.spec", name)).module.backend
                for name in ("libra_gpt_spec", "libra_te_spec", "libra_te_moe_spec")}
    assert backends == {"libra_gpt_spec": None, "libra_te_spec": "transformer_engine",
                        "libra_te_moe_spec": "transformer_engine"}
    assert issubclass(libra_spec.libra_gpt_spec.module, TransformerLayer)  # what TransformerBlock requires


def test_args_specs_outside_a_megatron_lm_run_say_how_to_build_one(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "megatron.training", None)  # import fails as without Megatron-LM
    with pytest.raises(ValueError, match="libra_gpt_spec_from_args"):
        libra_spec.libra_gpt_spec.module(config=None, layer_number=1)


def test_te_backend_without_transformer_engine_is_an_import_error_naming_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    with pytest.raises(ImportError, match="transformer_engine.*--transformer-impl local"):
        libra_spec.libra_gpt_spec_from_args(_run_args(transformer_impl="transformer_engine"))


def test_mixed_dense_and_moe_layers_are_rejected_by_name():
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        libra_spec.libra_gpt_spec_from_args(_run_args(num_experts=8, moe_layer_freq=[1, 0]))


# ------------------------------------------------------------------ real models (one gloo rank)
def _fake_megatron_lm_args(**overrides):
    """In this worker process only: ``megatron.training.get_args()`` returns these flags (no Megatron-LM needed)."""
    import sys
    import types

    training = types.ModuleType("megatron.training")
    args = _run_args(**overrides)
    training.get_args = lambda: args
    sys.modules["megatron.training"] = training


def _build_models_on_rank(rank, world_size):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig

    from libra_megatron.testing.cpu_shims import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()
    ps.initialize_model_parallel(1, 1)
    common = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                  ffn_hidden_size=64, normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True,
                  activation_func=torch.nn.functional.silu, add_bias_linear=False, use_cpu_initialization=True,
                  bias_dropout_fusion=False, attention_dropout=0.0, hidden_dropout=0.0,
                  gradient_accumulation_fusion=False, apply_rope_fusion=False)
    dense = TransformerConfig(**common)
    moe = TransformerConfig(**common, num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="allgather",
                            moe_aux_loss_coeff=0.0)
    _fake_megatron_lm_args(transformer_impl="local", num_experts=4, moe_grouped_gemm=False)
    specs = {
        "dense_qk_module_level": (dense, libra_spec.libra_local_qk_spec),
        "moe_from_run_args": (moe, libra_spec.libra_gpt_spec),
        "moe_block_spec": (moe, swap_core_attention(get_gpt_decoder_block_spec(moe, use_transformer_engine=False,
                                                                               normalization="RMSNorm"))),
    }
    out = {}
    for name, (config, spec) in specs.items():
        torch.manual_seed(0)
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=32,
                         position_embedding_type="rope")
        kinds = [type(layer.self_attention.core_attention).__name__ for layer in model.decoder.layers]
        if name == "moe_from_run_args":
            kinds += [type(layer.mlp.experts).__name__ for layer in model.decoder.layers]
        tokens = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
        loss = model(tokens, torch.arange(24)[None], None, labels=tokens)
        loss.sum().backward()
        finite = all(torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None)
        out[name] = (kinds, loss.shape == (1, 24) and bool(torch.isfinite(loss).all()), finite)
    ps.destroy_model_parallel()
    return out


def test_swapped_specs_build_gpt_models_whose_core_attention_is_libra():
    from libra_megatron.testing.dist import run_distributed

    built = run_distributed(_build_models_on_rank, 1, timeout=300)[0]
    moe_kinds = built.pop("moe_from_run_args")
    assert moe_kinds[0] == ["LibraCoreAttention"] * 2 + ["SequentialMLP"] * 2 and all(moe_kinds[1:])
    for name, (kinds, loss_ok, grads_ok) in built.items():
        assert kinds == ["LibraCoreAttention", "LibraCoreAttention"], f"{name}: {kinds}"
        assert loss_ok and grads_ok, f"{name}: loss or gradients not finite"
