"""tau and M sweeps of the simulator (review objections 2 and 4) on a tiny SYNTHETIC trace."""

import numpy as np
import pytest

from libra_megatron.sim.__main__ import build_parser, run, spec_from_args
from libra_megatron.sim.report import format_table
from libra_megatron.sim.runner import run_simulation

# synthetic long-tailed lengths: many short documents and a few long ones (deterministic)
SYNTH = np.concatenate([np.arange(1, 400) % 23 + 1, [150, 90, 64, 200, 33, 120]])
# hq 8, hkv 2 (GQA group 4): V_g = kv_bytes_per_token is the same for M = 1, 2 and doubles at M = 4
# (chunk pieces of 2 query heads share one kv head), so M = 4 also changes the Eq. 8 placement.
FLAGS = ["--seq-len", "64", "--gbs", "8", "--dp", "4", "--cp", "2", "--pool-size", "2", "--head-split", "1",
         "--block-size", "8", "--num-heads", "8", "--num-kv-heads", "2", "--head-dim", "8", "--gpus-per-node", "2",
         "--attn-tflops", "1e-6", "--intra-node-gbps", "1e-3", "--inter-node-gbps", "5e-4", "--no-progress"]
TAUS, CHUNKS = ("0", "0.5"), ("1", "2", "4")


def _report(extra):
    spec = spec_from_args(build_parser().parse_args(["--trace", "unused"] + FLAGS + extra))
    return run_simulation(SYNTH, spec).to_json()


@pytest.fixture(scope="module")
def swept():
    return _report(["--tau", *TAUS, "--num-chunks", *CHUNKS])


def test_swept_candidate_equals_the_single_value_run(swept):
    assert [(c["tau"], c["num_chunks"]) for c in swept["candidates"]] == [
        (float(t), int(m)) for t in TAUS for m in CHUNKS]
    for cand in swept["candidates"]:
        single = _report(["--tau", str(cand["tau"]), "--num-chunks", str(cand["num_chunks"])])
        assert single["candidates"] == [cand]
        assert single["baselines"] == swept["baselines"]


def test_tau_changes_intra_pool_placement(swept):
    by_tau = {c["tau"]: c for c in swept["candidates"] if c["num_chunks"] == 1}
    # tau = slack above the mean worker load that Alg. 2 accepts before it migrates a tile
    assert by_tau[0.0]["intra_pool_imbalance"] < 0.1 < by_tau[0.5]["intra_pool_imbalance"]
    assert by_tau[0.5]["bytes_per_layer"]["q"] < by_tau[0.0]["bytes_per_layer"]["q"]  # fewer tiles migrate


def test_m_changes_exposure_and_shared_kv_bytes(swept):
    by_m = {c["num_chunks"]: c for c in swept["candidates"] if c["tau"] == 0.0}
    kv = {m: c["bytes_per_layer"]["kv"] for m, c in by_m.items()}
    assert kv[1] == kv[2] and kv[4] > kv[2]  # V_g doubles once two chunk pieces read the same kv head
    assert by_m[2]["estimated_step_seconds"] < by_m[1]["estimated_step_seconds"]  # M=1 overlaps nothing


def test_table_shows_tau_and_m_columns_only_when_swept(swept):
    header = format_table(swept).splitlines()[0].split()
    assert header[:5] == ["P", "H", "B", "tau", "M"]
    assert "recommended P=2 H=1 B=8 tau=" in format_table(swept)
    single = format_table(_report([]))
    assert single.splitlines()[0].split()[:4] == ["P", "H", "B", "tiles"] and " tau=" not in single
    assert sum("<- recommended" in row for row in format_table(swept).splitlines()) == 1


@pytest.mark.parametrize("heads, chunks, match", [
    (["--num-heads", "8"], ["1", "3"],
     r"--num-chunks 3 must divide num_attention_heads/--head-split = 8/1 = 8"),
    (["--num-heads", "12"], ["3"], r"--num-chunks 3 .*= 12/\(1\*3\) = 4 must be a multiple or a divisor of the GQA "
                                   r"group size 12/2 = 6"),
])
def test_bad_num_chunks_value_names_the_flag_and_the_arithmetic(tmp_path, heads, chunks, match):
    trace = tmp_path / "synthetic.txt"
    trace.write_text("\n".join(map(str, SYNTH)) + "\n")
    with pytest.raises(ValueError, match=match):
        run(["--trace", str(trace)] + FLAGS + heads + ["--num-chunks", *chunks])
