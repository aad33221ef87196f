"""sim.hybrid_cp: Megatron-LM hybrid-CP schedules priced by hand, and the simulator's baseline keys."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from libra_megatron.sim.__main__ import run
from libra_megatron.plan.model import StepTimeModel
from libra_megatron.sim.hybrid_cp import HybridCpDims, price_schedule, ring_document_seconds, ring_layer_seconds

COST = StepTimeModel(head_dim=8, attn_tflops=1e-6, intra_node_gbps=1e-3, inter_node_gbps=5e-4, gpus_per_node=2,
                     kv_relay=True)
DIMS = HybridCpDims(num_q_heads=4, num_kv_heads=2, elem_bytes=2)


def _compute(length, cp):
    return 4 * length * (length + 1) / 2 * 4 * 8 / cp / 1e6  # pair-heads * 4d FLOPs at 1 MFLOP/s


def test_ring_document_by_hand_compute_bound_and_comm_bound():
    # one GPU: compute only
    assert ring_document_seconds(10, [0], DIMS, COST) == pytest.approx((_compute(10, 1),) * 2)
    # two GPUs on one node: 2 steps; K/V block = 32 tokens * 2 kv heads * 8 * 2 bytes * 2 (K and V)
    c = _compute(64, 2)
    x = 32 * 2 * 2 * 8 * 2 / 1e6  # intra 1e-3 GB/s
    assert ring_document_seconds(64, [0, 1], DIMS, COST) == pytest.approx((c / 2 + max(c / 2, x), c))
    # four GPUs over two nodes: the (here very slow) inter-node link paces every step
    slow = dataclasses.replace(COST, inter_node_gbps=5e-6)
    c4 = _compute(64, 4)
    x4 = 16 * 2 * 2 * 8 * 2 / 5e3
    seconds, compute = ring_document_seconds(64, [0, 1, 2, 3], DIMS, slow)
    assert compute == pytest.approx(c4)
    assert seconds == pytest.approx(c4 / 4 + 3 * max(c4 / 4, x4))
    assert seconds > compute  # the small document is comm-bound here: exposed comm shows


def test_ring_layer_forward_and_backward_by_hand():
    """Whole layer (TE's P2P ring): forward c + (cp-1) max(c, x), backward c_b + (cp-1) max(c_b, x_b) + x with
    c_b = 2.5 c, x_b carrying K|V and dK|dV (twice the bytes), alpha (message latency) per ring step, a kernel
    launch per step."""
    launch, us = COST.kernel_launch_us * 1e-6, 1e-6
    f, fc, b, bc = ring_layer_seconds(10, [0], DIMS, COST)  # one GPU: compute only
    assert (f, fc) == pytest.approx((_compute(10, 1) + launch,) * 2)
    assert (b, bc) == pytest.approx((2.5 * _compute(10, 1) + launch,) * 2)
    # two GPUs on one node, comm-bound: x = 2 us + 32 tokens * 2 kv heads * 8 * 2 bytes * 2 (K, V) / 1e6 B/s
    c = _compute(64, 2) / 2 + launch
    cb = 2.5 * _compute(64, 2) / 2 + launch
    x = COST.intra_message_us * us + 32 * 2 * 2 * 8 * 2 / 1e6
    xb = COST.intra_message_us * us + 2 * 32 * 2 * 2 * 8 * 2 / 1e6
    f, fc, b, bc = ring_layer_seconds(64, [0, 1], DIMS, COST)
    assert (f, fc) == pytest.approx((c + max(c, x), 2 * c))
    assert (b, bc) == pytest.approx((cb + max(cb, xb) + x, 2 * cb))
    # four GPUs over two nodes: the inter-node latency and link pace every step
    slow = dataclasses.replace(COST, inter_node_gbps=5e-6)
    c4, cb4 = _compute(64, 4) / 4 + launch, 2.5 * _compute(64, 4) / 4 + launch
    x4 = COST.inter_message_us * us + 16 * 2 * 2 * 8 * 2 / 5e3
    xb4 = COST.inter_message_us * us + 2 * 16 * 2 * 2 * 8 * 2 / 5e3
    f, fc, b, bc = ring_layer_seconds(64, [0, 1, 2, 3], DIMS, slow)
    assert f == pytest.approx(c4 + 3 * max(c4, x4)) and b == pytest.approx(cb4 + 3 * max(cb4, xb4) + x4)
    assert b - bc > f - fc > 0  # the backward's exposed ring (twice the bytes, one hop more) exceeds the forward's


def test_schedule_sums_groups_of_their_slowest_gpu():
    lens = [64, 10, 20, 30]
    # group 0: doc 0 on GPUs 0-1 (CP2); doc 1 on GPU 2, doc 2 on GPU 3. group 1: doc 3 on GPU 0 only
    schedule = [[[0], [0], [1], [2]], [[3], [], [], []]]
    total, compute = price_schedule(schedule, lens, DIMS, COST)
    doc0 = ring_document_seconds(64, [0, 1], DIMS, COST)
    g0 = max(doc0[0], _compute(10, 1), _compute(20, 1))
    assert total == pytest.approx(g0 + _compute(30, 1))
    assert compute == pytest.approx((doc0[1] if doc0[0] == g0 else _compute(20, 1)) + _compute(30, 1))


SYNTH = np.concatenate([np.arange(1, 400) % 23 + 1, [150, 90, 64, 200, 33, 120]])


def _one_gpu_each(windows, dp_cp, cap):
    """A stand-in schedule: one group, document i on GPU i % dp_cp (checks the plumbing, not Megatron)."""
    out = []
    for lens in windows:
        gpus = [[] for _ in range(dp_cp)]
        for i in range(len(lens)):
            gpus[i % dp_cp].append(i)
        out.append([gpus])
    return out


def test_simulator_reports_the_baseline_against_the_same_lower_bound(tmp_path, monkeypatch):
    trace = tmp_path / "t.txt"
    trace.write_text("\n".join(map(str, SYNTH)) + "\n")
    seen = {}

    def fake(windows, dp_cp, cap):
        seen.update(dp_cp=dp_cp, cap=cap, windows=windows)
        return _one_gpu_each(windows, dp_cp, cap)

    monkeypatch.setattr("libra_megatron.sim.__main__.subprocess_scheduler", lambda: fake)
    out = tmp_path / "o.json"
    flags = ["--trace", str(trace), "--seq-len", "64", "--gbs", "8", "--dp", "4", "--cp", "2", "--pool-size", "2",
             "--block-size", "8", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "8", "--num-chunks", "2",
             "--gpus-per-node", "2", "--attn-tflops", "1e-6", "--intra-node-gbps", "1e-3", "--inter-node-gbps",
             "5e-4", "--no-progress", "--megatron-hybrid-cp", "--json", str(out)]
    assert run(flags) == 0
    report = json.loads(out.read_text())
    assert seen["dp_cp"] == 8 and seen["cap"] == 32  # --seq-len / --cp
    meg = report["baselines"]["megatron_hybrid_cp"]
    windows = seen["windows"]
    assert all(sum(w) == 8 * 64 for w in windows)  # every token of the GBS window, as documents
    # forward only (the forward_* keys): CP1 documents, compute only
    seconds = [max(sum(_compute(w[i], 1) for i in range(g, len(w), 8)) for g in range(8)) for w in windows]
    lower = [sum(_compute(n, 1) for n in w) / 8 for w in windows]  # GA steps of work over DP*CP = 8 GPUs
    assert meg["forward_straggler_vs_lower_bound"] == pytest.approx(sum(seconds) / sum(lower))
    assert meg["forward_mean_step_seconds"] == pytest.approx(np.mean(seconds) / 2)  # GA = 2
    # whole layer: forward + backward (2.5 x the FLOPs), a kernel launch in each; the bound is forward + backward
    launch = COST.kernel_launch_us * 1e-6  # the run's flags keep the default launch cost
    layer = [max(sum(3.5 * _compute(w[i], 1) + 2 * launch for i in range(g, len(w), 8)) for g in range(8))
             for w in windows]
    assert meg["straggler_vs_lower_bound"] == pytest.approx(sum(layer) / (3.5 * sum(lower)))
    assert report["megatron_hybrid_cp_straggler_vs_lower_bound"] == meg["straggler_vs_lower_bound"]
    assert report["forward_megatron_hybrid_cp_straggler_vs_lower_bound"] == meg["forward_straggler_vs_lower_bound"]
    assert meg["mean_step_seconds"] == pytest.approx(np.mean(layer) / 2)
    assert meg["exposed_comm_seconds"] == pytest.approx(0.0)  # CP1 documents move nothing
    assert meg["forward_exposed_comm_seconds"] == pytest.approx(0.0)


def test_max_seqlen_flag_needs_the_baseline_flag(tmp_path):
    from libra_megatron.sim.__main__ import build_parser, _hybrid_cp

    args = build_parser().parse_args(["--trace", "x", "--seq-len", "64", "--gbs", "8", "--dp", "4", "--cp", "2",
                                      "--megatron-max-seqlen-per-rank", "16"])
    with pytest.raises(ValueError, match="--megatron-max-seqlen-per-rank needs --megatron-hybrid-cp"):
        _hybrid_cp(args)
    args.megatron_hybrid_cp, args.megatron_max_seqlen_per_rank = True, 0
    with pytest.raises(ValueError, match="--megatron-max-seqlen-per-rank must be a positive integer, got 0"):
        _hybrid_cp(args)
