"""Straggler benchmark on CPU gloo: Ulysses vs Libra TAP-only vs Libra TAP+VRSP, measured and predicted.

One sequence pool of 8 ranks: DP=4, CP=2, P=4 (zigzag CP layout). The step has --gbs packed sequences of
--seq-len tokens (real Linux-trace documents, Megatron-style packing via ``plan.packing.pack_documents``),
processed as GBS/4 pool instances (gradient-accumulation micro-steps):
    ulysses   sequence order[4k+p] on DP replica p (sampler order), head all-to-all inside each CP pair
    tap       Libra, sampler order, tiles placed by Algorithm 2 (place_tiles ALG2) over the 8-rank pool
    tap+vrsp  Libra, sequences reordered by place_sequences (VRSP, refined), then Algorithm 2
Each rank measures the thread CPU time spent *inside attention kernel calls* (forward + backward),
so communication and the 2-core oversubscription do not pollute it. Step model (same for measured and
predicted): Ulysses replicas only meet at the end of the step -> max over replicas of their summed time;
a Libra pool synchronises every instance -> sum over instances of the slowest rank. Predicted loads are
the planner's Eq. 6 pair-heads (tile_flops / placement loads). The gap between the two columns is what
referee objection 2 asks about.

    .venv/bin/python benchmarks/bench_straggler_cpu.py [--seq-len 16384] [--gbs 8]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from libra_megatron.testing.dist import run_distributed  # noqa: E402

from libra_megatron.plan.traces import find_trace

TRACE = find_trace("linux-6.12-files.qwen.txt")
DP, CP, P = 4, 2, 4
W = P * CP


def packed_step(seq_len: int, gbs: int, seed: int):
    from libra_megatron.plan.packing import pack_documents
    from libra_megatron.plan.traces import load_trace

    return [[int(x) for x in s] for s in pack_documents(load_trace(TRACE), seq_len, "megatron", seed)[:gbs]]


def step_orders(seqs):
    from libra_megatron.plan.sequences import place_sequences
    from libra_megatron.plan.workload import sequence_flops

    flops = sequence_flops(seqs)
    return {"ulysses": np.arange(len(seqs)), "tap": np.arange(len(seqs)), "tap+vrsp": place_sequences(flops, P)}


def _pool_tiles(segs, args):
    from libra_megatron.plan.layout import HeadLayout, TokenLayout
    from libra_megatron.plan.tiles import build_tiles

    layout = TokenLayout("zigzag", args["seq_len"], CP)
    heads = HeadLayout(args["hq"], args["hkv"], args["d"], args["H"], args["M"], elem_bytes=4)
    return layout, build_tiles(segs, layout, heads, args["block"])


def predicted_loads(seqs, orders, args):
    """{mode: float64 [instances, W]} Eq. 6 pair-heads per rank and instance."""
    from libra_megatron.config import TilePlacement
    from libra_megatron.plan.placement import place_tiles
    from libra_megatron.plan.tiles import causal_pairs

    out = {}
    for mode, order in orders.items():
        rows = []
        for k in range(len(seqs) // P):
            segs = [seqs[i] for i in order[k * P : (k + 1) * P]]
            if mode == "ulysses":
                per_seq = [float(causal_pairs(0, np.asarray(s)).sum()) * args["hq"] / CP for s in segs]
                rows.append(np.repeat(per_seq, CP))
            else:
                _, tiles = _pool_tiles(segs, args)
                rows.append(place_tiles(tiles, args["tau"], TilePlacement.ALG2).loads)
        out[mode] = np.asarray(rows, dtype=np.float64)
    return out


def step_time(mode: str, per_instance: np.ndarray) -> float:
    """per_instance [instances, W] -> modelled step time (see module docstring)."""
    if mode == "ulysses":
        per_replica = per_instance.reshape(per_instance.shape[0], P, CP).max(axis=2).sum(axis=0)
        return float(per_replica.max())
    return float(per_instance.max(axis=1).sum())


# ====================================================================================== per rank
def _run_ulysses(rank, segs_p, args, cp_group, stats):
    import torch

    from libra_megatron.plan.layout import TokenLayout
    from libra_megatron.runtime import ulysses_attn_func
    from libra_megatron.testing.reference import shard_tokens

    layout = TokenLayout("zigzag", args["seq_len"], CP)
    q, k, v, do = _inputs(args, sum(segs_p), seed=hash(tuple(segs_p)) % (1 << 30))
    q, k, v, do = (shard_tokens(x, layout, rank % CP) for x in (q, k, v, do))
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    cu = np.concatenate([[0], np.cumsum(segs_p)])
    out = ulysses_attn_func(q, k, v, cu, cp_group, token_layout="zigzag", backend="torch", stats=stats)
    out.backward(do)


def _run_libra(rank, segs, args, stats):
    import torch.distributed as dist

    from libra_megatron.config import TilePlacement
    from libra_megatron.plan.exchange import build_exchange_plan
    from libra_megatron.plan.placement import place_tiles
    from libra_megatron.runtime import libra_attn_func
    from libra_megatron.testing.reference import shard_tokens

    layout, tiles = _pool_tiles(segs, args)
    plan = build_exchange_plan(tiles, place_tiles(tiles, args["tau"], TilePlacement.ALG2).assignment).for_rank(rank)
    p, c = divmod(rank, CP)
    q, k, v, do = _inputs(args, args["seq_len"], seed=hash(tuple(segs[p])) % (1 << 30))
    q, k, v, do = (shard_tokens(x, layout, c) for x in (q, k, v, do))
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    out = libra_attn_func(q, k, v, plan, dist.group.WORLD, backend="torch", stats=stats)
    out.backward(do)


def _inputs(args, length, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = args["hq"], args["hkv"], args["d"]
    return [torch.randn(length, h, d, generator=g) for h in (hq, hkv, hkv, hq)]


def bench_rank(rank, world_size, seqs, orders, args):
    import torch.distributed as dist

    from libra_megatron.runtime import ExchangeStats

    cp_groups = [dist.new_group([p * CP + c for c in range(CP)]) for p in range(P)]
    result = {}
    for mode, order in orders.items():
        times = []
        for k in range(len(seqs) // P):
            segs = [seqs[i] for i in order[k * P : (k + 1) * P]]
            stats = ExchangeStats()
            if mode == "ulysses":
                _run_ulysses(rank, segs[rank // CP], args, cp_groups[rank // CP], stats)
            else:
                _run_libra(rank, segs, args, stats)
            dist.barrier()
            times.append(stats.kernel_seconds)
        result[mode] = times
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--gbs", type=int, default=8, help="packed sequences per step (multiple of P=4)")
    ap.add_argument("--hq", type=int, default=2)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--head-split", type=int, default=2)
    ap.add_argument("--num-chunks", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--tau", type=float, default=0.03)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args(argv)
    if a.gbs % P:
        raise ValueError(f"--gbs {a.gbs} must be a multiple of P={P}")
    args = dict(seq_len=a.seq_len, hq=a.hq, hkv=a.hkv, d=a.head_dim, H=a.head_split, M=a.num_chunks,
                block=a.block_size, tau=a.tau)
    seqs = packed_step(a.seq_len, a.gbs, a.seed)
    orders = step_orders(seqs)
    predicted = predicted_loads(seqs, orders, args)
    results = run_distributed(bench_rank, W, seqs, orders, args, timeout=3000)
    print(f"DP={DP} CP={CP} P={P} L={a.seq_len} GBS={a.gbs} hq={a.hq} hkv={a.hkv} d={a.head_dim} H={a.head_split} "
          f"M={a.num_chunks} B={a.block_size}; Linux trace, megatron packing; kernel thread CPU time fwd+bwd")
    print(f"{'mode':10s} {'meas step s':>11s} {'meas max/mean':>13s} {'pred max/mean':>13s} "
          f"{'meas speedup':>12s} {'pred speedup':>12s}")
    base_m = base_p = None
    for mode in orders:
        meas = np.array([r[mode] for r in results]).T  # [instances, W]
        pred = predicted[mode]
        sm, sp = step_time(mode, meas), step_time(mode, pred)
        base_m, base_p = (sm, sp) if base_m is None else (base_m, base_p)
        mean_m, mean_p = meas.sum() / W, pred.sum() / W
        print(f"{mode:10s} {sm:11.3f} {sm / mean_m:13.3f} {sp / mean_p:13.3f} {base_m / sm:12.3f} {base_p / sp:12.3f}")


if __name__ == "__main__":
    main()
