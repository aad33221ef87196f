"""Knobs reach what runs: kernel_backend / save_mode from YAML + flags through the Libra batch path into the
LibraCoreAttention call; --libra-packing refused in Megatron runs; the planner materialises this worker's plan."""
from __future__ import annotations

import argparse
import os

import numpy as np
import pytest
import torch
import yaml

from libra_megatron.config import LibraConfig, SaveModeName
from libra_megatron.megatron.args import add_libra_args, libra_config_from_args
from libra_megatron.testing.dist import run_distributed

HQ, HKV, D, L = 4, 2, 8, 32
POOL = [[12, 20], [5, 9, 18]]  # the P=2 packed sequences of the pool


def _args(tmp_yaml: str, *flags: str) -> argparse.Namespace:
    args = add_libra_args(argparse.ArgumentParser()).parse_args(["--libra-config", tmp_yaml, *flags])
    for key, value in dict(num_attention_heads=HQ, num_query_groups=HKV, group_query_attention=True,
                           data_parallel_size=2, context_parallel_size=1, seq_length=L, micro_batch_size=1,
                           global_batch_size=4).items():
        setattr(args, key, value)
    return args


def _yaml(tmp_path, name: str, mapping: dict) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"libra": mapping}))
    return str(path)


YAMLS = {  # name: (YAML keys, save mode that must run)
    "refetch": (dict(save_mode="refetch", kernel_backend="torch"), "refetch"),
    "arranged": (dict(save_mode="arranged", kernel_backend="torch"), "arranged"),
    "auto_small_budget": (dict(save_mode="auto", activation_budget_gb=0.0, kernel_backend="torch"), "refetch"),
    "auto_big_budget": (dict(save_mode="auto", activation_budget_gb=1000.0, kernel_backend="torch"), "arranged"),
}
BASE = dict(pool_size=2, head_split=2, num_chunks=2, block_size=8, token_layout="contiguous")


def _run_module_from_yaml(rank: int, world_size: int, config_dicts: dict) -> dict:
    """Per rank: YAML -> LibraConfig -> planner -> LibraHooks._assemble (the real batch path) ->
    LibraCoreAttention fwd+bwd, with libra_attn_func spied and saved tensors measured."""
    import torch.distributed as dist
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    import libra_megatron.runtime as runtime
    from libra_megatron.megatron.attention import LibraCoreAttention
    from libra_megatron.megatron.hooks import LibraHooks
    from libra_megatron.megatron.planner import BackgroundPlanner
    from libra_megatron.plan.layout import HeadLayout, TokenLayout
    from libra_megatron.plan.model import saved_bytes_per_rank

    seen = []
    original = runtime.libra_attn_func

    def spy(*args, **kwargs):
        seen.append({k: getattr(v, "value", v) for k, v in kwargs.items() if k in ("backend", "save_mode", "verify")})
        return original(*args, **kwargs)

    runtime.libra_attn_func = spy
    out = {}
    for name, config in config_dicts.items():
        layout, heads = TokenLayout(config.token_layout, L, 1), HeadLayout(HQ, HKV, D, 2, 2, elem_bytes=4)
        hooks = LibraHooks()
        hooks.config, hooks.qkv_format = config, "thd"
        hooks.planner = BackgroundPlanner(config, layout, heads, worker=rank, num_layers=1, mode="thread")
        sample = {key: torch.arange(L) for key in ("tokens", "labels", "loss_mask")}
        carrier = hooks._assemble(sample, [np.asarray(s) for s in POOL], rank, 1, 0)[-1]
        planned = hooks.planner.get_pool(POOL)
        hooks.planner.close()
        cfg = TransformerConfig(num_layers=1, hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=HKV,
                                kv_channels=D, attention_dropout=0.0, use_cpu_initialization=True)
        module = LibraCoreAttention(cfg, 1, AttnMaskType.causal, "self", pool_group=dist.group.WORLD)
        gen = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(L, h, D, generator=gen).requires_grad_(True) for h in (HQ, HKV, HKV))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            result = module(q, k, v, None, packed_seq_params=carrier)
        result.sum().backward()
        first_call = seen[-1]
        module(q, k, v, None, packed_seq_params=carrier)  # a second layer of the same microbatch
        predicted = {m: int(saved_bytes_per_rank(planned.pool_plan.exchange, heads, L, m)[rank])
                     for m in ("arranged", "refetch")}
        out[name] = dict(call=first_call, second_verify=seen[-1]["verify"], carrier=(carrier.libra_kernel_backend, carrier.libra_save_mode),
                         saved=sum(saved), predicted=predicted)
    runtime.libra_attn_func = original
    return out


