"""Sync model and sync-aware VRSP on the shipped traces: per-instance and sync-model figures side by side,
and the lane-balance floor checked from ``--dump-orders`` alone.

Run:  .venv/bin/python benchmarks/bench_sync.py [--windows N] [--pp 1 2] [--jobs N] [--traces PATH ...]

Layout (issue 16's spike and its knobs, not today's shipped ones): dense Qwen3-8B attention (hq=32, hkv=8, d=128,
bf16), 256K packed sequences, GBS=128, DP=32, CP=8, every head on each GPU (issue 16's spike layout, kept so its
figures compare; the shipped configs/qwen3-8b-256k.args runs TP2 x CP4, which the simulator prices with --tp 2
--cp 4) -> 4 lanes x GA 4; P=8, H=2, B=4096, M=4, tau=0.03, adaptive tiles, prefix KV fetch, Alg. 2 tiles, no K/V
relay; --pp 1 and 2 (1F1B). Every number is the simulator's estimate (its time model), not a measurement. For each (trace, PP) one ``python -m libra_megatron.sim``
run (the command is printed) reports:
    per-instance   straggler_vs_lower_bound of ours (sync VRSP) and of Alg. 1 (the ``tap_vrsp`` baseline's
                   order, same tiles): every GA step waits for the slowest pool of the whole DP
    sync model     sync_straggler_vs_lower_bound of ours / Alg. 1 / sampler order, and the pipeline bubble
    lane R-1       max/mean - 1 of lane totals of F = sum l^2: VRSP's F stage (the lanes ``plan.sequences.lanes.
                   lane_members`` cuts from the dump's sequences) vs an LPT reference, and the placed order's
                   (the dump's): at PP = 1 the placement then swaps pools between lanes until their priced seconds
                   are even (``priced_lanes.balance_lane_seconds``), which moves their F totals
The floor (issue 16): at PP=1, the F stage <= LPT reference + 0.01 in every window; sync ours <= sync Alg. 1.

LPT reference (independent of ``plan``): sort the window's sequences by F (decreasing, index on ties) and give
each to the lightest lane that still has room for GA*P sequences. Lanes of an order follow the dump's convention
(``plan.sequences.assign_to_ranks``): positions k*P .. k*P+P-1 are pool instance k, which runs on DP ranks
(k mod DP/P)*P + j, i.e. in lane k mod DP/P.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Sequence

import numpy as np

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TRACES = ("data/traces/linux-6.12-files.qwen.txt", "data/traces/wikipedia-flexsp.txt")
FLOOR_SLACK = 0.01


def sim_command(trace: str, pp: int, windows: int, jobs: int, json_path: str, dump_path: str) -> List[str]:
    cmd = [sys.executable, "-m", "libra_megatron.sim", "--trace", trace, "--seq-len", "262144", "--gbs", "128",
           "--dp", "32", "--cp", "8", "--pool-size", "8", "--head-split", "2", "--block-size", "4096",
           "--num-chunks", "4", "--tau", "0.03", "--model", "qwen3-8b", "--pp", str(pp), "--no-distca",
           "--no-progress", "--jobs", str(jobs), "--json", json_path, "--dump-orders", dump_path,
           "--tile-placement", "alg2", "--no-kv-relay"]  # the knobs this benchmark was measured at
    return cmd + (["--max-windows", str(windows)] if windows else [])


def sequence_loads(seq_docs: Sequence[Sequence[int]]) -> np.ndarray:
    """F_i = sum of squared document lengths of packed sequence i (Eq. 4's proxy)."""
    return np.array([float(np.sum(np.square(np.asarray(d, dtype=np.float64)))) for d in seq_docs])


def order_lane_totals(loads: np.ndarray, order: Sequence[int], dp: int, pool: int) -> np.ndarray:
    """Lane totals of an order under the dump's convention (pool instance k in lane k mod DP/P)."""
    lanes = dp // pool
    totals = np.zeros(lanes)
    for k in range(len(order) // pool):
        totals[k % lanes] += loads[list(order[k * pool:(k + 1) * pool])].sum()
    return totals


def lpt_lane_totals(loads: np.ndarray, num_lanes: int, lane_size: int) -> np.ndarray:
    """Exact-cardinality LPT: heaviest first, each to the lightest lane with room (lowest index on ties)."""
    totals, counts = np.zeros(num_lanes), np.zeros(num_lanes, dtype=np.int64)
    for i in sorted(range(loads.size), key=lambda i: (-loads[i], i)):
        open_lanes = [j for j in range(num_lanes) if counts[j] < lane_size]
        j = min(open_lanes, key=lambda j: (totals[j], j))
        totals[j] += loads[i]
        counts[j] += 1
    return totals


def r_minus_1(totals: np.ndarray) -> float:
    return float(totals.max() / totals.mean() - 1.0) if totals.mean() > 0 else 0.0


def check_dump(lines: Sequence[Dict], enforce: bool) -> Dict[str, float]:
    """Lane R-1 of every dumped window: VRSP's F stage against the LPT reference (with ``enforce`` an AssertionError
    when a window breaks the floor, F stage <= LPT + 0.01), and the placed order's."""
    from libra_megatron.plan.sequences import SyncLayout
    from libra_megatron.plan.sequences.lanes import lane_members

    ours, lpt, placed = [], [], []
    for rec in lines:
        loads = sequence_loads(rec["seq_docs"])
        dp, pool, ga = rec["dp"], rec["pool_size"], rec["ga"]
        assert sorted(rec["order"]) == list(range(len(rec["seq_docs"]))) == list(range(dp * ga))
        ours.append(r_minus_1(loads[lane_members(loads, SyncLayout(dp, pool, ga))].sum(axis=1)))
        placed.append(r_minus_1(order_lane_totals(loads, rec["order"], dp, pool)))
        lpt.append(r_minus_1(lpt_lane_totals(loads, dp // pool, ga * pool)))
        assert not enforce or ours[-1] <= lpt[-1] + FLOOR_SLACK, (rec["window"], ours[-1], lpt[-1])
    return {"ours": float(np.mean(ours)), "lpt": float(np.mean(lpt)), "placed": float(np.mean(placed)),
            "worst_excess": float(np.max(np.subtract(ours, lpt)))}


def _row(trace: str, pp: int, report: Dict, lanes: Dict[str, float]) -> str:
    c = report["candidates"][0]
    per_alg1 = c["baselines"]["tap_vrsp"]["mean_step_seconds"] * c["straggler_vs_lower_bound"] / c["estimated_step_seconds"]
    bubble = (f"{c['pipeline_bubble_fraction']:.3f} / {c['pipeline_bubble_fraction_alg1']:.3f} / "
              f"{c['pipeline_bubble_fraction_contiguous']:.3f}" if pp > 1 else "-")
    return (f"| {os.path.basename(trace).split('-')[0]} | {pp} | {c['straggler_vs_lower_bound']:.3f} | {per_alg1:.3f} | "
            f"{c['sync_straggler_vs_lower_bound']:.3f} | {c['sync_straggler_vs_lower_bound_alg1']:.3f} | "
            f"{c['sync_straggler_vs_lower_bound_contiguous']:.3f} | {bubble} | {lanes['ours']:.4f} | {lanes['lpt']:.4f} | "
            f"{lanes['placed']:.4f} | {c['lane_imbalance']['alg1']:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=0, help="first N windows (default: all)")
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--traces", nargs="+", default=list(TRACES))
    args = parser.parse_args()
    rows = ["| trace | PP | per-instance ours | per-instance Alg. 1 | sync ours | sync Alg. 1 | sync sampler order | "
            "bubble ours / Alg. 1 / sampler | lane R-1 F stage | lane R-1 LPT ref. | lane R-1 placed | lane R-1 Alg. 1 |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for trace in args.traces:
            for pp in args.pp:
                json_path, dump_path = os.path.join(tmp, "out.json"), os.path.join(tmp, "orders.jsonl")
                cmd = sim_command(trace, pp, args.windows, args.jobs, json_path, dump_path)
                print("$ " + " ".join(cmd[1:]).replace(tmp + "/", ""), flush=True)
                subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
                with open(json_path, encoding="utf-8") as handle:
                    report = json.load(handle)
                with open(dump_path, encoding="utf-8") as handle:
                    lanes = check_dump([json.loads(line) for line in handle], enforce=pp == 1)
                c = report["candidates"][0]
                assert c["sync_straggler_vs_lower_bound"] <= c["sync_straggler_vs_lower_bound_alg1"] + 1e-12, c
                rows.append(_row(trace, pp, report, lanes))
                print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
