"""The prepared device check runs end to end on CPU (--dry-run): every section, JSON + text results."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECTIONS = {"backends", "sync_free", "overhead", "calibration", "straggler", "memory", "tables", "exchange",
            "step_model", "call_shapes", "pool_replay", "overhead_profile", "place_copies"}


def test_device_check_dry_run_writes_every_section(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)  # this interpreter, wherever its venv lives (LIBRA_VENV)
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks/gpu/run_all.sh"), "--dry-run", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert results["dry_run"] is True and set(results["sections"]) == SECTIONS
    sections = {k: v["result"] for k, v in results["sections"].items() if v["status"] == "ok"}
    assert set(sections) == SECTIONS, {k: v.get("error") for k, v in results["sections"].items()}
    assert sections["backends"]["torch"]["status"] == "ok"  # exact backend meets the rule in bf16
    assert sections["backends"]["torch_flash"]["status"] == "unavailable"  # and says why on CPU
    for mode in ("arranged", "refetch"):
        assert sections["memory"][mode]["saved_equals_predicted"], sections["memory"][mode]
    assert sections["tables"]["rows_equal_host_expansion"] and sections["tables"]["rows"] > 0
    exchange = sections["exchange"]  # a real 2-worker pool exchange: exact, tiles moved
    assert exchange["workers"] == 2 and exchange["errors_ok"] and exchange["bytes_exchanged"] > 0
    assert all(w["kernel_calls"] for w in exchange["per_worker"])
    assert exchange["receive_buffers_released"]  # no placed exchange holds its receive buffer at a kernel call
    step = sections["step_model"]  # the whole-layer model's compute part: fitted rates, world-1 pool priced
    assert step["arranged"]["predicted_fwd_s"] > 0 and step["measured_fwd_s"] > 0
    shapes = sections["call_shapes"]  # Libra-shaped kernel calls timed and priced by both model variants
    rows = json.loads((out / "call_shapes.json").read_text())["rows"]
    assert shapes["shapes"] == len(rows) > 0 and any(r["k_len"] > r["q_block"] for r in rows)
    for name in ("default", "calibrated"):
        assert shapes[f"{name}_fwd_predicted_over_measured"]["median"] > 0
        assert all(r[f"{name}_fwd_over_measured"] > 0 and r["fwd_s"] > 0 for r in rows)
    replay = sections["pool_replay"]  # real pools at the shipped knobs: every worker timed and priced
    for trace in ("linux", "wikipedia"):
        assert replay[trace]["measured_fwdbwd_max_over_mean"] >= 1.0
        assert replay[trace]["default"]["fwd"]["median"] > 0 and replay[trace]["default"]["fwdbwd_max_over_mean"] >= 1.0
    profiled = sections["overhead_profile"]  # the P=1 operator's time by kernel name, next to the bare kernel's
    assert profiled["bare"]["device_us_per_iter"] > 0 and profiled["H=1 M=1"]["top"]
    assert (out / "overhead_profile.txt").stat().st_size > 0
    place = sections["place_copies"]  # every placement variant writes the same rows
    assert all(place[k]["same_result"] and place[k]["seconds"] > 0 for k in place if isinstance(place[k], dict))
    pool = sections["straggler"]["pools"][0]
    assert pool["libra_fwd_max_over_mean"] >= 1.0 and pool["pred_eq6_ulysses"] >= 1.0
    for name in ("summary.txt", "device.txt", "log.txt"):
        assert (out / name).stat().st_size > 0

    table = json.loads((out / "calibration.json").read_text())
    assert set(table) == {"device", "head_dim", "entries"} and table["head_dim"] == 8
    assert {(e["block_tokens"], e["heads"]) for e in table["entries"]} == {(8, 1), (8, 2), (16, 1), (16, 2)}
    for e in table["entries"]:
        n = max(1, 32 // e["block_tokens"])  # dry run: 32 tokens per call
        assert e["pairs"] == n * e["block_tokens"] * (e["block_tokens"] + 1) // 2 and e["seconds"] > 0
    from libra_megatron.plan.model import CalibrationTable

    assert CalibrationTable.from_json(str(out / "calibration.json")).heads == (1, 2)  # the simulator reads it
