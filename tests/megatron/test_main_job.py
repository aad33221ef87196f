"""The main job's driver (libra_megatron.testing.train_cpu, run by scripts/main.sh): a short run writes a
consistent JSON summary. Parity itself is proven in test_e2e_parity.py; this checks the summary's fields."""
from __future__ import annotations

import json

import numpy as np
import pytest

from libra_megatron.testing import train_cpu

FIELDS = ("parity_ok", "max_rel_loss", "max_rel_grad_norm", "steps", "inter_pool_r1_before_mean",
          "lane_r1_before_mean", "lane_r1_after_mean",
          "inter_pool_r1_after_mean", "intra_pool_max_mean_home", "intra_pool_max_mean_placed", "bytes_per_step",
          "planner_ms_median")


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    work = tmp_path_factory.mktemp("main_job")
    path = work / "summary.json"
    code = train_cpu.run(["--compare", "--steps", "3", "--seq-len", "512", "--block-size", "64", "--max-docs", "800",
                           "--max-files", "5", "--workdir", str(work), "--json", str(path)])
    return code, json.loads(path.read_text())


def test_summary_has_every_field_and_agrees_with_the_exit_code(summary):
    code, s = summary
    assert all(k in s for k in FIELDS), sorted(set(FIELDS) - set(s))
    assert s["steps"] == 3 and s["config"]["seq_len"] == 512
    expected = max(s["max_rel_loss"], s["max_rel_grad_norm"]) < s["parity_rtol"] and s["same_step_multisets"]
    assert s["parity_ok"] is bool(expected) and s["parity_ok"]
    assert code == 0


def test_summary_shows_both_balancing_levels_and_real_planner_work(summary):
    _, s = summary
    assert s["inter_pool_r1_after_mean"] <= s["inter_pool_r1_before_mean"] + 1e-12
    # the shipped sync placement balances lanes: what it optimises goes down (issue 26's main-job floor)
    assert (s["lane_r1_after_mean"] <= 0.8 * s["lane_r1_before_mean"]
            or max(s["lane_r1_before_mean"], s["lane_r1_after_mean"]) <= 0.01), s
    assert 1.0 <= s["intra_pool_max_mean_placed"] <= s["intra_pool_max_mean_home"] + 1e-12
    assert s["bytes_per_step"] > 0 and s["plans_computed"] > 0 and s["planner_ms_median"] > 0
    assert "stdlib Qwen2 tokens" in s["data"]


def test_trace_documents_filled_from_a_token_stream_are_its_consecutive_slices(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from libra_megatron.megatron.corpus import build_indexed_dataset_from_trace

    stream = np.array([5, 6, 7, 8], dtype=np.int64)
    info = build_indexed_dataset_from_trace([3, 4, 2], str(tmp_path / "c"), vocab_size=10, eod=9, token_stream=stream)
    dataset = IndexedDataset(info.prefix)  # keep it open: items are views of its memory map
    docs = [np.asarray(dataset[i]).tolist() for i in range(3)]
    assert docs == [[5, 6, 9], [7, 8, 5, 9], [6, 9]] and not info.synthetic_tokens
    with pytest.raises(ValueError, match="must not contain eod"):
        build_indexed_dataset_from_trace([3], str(tmp_path / "d"), vocab_size=10, eod=9, token_stream=[1, 9])


def test_json_needs_a_libra_run():
    with pytest.raises(ValueError, match="--json summarises a Libra run"):
        train_cpu.run(["--baseline", "--json", "x.json"])
