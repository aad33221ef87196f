"""Balance of VRSP (inter-pool) and TAP (intra-pool) on the shipped real traces (data/traces), in estimated FLOPs.

Run:  .venv/bin/python benchmarks/bench_balance.py [--windows N]

For each trace (linux-6.12-files, wikipedia-flexsp) and setting (256K: GBS=128, CP=8, B=4096;
1M: GBS=32, CP=16, B=8192; P=8, H=1, zigzag, paper microbench heads), documents are packed
Megatron-style (fixed-seed shuffle, concatenate, cut every L tokens) and cut into GBS windows.
Inter-pool: mean over windows of R-1 (max/mean pool load - 1) for contiguous, Alg. 1, refined, and two
lower bounds (the simple outlier/mean bound and the counting bound). Intra-pool: mean and max over
pools (after refined VRSP) of worker max/mean for ALG2 and REFINED, tiles placed by the fallback,
pools where some tile exceeds C (then max/mean <= 1+tau cannot be promised), and remote bytes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from libra_megatron.config import SequencePlacement, TilePlacement, TokenLayoutKind  # noqa: E402
from libra_megatron.plan.layout import HeadLayout, TokenLayout  # noqa: E402
from libra_megatron.plan.packing import pack_documents  # noqa: E402
from libra_megatron.plan.placement import place_tiles  # noqa: E402
from libra_megatron.plan.sequences import place_sequences, pool_loads  # noqa: E402
from libra_megatron.plan.tiles import build_tiles  # noqa: E402
from libra_megatron.plan.traces import find_trace, load_trace  # noqa: E402
from libra_megatron.plan.workload import (  # noqa: E402
    imbalance,
    pool_lower_bound,
    pool_lower_bound_counting,
    sequence_flops,
    worker_lower_bound,
)

TRACES = ("linux-6.12-files.qwen.txt", "wikipedia-flexsp.txt")
SETTINGS = (  # name, L, GBS, CP, B, (hq, hkv, d)
    ("256K", 256 * 1024, 128, 8, 4096, (128, 16, 256)),
    ("1M", 1024 * 1024, 32, 16, 8192, (128, 4, 256)),
)
POOL_SIZE = 8


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


def intra_pool(segs, flops, gbs, seq_len, cp, block, head_dims, max_windows):
    layout = TokenLayout(TokenLayoutKind.ZIGZAG, seq_len, cp)
    heads = HeadLayout(*head_dims, head_split=1, num_chunks=4, elem_bytes=2)
    stats = {m: {"r": [], "fallback": 0, "bytes": [], "sec": 0.0} for m in ("home", "alg2", "refined")}
    over_cap = num_pools = 0
    bound = []
    for w in range(min(flops.size // gbs, max_windows)):
        order = w * gbs + place_sequences(flops[w * gbs : (w + 1) * gbs], POOL_SIZE)
        for k in range(gbs // POOL_SIZE):
            tiles = build_tiles([segs[i] for i in order[k * POOL_SIZE : (k + 1) * POOL_SIZE]], layout, heads, block)
            num_pools += 1
            for method in (TilePlacement.HOME, TilePlacement.ALG2, TilePlacement.REFINED):
                start = time.perf_counter()
                res = place_tiles(tiles, tau=0.03, method=method)
                entry = stats[method.value]
                entry["sec"] += time.perf_counter() - start
                entry["r"].append(res.max_over_mean)
                entry["fallback"] += res.num_fallback
                entry["bytes"].append(res.total_comm_bytes)
            over_cap += int(tiles.tile_flops().max() > res.capacity)
            bound.append(worker_lower_bound(tiles.tile_flops(), tiles.num_workers) / res.loads.mean())
    return stats, over_cap, num_pools, float(np.mean(bound))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=1000, help="max GBS windows for the intra-pool part")
    args = parser.parse_args()
    print(f"P={POOL_SIZE}, tau=0.03, H=1, zigzag, megatron packing seed 1234")
    print(f"{'trace':<12}{'L':>5}{'win':>5} | R-1 mean: {'contig':>8}{'alg1':>8}{'refined':>9}"
          f"{'LB':>8}{'LBcount':>9}")
    intra_rows = []
    for trace in TRACES:
        docs = load_trace(find_trace(trace))
        for name, seq_len, gbs, cp, block, head_dims in SETTINGS:
            segs = pack(docs, seq_len)
            flops = sequence_flops(segs)
            r = inter_pool(flops, gbs)
            print(f"{trace[:11]:<12}{name:>5}{flops.size // gbs:>5} | {'':9}{r['contiguous']:>8.4f}{r['alg1']:>8.4f}"
                  f"{r['refined']:>9.4f}{r['lb_simple']:>8.4f}{r['lb_counting']:>9.4f}")
            intra_rows.append((trace[:11], name, *intra_pool(segs, flops, gbs, seq_len, cp, block, head_dims, args.windows)))
    print("\nintra-pool worker max/mean (mean, max over pools); LB = mean of max(sum/W, max tile)/mean;")
    print("f>C = pools where one tile exceeds C; fallbk = tiles placed by the fallback; GB = remote bytes/pool/layer")
    print(f"{'trace':<12}{'L':>5}{'pools':>6}{'f>C':>5}{'LB':>8} | {'method':<8}{'mean':>8}{'max':>8}{'fallbk':>8}"
          f"{'GB':>9}{'ms':>8}")
    for trace, name, stats, over_cap, num_pools, bound in intra_rows:
        for method, entry in stats.items():
            r = np.array(entry["r"])
            print(f"{trace:<12}{name:>5}{num_pools:>6}{over_cap:>5}{bound:>8.4f} | {method:<8}{r.mean():>8.4f}"
                  f"{r.max():>8.4f}{entry['fallback']:>8}{np.mean(entry['bytes']) / 2**30:>9.1f}"
                  f"{entry['sec'] / num_pools * 1e3:>8.2f}")


if __name__ == "__main__":
    main()
