"""Pipeliner on CPU gloo: measured per-rank exchange wait vs the simulator's exposed communication, same plans.

One sequence pool of 8 ranks (P=4 packed sequences of --seq-len tokens, CP=2, zigzag), real documents of
--trace (Megatron-style packing), --instances pool instances. Every instance is planned by each --placement
(alg2, time) and run forward by ``libra_attn_func`` (torch kernel, fp32) on 8 gloo processes. Per rank:
    measured wait      host time blocked in the exchanges' waits (``ExchangeStats.wait_seconds``: Q and K/V
                       dispatches, O returns), i.e. the communication the Pipeliner did not hide
    measured compute   thread CPU time inside the attention kernel calls (``ExchangeStats.kernel_seconds``)
    predicted exposed  the simulator's ``sim.pools.pool_result`` for the same tiles and assignment, with its
                       time model fitted to this machine: attention FLOP/s = measured kernel FLOPs / kernel
                       seconds (alg2 runs), link bytes/s = a timed all_to_all probe on the same 8 ranks (one
                       link class: every rank is one "node")
The ratio measured / predicted (sum over ranks and instances, and per instance at the slowest rank) says how
far the model's overlap formula is from what the runtime achieves. Caveat: 8 ranks share this machine's
cores, so compute and gloo's communication threads contend; the numbers are CPU numbers, not GPU ones.

    .venv/bin/python benchmarks/bench_exchange_wait_cpu.py [--trace wikipedia-flexsp.txt] [--seq-len 8192]
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from libra_megatron.cli import ArgumentParser, run_cli  # noqa: E402
from libra_megatron.testing.dist import run_distributed  # noqa: E402

P, CP = 4, 2
W = P * CP
PROBE_BYTES = 4 << 20  # per peer, per probe all_to_all
FWD_KINDS = ("q", "kv", "o")


def _heads(args):
    from libra_megatron.plan.layout import HeadLayout

    return HeadLayout(args.hq, args.hkv, args.d, args.head_split, args.num_chunks, elem_bytes=4)


def pool_tiles(segs, args):
    from libra_megatron.plan.layout import TokenLayout
    from libra_megatron.plan.tiles import build_tiles

    layout = TokenLayout("zigzag", args.seq_len, CP)
    return layout, build_tiles(segs, layout, _heads(args), args.block_size, tiling="adaptive", tau=0.03,
                               kv_fetch="prefix")


def instances(args):
    from bench_straggler_cpu import packed_step

    seqs = packed_step(args.seq_len, P * args.instances, args.seed, args.trace)
    return [seqs[k * P:(k + 1) * P] for k in range(args.instances)]


def assignments(pools, args, method, timing=None):
    from libra_megatron.plan.tiles import place_tiles

    return [place_tiles(pool_tiles(segs, args)[1], 0.03, method, timing=timing).assignment for segs in pools]


# ============================================================================ per rank
def _probe(rank):
    """Bytes/s one rank moves in a timed all_to_all of PROBE_BYTES to every peer (best of 3)."""
    import time

    import torch
    import torch.distributed as dist

    send = torch.zeros(W * PROBE_BYTES // 4)
    recv = torch.empty_like(send)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        dist.all_to_all_single(recv, send)
        best = min(best, time.perf_counter() - start)
    return (W - 1) * PROBE_BYTES / best


def bench_rank(rank, world_size, pools, plans, args, probe):
    import torch
    import torch.distributed as dist

    from libra_megatron.plan.exchange import build_exchange_plan
    from libra_megatron.runtime import ExchangeStats, libra_attn_func
    from libra_megatron.testing.reference import shard_tokens

    from bench_straggler_cpu import _inputs

    torch.set_num_threads(1)
    out = {"probe": _probe(rank) if probe else None}
    for method, per_instance in plans.items():
        rows = []
        for segs, assignment in zip(pools, per_instance):
            layout, tiles = pool_tiles(segs, args)
            plan = build_exchange_plan(tiles, assignment).for_rank(rank)
            p, c = divmod(rank, CP)
            q, k, v, _ = _inputs(dict(hq=args.hq, hkv=args.hkv, d=args.d), args.seq_len, seed=p + 7)
            q, k, v = (shard_tokens(x, layout, c) for x in (q, k, v))
            stats = ExchangeStats()
            dist.barrier()
            with torch.no_grad():
                libra_attn_func(q, k, v, plan, dist.group.WORLD, backend="torch", stats=stats)
            rows.append((stats.kernel_seconds, sum(stats.wait_seconds.get(kind, 0.0) for kind in FWD_KINDS)))
        out[method] = rows
    return out


# ============================================================================ model side
def predicted(pools, per_instance, args, cost):
    """[instances, W] (compute, exposed) seconds from the simulator's pool pricing of the same plans."""
    from libra_megatron.plan.tiles import TilePlacementResult
    from libra_megatron.sim.pools import pool_result

    comp, exp = [], []
    for segs, assignment in zip(pools, per_instance):
        tiles = pool_tiles(segs, args)[1]
        loads = np.bincount(assignment, tiles.tile_flops(), minlength=W).astype(float)
        r = pool_result(tiles, TilePlacementResult(np.asarray(assignment), loads, 0.0, (0, 0, 0)), cost, 0)
        comp.append(r.compute_seconds)
        exp.append(r.seconds - r.compute_seconds)
    return np.asarray(comp), np.asarray(exp)


