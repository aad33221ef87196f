"""The prepared GPU calibration script runs end to end on CPU (--dry-run) and writes the simulator's JSON."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_calibrate_dry_run_writes_schema_with_exact_pair_counts(tmp_path):
    out = tmp_path / "cal.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks/gpu/calibrate.py"), "--dry-run",
                           "--repeats", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert set(data) == {"device", "head_dim", "entries"} and isinstance(data["device"], str)
    assert data["head_dim"] == 8
    grid = {(e["block_tokens"], e["heads"]) for e in data["entries"]}
    assert grid == {(8, 1), (8, 2), (16, 1), (16, 2)}
    for e in data["entries"]:
        n = max(1, 32 // e["block_tokens"])  # dry run: 32 tokens per call
        assert e["pairs"] == n * e["block_tokens"] * (e["block_tokens"] + 1) // 2  # per head (sim/cost.py)
        assert e["seconds"] > 0
    assert "P=1 operator overhead" in proc.stdout
    from libra_megatron.sim.cost import CalibrationTable

    table = CalibrationTable.from_json(str(out))  # the simulator accepts it
    assert table.head_dim == 8 and table.heads == (1, 2)
