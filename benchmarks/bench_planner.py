"""Planner latency on this machine vs the budgets of the issue (medians over real-trace pools).

Run:  .venv/bin/python benchmarks/bench_planner.py [--pools N] [--reps R] [--cpu] [--modes paper ours]
                                                   [--gc auto|manual] [--vrsp-only]

Per pool (P=8, zigzag, tau=0.03, paper microbench heads, linux-6.12 and wikipedia traces packed
Megatron-style), for the paper's tiles (uniform blocks, whole-group KV fetch) and ours (adaptive blocks,
prefix fetch): build_tiles, place_tiles(ALG2), build_exchange_plan, and the per-rank plan a rank waits for
(its RankPlan and row run tables, the slowest of 8 ranks spread over the pool) -- what one rank needs
before its first step. Separately (not on the planner thread): "expand", the CPU time of expanding the
slowest of those ranks' run tables into index tensors with torch on the CPU (``runtime.routes``, 1 thread;
on a GPU this is device work at the first use of the plan).
  256K: CP=8,  B=4096, H=1, hq=128 hkv=16 d=256      budget 20 ms (placement aim <= 1/3)
  1M:   CP=16, B=8192, H=1,2,4, hq=128 hkv=4 d=256   budget 50 ms
  1M:   CP=16, B=8192, H=4, Qwen3-8B hq=32 hkv=8 d=128  budget 50 ms
  256K / 1M: CP=8 / 16, Qwen3-30B-A3B hq=32 hkv=4 d=128, B, H, M, tau and kv_relay of the shipped
            configs/libra/*.yaml (the K/V relay priced where it pays, as plan.pool.pool_timing sets it)
            budget 20 / 50 ms
VRSP: place_sequences at GBS=1024 (Alg. 1, refined, and sync at DP 32-256, PP 1-8)   budget 5 ms
(`--vrsp-only` runs just these)
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_balance import pack  # noqa: E402
from libra_megatron.plan.sequences import PoolProxy, SequenceStats, SyncLayout, place_sequences  # noqa: E402
from libra_megatron.plan.traces import find_trace, load_trace  # noqa: E402
from libra_megatron.config import KvFetch, SequencePlacement, TilePlacement, TilingPolicy, TokenLayoutKind  # noqa: E402
from libra_megatron.plan.layout import HeadLayout, TokenLayout  # noqa: E402
from libra_megatron.plan.tiles import build_tiles, place_tiles  # noqa: E402
from libra_megatron.plan.model import StepTimeModel, sequence_flops  # noqa: E402

from libra_megatron.plan.exchange import build_exchange_plan, build_rank_tables  # noqa: E402
from libra_megatron.runtime.routes import upload_tables  # noqa: E402

POOL_SIZE = 8
CASES = (  # name, L, CP, B, H, (hq, hkv, d), budget ms
    ("256K H=1", 256 * 1024, 8, 4096, 1, (128, 16, 256), 20.0),
    ("1M H=1", 1024 * 1024, 16, 8192, 1, (128, 4, 256), 50.0),
    ("1M H=2", 1024 * 1024, 16, 8192, 2, (128, 4, 256), 50.0),
    ("1M H=4", 1024 * 1024, 16, 8192, 4, (128, 4, 256), 50.0),
    ("1M H=4 q8b", 1024 * 1024, 16, 8192, 4, (32, 8, 128), 50.0),  # Qwen3-8B heads
    ("256K q30b", 256 * 1024, 8, None, None, (32, 4, 128), 20.0),  # Qwen3-30B-A3B, knobs of configs/libra/256k.yaml
    ("1M q30b", 1024 * 1024, 16, None, None, (32, 4, 128), 50.0),  # Qwen3-30B-A3B, knobs of configs/libra/1m.yaml
)
MODES = {"paper": (TilingPolicy.UNIFORM, KvFetch.GROUP), "ours": (TilingPolicy.ADAPTIVE, KvFetch.PREFIX)}
RANK_SAMPLES = 8  # ranks per pool whose RankPlan is timed; the slowest counts (every rank waits for its own)


CLOCK = time.perf_counter  # --cpu switches to time.process_time (robust when the 2 cores are shared)
MANUAL_GC = False  # --gc manual: automatic collection off, gc.collect() between pools (untimed)


class FullGc:
    """Milliseconds (thread CPU time of the collecting thread) spent in full, generation-2 garbage collections.

    Their cost grows with every tracked object of the process, not with the plan: one that starts inside a
    timed planner call adds to it (this process's trace lists make one cost tens of ms; a training process
    holds far more objects). Megatron's ``--manual-gc`` turns automatic collection off for this reason."""

    def __init__(self):
        self.ms, self._start = 0.0, 0.0

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if info["generation"] == 2:
            if phase == "start":
                self._start = time.thread_time()
            else:
                self.ms += (time.thread_time() - self._start) * 1e3