def test_kernel_backend_and_save_mode_from_yaml_reach_the_attention_call(tmp_path):
    configs = {name: libra_config_from_args(_args(_yaml(tmp_path, name, dict(BASE, **keys))))
               for name, (keys, _) in YAMLS.items()}
    per_rank = run_distributed(_run_module_from_yaml, 2, configs, timeout=240)
    for name, (_, mode) in YAMLS.items():
        for rank, result in enumerate(per_rank):
            r = result[name]
            assert r["carrier"] == ("torch", mode), (name, rank, r)
            assert r["call"] == {"backend": "torch", "save_mode": mode, "verify": True}, (name, rank, r)
            assert r["second_verify"] is False  # one verification per microbatch, not per layer
            assert r["saved"] == r["predicted"][mode], (name, rank, r)  # what ran kept what that mode keeps


def test_flags_override_the_yaml_knobs(tmp_path):
    path = _yaml(tmp_path, "base", dict(BASE, save_mode="arranged", kernel_backend="torch"))
    config = libra_config_from_args(_args(path, "--libra-save-mode", "refetch", "--libra-kernel-backend", "auto",
                                          "--libra-activation-budget-gb", "2.5"))
    assert config.save_mode is SaveModeName.REFETCH and config.kernel_backend.value == "auto"
    assert config.activation_budget_gb == 2.5


@pytest.mark.parametrize("source", ["yaml", "flag"])
def test_packing_other_than_megatron_is_refused_in_megatron_runs(tmp_path, source):
    keys = dict(BASE, packing="best_fit") if source == "yaml" else dict(BASE)
    flags = ["--libra-packing", "best_fit"] if source == "flag" else []
    named = r"packing \(.*p\.yaml:\d+\)" if source == "yaml" else r"--libra-packing \(packing\)"
    with pytest.raises(ValueError, match=named + r" = best_fit has no effect in Megatron-LM"):
        libra_config_from_args(_args(_yaml(tmp_path, "p", keys), *flags))
    assert libra_config_from_args(_args(_yaml(tmp_path, "m", dict(BASE, packing="megatron")))).packing.value == "megatron"


def test_module_built_with_a_knob_the_carrier_contradicts_is_an_error():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from libra_megatron.megatron.attention import LibraCoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=HKV,
                            kv_channels=D, attention_dropout=0.0, use_cpu_initialization=True)
    module = LibraCoreAttention(cfg, 1, AttnMaskType.causal, "self", kernel_backend="flash")
    carrier = PackedSeqParams(qkv_format="thd")
    carrier.libra_kernel_backend = "torch"
    with pytest.raises(ValueError, match=r"built with kernel_backend=flash but the batch carries torch"):
        module.resolved_knobs(carrier)
    assert LibraCoreAttention(cfg, 1, AttnMaskType.causal, "self").resolved_knobs(carrier)[0].value == "torch"


def test_pools_off_path_reads_sample_bounds_from_host_segments_not_the_device_tensor():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from libra_megatron.megatron.attention import LibraCoreAttention
    from libra_megatron.megatron.batch import LibraPackedSeqParams
    from libra_megatron.testing.reference import reference_attention

    cfg = TransformerConfig(num_layers=1, hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=HKV,
                            kv_channels=D, attention_dropout=0.0, use_cpu_initialization=True)
    module = LibraCoreAttention(cfg, 1, AttnMaskType.causal, "self")
    meta_cu = torch.empty(3, dtype=torch.int32, device="meta")  # reading it would fail
    carrier = LibraPackedSeqParams(qkv_format="thd", cu_seqlens_q=meta_cu, cu_seqlens_kv=meta_cu,
                                   libra_pool_segments=[np.array([12, 20])], libra_position=0)
    q, k, v = (torch.randn(L, h, D, dtype=torch.float64) for h in (HQ, HKV, HKV))
    out = module(q, k, v, None, packed_seq_params=carrier)
    torch.testing.assert_close(out.reshape(L, HQ, D), reference_attention(q, k, v, [12, 20]))


def test_ulysses_refuses_device_cu_seqlens():
    from libra_megatron.runtime.ulysses import _host_bounds

    with pytest.raises(ValueError, match="needs host cu_seqlens"):
        _host_bounds(torch.zeros(3, dtype=torch.int32, device="meta"))
    assert _host_bounds(torch.tensor([0, 3, 8])) == (0, 3, 8)


