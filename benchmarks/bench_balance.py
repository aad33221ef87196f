"""Balance of VRSP (inter-pool) and TAP (intra-pool) on the shipped real traces; tilings and KV fetch side by side.

Run:  .venv/bin/python benchmarks/bench_balance.py [--windows N] [--cases NAME ...] [--head-splits H ...]
                                                   [--skip-inter] [--jobs N]

Inter-pool (P=8; 256K: GBS=128, 1M: GBS=32): mean over windows of R-1 (max/mean pool load - 1) for
contiguous, Alg. 1, refined, and two lower bounds (the simple outlier/mean bound and the counting bound).

Intra-pool: one simulator run per case (``sim.run_simulation``, every GBS window unless --windows),
Qwen3-30B-A3B attention (hq=32, hkv=4, d=128, bf16), P=8, M=4, tau=0.03, refined VRSP + Alg. 2, H=1 (the
paper's) and H=2 (the shipped configs), candidates uniform|adaptive tiling x group|prefix KV fetch, so the
paper's uniform+group at H=1 is in the same run:
    max/mean   worker max/mean of Eq. 6 loads: mean over pools and the worst pool (target <= 1+tau+0.005)
    tiles      SH-Tiles per pool; Q/KV/O GB remote bytes per pool per layer forward (exchange-plan totals)
    step ms    the simulator's estimated step (per attention layer forward; its time model, not a measurement)
    vs LB      estimated straggler over the perfectly balanced, communication-free lower bound
(Splitting rules and Eq. 8 costing are compared in ``benchmarks/bench_tiling.py``.)
Traces: both ship in data/traces (read through ``plan.traces.find_trace``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from libra_megatron.config import KvFetch, SequencePlacement, TilingPolicy  # noqa: E402
from libra_megatron.plan.packing import pack_documents  # noqa: E402
from libra_megatron.plan.sequences import place_sequences, pool_loads  # noqa: E402
from libra_megatron.plan.traces import find_trace, load_trace  # noqa: E402
from libra_megatron.plan.model import (StepTimeModel, imbalance, pool_lower_bound, pool_lower_bound_counting,
                                       sequence_flops)  # noqa: E402
from libra_megatron.sim.runner import MODEL_PRESETS, ModelDims, SimSpec, run_simulation  # noqa: E402

LINUX, WIKI = "linux-6.12-files.qwen.txt", "wikipedia-flexsp.txt"
TRACES = (LINUX, WIKI)
INTER_SETTINGS = (("256K", 256 * 1024, 128), ("1M", 1024 * 1024, 32))  # name, L, GBS
CASES = (  # name, trace, L, GBS, DP, CP, B
    ("linux-256K", LINUX, 256 * 1024, 128, 32, 8, 4096),
    ("linux-1M", LINUX, 1024 * 1024, 32, 16, 16, 4096),
    ("linux-1M-B8192", LINUX, 1024 * 1024, 32, 16, 16, 8192),
    ("wikipedia-256K", WIKI, 256 * 1024, 128, 32, 8, 4096),
    ("wikipedia-1M", WIKI, 1024 * 1024, 32, 16, 16, 4096),
)
POOL_SIZE, TAU, MODEL = 8, 0.03, "qwen3-30b-a3b"


def pack(doc_lens, seq_len: int, seed: int = 1234):
    """GPTDataset-style packing (``plan.packing``, megatron mode) as int64 segment arrays."""
    return [np.asarray(seg, dtype=np.int64) for seg in pack_documents(doc_lens, seq_len, "megatron", seed)]


def inter_pool(flops: np.ndarray, gbs: int):
    rows = {m: [] for m in ("contiguous", "alg1", "refined", "lb_simple", "lb_counting")}
    for w in range(flops.size // gbs):
        f = flops[w * gbs : (w + 1) * gbs]
        mean = f.sum() / (gbs // POOL_SIZE)
        for method in (SequencePlacement.CONTIGUOUS, SequencePlacement.ALG1, SequencePlacement.REFINED):
            rows[method.value].append(imbalance(pool_loads(f, place_sequences(f, POOL_SIZE, method), POOL_SIZE)))
        rows["lb_simple"].append(pool_lower_bound(f, POOL_SIZE) / mean - 1)
        rows["lb_counting"].append(pool_lower_bound_counting(f, POOL_SIZE) / mean - 1)
    return {k: float(np.mean(v)) for k, v in rows.items()}


def print_inter(docs_by_trace) -> None:
    print(f"inter-pool: P={POOL_SIZE}, megatron packing seed 1234, R-1 = max/mean - 1 of sum l^2, mean over windows")
    print(f"{'trace':<12}{'L':>5}{'win':>5} | {'contig':>8}{'alg1':>8}{'refined':>9}{'LB':>8}{'LBcount':>9}")
    for trace, docs in docs_by_trace.items():
        for name, seq_len, gbs in INTER_SETTINGS:
            flops = sequence_flops(pack(docs, seq_len))
            r = inter_pool(flops, gbs)
            print(f"{trace[:11]:<12}{name:>5}{flops.size // gbs:>5} | {r['contiguous']:>8.4f}{r['alg1']:>8.4f}"
                  f"{r['refined']:>9.4f}{r['lb_simple']:>8.4f}{r['lb_counting']:>9.4f}")


def case_spec(case, windows, head_splits=(1,), tilings=tuple(TilingPolicy), fetches=(KvFetch.GROUP, KvFetch.PREFIX)):
    """Simulator spec of one case: P=8, M=4, tau, the case's H and B, uniform|adaptive x group|prefix."""
    _, _, seq_len, gbs, dp, cp, block = case
    hq, hkv, d = MODEL_PRESETS[MODEL]
    return SimSpec(seq_len=seq_len, global_batch_size=gbs, data_parallel_size=dp, context_parallel_size=cp,
                   pool_sizes=(POOL_SIZE,), head_splits=tuple(head_splits), block_sizes=(block,),
                   dims=ModelDims(hq, hkv, d, 2), cost=StepTimeModel(head_dim=d, kv_relay=False), taus=(TAU,),
                   tilings=tuple(tilings), kv_fetches=tuple(fetches), max_windows=windows, distca=False,
                   memory_limit_gib=8.0)