FULL_GC = FullGc()


def set_gc_mode(mode: str) -> None:
    """``auto``: Python's default collector; ``manual``: as Megatron's ``--manual-gc`` (collect between pools)."""
    global MANUAL_GC
    FULL_GC.install()
    MANUAL_GC = mode == "manual"
    if MANUAL_GC:
        gc.disable()


def between_pools() -> None:
    if MANUAL_GC:
        gc.collect()


def timed(fn, *args, **kwargs):
    start = CLOCK()
    out = fn(*args, **kwargs)
    return out, (CLOCK() - start) * 1e3


def pools_of(segs, num_pools):
    """The first ``num_pools`` pools after refined VRSP over GBS windows of 128 sequences."""
    flops, out = sequence_flops(segs), []
    for w in range(0, len(segs) - 127, 128):
        order = w + place_sequences(flops[w : w + 128], POOL_SIZE)
        out += [[segs[i] for i in order[k * POOL_SIZE : (k + 1) * POOL_SIZE]] for k in range(16)]
        if len(out) >= num_pools:
            break
    return out[:num_pools]


def _rank_plan_ms(plan, num_workers: int):
    """Over ``RANK_SAMPLES`` ranks spread over the pool: (slowest own plan = RankPlan + run tables, slowest
    torch expansion of the tables on the CPU) in ms."""
    def own_plan(rank):
        return build_rank_tables(plan.ranks[rank])
    timings = [timed(own_plan, r) for r in range(0, num_workers, max(1, num_workers // RANK_SAMPLES))]
    return max(ms for _, ms in timings), max(timed(upload_tables, tables, "cpu")[1] for tables, _ in timings)


PLACEMENT = TilePlacement.DENSE  # --tile-placement (the shipped configs/libra/*.yaml)
NUM_CHUNKS = None  # --num-chunks; None: the shipped configs/libra/*.yaml
SHIPPED = {256 * 1024: "256k.yaml", 1024 * 1024: "1m.yaml"}  # B = H = None in CASES: these files' knobs


def shipped_knobs(seq_len: int, head_dims):
    """(B, H, M, tau, K/V relay on) of the shipped configs/libra YAML for ``seq_len`` (M for ``head_dims``' heads)."""
    from libra_megatron.config import KvRelay, LibraConfig

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "libra", SHIPPED[seq_len])
    cfg = LibraConfig.from_yaml(path)
    return cfg.block_size, cfg.head_split, cfg.chunks_for(*head_dims[:2]), cfg.tau, cfg.kv_relay is KvRelay.AUTO


def _place_and_plan(tiles, head_dim, tau, relay=False):
    """(placement, its ExchangePlan with every rank's Pipeliner lead, place ms, exchange ms) as ``plan_pool``
    does it: the 'dense' placer builds and prices its candidates' plans itself (counted in place). ``relay``: the
    time model relays K/V between nodes where it pays (``kv_relay: auto``, as ``plan.pool.pool_timing`` sets it)."""
    model = StepTimeModel(head_dim, kv_relay=relay)
    timing = model if PLACEMENT in (TilePlacement.DENSE, TilePlacement.TIME) else None
    result, t_place = timed(place_tiles, tiles, tau, PLACEMENT, timing=timing)
    if result.exchange is not None:
        return result, result.exchange, t_place, 0.0
    plan, t_ex = timed(build_exchange_plan, tiles, result.assignment, model)
    return result, plan, t_place, t_ex


def bench_case(segs_by_trace, case, num_pools, reps, mode):
    name, seq_len, cp, block, H, head_dims, budget = case
    tiling, kv_fetch = MODES[mode]
    layout = TokenLayout(TokenLayoutKind.ZIGZAG, seq_len, cp)
    chunks, tau, relay = (8 if seq_len <= 256 * 1024 else 4), 0.03, False  # the paper-scale cases: no relay
    if block is None:
        block, H, chunks, tau, relay = shipped_knobs(seq_len, head_dims)
    chunks = NUM_CHUNKS or chunks
    heads = HeadLayout(*head_dims, head_split=H, num_chunks=chunks if head_dims[0] % (H * chunks) == 0 else 4,
                       elem_bytes=2)
    for trace, segs in segs_by_trace.items():
        times = {"build": [], "place": [], "exchange": [], "rank": [], "expand": [], "tiles": [], "gc": []}
        for pool in pools_of(segs[seq_len], num_pools):
            for _ in range(reps):
                between_pools()
                gc_before = FULL_GC.ms
                tiles, t_build = timed(build_tiles, pool, layout, heads, block, tiling=tiling, tau=tau,
                                       kv_fetch=kv_fetch)
                result, plan, t_place, t_ex = _place_and_plan(tiles, head_dims[2], tau, relay)
                t_rank, t_expand = _rank_plan_ms(plan, tiles.num_workers)
                for key, val in (("build", t_build), ("place", t_place), ("exchange", t_ex), ("rank", t_rank),
                                 ("expand", t_expand), ("tiles", tiles.num_tiles), ("gc", FULL_GC.ms - gc_before)):
                    times[key].append(val)
        med = {k: float(np.median(v)) for k, v in times.items()}
        total = med["build"] + med["place"] + med["exchange"] + med["rank"]
        print(f"{name:<11}{mode:<6}{trace:<10}{int(med['tiles']):>6}{med['build']:>8.2f}{med['place']:>8.2f}"
              f"{np.percentile(times['place'], 90):>9.2f}{med['exchange']:>8.2f}{med['rank']:>8.2f}"
              f"{np.percentile(times['rank'], 90):>8.2f}{total:>8.2f}{budget:>7.0f}{total / budget:>7.2f}"
              f"{'  OK' if total <= budget else '  OVER'}{med['expand']:>9.2f}{max(times['gc']):>8.1f}")


SYNC_LAYOUTS = ((32, 1), (64, 1), (128, 1), (256, 1), (32, 2), (64, 4), (128, 4), (256, 8))  # (DP, PP) at GBS 1024


def _priced_sync(segments, layout, proxy):
    """What the sampler runs where lanes run apart: the window's proxy statistics, then the priced sync placement."""
    stats = SequenceStats.of(segments)
    return place_sequences(stats.flops, POOL_SIZE, SequencePlacement.SYNC, layout, proxy.pricer(stats))


def bench_vrsp(segments, reps):
    gbs = 1024
    segments = [segments[i % len(segments)] for i in range(gbs)]  # the trace's first 1024 sequences (wrapped)
    flops = sequence_flops(segments)
    proxy = PoolProxy(POOL_SIZE, 8, 256 * 1024, 32, 4, 128)  # 256K, CP=8, Qwen3-30B-A3B heads
    for method in (SequencePlacement.ALG1, SequencePlacement.REFINED):
        ms = [timed(place_sequences, flops, POOL_SIZE, method)[1] for _ in range(reps)]
        print(f"VRSP {method.value:<8} GBS={gbs} P={POOL_SIZE}: median {np.median(ms):.2f} ms "
              f"(p90 {np.percentile(ms, 90):.2f}) budget 5 ms ratio {np.median(ms) / 5:.2f}")
    for dp, pp in SYNC_LAYOUTS:  # sync: lanes of P replicas over GA = GBS/DP steps (plan/sequences/lanes.py)
        layout = SyncLayout(dp, POOL_SIZE, gbs // dp, pipeline_parallel_size=pp)
        # priced by the pool proxy (plan.sequences.priced_lanes), statistics included: pipelines at PP > 1, the
        # lanes' pool totals at PP = 1
        ms = [timed(_priced_sync, segments, layout, proxy)[1] for _ in range(reps)]
        print(f"VRSP sync     GBS={gbs} P={POOL_SIZE} DP={dp} GA={gbs // dp} PP={pp}: median {np.median(ms):.2f} ms "
              f"(p90 {np.percentile(ms, 90):.2f}) budget 5 ms ratio {np.median(ms) / 5:.2f} (priced pools)")


def main() -> None:
    global PLACEMENT, NUM_CHUNKS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=int, default=8, help="pools per trace and case")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="time with process CPU time instead of wall clock")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                        help="paper: uniform tiles + group fetch; ours: adaptive tiles + prefix fetch (the defaults)")
    parser.add_argument("--vrsp-only", action="store_true", help="only the VRSP timings (no pool plans)")
    parser.add_argument("--tile-placement", choices=[p.value for p in TilePlacement], default=PLACEMENT.value,
                        help="tile placement timed (default: the shipped one)")
    parser.add_argument("--num-chunks", type=int, default=None,
                        help="Pipeliner chunks M (default: the shipped YAML's for the q30b cases, else 8 at 256K, 4 at 1M)")
    parser.add_argument("--cases", nargs="+", choices=[c[0] for c in CASES], default=[c[0] for c in CASES],
                        help="pool cases to time (default: all)")
    parser.add_argument("--gc", choices=["auto", "manual"], default="auto",
                        help="auto: Python's garbage collector as is; manual: off, collected between pools "
                             "(Megatron's --manual-gc)")
    args = parser.parse_args()
    PLACEMENT, NUM_CHUNKS = TilePlacement(args.tile_placement), args.num_chunks
    set_gc_mode(args.gc)
    global CLOCK
    CLOCK = time.process_time if args.cpu else time.perf_counter
    torch.set_num_threads(1)  # the expand column: one thread's work (a GPU does it on the device)
    print(f"clock: {'process CPU time' if args.cpu else 'wall clock'}; gc: {args.gc}; tile placement "
          f"{PLACEMENT.value}, M={NUM_CHUNKS or 'shipped'}; load average {os.getloadavg()[0]:.1f}")
    segs_by_trace = {}
    for trace in ("linux-6.12-files.qwen.txt", "wikipedia-flexsp.txt"):
        docs = load_trace(find_trace(trace))
        segs_by_trace[trace.split("-")[0]] = {L: pack(docs, L) for L in (256 * 1024, 1024 * 1024)}
    print(f"{'case':<11}{'mode':<6}{'trace':<10}{'tiles':>6}{'build':>8}{'place':>8}{'place90':>9}{'exch':>8}"
          f"{'rank':>8}{'rank90':>8}{'total':>8}{'budget':>7}{'tot/bud':>7}{'':>6}{'expand':>9}{'gc max':>8}   (ms, "
          f"medians; rank = slowest of {RANK_SAMPLES} ranks' RankPlan + run tables; total = build + place + exch + "
          f"rank; expand = slowest torch CPU expansion of those ranks' tables, training thread, not in total; gc max = "
          f"the most full-GC time inside one pool's timed work)")
    for case in () if args.vrsp_only else [c for c in CASES if c[0] in args.cases]:
        for mode in args.modes:
            bench_case(segs_by_trace, case, args.pools, args.reps, mode)
    bench_vrsp(segs_by_trace["linux"][256 * 1024], 20 * args.reps)


if __name__ == "__main__":
    main()
