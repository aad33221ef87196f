"""Operator overhead at P=1 (home placement, no migration): libra_attn_func vs the bare varlen kernel.

Both sides run forward + backward on the same varlen batch (one packed sequence of real Linux-trace
documents, Megatron-style packing) with the same kernel backend, in one process (world-size-1 gloo group,
so the route executor skips the collectives but does all gathers, placements and bookkeeping). Runs are
interleaved; reported: medians of --repeats of each side, the median of the per-pair ratios, and the
operator's CPU time over the kernel time measured inside the same call (the least noisy overhead figure
on a shared machine). Target: <= 1.10x.

    .venv/bin/python benchmarks/bench_operator_overhead.py [--seq-len 2048] [--repeats 9] [--memory]

--memory first runs a 4-rank gloo pool (P=2, CP=2, Alg. 2 placement) and prints, per rank, the bytes the
operator saves for backward in SaveMode.ARRANGED vs SaveMode.REFETCH, and the bytes/CPU time each costs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from libra_megatron.plan.exchange import build_exchange_plan  # noqa: E402
from libra_megatron.plan.layout import HeadLayout, TokenLayout  # noqa: E402
from libra_megatron.plan.tiles import build_tiles  # noqa: E402
from libra_megatron.runtime import ExchangeStats, VarlenBatch, libra_attn_func, varlen_attn_func  # noqa: E402
from libra_megatron.testing.dist import free_port  # noqa: E402

from libra_megatron.plan.traces import find_trace

TRACE = find_trace("linux-6.12-files.qwen.txt")


def packed_segments(seq_len: int, seed: int):
    """A packed sequence of seq_len tokens (real Linux-trace documents, shuffled, cut at seq_len): the first
    one holding at least 4 samples, so the varlen batch has several entries."""
    from libra_megatron.plan.packing import pack_documents
    from libra_megatron.plan.traces import load_trace

    packed = pack_documents(load_trace(TRACE), seq_len, "megatron", seed)
    return [int(x) for x in next(s for s in packed if len(s) >= 4)]


def _time(fn, *args) -> float:
    """Process CPU time (single-threaded torch): robust to other jobs sharing the machine."""
    start = time.process_time()
    fn(*args)
    return time.process_time() - start


def _fwd_bwd_bare(q, k, v, do, batch):
    out = varlen_attn_func(q, k, v, batch, backend="torch")
    out.backward(do)


def _fwd_bwd_libra(q, k, v, do, plan, stats=None):
    out = libra_attn_func(q, k, v, plan, dist.group.WORLD, backend="torch", stats=stats)
    out.backward(do)


def run(seq_len: int, hq: int, hkv: int, d: int, head_split: int, num_chunks: int, block: int, repeats: int,
        seed: int):
    segs = packed_segments(seq_len, seed)
    layout = TokenLayout("contiguous", seq_len, 1)
    heads = HeadLayout(hq, hkv, d, head_split, num_chunks, elem_bytes=4)
    tiles = build_tiles([segs], layout, heads, block)
    plan = build_exchange_plan(tiles, tiles.tile_home()).for_rank(0)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_len, hq, d, generator=g).requires_grad_(True)
    k, v = (torch.randn(seq_len, hkv, d, generator=g).requires_grad_(True) for _ in range(2))
    do = torch.randn(seq_len, hq, d, generator=g)
    batch = VarlenBatch.from_lengths(segs, segs, "cpu")
    _fwd_bwd_bare(q, k, v, do, batch)
    _fwd_bwd_libra(q, k, v, do, plan)  # warm-up (builds the cached plan tables)
    bare, libra, pair, inside = [], [], [], []
    for _ in range(repeats):
        bare.append(_time(_fwd_bwd_bare, q, k, v, do, batch))
        stats = ExchangeStats()
        libra.append(_time(_fwd_bwd_libra, q, k, v, do, plan, stats))
        pair.append(libra[-1] / bare[-1])
        inside.append(libra[-1] / stats.kernel_seconds)
    b, l_ = statistics.median(bare), statistics.median(libra)
    print(f"L={seq_len} samples={len(segs)} hq={hq} hkv={hkv} d={d} H={head_split} M={num_chunks} B={block}: "
          f"bare kernel {b * 1e3:7.1f} ms | libra_attn_func {l_ * 1e3:7.1f} ms | ratio {statistics.median(pair):.3f}x "
          f"| operator/own-kernel-time {statistics.median(inside):.3f}x (medians of {repeats}, fwd+bwd CPU time)")
    return statistics.median(pair)


def memory_rank(rank, world_size, seq_len, seed):
    """Per-rank bytes saved for backward (both SaveModes) and fwd+bwd CPU time, P=2 CP=2 pool, Alg. 2."""
    from libra_megatron.config import TilePlacement
    from libra_megatron.plan.packing import pack_documents
    from libra_megatron.plan.tiles import place_tiles
    from libra_megatron.plan.traces import load_trace
    from libra_megatron.runtime import SaveMode

    segs = [[int(x) for x in s] for s in pack_documents(load_trace(TRACE), seq_len, "megatron", seed)[:2]]
    layout = TokenLayout("zigzag", seq_len, 2)
    heads = HeadLayout(8, 2, 32, 2, 4, elem_bytes=4)
    tiles = build_tiles(segs, layout, heads, 512)
    plan = build_exchange_plan(tiles, place_tiles(tiles, 0.03, TilePlacement.ALG2).assignment).for_rank(rank)
    t = layout.local_len
    q = torch.randn(t, 8, 32).requires_grad_(True)
    k, v = (torch.randn(t, 2, 32).requires_grad_(True) for _ in range(2))
    row = {"local_qkvo_bytes": (2 * q.numel() + k.numel() + v.numel()) * 4}
    for mode in list(SaveMode) * 2:  # second pass is kept: the first call also builds the cached plan tables
        stats = ExchangeStats()
        start = time.process_time()
        out = libra_attn_func(q, k, v, plan, dist.group.WORLD, backend="torch", save_mode=mode, stats=stats)
        out.backward(torch.ones_like(out))
        row[mode.value] = (stats.saved_bytes, time.process_time() - start, sum(stats.bytes_sent.values()))
    return row


def report_memory(seq_len: int, seed: int):
    from libra_megatron.testing.dist import run_distributed

    rows = run_distributed(memory_rank, 4, seq_len, seed, timeout=900)
    print(f"save-vs-refetch, P=2 CP=2 L={seq_len} hq=8 hkv=2 d=32 H=2 M=4 B=512 fp32, Alg. 2 placement:")
    for r, row in enumerate(rows):
        (sa, ta, ba), (sr, tr, br) = row["arranged"], row["refetch"]
        print(f"  rank {r}: saved ARRANGED {sa / 2**20:6.2f} MiB vs REFETCH {sr / 2**20:6.3f} MiB "
              f"(local q,k,v,out {row['local_qkvo_bytes'] / 2**20:5.2f} MiB) | bytes sent fwd+bwd "
              f"{ba / 2**20:6.2f} vs {br / 2**20:6.2f} MiB | CPU s {ta:5.2f} vs {tr:5.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--memory", action="store_true", help="also measure saved bytes per rank for both SaveModes")
    args = ap.parse_args(argv)
    if args.memory:
        report_memory(8192, args.seed)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        for head_split, num_chunks in ((1, 1), (1, 4), (2, 2)):
            run(args.seq_len, 8, 2, 32, head_split, num_chunks, 512, args.repeats, args.seed)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
