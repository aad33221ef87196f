"""Simulator end to end on a tiny SYNTHETIC trace, checked against independent recomputation."""

import json
import subprocess
import sys

import numpy as np
import pytest

from libra_megatron.config import SequencePlacement, TilePlacement
from libra_megatron.plan.exchange import build_exchange_plan, plan_layer_timing
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.exchange.local_entries import LOCAL, SPLIT, rank_entry_kinds
from libra_megatron.plan.model import StepTimeModel, entry_pair_heads, pipeline_seconds
from libra_megatron.plan.packing import pack_documents
from libra_megatron.plan.tiles import build_tiles, place_tiles
from libra_megatron.plan.sequences import SyncLayout, place_sequences
from libra_megatron.sim.__main__ import build_parser, run, spec_from_args
from libra_megatron.sim.runner import run_simulation

# synthetic long-tailed lengths: many short documents and a few long ones (deterministic)
SYNTH = np.concatenate([np.arange(1, 400) % 23 + 1, [150, 90, 64, 200, 33, 120]])
FLAGS = ["--seq-len", "64", "--gbs", "8", "--dp", "4", "--cp", "2", "--pool-size", "2", "4",
         "--head-split", "1", "2", "--block-size", "8", "16", "--num-heads", "4", "--num-kv-heads", "2",
         "--head-dim", "8", "--num-chunks", "2", "--gpus-per-node", "2", "--attn-tflops", "1e-6",
         "--intra-node-gbps", "1e-3", "--inter-node-gbps", "5e-4", "--no-progress",
         "--no-kv-relay"]  # the recomputation below prices direct fetches (the relay: tests/sim/test_pools.py)
