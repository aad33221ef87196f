"""A launched Libra run on 2 gloo ranks against real Megatron-LM: model via --spec, patched loader, forward_step.

In-process and without CUDA emulation: ``megatron_workers.launched_step`` performs the launcher's start-up
steps by hand (see its docstring), then one global batch through ``pretrain_gpt``'s ``forward_step`` and
``loss_func``, with and without the plan, for both batch carriers. This inspects what the patch points hand
Megatron (batches, carriers, metrics) directly; Megatron-LM's whole ``pretrain()`` loop on CPU is
``test_pretrain_loop.py``.
"""
import numpy as np
import pytest

from libra_megatron.config import LibraConfig
from libra_megatron.testing.dist import run_distributed

from .megatron_lm import REPO, needs_megatron_lm
from .megatron_workers import CARRIER_VARIANTS, GBS, SEQ_LEN, launched_step

pytestmark = needs_megatron_lm

LIBRA_FLAGS = ["--libra-pool-size", "2", "--libra-block-size", "128", "--libra-num-chunks", "2",
               "--libra-kernel-backend", "torch", "--libra-token-layout", "contiguous"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, megatron_lm_path):
    from libra_megatron.megatron.corpus import build_indexed_dataset_from_trace

    save_dir = str(tmp_path_factory.mktemp("libra_run"))
    # Real document lengths (first 200 files of the linux-6.12 trace, median 378 tokens): several documents
    # per 1024-token sample. Tokens are synthetic.
    prefix = str(tmp_path_factory.mktemp("corpus") / "linux")
    trace = REPO / "data" / "traces" / "linux-6.12-files.qwen.txt"
    build_indexed_dataset_from_trace(trace, prefix, vocab_size=256, eod=255, max_docs=200)
    env = {"MEGATRON_LM_PATH": megatron_lm_path}
    results = run_distributed(launched_step, 2, save_dir, "libra_local_qk_spec", LIBRA_FLAGS, prefix,
                              timeout=300, env=env)
    return save_dir, results


CARRIERS = sorted(CARRIER_VARIANTS)


@pytest.mark.parametrize("carrier", CARRIERS)
def test_startup_validates_saves_config_and_creates_pool_groups(run, carrier):
    save_dir, all_results = run
    results = [r[carrier] for r in all_results]
    from pathlib import Path

    saved = sorted(Path(save_dir, carrier).rglob("*.yaml"))
    assert saved, f"no Libra config saved under --save {save_dir}/{carrier}"
    cfg = LibraConfig.from_yaml(str(saved[0]))
    assert cfg.to_dict() == results[0]["config"] == results[1]["config"]
    assert (cfg.pool_size, cfg.block_size, cfg.num_chunks) == (2, 128, 2)
    assert all(r["pool_size"] == 2 for r in results)  # P*CP = 2*1 ranks per pool group


def test_spec_flag_builds_gpt_model_with_libra_core_attention(run):
    _, results = run
    assert all(r[c]["num_libra_attention"] == 2 for r in results for c in CARRIERS)  # one per layer (--num-layers 2)


def test_patched_loader_preserves_the_windows_sample_multiset(run):
    """Both ranks' microbatches of step 1 are exactly the first GBS samples of the dataset, reordered."""
    _, all_results = run
    results = [r["sbhd"] for r in all_results]
    seen = sorted(tuple(t) for r in results for t in r["window_tokens"])
    assert seen == sorted(tuple(t) for t in results[0]["dataset_window"])
    assert len(seen) == GBS


@pytest.mark.parametrize("carrier", CARRIERS)
def test_get_batch_returns_the_carrier_with_plan_and_matching_positions(run, carrier):
    """thd (--reset-position-ids): positions restart per document; sbhd (default): 0..L-1 over the sequence."""
    _, all_results = run
    for r in all_results:
        b = r[carrier]["batch"]
        assert b["type"] == "LibraPackedSeqParams" and b["qkv_format"] == carrier and b["has_plan"]
        assert b["attention_mask_is_none"]
        cu = np.asarray(b["cu_seqlens"])
        assert cu[0] == 0 and cu[-1] == SEQ_LEN and np.all(np.diff(cu) > 0)
        if carrier == "thd":
            expected = np.concatenate([np.arange(e - s) for s, e in zip(cu[:-1], cu[1:])])
        else:
            expected = np.arange(SEQ_LEN)
        assert np.array_equal(np.asarray(b["position_ids"]), expected)
        assert b["labels"][:-1] == b["tokens"][1:]  # GPTDataset shift, CP=1 holds the whole sequence


