"""LibraCoreAttention against independent fp64 references (dense block-causal masks, autograd).

Cheapest layer first: the pools-off path in-process (THD and sbhd, GQA, hypothesis over segments), then a
real multi-rank plan on gloo (P=2 x CP=2 and P=4 x CP=1) executed through the megatron module.
"""
from __future__ import annotations

import inspect
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from libra_megatron.megatron.attention import LibraCoreAttention
from libra_megatron.testing.reference import reference_forward_backward

HEAD_SHAPES = [(4, 4), (4, 2), (8, 2), (4, 1)]  # (hq, hkv): MHA, GQA 2/4, MQA


def _config(hq: int, hkv: int, d: int, cp: int = 1) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=hq * d, num_attention_heads=hq, num_query_groups=hkv,
                             kv_channels=d, attention_dropout=0.0, use_cpu_initialization=True,
                             context_parallel_size=cp)


def _module(cfg: TransformerConfig, **extra) -> LibraCoreAttention:
    # Exactly the keyword set megatron-core 0.16.1's Attention.__init__ passes to core_attention(...).
    return LibraCoreAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                              cp_comm_type=None, softmax_scale=None, pg_collection=None, **extra)


def _cu(segments) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(segments)]), dtype=torch.int32)


def _qkv(t: int, hq: int, hkv: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, d, generator=gen, dtype=torch.float32) for h in (hq, hkv, hkv))


def _run_and_grads(module, q, k, v, dout, **fwd):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = module(*leaves, None, attn_mask_type=AttnMaskType.causal, attention_bias=None, **fwd)
    out.backward(dout.reshape(out.shape))
    return out.detach(), [x.grad for x in leaves]


def _assert_close_to_reference(out, grads, q, k, v, dout, segments):
    ref_out, *ref_grads = reference_forward_backward(q, k, v, dout, segments)
    t, hq, d = q.shape
    torch.testing.assert_close(out.reshape(t, hq, d).double(), ref_out, atol=2e-5, rtol=2e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=5e-5, rtol=5e-5)


@settings(max_examples=15, deadline=None)
@given(segments=st.lists(st.integers(1, 40), min_size=1, max_size=6), heads=st.sampled_from(HEAD_SHAPES),
       seed=st.integers(0, 10_000))
def test_thd_pools_off_matches_fp64_reference_with_gqa(segments, heads, seed):
    hq, hkv = heads
    d, t = 8, sum(segments)
    q, k, v = _qkv(t, hq, hkv, d, seed)
    dout = torch.randn(t, hq, d, generator=torch.Generator().manual_seed(seed + 1))
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu(segments), cu_seqlens_kv=_cu(segments))
    out, grads = _run_and_grads(_module(_config(hq, hkv, d)), q, k, v, dout, packed_seq_params=psp)
    assert out.shape == (t, hq * d)
    _assert_close_to_reference(out, grads, q, k, v, dout, segments)


@pytest.mark.parametrize("hq,hkv", HEAD_SHAPES)
def test_sbhd_with_cu_seqlens_matches_fp64_reference(hq, hkv):
    d, segments = 16, [7, 1, 20, 4]
    t = sum(segments)
    q, k, v = _qkv(t, hq, hkv, d, seed=hq * 10 + hkv)
    dout = torch.randn(t, hq, d)
    psp = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=_cu(segments), max_seqlen_q=t, max_seqlen_kv=t)
    module = _module(_config(hq, hkv, d))
    leaves = [x.unsqueeze(1).clone().requires_grad_(True) for x in (q, k, v)]  # (s, b=1, h, d)
    out = module(*leaves, None, attn_mask_type=AttnMaskType.causal, attention_bias=None, packed_seq_params=psp)
    assert out.shape == (t, 1, hq * d)
    out.backward(dout.reshape(t, 1, hq * d))
    _assert_close_to_reference(out, [x.grad.squeeze(1) for x in leaves], q, k, v, dout, segments)