def test_planner_from_args_materialises_this_workers_plan_and_tables_in_its_thread(monkeypatch):
    from libra_megatron.megatron import groups
    from libra_megatron.megatron.planner_setup import build_planner_from_args
    from libra_megatron.plan.exchange import runtime_tables as rank_tables

    monkeypatch.setattr(groups, "pool_groups_initialized", lambda: True)
    monkeypatch.setattr(groups, "get_pool_rank", lambda: 1)
    monkeypatch.setattr(groups, "get_pool_ranks", lambda: [7, 8])  # a pool straddling two 8-GPU nodes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = argparse.Namespace(context_parallel_size=1, tensor_model_parallel_size=1, num_attention_heads=HQ,
                              num_query_groups=HKV, group_query_attention=True, kv_channels=D, hidden_size=HQ * D,
                              bf16=True, seq_length=L, data_parallel_size=2, global_batch_size=4,
                              micro_batch_size=1, pipeline_model_parallel_size=2, num_layers=6)
    config = LibraConfig(**dict(BASE, token_layout="zigzag"))
    with build_planner_from_args(config, args) as planner:
        assert planner._worker == 1 and planner._num_layers == 3
        assert planner._timing.nodes(2).tolist() == [0, 1]  # ranks 7, 8 // LOCAL_WORLD_SIZE 8
        planned = planner.get_pool(POOL)
        assert planned.pool_plan.exchange.local_lead is not None  # every rank's Pipeliner lead, chosen on its nodes
        assert planned.rank_ready_s is not None and planned.rank_ready_s >= planned.queued_s
        assert planned.pool_plan.exchange.for_rank(1) in rank_tables._CACHE  # built by the thread
        assert planned.save_mode is SaveModeName.ARRANGED  # tiny plan, 16 GiB default budget
        assert set(planned.saved_bytes) == {"arranged", "refetch"}


@pytest.mark.parametrize("recompute, want", [((None, None, None), 24), (("full", "uniform", 1), 1),
                                              (("full", "uniform", 2), 2), (("full", "block", 4), 21),
                                              (("selective", None, None), 24)])
def test_planner_budgets_the_layers_whose_tensors_are_alive_at_once(monkeypatch, recompute, want):
    """save_mode=auto's budget covers the stage's layers (48 / PP 2) only without full recompute; the shipped
    configs recompute one layer at a time, so one layer's tensors are alive (issue 24)."""
    from libra_megatron.megatron import planner_setup as planner_module

    seen = {}
    monkeypatch.setattr(planner_module, "BackgroundPlanner", lambda *a, **kw: seen.update(kw) or kw)
    monkeypatch.setenv("LIBRA_PLAN_SHARE_DIR", "off")  # no planner process starts to remove a plan directory
    granularity, method, n = recompute
    args = argparse.Namespace(context_parallel_size=1, tensor_model_parallel_size=1, num_attention_heads=HQ,
                              num_query_groups=HKV, group_query_attention=True, kv_channels=D, hidden_size=HQ * D,
                              bf16=True, seq_length=L, data_parallel_size=2, global_batch_size=4, micro_batch_size=1,
                              pipeline_model_parallel_size=2, num_layers=48, recompute_granularity=granularity,
                              recompute_method=method, recompute_num_layers=n)
    planner_module.build_planner_from_args(LibraConfig(**dict(BASE, token_layout="zigzag")), args)
    assert seen["num_layers"] == want


def test_an_unusable_plan_share_dir_is_refused_at_start_up(monkeypatch, tmp_path):
    """Issue 25: LIBRA_PLAN_SHARE_DIR names a plain file: one ValueError naming the variable, before any planner
    process starts (which would otherwise die and fail only the first get)."""
    from libra_megatron.megatron import planner_setup

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("LIBRA_PLAN_SHARE_DIR", str(blocker))
    with pytest.raises(ValueError, match=r"^LIBRA_PLAN_SHARE_DIR='.*not-a-dir': cannot create the run's plan "
                                         r"directory .*not-a-dir/libra-plans-\w+ \(Not a directory\)"):
        planner_setup._share_dir()
    monkeypatch.setenv("LIBRA_PLAN_SHARE_DIR", "off")
    assert planner_setup._share_dir() is None
    monkeypatch.setenv("LIBRA_PLAN_SHARE_DIR", str(tmp_path / "plan-share"))
    made = planner_setup._share_dir()
    assert os.path.isdir(made) and os.path.dirname(made) == str(tmp_path / "plan-share")
