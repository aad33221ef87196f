"""How to split heavy tiles, and what Eq. 8 should cost: measured on real pools of the shared traces.

Run:  .venv/bin/python benchmarks/bench_tiling.py [--windows N] [--cases NAME ...]

Pools: refined VRSP over every GBS window (or the first N) of Megatron-packed traces, P=8, zigzag,
Qwen3-30B-A3B attention (hq=32, hkv=4, d=128, bf16), M=4, tau=0.03, Alg. 2. Per rule: worker max/mean
(Eq. 6; mean over pools and the worst pool), SH-Tiles per pool and remote Q/KV/O GB per pool per layer
forward (the exchange plan's totals), prefix KV fetch unless said otherwise.

Splitting rules (issue 9: finer blocks, more head shards for the heavy document, or both):
    uniform H=1          the paper's tiles
    blocks C/2, C/4      adaptive tiling: blocks halved while a tile exceeds 1/2 (the default) or 1/4 of C
    heads H=2, H=4       every document split into more head shards (uniform tiles at H=2 or 4): an upper
                         bound on the tiles a per-document head split would add, and the byte volume it has
                         (kv heads split with the queries, so no K/V is duplicated across shards)
    blocks+heads H=2     adaptive tiling at H=2
Costing (issue 9: Eq. 8 prices what is sent): adaptive tiles, prefix fetch executed, Alg. 2 costing KV
either as the paper does (whole groups, ``TileSet.with_kv_fetch("group")``) or by prefix (ours).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from libra_megatron.plan.layout import HeadLayout, TokenLayout  # noqa: E402
from libra_megatron.plan.packing import pack_documents  # noqa: E402
from libra_megatron.plan.tiles import assignment_comm_bytes, build_tiles, place_tiles  # noqa: E402
from libra_megatron.plan.sequences import place_sequences  # noqa: E402
from libra_megatron.plan.traces import find_trace, load_trace  # noqa: E402
from libra_megatron.plan.model import sequence_flops  # noqa: E402

CASES = (  # name, trace, L, GBS, CP, B
    ("linux-256K", "linux-6.12-files.qwen.txt", 256 * 1024, 128, 8, 4096),
    ("linux-1M", "linux-6.12-files.qwen.txt", 1024 * 1024, 32, 16, 4096),
    ("linux-1M-B8192", "linux-6.12-files.qwen.txt", 1024 * 1024, 32, 16, 8192),
    ("wikipedia-256K", "wikipedia-flexsp.txt", 256 * 1024, 128, 8, 4096),
)
RULES = (  # name, H, tiling, tile fraction
    ("uniform H=1", 1, "uniform", 0.5),
    ("blocks C/2", 1, "adaptive", 0.5),
    ("blocks C/4", 1, "adaptive", 0.25),
    ("heads H=2", 2, "uniform", 0.5),
    ("heads H=4", 4, "uniform", 0.5),
    ("blocks+heads H=2", 2, "adaptive", 0.5),
)
P, TAU, HEADS = 8, 0.03, (32, 4, 128)


def pools(trace: str, seq_len: int, gbs: int, windows):
    segs = pack_documents(load_trace(find_trace(trace)), seq_len, "megatron", 1234)
    flops = sequence_flops(segs)
    num_windows = len(segs) // gbs if windows is None else min(windows, len(segs) // gbs)
    for w in range(num_windows):
        order = w * gbs + place_sequences(flops[w * gbs : (w + 1) * gbs], P)
        for k in range(gbs // P):
            yield [segs[i] for i in order[k * P : (k + 1) * P]]


class Tally:
    def __init__(self):
        self.ratio, self.tiles, self.bytes = [], [], []

    def add(self, tiles, placed, comm):
        self.ratio.append(placed.max_over_mean)
        self.tiles.append(tiles.num_tiles)
        self.bytes.append(comm)

    def row(self, name: str, base_kv: float) -> str:
        q, kv, o = (np.mean(self.bytes, axis=0) / 1e9).tolist()
        return (f"  {name:<22}{np.mean(self.ratio):>8.4f}{np.max(self.ratio):>8.4f}{np.mean(self.tiles):>8.1f}"
                f"{q:>8.2f}{kv:>8.2f}{o:>8.2f}{kv * 1e9 / base_kv - 1:>+10.1%}")


def run_case(case, windows) -> None:
    name, trace, seq_len, gbs, cp, block = case
    layout = TokenLayout("zigzag", seq_len, cp)
    rules = {r[0]: Tally() for r in RULES}
    costing = {"cost whole groups": Tally(), "cost prefixes": Tally()}
    start, num_pools = time.perf_counter(), 0
    for pool in pools(trace, seq_len, gbs, windows):
        num_pools += 1
        for rule, H, tiling, fraction in RULES:
            tiles = build_tiles(pool, layout, HeadLayout(*HEADS, H, 4), block, tiling=tiling, tau=TAU,
                                kv_fetch="prefix", tile_fraction=fraction)
            placed = place_tiles(tiles, TAU)
            rules[rule].add(tiles, placed, placed.comm_bytes)
            if rule == "blocks C/2":
                group_cost = place_tiles(tiles.with_kv_fetch("group"), TAU)
                costing["cost whole groups"].add(tiles, group_cost, assignment_comm_bytes(tiles, group_cost.assignment))
                costing["cost prefixes"].add(tiles, placed, placed.comm_bytes)
    header = f"  {'':<22}{'mm mean':>8}{'mm max':>8}{'tiles':>8}{'Q GB':>8}{'KV GB':>8}{'O GB':>8}{'KV vs 1st':>10}"
    print(f"\n{name}: L={seq_len} CP={cp} B={block}, {num_pools} pools, {time.perf_counter() - start:.0f} s")
    print("splitting rules (prefix fetch):\n" + header)
    base = np.mean(rules["uniform H=1"].bytes, axis=0)[1]
    for rule, tally in rules.items():
        print(tally.row(rule, base))
    print("Eq. 8 costing (adaptive tiles, prefix fetch executed):\n" + header)
    base = np.mean(costing["cost whole groups"].bytes, axis=0)[1]
    for what, tally in costing.items():
        print(tally.row(what, base))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=None, help="first N GBS windows per case (default all)")
    parser.add_argument("--cases", nargs="+", default=[c[0] for c in CASES], choices=[c[0] for c in CASES])
    args = parser.parse_args()
    print(f"P={P}, tau={TAU}, Qwen3-30B-A3B heads, M=4, bf16; mm = worker max/mean (Eq. 6); GB per pool per layer fwd")
    for case in (c for c in CASES if c[0] in args.cases):
        run_case(case, args.windows)


if __name__ == "__main__":
    main()