def test_sbhd_batch_without_packed_params_is_one_causal_sample_per_row():
    hq, hkv, d, s, b = 4, 2, 8, 13, 3
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, b, h, d, generator=gen) for h in (hq, hkv, hkv))
    out = _module(_config(hq, hkv, d))(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    assert out.shape == (s, b, hq * d)
    for row in range(b):
        want = reference_forward_backward(q[:, row], k[:, row], v[:, row], torch.zeros(s, hq, d), [s])[0]
        torch.testing.assert_close(out[:, row].reshape(s, hq, d).double(), want, atol=2e-5, rtol=2e-5)


def test_constructor_accepts_every_argument_of_megatron_dot_product_attention():
    theirs = set(inspect.signature(DotProductAttention.__init__).parameters) - {"self"}
    ours = set(inspect.signature(LibraCoreAttention.__init__).parameters)
    assert theirs <= ours, f"missing: {sorted(theirs - ours)}"


def test_context_parallel_without_plan_is_a_value_error():
    hq, hkv, d, t = 4, 2, 8, 16
    q, k, v = _qkv(t, hq, hkv, d, seed=0)
    module = _module(_config(hq, hkv, d, cp=2))
    with pytest.raises(ValueError, match="context_parallel_size 2 > 1 needs a Libra plan"):
        module(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu([t])))


def test_non_causal_mask_and_attention_bias_are_rejected():
    q, k, v = _qkv(8, 4, 2, 8, seed=1)
    module = _module(_config(4, 2, 8))
    with pytest.raises(ValueError, match="causal"):
        module(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), None, attn_mask_type=AttnMaskType.no_mask)
    with pytest.raises(ValueError, match="attention_bias"):
        module(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), None, attention_bias=torch.zeros(1))


def test_pool_group_lookup_order_explicit_then_pg_collection_then_groups_module():
    cfg = _config(4, 2, 8)
    explicit, carried = object(), object()
    pgc = types.SimpleNamespace(libra_pool=carried, cp=None)
    assert _module(cfg, pool_group=explicit).pool_group() is explicit
    mod = LibraCoreAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=pgc)
    assert mod.pool_group() is carried
    mod.set_pool_group(explicit)
    assert mod.pool_group() is explicit
    with pytest.raises(RuntimeError, match="initialize_pool_groups"):
        _module(cfg).pool_group()  # groups module not initialised in this process


# ================================================================ multi-rank plan (gloo)
CASES = [  # (P, CP, layout, H, M, hq, hkv, block): migration across pools and inside a CP group
    dict(P=2, cp=2, layout="zigzag", H=2, M=2, hq=4, hkv=2, block=8, L=48, fmt="thd"),
    dict(P=4, cp=1, layout="contiguous", H=4, M=1, hq=8, hkv=2, block=6, L=40, fmt="sbhd"),
]


