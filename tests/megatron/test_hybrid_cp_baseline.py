"""Megatron-LM's own BalancedCPScheduler as the simulator's hybrid-CP baseline (megatron/hybrid_cp_baseline.py)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from libra_megatron.plan.packing import pack_documents
from libra_megatron.plan.traces import load_trace
from libra_megatron.sim.hybrid_cp import subprocess_scheduler

from conftest import LINUX_TRACE

pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")


@pytest.fixture(scope="module")
def window():
    seqs = pack_documents(load_trace(LINUX_TRACE)[:3000], 16384, "megatron", 5)[:16]
    return np.concatenate(seqs).astype(int).tolist()


def _check_schedule(schedule, lens, dp_cp, cap):
    """Every document runs in exactly one group, on a power-of-two CP group of at least ceil(l / cap) GPUs,
    and every GPU of every group has work (Megatron fills empty GPUs by doubling CP groups)."""
    seen = {}
    for g, group in enumerate(schedule):
        assert len(group) == dp_cp and all(group), f"group {g} leaves a GPU idle"
        for gpu, docs in enumerate(group):
            for d in docs:
                seen.setdefault(d, set()).add((g, gpu))
    assert sorted(seen) == list(range(len(lens)))
    for d, where in seen.items():
        groups = {g for g, _ in where}
        assert len(groups) == 1, f"document {d} runs in groups {groups}"
        cp = len(where)
        assert cp & (cp - 1) == 0 and cp >= 2 ** math.ceil(math.log2(max(lens[d] / cap, 1)))


def test_schedule_window_runs_megatrons_balancer(window):
    from libra_megatron.megatron.hybrid_cp_baseline import schedule_window

    schedule = schedule_window(window, 16, 2048)
    _check_schedule(schedule, window, 16, 2048)


def test_subprocess_scheduler_gives_the_in_process_schedule(window):
    from libra_megatron.megatron.hybrid_cp_baseline import schedule_window

    got = subprocess_scheduler()([window, window[:200]], 16, 2048)
    assert got == [schedule_window(window, 16, 2048), schedule_window(window[:200], 16, 2048)]


def test_subprocess_without_megatron_is_one_value_error(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named megatron' >&2\nexit 1\n")
    fake_python.chmod(0o755)
    with pytest.raises(ValueError, match="--megatron-hybrid-cp: .* failed \\(ModuleNotFoundError: No module named "
                                         "megatron\\); it needs megatron-core"):
        subprocess_scheduler(str(fake_python))([[5, 6]], 2, 4)


def test_simulator_cli_reports_megatron_hybrid_cp(tmp_path):
    out = tmp_path / "o.json"
    cmd = [sys.executable, "-m", "libra_megatron.sim", "--trace", LINUX_TRACE, "--seq-len", "16384", "--gbs", "8",
           "--dp", "4", "--cp", "2", "--pool-size", "2", "--block-size", "2048", "--model", "qwen3-8b",
           "--max-windows", "1", "--no-progress", "--no-distca", "--megatron-hybrid-cp", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    meg = report["baselines"]["megatron_hybrid_cp"]
    assert meg["max_seqlen_per_rank"] == 8192
    assert report["megatron_hybrid_cp_straggler_vs_lower_bound"] == meg["straggler_vs_lower_bound"] >= 1.0
    assert "Megatron-LM hybrid CP (BalancedCPScheduler" in proc.stdout
