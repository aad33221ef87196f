"""Trace loading, the time model (calibration interpolation, Pipeliner exposure) and the baselines."""

import json
import math

import numpy as np
import pytest

from libra_megatron.plan.traces import find_trace, load_trace, load_traces
from libra_megatron.sim.baselines import sequence_pair_heads, ulysses_comm_bytes, wlb_repack
from libra_megatron.plan.model import CalibrationTable, StepTimeModel, resolve_calibration, shipped_calibrations


LINUX = find_trace("linux-6.12-files.qwen.txt")


def test_load_trace_skips_comments_and_blank_lines(tmp_path):
    path = tmp_path / "synthetic.txt"
    path.write_text("# synthetic trace\n5\n\n  7 \n# more\n0\n")
    assert load_trace(path).tolist() == [5, 7, 0]
    assert load_traces([path, path]).tolist() == [5, 7, 0, 5, 7, 0]


@pytest.mark.parametrize("body, match", [("5\nabc\n", r":2: expected one integer"), ("5\n-3\n", r":2: .*>= 0")])
def test_load_trace_rejects_bad_lines_with_line_number(tmp_path, body, match):
    path = tmp_path / "bad.txt"
    path.write_text(body)
    with pytest.raises(ValueError, match=match):
        load_trace(path)


def test_load_trace_reads_the_real_linux_trace_like_a_manual_parse():
    with open(LINUX) as handle:
        manual = [int(x) for x in handle if x.strip() and not x.startswith("#")]
    got = load_trace(LINUX)
    assert got.dtype == np.int64 and got.tolist() == manual and got.size == 86603


def _table():
    # throughput 100, 200 FLOP/s-units at 1024 / 4096 tokens for 4 heads; 50 / 150 for 1 head
    entries = []
    for heads, rates in ((4, (100.0, 200.0)), (1, (50.0, 150.0))):
        for tokens, rate in zip((1024, 4096), rates):
            pairs = 1000
            entries.append({"block_tokens": tokens, "heads": heads, "pairs": pairs,
                            "seconds": 4 * 64 * pairs * heads / rate})
    return {"device": "synthetic", "head_dim": 64, "entries": entries}


def test_calibration_interpolates_log_linear_and_clamps(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(_table()))
    table = CalibrationTable.from_json(str(path))
    got = table.flops_per_second(np.array([1024, 2048, 4096, 8192, 512]), 4)
    assert np.allclose(got, [100, 150, 200, 200, 100])  # 2048 is halfway in log2
    assert np.allclose(table.flops_per_second(np.array([2048]), 1), [100])
    assert np.allclose(table.flops_per_second(np.array([2048]), 2), [125])  # halfway between 1 and 4 heads in log2
    cost = StepTimeModel(head_dim=64, calibration=table, kv_relay=True)
    assert np.allclose(cost.call_seconds([10.0], [4096], 4), [4 * 64 * 10.0 / 200])
    assert math.isclose(float(cost.peak_compute_seconds(10.0)), 4 * 64 * 10.0 / 200)


def test_calibration_errors_name_the_flag(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"device": "x", "entries": []}))
    with pytest.raises(ValueError, match="--calibration"):
        CalibrationTable.from_json(str(path))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_table()))
    with pytest.raises(ValueError, match="--head-dim"):
        StepTimeModel(head_dim=128, calibration=CalibrationTable.from_json(str(good)))


def test_the_shipped_h200_table_is_named_and_priced_as_its_raw_entries_say():
    assert "h200-torch-fa2" in shipped_calibrations()
    table = resolve_calibration("h200-torch-fa2")
    import libra_megatron.plan.model.calibration as C
    with open(f"{C.SHIPPED_CALIBRATION_DIR}/h200-torch-fa2.json") as handle:
        raw = json.load(handle)
    assert table.head_dim == raw["head_dim"] == 128 and "H200" in table.device
    by_shape = {(e["block_tokens"], e["heads"]): 4 * 128 * e["pairs"] * e["heads"] / e["seconds"] for e in raw["entries"]}
    for (tokens, heads), rate in by_shape.items():  # at a measured shape, the measured rate
        assert math.isclose(float(table.flops_per_second(np.array([tokens]), heads)[0]), rate, rel_tol=1e-9)
    assert math.isclose(table.peak_flops_per_second(), max(by_shape.values()))
    # the call shape matters: 8 heads x 2048 tokens runs well below 32 heads x 16384 tokens on this device
    assert by_shape[(2048, 8)] < 0.8 * by_shape[(16384, 32)]
    cost = StepTimeModel(head_dim=128, calibration=table)
    small, big = cost.call_seconds([1e6], [2048], 8), cost.call_seconds([1e6], [16384], 32)
    assert float(small[0] / big[0]) > 1.25  # the same work costs more seconds in the small call
    assert math.isclose(float(small[0]), 4 * 128 * 1e6 / by_shape[(2048, 8)], rel_tol=1e-9)