def _pool_segments(case, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(case["P"]):
        cuts = np.sort(rng.choice(np.arange(1, case["L"]), size=int(rng.integers(0, 4)), replace=False))
        out.append(np.diff(np.concatenate([[0], cuts, [case["L"]]])).tolist())
    out[0] = [case["L"]]  # one sample spanning every shard of its sequence
    return out


def _plan_case_on_rank(rank, world_size, case, seed):
    import torch.distributed as dist

    from libra_megatron.config import LibraConfig
    from libra_megatron.plan.layout import HeadLayout, TokenLayout
    from libra_megatron.plan.pool import plan_pool
    from libra_megatron.testing.reference import shard_tokens

    d = 8
    cfg = LibraConfig(pool_size=case["P"], head_split=case["H"], num_chunks=case["M"], block_size=case["block"],
                      token_layout=case["layout"], kernel_backend="torch")
    layout = TokenLayout(case["layout"], case["L"], case["cp"])
    heads = HeadLayout(case["hq"], case["hkv"], d, case["H"], case["M"], elem_bytes=4)
    segs = _pool_segments(case, seed)
    pool = plan_pool(segs, cfg, layout, heads)
    p, c = divmod(rank, case["cp"])
    gen = torch.Generator().manual_seed(seed * 100 + p)  # sequence p's tensors, same on all its CP ranks
    full = [torch.randn(case["L"], h, d, generator=gen) for h in (case["hq"], case["hkv"], case["hkv"], case["hq"])]
    q, k, v, dout = (shard_tokens(x, layout, c) for x in full)
    module = _module(_config(case["hq"], case["hkv"], d, cp=case["cp"]), pool_group=dist.group.WORLD)
    carrier = PackedSeqParams(qkv_format=case["fmt"])
    carrier.libra_plan = pool.exchange.for_rank(rank)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    inputs = leaves if case["fmt"] == "thd" else [x.unsqueeze(1) for x in leaves]
    out = module(*inputs, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=carrier)
    out.backward(dout.reshape(out.shape))
    ref = reference_forward_backward(*full[:3], full[3], segs[p])
    errors = [(out.reshape(q.shape).double() - shard_tokens(ref[0], layout, c)).abs().max().item()]
    errors += [(x.grad.double() - shard_tokens(g, layout, c)).abs().max().item() for x, g in zip(leaves, ref[1:])]
    migrated = int((pool.placement.assignment != pool.tiles.tile_home()).sum())
    return errors, migrated


def _run_cases_on_rank(rank, world_size, seed):
    return [_plan_case_on_rank(rank, world_size, case, seed) for case in CASES]


def test_multi_rank_plan_through_the_module_matches_fp64_reference():
    from libra_megatron.testing.dist import run_distributed

    per_rank = run_distributed(_run_cases_on_rank, 4, 5, timeout=300)
    for i, case in enumerate(CASES):
        migrated = per_rank[0][i][1]
        assert migrated > 0, f"case {case}: Algorithm 2 moved no tile, the test would not exercise migration"
        for rank, results in enumerate(per_rank):
            out_err, *grad_err = results[i][0]
            assert out_err < 3e-5, f"case {i} rank {rank}: output error {out_err}"
            assert max(grad_err) < 1e-4, f"case {i} rank {rank}: dq/dk/dv errors {grad_err}"


def test_pools_off_builds_its_varlen_metadata_once_per_carrier(monkeypatch):
    """Every layer of a microbatch shares one carrier: its varlen metadata (numpy offsets, pinned copies) is
    built by the first layer only; a new carrier builds its own."""
    from libra_megatron.runtime.kernels import VarlenBatch

    built = []
    original = VarlenBatch.from_lengths

    def counted(q_lens, k_lens, device):
        built.append(list(q_lens))
        return original(q_lens, k_lens, device)

    monkeypatch.setattr(VarlenBatch, "from_lengths", staticmethod(counted))
    hq, hkv, d, segments = 4, 2, 8, [5, 9, 2]
    t = sum(segments)
    q, k, v = _qkv(t, hq, hkv, d, seed=5)
    dout = torch.randn(t, hq, d, generator=torch.Generator().manual_seed(6))
    layers = [_module(_config(hq, hkv, d)) for _ in range(3)]
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu(segments), cu_seqlens_kv=_cu(segments))
    for layer in layers:
        out, grads = _run_and_grads(layer, q, k, v, dout, packed_seq_params=psp)
        _assert_close_to_reference(out, grads, q, k, v, dout, segments)
    assert built == [segments]
    _run_and_grads(layers[0], q, k, v, dout, packed_seq_params=PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=_cu(segments), cu_seqlens_kv=_cu(segments)))
    assert built == [segments, segments]


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_mode_of_the_config_reaches_the_backward_kernel(monkeypatch, deterministic):
    """TransformerConfig.deterministic_mode (Megatron-LM's --deterministic-mode) -> LibraCoreAttention -> the
    backend's backward, recorded at the kernel table."""
    import dataclasses

    from libra_megatron.config import KernelBackendName
    from libra_megatron.runtime import kernels

    seen, exact = [], kernels._BACKENDS[KernelBackendName.TORCH]

    def recording(*args, deterministic=False):
        seen.append(deterministic)
        return exact.raw_bwd(*args, deterministic=deterministic)

    monkeypatch.setitem(kernels._BACKENDS, KernelBackendName.TORCH, dataclasses.replace(exact, raw_bwd=recording))
    cfg = _config(4, 2, 8)
    cfg.deterministic_mode = deterministic
    segments = [6, 10]
    q, k, v = _qkv(16, 4, 2, 8, seed=8)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu(segments), cu_seqlens_kv=_cu(segments))
    _run_and_grads(_module(cfg, kernel_backend="torch"), q, k, v, torch.ones(16, 4, 8), packed_seq_params=psp)
    assert seen == [deterministic]