def _row(cand, base) -> str:
    b = cand["bytes_per_layer"]
    kv_vs = b["kv"] / base["bytes_per_layer"]["kv"] - 1 if base["bytes_per_layer"]["kv"] else 0.0
    return (f"{cand['head_split']:>3} {cand['tiling']:<9}{cand['kv_fetch']:<7}{1 + cand['intra_pool_imbalance']:>8.4f}"
            f"{1 + cand['intra_pool_imbalance_max']:>8.4f}{cand['num_tiles']:>7}{b['q'] / 1e9:>8.2f}{b['kv'] / 1e9:>8.2f}"
            f"{b['o'] / 1e9:>8.2f}{kv_vs:>+9.1%}{cand['estimated_step_seconds'] * 1e3:>9.2f}"
            f"{cand['straggler_vs_lower_bound']:>7.3f}")


HEADER = (f"{'H':>3} {'tiling':<9}{'fetch':<7}{'mm mean':>8}{'mm max':>8}{'tiles':>7}{'Q GB':>8}{'KV GB':>8}"
          f"{'O GB':>8}{'KV vs pg':>9}{'step ms':>9}{'vs LB':>7}")


def print_case(case, report, seconds: float) -> None:
    name = case[0]
    paper = [c for c in report["candidates"] if (c["tiling"], c["kv_fetch"]) == ("uniform", "group")]
    base = min(paper, key=lambda c: c["head_split"])
    print(f"\n{name}: L={case[2]} GBS={case[3]} DP={case[4]} CP={case[5]} B={case[6]}, {report['num_windows']} windows, "
          f"{seconds:.0f} s  (pg = paper: uniform tiles + group fetch at H={base['head_split']})")
    print(HEADER)
    for cand in report["candidates"]:
        print(_row(cand, base))
    for cand in report["candidates"]:
        if (cand["tiling"], cand["kv_fetch"]) != ("adaptive", "prefix"):
            continue
        same_h = next(c for c in paper if c["head_split"] == cand["head_split"])
        worst = 1 + cand["intra_pool_imbalance_max"]
        print(f"  H={cand['head_split']} adaptive+prefix: worst pool max/mean {worst:.4f} (target <= "
              f"{1 + TAU + 0.005:.3f}: {'met' if worst <= 1 + TAU + 0.005 + 1e-12 else 'NOT met'}); KV "
              f"{cand['bytes_per_layer']['kv'] / same_h['bytes_per_layer']['kv'] - 1:+.1%} vs uniform+group at the "
              f"same H; step {cand['estimated_step_seconds'] / same_h['estimated_step_seconds'] - 1:+.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=None, help="max GBS windows for the intra-pool part (default all)")
    parser.add_argument("--cases", nargs="+", default=[c[0] for c in CASES], choices=[c[0] for c in CASES])
    parser.add_argument("--head-splits", type=int, nargs="+", default=[1, 2], help="H values (1 = the paper)")
    parser.add_argument("--skip-inter", action="store_true", help="skip the inter-pool table")
    parser.add_argument("--jobs", type=int, default=1, help="simulate windows in N processes")
    args = parser.parse_args()
    docs_by_trace = {t: load_trace(find_trace(t)) for t in TRACES}
    if not args.skip_inter:
        print_inter(docs_by_trace)
    print(f"\nintra-pool: {MODEL} heads, bf16, P={POOL_SIZE}, M=4, tau={TAU}, refined VRSP + Alg. 2; per pool per "
          "layer fwd; mm = worker max/mean (Eq. 6)")
    for case in (c for c in CASES if c[0] in args.cases):
        start = time.perf_counter()
        spec = case_spec(case, args.windows, head_splits=tuple(args.head_splits))
        report = run_simulation(docs_by_trace[case[1]], spec, jobs=args.jobs).to_json()
        print_case(case, report, time.perf_counter() - start)


if __name__ == "__main__":
    main()