def fitted_cost(pools, per_instance, args, measured_kernel, bytes_per_s):
    from libra_megatron.plan.model import StepTimeModel

    pair_heads = sum(float(pool_tiles(segs, args)[1].tile_flops().sum()) for segs in pools)
    flops_per_s = 4.0 * args.d * pair_heads / float(np.sum(measured_kernel))
    return StepTimeModel(head_dim=args.d, attn_tflops=flops_per_s / 1e12, intra_node_gbps=bytes_per_s / 1e9,
                         inter_node_gbps=bytes_per_s / 1e9, gpus_per_node=W,
                         kv_relay=False)  # one node, and the ranks execute direct plans


def _report(method, measured, comp, exp):
    kernel, wait = measured[..., 0], measured[..., 1]
    print(f"\n{method}: per instance, the slowest rank (measured kernel + wait vs predicted compute + exposed)")
    print(f"{'inst':>4} {'meas ms':>9} {'pred ms':>9} {'ratio':>6} {'meas wait ms':>13} {'pred exp ms':>12} {'ratio':>6}")
    for i in range(kernel.shape[0]):
        m, pr = kernel[i] + wait[i], comp[i] + exp[i]
        mw, pw = wait[i].sum(), exp[i].sum()
        print(f"{i:>4} {m.max() * 1e3:9.2f} {pr.max() * 1e3:9.2f} {m.max() / pr.max():6.2f} {mw * 1e3:13.2f} "
              f"{pw * 1e3:12.2f} {mw / pw if pw > 0 else float('nan'):6.2f}")
    total_w, total_e = wait.sum(), exp.sum()
    print(f"all ranks and instances: measured wait {total_w * 1e3:.2f} ms, predicted exposed {total_e * 1e3:.2f} ms, "
          f"ratio {total_w / total_e if total_e > 0 else float('nan'):.2f}")


def run(argv=None) -> int:
    parser = ArgumentParser(prog="bench_exchange_wait_cpu", description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="wikipedia-flexsp.txt")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--head-split", type=int, default=2)
    parser.add_argument("--num-chunks", type=int, default=4)
    parser.add_argument("--hq", type=int, default=16)
    parser.add_argument("--hkv", type=int, default=4)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    from libra_megatron.config import TilePlacement

    pools = instances(args)
    plans = {"alg2": assignments(pools, args, TilePlacement.ALG2)}
    first = run_distributed(bench_rank, W, pools, plans, args, True, timeout=1800)
    measured = np.stack([np.asarray(first[r]["alg2"]) for r in range(W)], axis=1)  # [instances, W, 2]
    bytes_per_s = float(np.median([first[r]["probe"] for r in range(W)]))
    cost = fitted_cost(pools, plans["alg2"], args, measured[..., 0], bytes_per_s)
    print(f"fitted on this machine: {cost.attn_tflops * 1e3:.3f} GFLOP/s attention, {bytes_per_s / 1e9:.3f} GB/s "
          f"per rank (all_to_all probe); {args.instances} instances of P={P} x {args.seq_len} tokens, CP={CP}, "
          f"H={args.head_split}, M={args.num_chunks}, B={args.block_size}, {args.trace}")
    _report("alg2", measured, *predicted(pools, plans["alg2"], args, cost))
    timed = {"time": assignments(pools, args, TilePlacement.TIME, cost.at_gpu(0))}
    second = run_distributed(bench_rank, W, pools, timed, args, False, timeout=1800)
    measured_t = np.stack([np.asarray(second[r]["time"]) for r in range(W)], axis=1)
    _report("time", measured_t, *predicted(pools, timed["time"], args, cost))
    return 0


def main(argv=None) -> None:
    run_cli("bench_exchange_wait_cpu", run, argv)


if __name__ == "__main__":
    main()
