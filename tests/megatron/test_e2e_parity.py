"""End-to-end loss parity on CPU gloo: Libra (VRSP sampler + pools + TAP plans through LibraCoreAttention)
versus the plain run (Megatron sampler order, per-sample attention, no plans) of the same tiny Qwen3-shaped
megatron-core GPTModel on the same GPTDataset windows.

One 4-rank job trains four configs in turn; the reference is DP=4, CP=1 without Libra (local SDPA per
sample, no exchange), an independent path for every Libra config -- including DP=2 x CP=2, which sees the
same GBS = 8 windows, and P=4 with the ranks priced as two nodes of two and the K/V relay on (its relay
exchanges on the groups module's twin of the pool group). Loss is the per-token average over the global batch, so reordering cannot change it.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from libra_megatron.testing.train_cpu import PARITY_RTOL, RunConfig, compare_runs, prepare_data, run_training

STEPS = 10
BASE = RunConfig(dp=4, cp=1, pool_size=2, steps=STEPS, seq_len=256, grad_accum=2, libra=False, data="trace",
                 tokens="synthetic", max_docs=3000, vocab=512, head_split=2, num_chunks=2, block_size=32)
LIBRA = {
    "dp4_p2": replace(BASE, libra=True),
    "dp4_p4_relay": replace(BASE, libra=True, pool_size=4, kv_relay="auto", gpus_per_node=2, inter_node_gbps=0.001),
    "dp2_cp2_p2": replace(BASE, libra=True, dp=2, cp=2, grad_accum=4),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("e2e"))
    cfgs = [replace(c, workdir=workdir) for c in (BASE, *LIBRA.values())]
    data = prepare_data(cfgs[0])
    results = run_training(cfgs, data, timeout=600)
    return dict(zip(["base", *LIBRA], results))


@pytest.mark.parametrize("name", list(LIBRA))
def test_libra_matches_plain_run_loss_and_grad_norm_every_step(runs, name):
    parity = compare_runs(runs[name], runs["base"])
    assert parity["steps"] == STEPS
    assert parity["same_step_multisets"] == 1.0
    assert parity["max_rel_loss"] < PARITY_RTOL, parity
    assert parity["max_rel_grad_norm"] < PARITY_RTOL, parity


def test_every_run_averages_over_all_loss_tokens_of_the_global_batch(runs):
    for name, per_rank in runs.items():
        for step in per_rank[0]:
            assert step["loss_tokens"] == BASE.global_batch * BASE.seq_len, name
        losses = [r[0]["loss"] for r in per_rank]
        assert len(set(losses)) == 1, f"{name}: ranks disagree on the global loss {losses}"


def test_the_relay_config_really_relays(runs):
    assert sum(s["relayed_plans"] for s in runs["dp4_p4_relay"][0]) > 0
    assert all(s["relayed_plans"] == 0 for name in ("dp4_p2", "dp2_cp2_p2") for s in runs[name][0])


def test_libra_really_reorders_and_migrates(runs):
    base_order = [[r[s]["samples"] for r in runs["base"]] for s in range(STEPS)]
    for name in LIBRA:
        per_rank = runs[name]
        steps = per_rank[0]
        assert any(s["intra_pool_max_over_mean_placed"] < s["intra_pool_max_over_mean_home"] for s in steps), name
        assert all(s["intra_pool_max_over_mean_placed"] <= s["intra_pool_max_over_mean_home"] + 1e-12
                   for s in steps), name
        assert sum(s["bytes_per_step"] for s in steps) > 0, name
        assert all(s["inter_pool_r1_after"] <= s["inter_pool_r1_before"] + 1e-12 for s in steps), name
        if LIBRA[name].dp == BASE.dp:
            libra_order = [[r[s]["samples"] for r in per_rank] for s in range(STEPS)]
            assert libra_order != base_order, f"{name}: VRSP never changed the sampler order"


def test_training_moves_the_loss(runs):
    losses = [s["loss"] for s in runs["base"][0]]
    assert all(l == l and 0 < l < 20 for l in losses)  # finite, sane
    assert len(set(round(l, 6) for l in losses)) > 1