def test_training_step_with_plan_matches_plain_attention(run):
    """Loss and global grad norm of the planned step equal the same step without tile migration."""
    _, all_results = run
    for r in (res[c] for res in all_results for c in CARRIERS):
        assert r["loss_libra"] == pytest.approx(r["loss_local"], rel=1e-5)
        assert r["grad_norm_libra"] == pytest.approx(r["grad_norm_local"], rel=1e-4)
        assert np.isfinite(r["loss_libra"]) and r["grad_norm_libra"] > 0
    for c in CARRIERS:
        assert all_results[0][c]["loss_libra"] == pytest.approx(all_results[1][c]["loss_libra"], rel=1e-12)


def test_both_carriers_compute_the_same_step(run):
    """RoPE is relative and attention is block-diagonal per document, so positions restarting per document
    (thd) and running over the packed sequence (sbhd) give the same loss and gradients up to rounding."""
    _, all_results = run
    for r in all_results:
        assert r["thd"]["loss_libra"] == pytest.approx(r["sbhd"]["loss_libra"], rel=1e-5)
        assert r["thd"]["grad_norm_libra"] == pytest.approx(r["sbhd"]["grad_norm_libra"], rel=1e-4)


def test_step_metrics_reach_megatrons_tensorboard_writer(run):
    """Planner scalars as the planner reports them; inter-pool R-1 against a hand computation of window 0."""
    _, all_results = run
    sbhd = [r["sbhd"] for r in all_results]
    flops = [float(np.sum(np.square(np.asarray(s, dtype=np.float64)))) for s in sbhd[0]["window_segments"]]
    before = np.add.reduceat(flops, [0, 2])  # P=2 consecutive sampler-order sequences per pool
    ga = GBS // 2
    after = [flops[sbhd[0]["window_sample_index"][g]] + flops[sbhd[1]["window_sample_index"][g]] for g in range(ga)]
    for r in (res[c] for res in all_results for c in CARRIERS):
        expected = {"libra/" + k: pytest.approx(v) for k, v in r["planner_metrics"].items()}
        expected["libra/inter_pool_r1_before"] = pytest.approx(max(before) / np.mean(before) - 1)
        expected["libra/inter_pool_r1_after"] = pytest.approx(max(after) / np.mean(after) - 1)
        # DP = P = 2: one lane runs every GA step, so its total is the window's and the lane R-1 is 0
        expected["libra/lane_r1_before"] = expected["libra/lane_r1_after"] = 0.0
        expected.update(_microbatch_expected(sbhd, r["config"]))
        assert r["tensorboard"] == expected


def _microbatch_expected(sbhd, config_dict):
    """Window 0's microbatch_max_mean_* by hand: DP = P = 2 and CP = 1, so GA g runs one pool. Before: the
    sampler's pool g (samples 2g, 2g+1) at home, where worker p's Eq. 6 load is hq * the causal pairs
    (l(l+1)/2 per document) of its sequence. After: the planner's own plan of the pool the ranks ran at g."""
    from libra_megatron.config import LibraConfig
    from libra_megatron.plan.layout import HeadLayout, TokenLayout
    from libra_megatron.plan.pool import plan_pool

    segments = sbhd[0]["window_segments"]
    pairs = [sum(l * (l + 1) // 2 for l in seq) for seq in segments]
    before = [max(pairs[2 * g], pairs[2 * g + 1]) for g in range(GBS // 2)]
    config = LibraConfig(**config_dict)
    heads = HeadLayout(4, 2, 16, config.head_split, config.num_chunks, elem_bytes=4)  # TINY_MODEL_ARGS, fp32
    pools = [[segments[r["window_sample_index"][g]] for r in sbhd] for g in range(GBS // 2)]
    after = [plan_pool(pool, config, TokenLayout("contiguous", SEQ_LEN, 1), heads).placement.loads.max()
             for pool in pools]
    return {"libra/microbatch_max_mean_before": pytest.approx(max(before) / np.mean(before)),
            "libra/microbatch_max_mean_after": pytest.approx(max(after) / np.mean(after)),
            "libra/microbatch_slowest_after_over_before": pytest.approx(max(after) / (heads.num_q_heads * max(before)))}
