"""Straggler benchmark on CPU gloo: Ulysses vs Libra TAP-only vs Libra TAP+VRSP, measured and predicted.

One sequence pool of 8 ranks: DP=4, CP=2, P=4 (zigzag CP layout). The step has --gbs packed sequences of
--seq-len tokens (real documents of --trace, Linux by default; Megatron-style packing via
``plan.packing.pack_documents``),
processed as GBS/4 pool instances (gradient-accumulation micro-steps):
    ulysses   sequence order[4k+p] on DP replica p (sampler order), head all-to-all inside each CP pair
    tap       Libra, sampler order, tiles placed by Algorithm 2 (place_tiles ALG2) over the 8-rank pool
    tap+vrsp  Libra, sequences reordered by place_sequences (VRSP, refined), then Algorithm 2
    tap (calibrated), tap+vrsp (calibrated)
              the same pools, Algorithm 2 balancing calibrated seconds (``place_tiles(tile_cost=...)`` with
              ``plan.model.kernel_cost.TileCostModel.tile_costs``) instead of Eq. 6 pair-heads (review objection 2)
Each rank measures the thread CPU time spent *inside attention kernel calls* (forward + backward),
so communication and the 2-core oversubscription do not pollute it. Step model (same for measured and
predicted): Ulysses replicas only meet at the end of the step -> max over replicas of their summed time;
a Libra pool synchronises every instance -> sum over instances of the slowest rank. Per-rank time is
predicted by two models fitted on the same calibration samples (``benchmarks/calibrate_cpu.py``):
"flops" = Eq. 6 pair-heads x one fitted s/pair (the planner's proxy), "cal" = the calibrated
``TileCostModel`` (pairs, rows, entries, key rows). MARE = mean |predicted - measured| / measured over
every (rank, instance); nMARE divides every instance by its mean first (scale-free, what balance needs).
The gap between measured and predicted is what referee objection 2 asks about.
--replay re-times every rank's exact varlen calls (from its RankPlan) one after another in this single
process, without the 8-on-2-core contention: "replay" separates model error (model vs replay) from
measurement noise of the distributed run (measured vs replay).

    .venv/bin/python benchmarks/bench_straggler_cpu.py [--seq-len 16384] [--gbs 8] [--calibration PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from libra_megatron.cli import ArgumentParser, run_cli  # noqa: E402
from libra_megatron.paths import check_input_file, check_output_file, read_json  # noqa: E402
from libra_megatron.plan.model import TileCostModel, entry_features, tile_features  # noqa: E402
from libra_megatron.plan.traces import find_trace  # noqa: E402
from libra_megatron.testing.dist import run_distributed  # noqa: E402

TRACE = "linux-6.12-files.qwen.txt"
DP, CP, P = 4, 2, 4
W = P * CP


def packed_step(seq_len: int, gbs: int, seed: int, trace: str = TRACE):
    from libra_megatron.plan.packing import pack_documents
    from libra_megatron.plan.traces import load_trace

    docs = load_trace(find_trace(trace))
    return [[int(x) for x in s] for s in pack_documents(docs, seq_len, "megatron", seed)[:gbs]]


def step_orders(seqs):
    from libra_megatron.plan.sequences import place_sequences
    from libra_megatron.plan.model import sequence_flops

    flops = sequence_flops(seqs)
    vrsp = place_sequences(flops, P)
    plain = np.arange(len(seqs))
    return {"ulysses": plain, "tap": plain, "tap+vrsp": vrsp, "tap (calibrated)": plain, "tap+vrsp (calibrated)": vrsp}


def _instances(seqs, order):
    """The step's pool instances: lists of P segment lists, in gradient-accumulation order."""
    return [[seqs[i] for i in order[k * P : (k + 1) * P]] for k in range(len(seqs) // P)]


def _pool_tiles(segs, args):
    from libra_megatron.plan.layout import TokenLayout
    from libra_megatron.plan.tiles import build_tiles

    layout = TokenLayout("zigzag", args["seq_len"], CP)
    return layout, build_tiles(segs, layout, _heads(args), args["block"])


def _heads(args):
    from libra_megatron.plan.layout import HeadLayout

    return HeadLayout(args["hq"], args["hkv"], args["d"], args["H"], args["M"], elem_bytes=4)


def plan_assignments(seqs, orders, args, model: TileCostModel):
    """{mode: [assignment int64 [num_tiles] per instance]} for the Libra modes (Algorithm 2)."""
    from libra_megatron.config import TilePlacement
    from libra_megatron.plan.tiles import place_tiles

    out = {}
    for mode, order in orders.items():
        if mode == "ulysses":
            continue
        plans = []
        for segs in _instances(seqs, order):
            _, tiles = _pool_tiles(segs, args)
            cost = model.tile_costs(tiles) if "calibrated" in mode else None
            plans.append(place_tiles(tiles, args["tau"], TilePlacement.ALG2, tile_cost=cost).assignment)
        out[mode] = plans
    return out


def rank_features(seqs, orders, assignments, args):
    """{mode: float64 [instances, W, 4]} per-rank kernel features (``plan.model.kernel_cost.FEATURES``), fwd+bwd."""
    out = {}
    for mode, order in orders.items():
        rows = []
        for k, segs in enumerate(_instances(seqs, order)):
            if mode == "ulysses":  # each CP rank runs all documents of its sequence on hq/CP heads
                per_seq = [entry_features(s, s, args["hq"] // CP) for s in segs]
                rows.append(np.repeat(np.asarray(per_seq), CP, axis=0))
            else:
                _, tiles = _pool_tiles(segs, args)
                feats = tile_features(tiles)
                rows.append(np.stack([np.bincount(assignments[mode][k], feats[:, i], W) for i in range(4)], axis=1))
        out[mode] = np.asarray(rows, dtype=np.float64)
    return out


def predict_seconds(features: np.ndarray, model: TileCostModel, calls_per_rank: int) -> np.ndarray:
    """[instances, W, 4] features -> [instances, W] predicted kernel seconds (per_call for busy ranks)."""
    busy = features[..., 0] > 0
    return model.predict(features.reshape(-1, 4)).reshape(busy.shape) + model.per_call * calls_per_rank * busy


def step_time(mode: str, per_instance: np.ndarray) -> float:
    """per_instance [instances, W] -> modelled step time (see module docstring)."""
    if mode == "ulysses":
        per_replica = per_instance.reshape(per_instance.shape[0], P, CP).max(axis=2).sum(axis=0)
        return float(per_replica.max())
    return float(per_instance.max(axis=1).sum())


# ====================================================================================== per rank
def _run_ulysses(rank, segs_p, args, cp_group, stats):
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


def _run_libra(rank, segs, assignment, args, stats):
    import torch.distributed as dist

    from libra_megatron.plan.exchange import build_exchange_plan
    from libra_megatron.runtime import libra_attn_func
    from libra_megatron.testing.reference import shard_tokens

    layout, tiles = _pool_tiles(segs, args)
    plan = build_exchange_plan(tiles, assignment).for_rank(rank)
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


def bench_rank(rank, world_size, seqs, orders, assignments, args):
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
                _run_libra(rank, segs, assignments[mode][k], args, stats)
            dist.barrier()
            times.append(stats.kernel_seconds)
        result[mode] = times
    return result


def load_or_calibrate(path, args):
    """(calibrated, flops-only) ``TileCostModel`` from ``path``, or from a fresh inline calibration."""
    if path is None:
        import calibrate_cpu

        heads = _heads(args)
        print(f"no --calibration: calibrating inline (q heads {heads.q_piece}, kv heads {heads.kv_piece})")
        data = calibrate_cpu.calibrate(hq=heads.q_piece, hkv=heads.kv_piece, head_dim=args["d"],
                                       max_key_offset=max(0, args["seq_len"] - max(calibrate_cpu.TOTAL_ROWS)))
    else:
        data = read_json(path, f"--calibration {path}")
        if not isinstance(data, dict) or not {"model", "flops_only"} <= set(data):
            raise ValueError(f"--calibration {path}: expected the JSON of benchmarks/calibrate_cpu.py "
                             f"(keys 'model' and 'flops_only')")
    return TileCostModel.from_dict(data["model"]), TileCostModel.from_dict(data["flops_only"])


def rank_calls(seqs, orders, assignments, args):
    """{mode: [[(q_lens, k_lens, q heads, kv heads, num calls) per rank] per instance]}: the exact kernel calls."""
    from libra_megatron.plan.exchange import build_exchange_plan

    heads, out = _heads(args), {}
    for mode, order in orders.items():
        per_inst = []
        for k, segs in enumerate(_instances(seqs, order)):
            if mode == "ulysses":
                kv = args["hkv"] // CP if args["hkv"] % CP == 0 else args["hq"] // CP
                docs = [tuple(segs[r // CP]) for r in range(W)]
                per_inst.append([(d, d, args["hq"] // CP, kv, 1) for d in docs])
                continue
            _, tiles = _pool_tiles(segs, args)
            plan = build_exchange_plan(tiles, assignments[mode][k])
            per_inst.append([(tuple(np.diff(rp.cu_seqlens_q).tolist()), tuple(rp.seq_k_len.tolist()), heads.q_piece,
                              heads.kv_piece, heads.num_chunks) for rp in (plan.for_rank(r) for r in range(W))])
        out[mode] = per_inst
    return out


def replay(calls, head_dim: int, reps: int) -> dict:
    """{mode: float64 [instances, W]} thread CPU seconds of each rank's calls, re-run serially here
    (minimum over ``reps`` runs: the least contention-inflated one; equal shapes are timed once)."""
    import torch

    import calibrate_cpu

    torch.set_num_threads(1)
    cache, out = {}, {}
    for mode, per_inst in calls.items():
        for shape in (c for ranks in per_inst for c in ranks):
            q_lens, k_lens, hq, hkv, num = shape
            if shape in cache:
                continue
            if not q_lens:  # a rank hosting no tile does no kernel work
                cache[shape] = 0.0
                continue
            cache[shape] = num * calibrate_cpu.time_call(list(q_lens), list(k_lens), hq, hkv, head_dim, reps, np.min)
        out[mode] = np.array([[cache[c] for c in ranks] for ranks in per_inst])
    return out


def report_replay(orders, results, features, models, num_chunks, replayed):
    """Replayed (contention-free) per-rank time vs the distributed measurement and both models."""
    print(f"\n{'mode':22s} {'replay m/m':>10s} {'meas m/m':>8s} {'nMARE meas~replay':>17s} "
          f"{'nMARE flops~replay':>18s} {'nMARE cal~replay':>16s}")
    for mode in orders:
        meas = np.array([r[mode] for r in results]).T
        rep = replayed[mode]
        calls = 1 if mode == "ulysses" else num_chunks
        preds = [predict_seconds(features[mode], m, calls) for m in models]
        ratio = [step_time(mode, x) / (x.sum() / W) for x in (rep, meas)]
        print(f"{mode:22s} {ratio[0]:10.3f} {ratio[1]:8.3f} {_mare(meas, rep, True):17.3f} "
              f"{_mare(preds[0], rep, True):18.3f} {_mare(preds[1], rep, True):16.3f}")


def _mare(pred: np.ndarray, meas: np.ndarray, normalize: bool = False) -> float:
    """Mean |pred - meas| / meas over (instance, rank); ``normalize``: each instance divided by its mean
    first (scale-free: only the shape across ranks, which is what balancing needs, counts)."""
    if normalize:
        pred, meas = pred / pred.mean(axis=1, keepdims=True), meas / meas.mean(axis=1, keepdims=True)
    return float(np.mean(np.abs(pred - meas) / meas))


def report(orders, results, features, models, num_chunks):
    """``models`` = (flops, cal). Print measured vs predicted max/mean, speedup and per-rank MARE for every mode."""
    print(f"{'mode':22s} {'meas step':>9s} {'meas m/m':>8s} {'pred m/m flops':>14s} {'pred m/m cal':>12s} "
          f"{'meas spd':>8s} {'spd flops':>9s} {'spd cal':>7s} {'MARE flops':>10s} {'MARE cal':>8s} "
          f"{'nMARE flops':>11s} {'nMARE cal':>9s}")
    base, dump = None, {}
    for mode in orders:
        meas = np.array([r[mode] for r in results]).T  # [instances, W]
        calls = 1 if mode == "ulysses" else num_chunks
        preds = [predict_seconds(features[mode], m, calls) for m in models]
        steps = [step_time(mode, x) for x in [meas] + preds]
        ratios = [st / (x.sum() / W) for st, x in zip(steps, [meas] + preds)]
        base = steps if base is None else base
        spd = [b / st for b, st in zip(base, steps)]
        mares = [_mare(x, meas, norm) for norm in (False, True) for x in preds]
        print(f"{mode:22s} {steps[0]:9.3f} {ratios[0]:8.3f} {ratios[1]:14.3f} {ratios[2]:12.3f} {spd[0]:8.3f} "
              f"{spd[1]:9.3f} {spd[2]:7.3f} {mares[0]:10.3f} {mares[1]:8.3f} {mares[2]:11.3f} {mares[3]:9.3f}")
        dump[mode] = dict(measured=meas.tolist(), flops=preds[0].tolist(), cal=preds[1].tolist(),
                          features=features[mode].tolist())
    return dump


def run(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ap.add_argument("--calibration", default=None,
                    help="JSON from benchmarks/calibrate_cpu.py (same heads per call); default: calibrate inline")
    ap.add_argument("--trace", default=TRACE, help="document-length trace (a file, or a name in data/traces or $LIBRA_TRACE_DIR)")
    ap.add_argument("--replay", action="store_true", help="also re-time every rank's calls serially (see above)")
    ap.add_argument("--replay-reps", type=int, default=3, help="replay runs per call (minimum kept)")
    ap.add_argument("--dump", default=None, help="write per-rank measured/predicted seconds as JSON here")
    a = ap.parse_args(argv)
    if a.gbs % P:
        raise ValueError(f"--gbs {a.gbs} must be a multiple of P={P}")
    if a.calibration is not None:
        check_input_file(a.calibration, f"--calibration {a.calibration}")
    if a.dump is not None:
        check_output_file(a.dump, f"--dump {a.dump}")
    args = dict(seq_len=a.seq_len, hq=a.hq, hkv=a.hkv, d=a.head_dim, H=a.head_split, M=a.num_chunks,
                block=a.block_size, tau=a.tau)
    cal, flops = load_or_calibrate(a.calibration, args)
    seqs = packed_step(a.seq_len, a.gbs, a.seed, a.trace)
    orders = step_orders(seqs)
    assignments = plan_assignments(seqs, orders, args, cal)
    features = rank_features(seqs, orders, assignments, args)
    results = run_distributed(bench_rank, W, seqs, orders, assignments, args, timeout=3000)
    print(f"DP={DP} CP={CP} P={P} L={a.seq_len} GBS={a.gbs} hq={a.hq} hkv={a.hkv} d={a.head_dim} H={a.head_split} "
          f"M={a.num_chunks} B={a.block_size}; {a.trace}, megatron packing; kernel thread CPU time fwd+bwd")
    print("cal model: " + ", ".join(f"{k}={v:.3e}" for k, v in cal.to_dict().items())
          + f"; flops model: {flops.per_pair_head:.3e} s/pair-head")
    dump = report(orders, results, features, (flops, cal), a.num_chunks)
    if a.replay:
        replayed = replay(rank_calls(seqs, orders, assignments, args), a.head_dim, a.replay_reps)
        report_replay(orders, results, features, (flops, cal), a.num_chunks, replayed)
        for mode, x in replayed.items():
            dump[mode]["replay"] = x.tolist()
    if a.dump:
        import json

        with open(a.dump, "w", encoding="utf-8") as fh:
            json.dump(dump, fh)



def main(argv=None):
    run_cli("bench_straggler_cpu.py", run, argv)


if __name__ == "__main__":
    main()