def test_an_unknown_calibration_name_lists_the_shipped_tables(tmp_path):
    with pytest.raises(ValueError, match=r"--calibration nope: neither a file nor a shipped table .*h200-torch-fa2"):
        resolve_calibration("nope")
    with pytest.raises(ValueError, match=r"--calibration .*missing.json: no such file"):
        resolve_calibration(str(tmp_path / "missing.json"))


def test_the_simulator_takes_a_shipped_table_by_name():
    from libra_megatron.sim.__main__ import parse_args, spec_from_args

    argv = ["--trace", LINUX, "--seq-len", "8192", "--gbs", "8", "--dp", "4", "--cp", "2", "--pool-size", "2",
            "--model", "qwen3-8b"]
    spec = spec_from_args(parse_args(argv + ["--calibration", "h200-torch-fa2"]))
    assert spec.cost.calibration is not None and spec.cost.calibration.device == "NVIDIA H200"
    assert spec_from_args(parse_args(argv)).cost.calibration is None
    fit = spec_from_args(parse_args(argv + ["--calibration", "h200-torch-fa2-calls"])).cost.calibration
    assert fit.kind == "kernel_fit" and fit.head_dim == 128  # the fit on Libra-shaped calls, by name too


def test_cost_model_prices_a_worker_by_the_pipeliner_timeline_and_the_default_rates():
    cost = StepTimeModel(head_dim=8, intra_node_gbps=2.0, inter_node_gbps=1.0, kv_relay=True)
    assert cost.comm_seconds([4e9], [3e9]).tolist() == [3.0]  # max(4/2, 3/1)
    # M=2, local 2 s, remote 4 s, every transfer 1 s (tests/plan/test_timing.py by hand): 6 s local first,
    # 8 s (= compute + first dispatch + last return) with --no-local-first
    args = ([2.0], [4.0], [[1.0, 1.0]], [[1.0, 1.0]])
    assert cost.worker_seconds(*args).tolist() == [6.0]
    old = StepTimeModel(head_dim=8, local_first=False, kv_relay=True)
    assert old.worker_seconds(*args).tolist() == [8.0]
    assert old.assumptions()["local_first"] is False and "local entries" not in old.assumptions()["step_time"]
    assert "no local split" in old.assumptions()["step_time"]
    assert "local entries while the dispatches travel" in cost.assumptions()["step_time"]
    # one place for the default rates: the CLI and StepTimeModel agree (values unchanged)
    from libra_megatron.sim.__main__ import build_parser
    args = build_parser().parse_args(["--trace", "x", "--seq-len", "64", "--gbs", "8", "--dp", "4", "--cp", "2"])
    default = StepTimeModel(head_dim=8, kv_relay=True)
    assert (args.attn_tflops, args.intra_node_gbps, args.inter_node_gbps, args.gpus_per_node) == (400.0, 300.0, 50.0, 8)
    assert (default.attn_tflops, default.intra_node_gbps, default.inter_node_gbps, default.gpus_per_node) == \
        (400.0, 300.0, 50.0, 8)
    timing = default.at_gpu(0)
    assert (timing.attn_tflops, timing.intra_node_gbps, timing.inter_node_gbps, timing.gpus_per_node) == \
        (400.0, 300.0, 50.0, 8)
    assert args.no_local_first is False and timing.local_first is True


def test_ulysses_comm_bytes_by_hand():
    # 64 tokens, CP 4: a rank holds 16 tokens, sends 3/4 of (2*hq + 2*hkv)*d*elem = (8+4)*8*2 = 192 B/token
    intra, inter = ulysses_comm_bytes([64], 4, 4, 2, 8, 2, gpus_per_node=2)
    total = 16 * 192 * 3 / 4
    assert math.isclose(float(intra[0]), total / 3) and math.isclose(float(inter[0]), total * 2 / 3)


def test_wlb_repack_by_hand_and_preserves_segments():
    bins = wlb_repack([np.array([4, 3]), np.array([3, 2])], 2, cap_tokens=100)
    # 4 -> bin0 (16); 3 -> bin1 (9); 3 -> bin1 (18 > 16? no: bin1 load 9 < 16) ; 2 -> bin0 (16 < 18)
    assert sorted(map(sorted, (b.tolist() for b in bins))) == [[2, 4], [3, 3]]
    capped = wlb_repack([np.array([5, 5, 1, 1])], 2, cap_tokens=6)
    assert sorted(b.sum() for b in capped) == [6, 6]
    assert sequence_pair_heads([np.array([2, 3])], 4).tolist() == [4 * (3 + 6)]