KEYS = {"pool_size", "head_split", "block_size", "num_tiles", "inter_pool_imbalance", "intra_pool_imbalance",
        "straggler_vs_ulysses", "straggler_vs_lower_bound", "bytes_per_layer", "estimated_step_seconds", "baselines",
        "forward_straggler_vs_ulysses", "forward_straggler_vs_lower_bound", "forward_estimated_step_seconds",
        "forward_compute_seconds", "forward_exposed_comm_seconds", "straggler_split", "save_mode_pools"}


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "synthetic.txt"
    path.write_text("# synthetic long-tailed trace for tests\n" + "\n".join(map(str, SYNTH)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def report(trace_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "sim.json"
    assert run(["--trace", trace_path, "--json", str(out)] + FLAGS) == 0
    return json.loads(out.read_text())


def _windows():
    seqs = pack_documents(SYNTH, 64, "megatron", 1234)
    return [seqs[w * 8:(w + 1) * 8] for w in range(len(seqs) // 8)]


def _rank_phase_seconds(plan, rank, heads, node):
    """(dispatch [M], return [M]) link seconds of one rank, read off its routes' per-peer splits: per link class
    Q/M (+ K/V/F on the chunks that send K/V) out and in, O/M back for every Q unit received; max(sent,
    received) per class, 1e-3 GB/s intra-node, 5e-4 GB/s inter-node, the slower class paces the phase."""
    rp = plan.for_rank(rank)
    qb, kvb, M = heads.q_bytes_per_token(), heads.kv_bytes_per_token(), heads.num_chunks
    piece = heads.num_q_heads // (heads.head_split * M)  # F = chunks that send K/V
    sends = np.ones(M) if piece >= heads.group else (np.arange(M) % (heads.group // piece) == 0).astype(float)
    dispatch, ret = np.zeros((2, M)), np.zeros((2, M))
    for k, (peers, rate) in enumerate(((node == node[rank], 1e6), (node != node[rank], 5e5))):
        peers = peers & (np.arange(node.size) != rank)
        qs, qr = rp.q_route.send_splits[peers].sum() * qb, rp.q_route.recv_splits[peers].sum() * qb
        ks, kr = rp.kv_route.send_splits[peers].sum() * kvb, rp.kv_route.recv_splits[peers].sum() * kvb
        kv_share = sends / sends.sum()
        dispatch[k] = np.maximum(qs / M + ks * kv_share, qr / M + kr * kv_share) / rate
        ret[k] = max(qr, qs) / M / rate
    return dispatch.max(axis=0), ret.max(axis=0)


def _rank_local_share(plan, rank, heads):
    """Share of the rank's Eq. 6 load computed before any dispatch arrives (its routes' view): local entries
    whole, split entries over their self-sourced key tail."""
    rp = plan.for_rank(rank)
    q_len = np.diff(rp.cu_seqlens_q)
    k_hi = np.asarray(rp.seq_kv_offset) + np.asarray(rp.seq_k_len)
    kinds, tail = rank_entry_kinds(rp)
    load = entry_pair_heads(q_len, rp.seq_k_len, heads.q_heads_per_shard).astype(float)
    early = np.where(kinds == LOCAL, load, np.where(kinds == SPLIT, entry_pair_heads(q_len, k_hi - tail,
                                                                                      heads.q_heads_per_shard), 0.0))
    return early.sum() / load.sum() if load.sum() else 0.0


MODEL = StepTimeModel(head_dim=8, attn_tflops=1e-6, intra_node_gbps=1e-3, inter_node_gbps=5e-4, gpus_per_node=2)


def _reference_libra(P, H, B, local_first=True, layer=None):
    """Recompute steps, bytes and intra imbalance from plan/ records alone (sync VRSP, the default, + Alg. 2).
    Forward-only Pipeliner figures; with ``layer`` = [], also appends per step (forward straggler seconds, its
    compute, backward straggler seconds, its compute) of ``plan_layer_timing`` (arranged: the run's auto mode
    with a 16 GiB budget keeps everything of these tiny pools)."""
    layout, heads = TokenLayout("zigzag", 64, 2), HeadLayout(4, 2, 8, H, 2, 2)
    steps, byte_rows, intra, step_compute = [], [], [], []
    for seqs in _windows():
        flops = np.array([float((s.astype(float) ** 2).sum()) for s in seqs])
        order = place_sequences(flops, P, SequencePlacement.SYNC, SyncLayout(4, P, 2))  # DP=4, GA=2
        step_max, straggler_compute, pool_workers, pool_phases = np.zeros(2), np.zeros(2), [], []
        for k in range(8 // P):
            tiles = build_tiles([seqs[i] for i in order[k * P:(k + 1) * P]], layout, heads, B)
            placed = place_tiles(tiles, 0.03, TilePlacement.ALG2)
            plan = build_exchange_plan(tiles, placed.assignment)
            byte_rows.append((plan.bytes_q, plan.bytes_kv, plan.bytes_o))
            intra.append(placed.loads.max() / placed.loads.mean() - 1)
            compute = np.bincount(placed.assignment, weights=tiles.tile_flops() * 4 * 8, minlength=2 * P) / 1e6
            node = ((k % (4 // P)) * P * 2 + np.arange(2 * P)) // 2  # first GPU of the pool; 2 GPUs per node
            phases = [_rank_phase_seconds(plan, r, heads, node) for r in range(2 * P)]
            local = compute * np.array([_rank_local_share(plan, r, heads) for r in range(2 * P)])
            seconds = pipeline_seconds(local, compute - local, [d for d, _ in phases], [r for _, r in phases],
                                       local_first)[0]
            step_max[k * P // 4] = max(step_max[k * P // 4], max(seconds))
            pool_workers.append((k * P // 4, np.array(seconds), compute))
            if layer is not None:
                timing = plan_layer_timing(plan, MODEL.at_gpu((k % (4 // P)) * P * 2), "arranged")
                pool_phases.append((k * P // 4, timing))
        for step, seconds, compute in pool_workers:  # the straggler; ties (1e-9) go to the largest compute
            tied = seconds >= step_max[step] * (1 - 1e-9)
            straggler_compute[step] = max(straggler_compute[step], compute[tied].max(initial=0.0))
        for step in range(2) if layer is not None else ():
            row = []
            for phase in ("forward", "backward"):
                sec = np.concatenate([getattr(t, phase).seconds for g, t in pool_phases if g == step])
                comp = np.concatenate([getattr(t, phase).compute for g, t in pool_phases if g == step])
                row += [sec.max(), comp[sec >= sec.max() * (1 - 1e-9)].max()]
            layer.append(row)
        steps.extend(step_max.tolist())
        step_compute.extend(straggler_compute.tolist())
    return np.array(steps), np.mean(byte_rows, axis=0), float(np.mean(intra)), np.array(step_compute)


def test_json_has_schema_keys_and_grid(report):
    assert report["num_windows"] == len(_windows()) >= 2
    grid = {(c["pool_size"], c["head_split"], c["block_size"]) for c in report["candidates"]}
    assert grid == {(p, h, b) for p in (2, 4) for h in (1, 2) for b in (8, 16)}
    for cand in report["candidates"]:
        assert KEYS <= set(cand)
        assert set(cand["inter_pool_imbalance"]) >= {"contiguous", "alg1", "placed", "lower_bound"}
        assert set(cand["bytes_per_layer"]) == {"q", "kv", "o"}
    assert {"ulysses", "wlb_llm"} <= set(report["baselines"])
    assert {"pool_size", "head_split", "block_size", "estimated_step_seconds"} <= set(report["recommended"])
    assert report["assumptions"]["cost"]["gpus_per_node"] == 2


def test_inter_pool_imbalance_matches_hand_computation(report):
    for P in (2, 4):
        contiguous, alg1 = [], []
        for seqs in _windows():
            f = np.array([float((s.astype(float) ** 2).sum()) for s in seqs])
            pools = f.reshape(-1, P).sum(axis=1)  # sampler order
            contiguous.append(pools.max() / pools.mean() - 1)
            order = place_sequences(f, P, SequencePlacement.ALG1)
            pools = f[order].reshape(-1, P).sum(axis=1)
            alg1.append(pools.max() / pools.mean() - 1)
        cand = next(c for c in report["candidates"] if c["pool_size"] == P)
        assert np.isclose(cand["inter_pool_imbalance"]["contiguous"], np.mean(contiguous))
        assert np.isclose(cand["inter_pool_imbalance"]["alg1"], np.mean(alg1))
        assert cand["inter_pool_imbalance"]["lower_bound"] <= cand["inter_pool_imbalance"]["placed"] + 1e-12


def _ulysses_steps(layer=False):
    """Ulysses step seconds by hand: forward only (no latencies, the forward_* figures) or the whole layer:
    forward + backward compute (2.5 x the FLOPs), a kernel launch each, and per phase four all-to-alls (Q, K, V
    | O forward, dO | dQ, dK, dV backward) of 15 us + the peer's 2 us + bytes / bandwidth."""
    steps = []
    for seqs in _windows():
        per_seq = []
        for s in seqs:
            pairs = float((s * (s + 1) // 2).sum()) * 4  # hq = 4
            compute = pairs / 2 * 4 * 8 / 1e6  # CP 2, 4*d FLOPs per pair-head, 1 MFLOP/s
            a2a = 32 * (2 * 4 + 2 * 2) * 8 * 2 / 2  # 32 local tokens, half go to the CP peer (same node)
            if layer:
                calls = 4 * (MODEL.collective_us + MODEL.intra_message_us) * 1e-6
                launch = MODEL.kernel_launch_us * 1e-6
                per_seq.append(3.5 * compute + 2 * launch + 2 * (a2a / 1e6 + calls))
            else:
                per_seq.append(compute + a2a / 1e6)
        steps.extend(np.array(per_seq).reshape(2, 4).max(axis=1).tolist())
    return np.array(steps)


@pytest.mark.parametrize("P, H, B", [(2, 1, 8), (4, 2, 16), (4, 1, 8)])
def test_candidate_matches_independent_plan_recomputation(report, P, H, B):
    cand = next(c for c in report["candidates"] if (c["pool_size"], c["head_split"], c["block_size"]) == (P, H, B))
    layer = []
    steps, byte_mean, intra, step_compute = _reference_libra(P, H, B, layer=layer)
    uly = _ulysses_steps()
    assert np.isclose(report["baselines"]["ulysses"]["forward_mean_step_seconds"], uly.mean())
    assert np.allclose([cand["bytes_per_layer"][k] for k in "q kv o".split()], byte_mean)
    assert np.isclose(cand["intra_pool_imbalance"], intra)
    # forward only (the Pipeliner timeline, each worker alone): the forward_* keys
    assert np.isclose(cand["forward_estimated_step_seconds"], steps.mean())
    assert np.isclose(cand["forward_straggler_vs_ulysses"], steps.sum() / uly.sum())
    # the step splits into the straggler's compute and its exposed communication, mean per step
    assert np.isclose(cand["forward_compute_seconds"], step_compute.mean())
    assert np.isclose(cand["forward_exposed_comm_seconds"], (steps - step_compute).mean())
    assert cand["forward_exposed_comm_seconds"] > 0  # the synthetic link rates make communication visible
    # the whole layer: max over the step's workers of the forward + max of the backward (plan_layer_timing)
    f_s, f_c, b_s, b_c = np.array(layer).T
    uly_layer = _ulysses_steps(layer=True)
    assert np.isclose(report["baselines"]["ulysses"]["mean_step_seconds"], uly_layer.mean())
    assert np.isclose(cand["estimated_step_seconds"], (f_s + b_s).mean())
    assert np.isclose(cand["straggler_vs_ulysses"], (f_s + b_s).sum() / uly_layer.sum())
    assert np.isclose(cand["compute_seconds"], (f_c + b_c).mean())
    assert np.isclose(cand["exposed_comm_seconds"], (f_s + b_s - f_c - b_c).mean())
    split = cand["straggler_split"]
    for phase, sec, comp in (("forward", f_s, f_c), ("backward", b_s, b_c)):
        assert np.isclose(split[phase]["seconds"], sec.mean())
        assert np.isclose(split[phase]["compute_seconds"], comp.mean())
        assert np.isclose(split[phase]["exposed_comm_seconds"], (sec - comp).mean())
    assert cand["save_mode_pools"]["refetch"] == 0


def test_no_local_first_prices_the_previous_schedule_from_the_same_plans(report, trace_path, tmp_path):
    out = tmp_path / "old.json"
    assert run(["--trace", trace_path, "--json", str(out), "--pool-size", "4", "--head-split", "2",
                "--block-size", "16", "--no-local-first"] + FLAGS[:FLAGS.index("--pool-size")]
               + FLAGS[FLAGS.index("--num-heads"):]) == 0
    old = json.loads(out.read_text())
    assert old["assumptions"]["cost"]["local_first"] is False and report["assumptions"]["cost"]["local_first"] is True
    steps, _, _, step_compute = _reference_libra(4, 2, 16, local_first=False)
    (cand,) = old["candidates"]
    assert np.isclose(cand["forward_estimated_step_seconds"], steps.mean())
    assert np.isclose(cand["forward_exposed_comm_seconds"], (steps - step_compute).mean())
    new = next(c for c in report["candidates"] if (c["pool_size"], c["head_split"], c["block_size"]) == (4, 2, 16))
    assert new["forward_estimated_step_seconds"] <= cand["forward_estimated_step_seconds"]
    assert new["bytes_per_layer"] == cand["bytes_per_layer"]  # the same plans, only the schedule differs


def test_recommended_is_argmin_of_estimated_step_time(report):
    best = min(report["candidates"], key=lambda c: c["estimated_step_seconds"])
    rec = report["recommended"]
    assert (rec["pool_size"], rec["head_split"], rec["block_size"]) == (best["pool_size"], best["head_split"], best["block_size"])
    assert rec["estimated_step_seconds"] == best["estimated_step_seconds"]


def test_forked_windows_give_identical_results(trace_path):
    spec = spec_from_args(build_parser().parse_args(["--trace", trace_path] + FLAGS))
    one = run_simulation(SYNTH, spec, jobs=1).to_json()
    two = run_simulation(SYNTH, spec, jobs=2).to_json()
    for r in (one, two):
        r.pop("runtime_seconds")
    assert one == two


@pytest.mark.parametrize("change, match", [
    (["--pool-size", "3"], "--pool-size 3 must divide --dp 4"),
    (["--head-split", "3"], "--head-split 3 x --num-chunks 2"),
    (["--gbs", "6"], "--gbs 6 must be divisible by --dp 4"),
    (["--seq-len", "66"], "--seq-len 66 must be divisible by 4 CP chunks"),
    (["--block-size", "0"], "--block-size"),
    (["--tau", "-1"], "--tau"),
])
def test_bad_flag_values_raise_value_error_naming_the_flag(trace_path, change, match):
    flags = list(FLAGS)
    if change[0] in flags:
        i = flags.index(change[0])
        flags[i:i + 2] = change  # the grid flags take lists: replace the first value, drop the rest below
        while i + 2 < len(flags) and not flags[i + 2].startswith("--"):
            del flags[i + 2]
    else:
        flags += change
    with pytest.raises(ValueError, match=match):
        run(["--trace", trace_path] + flags)


def test_unknown_enum_value_is_a_usage_error_naming_the_flag_and_choices(trace_path):
    with pytest.raises(ValueError, match=r"argument --packing: invalid choice: 'zigzag' \(choose from 'megatron', 'best_fit'\)"):
        run(["--trace", trace_path, "--packing", "zigzag"] + FLAGS)


def test_plots_are_written(trace_path, tmp_path):
    out = tmp_path / "plots"
    assert run(["--trace", trace_path, "--plots", str(out), "--max-windows", "1", "--no-distca"] + FLAGS) == 0
    for name in ("inter_pool_imbalance.png", "speedup_heatmap.png", "worst_step_loads.png",
                 "lanes_and_microbatches.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_sim_and_plan_import_neither_torch_nor_megatron():
    code = ("import sys, libra_megatron.sim, libra_megatron.sim.__main__, libra_megatron.sim.plots, "
            "libra_megatron.plan.packing, libra_megatron.plan.traces; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]; print(bad); sys.exit(bool(bad))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0


def test_flat_calibration_table_reproduces_the_constant_throughput_model(trace_path, tmp_path, report):
    # every shape at 1e6 FLOP/s, the same as --attn-tflops 1e-6: the estimates must not change
    entries = [{"block_tokens": t, "heads": h, "pairs": 100, "seconds": 4 * 8 * 100 * h / 1e6}
               for t in (4, 64) for h in (1, 2, 4)]
    cal = tmp_path / "flat.json"
    cal.write_text(json.dumps({"device": "synthetic-flat", "head_dim": 8, "entries": entries}))
    out = tmp_path / "cal.json"
    assert run(["--trace", trace_path, "--json", str(out), "--calibration", str(cal)] + FLAGS) == 0
    calibrated = json.loads(out.read_text())
    assert calibrated["assumptions"]["cost"]["calibration"]["device"] == "synthetic-flat"
    for a, b in zip(calibrated["candidates"], report["candidates"]):
        assert np.isclose(a["estimated_step_seconds"], b["estimated_step_seconds"])
        assert np.isclose(a["straggler_vs_lower_bound"], b["straggler_vs_lower_bound"])
        assert np.isclose(a["forward_straggler_vs_lower_bound"], b["forward_straggler_vs_lower_bound"])


def test_progress_bar_reaches_total_and_is_silent_when_disabled():
    import io

    from libra_megatron.sim.report import ProgressBar

    on, off = io.StringIO(), io.StringIO()
    for bar, stream in ((ProgressBar(True, on, width=4), on), (ProgressBar(False, off), off)):
        for i in range(1, 3):
            bar(i, 2)
    assert "[##..] 1/2 windows" in on.getvalue() and "[####] 2/2 windows" in on.getvalue()
    assert on.getvalue().endswith("\n") and off.getvalue() == ""


def test_distca_scope_equals_tap_when_the_pool_is_all_of_dp(report):
    # P = DP = 4: one pool per GA step in sampler order is exactly what TAP (contiguous + Alg. 2) runs
    for cand in (c for c in report["candidates"] if c["pool_size"] == 4):
        assert cand["baselines"]["distca"] == cand["baselines"]["tap"]
    assert any(c["baselines"]["distca"] != c["baselines"]["tap"] for c in report["candidates"] if c["pool_size"] == 2)
