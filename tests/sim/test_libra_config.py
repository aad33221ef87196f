"""``--libra-config FILE``: the YAML's knobs are the simulator's defaults, flags override them, bad files name the
file and key; ``--save-mode`` prices the backward in the mode the runtime would run (auto: the planner's rule)."""
import json
import pathlib

import numpy as np
import pytest

from libra_megatron.config import KvFetch, SaveModeName, SequencePlacement, TilePlacement, TilingPolicy
from libra_megatron.sim.__main__ import parse_args, run, spec_from_args
from libra_megatron.sim.spec import chunks_for_split

REPO = pathlib.Path(__file__).resolve().parents[2]
SYNTH = np.concatenate([np.arange(1, 400) % 23 + 1, [150, 90, 64, 200, 33, 120]])
LAYOUT = ["--seq-len", "262144", "--gbs", "128", "--dp", "32", "--cp", "8", "--model", "qwen3-30b-a3b"]
TINY = ["--seq-len", "64", "--gbs", "8", "--dp", "4", "--cp", "2", "--num-heads", "4", "--num-kv-heads", "2",
        "--head-dim", "8", "--gpus-per-node", "2", "--attn-tflops", "1e-6", "--intra-node-gbps", "1e-3",
        "--inter-node-gbps", "5e-4", "--no-progress", "--no-distca", "--max-windows", "3"]


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "synthetic.txt"
    path.write_text("\n".join(map(str, SYNTH)) + "\n")
    return str(path)


def _spec(argv):
    return spec_from_args(parse_args(["--trace", "unused.txt"] + argv))


def test_the_shipped_yaml_becomes_the_defaults():
    spec = _spec(LAYOUT + ["--libra-config", str(REPO / "configs/libra/256k.yaml")])
    assert (spec.pool_sizes, spec.head_splits, spec.block_sizes, spec.chunk_counts, spec.taus) == \
        ((8,), (2,), (2048,), ("auto",), (0.01,))
    # auto: each candidate's M is the K/V heads of a head shard (Qwen3-30B-A3B: 4 / H)
    assert [chunks_for_split(spec, h, "auto") for h in (1, 2, 4)] == [4, 2, 1]
    assert spec.tile_placement is TilePlacement.DENSE and spec.sequence_placement is SequencePlacement.SYNC
    assert spec.tilings == (TilingPolicy.ADAPTIVE,) and spec.kv_fetches == (KvFetch.PREFIX,)
    assert spec.cost.kv_relay is True  # kv_relay: auto
    assert spec.save_mode is SaveModeName.AUTO and spec.activation_budget_gb == 16.0  # LibraConfig's defaults
    assert spec.num_layers == 48 and spec.libra_config.endswith("256k.yaml")
    one_m = _spec(LAYOUT + ["--libra-config", str(REPO / "configs/libra/1m.yaml")])
    assert (one_m.head_splits, one_m.block_sizes, one_m.taus) == ((2,), (4096,), (0.01,))


def test_flags_override_the_yaml_and_keys_it_leaves_out_take_libra_config_defaults(tmp_path):
    spec = _spec(LAYOUT + ["--libra-config", str(REPO / "configs/libra/256k.yaml"), "--head-split", "2",
                           "--pool-size", "4", "8", "--tile-placement", "alg2", "--no-kv-relay", "--save-mode", "refetch"])
    assert spec.head_splits == (2,) and spec.pool_sizes == (4, 8) and spec.tile_placement is TilePlacement.ALG2
    assert spec.cost.kv_relay is False and spec.save_mode is SaveModeName.REFETCH
    assert spec.block_sizes == (2048,) and spec.taus == (0.01,)  # the rest still from the file
    partial = tmp_path / "partial.yaml"
    partial.write_text("libra:\n  pool_size: 4\n  save_mode: arranged\n")
    spec = _spec(LAYOUT + ["--libra-config", str(partial)])
    # what the runtime would run: LibraConfig's defaults for every key the file leaves out (relay off, H=1, alg2)
    assert spec.pool_sizes == (4,) and spec.head_splits == (1,) and spec.cost.kv_relay is False
    assert spec.tile_placement is TilePlacement.ALG2 and spec.save_mode is SaveModeName.ARRANGED
    assert _spec(LAYOUT + ["--libra-config", str(partial), "--kv-relay", "auto"]).cost.kv_relay is True
    assert _spec(LAYOUT).cost.kv_relay is True  # without a file: the simulator's own default (relay on)


@pytest.mark.parametrize("text,match", [
    ("libra:\n  pool_sise: 8\n", r"bad\.yaml:2: unknown Libra key 'pool_sise' \(did you mean 'pool_size'\?\)"),
    ("libra:\n  tau: -1\n", r"tau \(.*bad\.yaml:2\) must be a finite number >= 0, got -1"),
    ("libra:\n  head_split: 3\n", r"head_split \(.*bad\.yaml:2\) 3 must divide num_attention_heads 32"),
    ("libra:\n  pool_size: 3\n", r"pool_size \(.*bad\.yaml:2\) 3 must divide the data-parallel size 32"),
    ("libra:\n  tile_placement: best\n", r"tile_placement \(.*bad\.yaml:2\) must be one of"),
    ("libra: [\n", r"bad\.yaml:\d+:\d+: YAML syntax error"),
])
def test_a_bad_yaml_names_the_file_and_the_key(tmp_path, text, match):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ValueError, match=match):
        _spec(LAYOUT + ["--libra-config", str(bad)])


