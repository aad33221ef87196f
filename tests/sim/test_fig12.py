"""``--fig12`` (sim/fig12.py): Ulysses' per-microbatch forward by hand from the packed segments, Libra's from the
simulator's own pools (max over each pool's workers, lane -> replicas), the normalisation and the reduction on
hand-made seconds, the paper's constant, the JSON and the PNG, and the flag errors."""
import json
import pathlib

import numpy as np
import pytest

from libra_megatron.plan.packing import pack_documents
from libra_megatron.plan.sequences import place_sequences
from libra_megatron.sim import fig12 as F
from libra_megatron.sim import runner as R
from libra_megatron.sim.__main__ import build_parser, main, run, spec_from_args

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = np.concatenate([np.arange(1, 300) % 29 + 1, [64, 150, 90, 64, 200, 33, 120, 64]])
HQ, HKV, D, E = 4, 2, 8, 2
TFLOPS, GBPS, COLL_US, MSG_US, LAUNCH_US = 1e-6, 1e-3, 7.0, 3.0, 5.0
FLAGS = ["--seq-len", "64", "--gbs", "8", "--dp", "2", "--cp", "2", "--pp", "2", "--pool-size", "2",
         "--head-split", "1", "--block-size", "8", "--num-heads", str(HQ), "--num-kv-heads", str(HKV),
         "--head-dim", str(D), "--num-chunks", "2", "--gpus-per-node", "2", "--attn-tflops", str(TFLOPS),
         "--intra-node-gbps", str(GBPS), "--inter-node-gbps", "5e-4", "--collective-us", str(COLL_US),
         "--intra-message-us", str(MSG_US), "--kernel-launch-us", str(LAUNCH_US), "--no-progress", "--fig12"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "docs.txt"
    path.write_text("\n".join(map(str, DOCS)) + "\n")
    return str(path)


def _report(trace, tmp_path, extra=()):
    out = tmp_path / "fig12.json"
    assert run(["--trace", trace, "--json", str(out)] + FLAGS + list(extra)) == 0
    return json.loads(out.read_text())


def _ulysses_forward_by_hand(segments, seq_len=64, cp=2):
    """One CP group of 2 on one node: compute of hq * sum l(l+1)/2 / CP at 4*d FLOPs per pair-head, one launch,
    four all-to-alls (Q, K, V, O: hq, hkv, hkv, hq heads) of L/CP tokens x (CP-1)/CP, each 7 us + bytes/bw +
    one same-node peer x 3 us."""
    pair_heads = HQ * sum(int(l) * (int(l) + 1) / 2 for l in segments)
    compute = 4 * D * pair_heads / cp / (TFLOPS * 1e12)
    calls = [COLL_US * 1e-6 + seq_len / cp * h * D * E * (cp - 1) / cp / (GBPS * 1e9) + MSG_US * 1e-6
             for h in (HQ, HKV, HKV, HQ)]
    return compute + LAUNCH_US * 1e-6 + sum(calls)


def _raw(report, method):
    """[windows, GA, DP] seconds: the normalised samples times Libra's mean of each window."""
    means = np.array([w["libra_mean_seconds"] for w in report["per_window"]])
    return np.asarray(report["samples"][method]) * means[:, None, None]


def test_ulysses_samples_are_each_sequence_forward_in_sampler_order_by_hand(trace, tmp_path):
    report = _report(trace, tmp_path)
    segments = pack_documents(DOCS, 64, "megatron", 1234)
    raw = _raw(report, "ulysses")
    assert raw.shape == (len(segments) // 8, 4, 2)  # windows x GA (8 / DP 2) x DP
    for w, window in enumerate(raw):
        for g in range(4):
            for r in range(2):  # sequence g*DP + r of the window runs on replica r at GA step g
                expected = _ulysses_forward_by_hand(segments[w * 8 + g * 2 + r])
                assert window[g, r] == pytest.approx(expected, rel=1e-9)


def test_libra_samples_are_the_pool_maxima_of_the_shipped_placement_per_replica_of_its_lane(trace, tmp_path):
    extra = ["--dp", "4", "--gbs", "16"]  # 2 lanes of P=2 replicas, GA 4
    report = _report(trace, tmp_path, extra)
    spec = spec_from_args(build_parser().parse_args(["--trace", trace] + FLAGS + extra))
    corpus, num_windows, ev = R.prepare_corpus(DOCS, spec, 1)
    knobs = R._make_candidates(spec)[0].knobs
    raw = _raw(report, "libra")
    assert raw.shape == (num_windows, 4, 4)
    for w in range(num_windows):
        ids = np.arange(w * 16, (w + 1) * 16)
        order = place_sequences(corpus.flops[ids], 2, spec.sequence_placement, spec.sync_layout(2),
                                R.window_pool_seconds(corpus, ids, 2, spec))  # PP=2: pools priced by the proxy
        for k in range(8):  # pool k: GA step k*P // DP = k // 2, lane k % 2 = replicas 2*(k % 2), 2*(k % 2) + 1
            pool = ev.evaluate(ids[order[2 * k:2 * k + 2]], knobs, spec.tile_placement, (k % 2) * 2 * 2)
            expected = pool.fwd_seconds.max()  # the exchange couples the pool: it waits for its slowest worker
            lane = 2 * (k % 2)
            assert raw[w, k // 2, lane:lane + 2] == pytest.approx([expected, expected], rel=1e-9)
        ev.clear()
    assert [np.mean(s) for s in report["samples"]["libra"]] == pytest.approx([1.0] * num_windows)


def test_normalisation_by_each_windows_libra_mean_and_the_reduction_is_the_ratio_of_worsts(trace):
    spec = spec_from_args(build_parser().parse_args(["--trace", trace] + FLAGS))  # GA 4, DP 2
    libra = [np.array([[1.0, 3.0]] * 4), np.full((4, 2), 4.0)]  # window means 2 and 4
    ulysses = [np.array([[8.0, 1.0], [0.5, 2.0], [2.0, 2.0], [2.0, 2.0]]), np.array([[4.0, 4.0]] * 3 + [[4.0, 20.0]])]
    result = F.Fig12Result(spec, {"ulysses": ulysses, "libra": libra}, {"sequence_spread": [3.0, 5.0],
                                                                        "libra_floor": [1.2, 1.1]})
    report = result.to_json()
    # window 0 / 2: ulysses 4 .5 .25 1 1 1 1 1 (sum 9.75), libra .5 1.5 (x4); window 1 / 4: ulysses 1 (x7) 5 (sum 12),
    # libra 1 (x8)
    assert report["normalised"]["ulysses"] == pytest.approx({"min": 0.25, "mean": 21.75 / 16, "max": 5.0})
    assert report["normalised"]["libra"] == pytest.approx({"min": 0.5, "mean": 1.0, "max": 1.5})
    assert report["worst_reduction"] == pytest.approx(5.0 / 1.5)
    assert report["ulysses_spread"] == pytest.approx(5.0 / (21.75 / 16))
    assert report["trace"] == {"sequence_spread_max": 5.0, "libra_floor_max": 1.2}
    assert [w["ulysses_max"] for w in report["per_window"]] == pytest.approx([4.0, 5.0])
    assert report["paper"] is None and report["paper_layout"] is None
    assert report["samples_per_window"] == 8 and report["ranks_per_sample"] == 4  # PP 2 x CP 2


def _paper_spec(name):
    lay = F.PAPER_FIG12[name]["layout"]
    argv = ["--trace", "x", "--seq-len", str(lay["seq_len"]), "--gbs", str(lay["gbs"]), "--dp", str(lay["dp"]),
            "--pp", str(lay["pp"]), "--cp", str(lay["cp"]), "--pool-size", "4", "--head-split", "2",
            "--block-size", "8192", "--model", "qwen3-30b-a3b"]
    return spec_from_args(build_parser().parse_args(argv))


@pytest.mark.parametrize("worst_ulysses, expected", [(3.0, "smaller Ulysses spread"), (25.0, "as large as"),
                                                     (200.0, "meets the paper")])
def test_the_paper_layout_is_recognised_and_the_verdict_separates_a_smaller_spread(worst_ulysses, expected):
    spec = _paper_spec("1M")  # GA 8, DP 4
    libra = np.ones((8, 4))
    libra[0, :] = 2.0  # worst 2 / mean 1.125
    ulysses = np.ones((8, 4))
    ulysses[3, 1] = worst_ulysses * 1.125
    report = F.Fig12Result(spec, {"ulysses": [ulysses], "libra": [libra]},
                           {"sequence_spread": [1.0], "libra_floor": [1.0]}).to_json()
    assert report["paper_layout"] == "1M" and report["paper"]["worst_reduction"] == 14.7
    assert report["worst_reduction"] == pytest.approx(worst_ulysses / (2.0 / 1.125))
    assert expected in report["verdict"]
    assert ("cannot exceed about P = 4" in report["verdict"]) == (expected != "meets the paper")  # 14.7 > P
    assert "Fig. 12" in report["paper"]["citation"]


def test_paper_constant_factors_are_the_ratio_of_its_worst_microbatches():
    for name, entry in F.PAPER_FIG12.items():
        ratio = entry["ulysses"]["max"] / entry["libra"]["max"]
        assert ratio == pytest.approx(entry["worst_reduction"], abs=0.06), name  # 23.1 / 1.57, 6.98 / 2.63
    assert F.PAPER_FIG12["256K"]["layout"] == {"seq_len": 262144, "dp": 4, "pp": 2, "cp": 8, "gbs": 128}
    assert F.PAPER_FIG12["1M"]["layout"] == {"seq_len": 1048576, "dp": 4, "pp": 2, "cp": 16, "gbs": 32}
    assert _paper_spec("256K") and F.paper_entry(_paper_spec("256K"))[0] == "256K"


def test_cli_prints_the_table_and_writes_the_json_and_the_png(trace, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, plots = tmp_path / "f.json", tmp_path / "plots"
    assert run(["--trace", trace, "--json", str(out), "--plots", str(plots)] + FLAGS) == 0
    text = capsys.readouterr().out
    assert "Fig. 12" in text and "worst microbatch reduced" in text and "Ulysses" in text
    report = json.loads(out.read_text())
    assert {"figure", "layout", "libra", "normalised", "worst_reduction", "ulysses_spread", "trace", "per_window",
            "samples", "paper", "verdict", "definition", "assumptions"} <= set(report)
    assert set(report["normalised"]) == {"ulysses", "libra"}
    assert report["libra"]["sequence_placement"] == "sync" and report["layout"]["pp"] == 2
    png = plots / F.FIG12_PNG
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("change, message", [
    (["--pool-size", "2", "4", "--dp", "4", "--gbs", "16"],
     r"--fig12 prices one Libra configuration .*--pool-size has 2 values \(2 4\)"),
    (["--gbs", "9"], r"--gbs 9 must be divisible by --dp 2 \(9 % 2 = 1\)"),
    (["--dp", "4", "--gbs", "16", "--pool-size", "3"], r"--pool-size 3 must divide --dp 4 \(4 % 3 = 1\)"),
    (["--tau", "0.01", "0.03"], r"--tau has 2 values"),
    (["--dump-orders", "/tmp/never.jsonl"], r"--fig12 does not run --dump-orders"),
])
def test_bad_layouts_and_flags_name_the_flag_and_the_arithmetic(trace, change, message):
    argv = ["--trace", trace] + FLAGS + change
    with pytest.raises(ValueError, match=message):
        run(argv)


def test_the_shipped_yaml_pool_size_at_the_papers_dp_is_one_line_naming_the_key(trace, capsys):
    argv = ["--trace", trace, "--seq-len", "64", "--gbs", "8", "--dp", "4", "--cp", "2", "--pp", "2",
            "--model", "qwen3-30b-a3b", "--libra-config", str(REPO / "configs/libra/256k.yaml"), "--fig12"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pool_size (" in err[0] and "8 must divide the data-parallel size 4 (4 % 8 = 4)" in err[0]