def test_an_overridden_yaml_value_is_checked_under_its_flag(tmp_path):
    bad = tmp_path / "h3.yaml"
    bad.write_text("libra:\n  head_split: 3\n")
    spec = _spec(LAYOUT + ["--libra-config", str(bad), "--head-split", "4"])  # the flag wins: no error
    assert spec.head_splits == (4,)
    with pytest.raises(ValueError, match=r"--libra-config nope\.yaml"):
        _spec(LAYOUT + ["--libra-config", "nope.yaml"])


def test_end_to_end_with_a_yaml_and_the_save_modes(trace_path, tmp_path):
    """The same tiny run from a YAML and from the flags is the same report; refetch re-sends Q, K|V and O in the
    backward, so its backward is never faster; auto with a zero budget picks refetch on every pool."""
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("libra:\n  pool_size: 2\n  head_split: 2\n  block_size: 8\n  num_chunks: 2\n  kv_relay: auto\n"
                   "  save_mode: arranged\n")
    reports = {}
    for name, extra in (("yaml", ["--libra-config", str(cfg)]),
                        ("flags", ["--pool-size", "2", "--head-split", "2", "--block-size", "8", "--num-chunks", "2",
                                   "--save-mode", "arranged"]),
                        ("refetch", ["--libra-config", str(cfg), "--save-mode", "refetch"]),
                        ("auto0", ["--libra-config", str(cfg), "--save-mode", "auto", "--activation-budget-gb", "0"])):
        out = tmp_path / f"{name}.json"
        assert run(["--trace", trace_path, "--json", str(out)] + TINY + extra) == 0
        reports[name] = json.loads(out.read_text())
        reports[name].pop("runtime_seconds")
    (yaml_c,), (flag_c,) = reports["yaml"]["candidates"], reports["flags"]["candidates"]
    assert yaml_c == flag_c
    assert reports["yaml"]["assumptions"]["libra_config"] == str(cfg)
    (arr,), (ref,), (auto,) = (reports[k]["candidates"] for k in ("yaml", "refetch", "auto0"))
    assert arr["save_mode_pools"]["refetch"] == 0 and ref["save_mode_pools"]["arranged"] == 0
    assert auto == ref  # every pool over a zero budget: refetch
    assert ref["straggler_split"]["backward"]["seconds"] >= arr["straggler_split"]["backward"]["seconds"]
    assert ref["straggler_split"]["forward"] == arr["straggler_split"]["forward"]  # the forward does not change
    assert ref["forward_straggler_vs_lower_bound"] == arr["forward_straggler_vs_lower_bound"]


def test_auto_budgets_the_layers_alive_under_recompute(trace_path, tmp_path):
    """--recompute-num-layers (default 1, the shipped configs' full recompute): save_mode auto's budget covers that
    many layers; 0 = no recompute, every layer of the stage. A budget that one layer fits and 10^7 layers do not
    keeps the arranged tensors only under recompute."""
    assert _spec(LAYOUT).saved_layers == 1
    assert _spec(LAYOUT + ["--recompute-num-layers", "0"]).saved_layers == 48  # the Qwen3-30B-A3B preset
    assert _spec(LAYOUT + ["--recompute-num-layers", "0", "--pp", "2"]).saved_layers == 24
    assert _spec(LAYOUT + ["--recompute-num-layers", "4"]).saved_layers == 4
    with pytest.raises(ValueError, match="--recompute-num-layers must be >= 0"):
        _spec(LAYOUT + ["--recompute-num-layers", "-1"])
    modes = {}
    for n in ("0", "1"):
        out = tmp_path / f"r{n}.json"
        assert run(["--trace", trace_path, "--json", str(out), "--pool-size", "2", "--head-split", "2", "--block-size",
                    "8", "--num-chunks", "2", "--save-mode", "auto", "--activation-budget-gb", "1e-3", "--num-layers",
                    "10000000", "--recompute-num-layers", n] + TINY) == 0
        (cand,) = json.loads(out.read_text())["candidates"]
        modes[n] = cand["save_mode_pools"]
    assert modes["0"]["arranged"] == 0 and modes["0"]["refetch"] > 0
    assert modes["1"]["refetch"] == 0 and modes["1"]["arranged"] > 0


def _tiny_with_heads(num_heads: int, num_kv_heads: int) -> list:
    """TINY's flags with the model's heads replaced."""
    argv = list(TINY)
    argv[argv.index("--num-heads") + 1], argv[argv.index("--num-kv-heads") + 1] = str(num_heads), str(num_kv_heads)
    return argv


def test_tp_prices_the_heads_of_one_tensor_parallel_rank(trace_path, tmp_path):
    """``--tp 2`` over 8 / 4 heads prices exactly the run given 4 / 2 heads (what each TP rank runs), and says so."""
    reports = {}
    for name, argv in (("tp2", _tiny_with_heads(8, 4) + ["--tp", "2"]), ("per_rank", _tiny_with_heads(4, 2))):
        out = tmp_path / f"{name}.json"
        assert run(["--trace", trace_path, "--json", str(out), "--pool-size", "2"] + argv) == 0
        reports[name] = json.loads(out.read_text())
    tp2, per_rank = reports["tp2"], reports["per_rank"]
    assert (tp2["assumptions"]["num_heads"], tp2["assumptions"]["num_kv_heads"]) == (4, 2)
    assert tp2["assumptions"]["sync"]["tp"] == 2 and per_rank["assumptions"]["sync"]["tp"] == 1
    assert "tensor-parallel rank" in tp2["assumptions"]["heads"]
    assert tp2["candidates"] == per_rank["candidates"]


def test_the_text_report_names_the_heads_of_one_tensor_parallel_rank(trace_path, capsys):
    assert run(["--trace", trace_path, "--pool-size", "2", "--tp", "2"] + _tiny_with_heads(8, 4)) == 0
    assert "heads per TP rank 4/2 x 8 (TP=2)" in capsys.readouterr().out
