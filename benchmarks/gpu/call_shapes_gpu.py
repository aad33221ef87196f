"""Device-check section ``call_shapes``: the time model's kernel price against kernel calls shaped like Libra's.

The ``calibration`` section times square causal blocks (n entries of B x B); the model then prices a chunk call
by its total query rows and heads (``plan.model.events.OpCosts.kernel`` -> ``StepTimeModel.call_seconds``). Libra's
calls are not square: an entry is a query block of <= B rows over its document's whole causal prefix (k_len >
q_len, bottom-right). This section times such calls -- entries of B query rows over prefixes of 1x, 4x and 16x B
keys, 1, 8 or 32 entries per call, 4-32 query heads (GQA group 8, as Qwen3-30B-A3B), forward and forward+backward --
and prices each one as the model does, under the constant default rates and under the table measured by the
``calibration`` section of the same run. Reports predicted / measured per shape, their median and spread, and
writes every row to ``call_shapes.json``. Nothing here changes the model; it says how far to trust it.

Section ``pool_replay`` (this file too): real 256K P=8 CP=8 pools (linux and wikipedia) at the shipped
``configs/libra/256k.yaml`` knobs, Qwen3-30B-A3B heads; every worker's hosted entries run as one chunk call (fwd, then
bwd alone), times M; predicted per worker by the default rates and by the shipped fit
(``--calibration h200-torch-fa2-calls``), as ``OpCosts.kernel`` prices the same call. Reports predicted / measured
per worker and the worst worker / mean measured vs predicted: the kernel price on real pools, not probe shapes.

    python benchmarks/gpu/device_check.py --out OUT --only calibration call_shapes pool_replay [--dry-run]
    python benchmarks/gpu/call_shapes_gpu.py [--dry-run] [--out DIR]   (calibration, then this section; JSON to stdout)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)

GPU = dict(d=128, heads=(4, 8, 16, 32), blocks=(1024, 2048, 4096, 8192), k_mults=(1, 4, 16), entries=(1, 8, 32),
           reps=3, max_pairs=6e9)
DRY = dict(d=8, heads=(2, 4), blocks=(8, 16), k_mults=(1, 4), entries=(1, 2), reps=1, max_pairs=1e9)


def _pairs(q_len: int, k_len: int) -> int:
    """Causal query-key pairs of one bottom-right entry (``plan.model.entry_pair_heads`` at one head)."""
    from libra_megatron.plan.model import entry_pair_heads

    return int(entry_pair_heads(q_len, k_len, 1))


def _measure(ctx, sh, heads: int, block: int, k_len: int, n: int):
    from libra_megatron.runtime.kernels import VarlenBatch, varlen_attn_func

    hkv = max(1, heads // 8)
    batch = VarlenBatch.from_lengths([block] * n, [k_len] * n, ctx.device)
    q = torch.randn(n * block, heads, sh["d"], device=ctx.device, dtype=ctx.dtype, requires_grad=True)
    k, v = (torch.randn(n * k_len, hkv, sh["d"], device=ctx.device, dtype=ctx.dtype, requires_grad=True)
            for _ in range(2))
    do = torch.randn_like(q)
    with torch.no_grad():
        fwd = ctx.seconds(lambda: varlen_attn_func(q, k, v, batch), sh["reps"])
    out = varlen_attn_func(q, k, v, batch)  # the backward alone, on one kept graph
    bwd = ctx.seconds(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), sh["reps"])
    return fwd, bwd


def _priced(costs, heads: int, block: int, k_len: int, n: int):
    from libra_megatron.plan.model import Kernel

    pairs = n * _pairs(block, k_len) * heads
    return tuple(costs.kernel(Kernel(direction, n, n * block, n * k_len, pairs, heads)) for direction in ("fwd", "bwd"))


def _call_of(tables, heads):
    """(Kernel fields) of one worker's chunk call over all its hosted entries: entries, q_rows, k_rows, pair-heads."""
    from libra_megatron.plan.model import entry_pair_heads

    pair_heads = int(entry_pair_heads(tables.q_lens, tables.k_lens, heads.q_piece).sum())
    return len(tables.q_lens), sum(tables.q_lens), sum(tables.k_lens), pair_heads


def section_pool_replay(ctx) -> dict:
    from device_check import _pool_segments, _replay_worker
    from libra_megatron.config import LibraConfig, TilePlacement
    from libra_megatron.plan.exchange import rank_tables
    from libra_megatron.plan.layout import HeadLayout, TokenLayout
    from libra_megatron.plan.model import Kernel, StepTimeModel, resolve_calibration
    from libra_megatron.plan.model.events import OpCosts
    from libra_megatron.plan.pool import plan_pool
    from libra_megatron.plan.traces import find_trace, load_trace

    sh, root = ctx.shape, os.path.dirname(os.path.dirname(HERE))
    shipped = LibraConfig.from_yaml(os.path.join(root, "configs", "libra", "256k.yaml"))
    H, M = (shipped.head_split, shipped.chunks_for(32, 4)) if not ctx.dry else (2, 1)  # Qwen3-30B-A3B heads
    config = LibraConfig(pool_size=sh["pool_p"], head_split=H, block_size=shipped.block_size if not ctx.dry else 16,
                         num_chunks=M, tau=shipped.tau, tile_placement=TilePlacement.ALG2)
    heads = HeadLayout(sh["hq"], sh["hkv"], sh["head_dim"], H, M, elem_bytes=2)
    layout = TokenLayout("zigzag", sh["pool_len"], sh["pool_cp"])
    models = {"default": OpCosts(StepTimeModel(sh["head_dim"]))}
    if sh["head_dim"] == 128:
        models["fit"] = OpCosts(StepTimeModel(128, calibration=resolve_calibration("h200-torch-fa2-calls")))
    out, calls = {}, []  # calls: every worker's one chunk call, its shape and seconds (pool_replay.json)
    for trace in ("linux-6.12-files.qwen.txt", "wikipedia-flexsp.txt"):
        docs = load_trace(find_trace(trace))
        segs = _pool_segments(ctx, docs=docs)[0]
        plan = plan_pool(segs, config, layout, heads, validate=False)
        measured, predicted = [], {name: [] for name in models}
        for w in range(plan.exchange.num_workers):
            rp = plan.exchange.for_rank(w)
            fwd, both = _replay_worker(ctx, rp, heads, sh["reps"])
            measured.append((fwd, both - fwd))
            n, q_rows, k_rows, pair_heads = _call_of(rank_tables(rp), heads)
            calls.append({"trace": trace, "worker": w, "entries": n, "q_rows": q_rows, "k_rows": k_rows,
                          "pair_heads": pair_heads, "heads": heads.q_piece, "fwd_s": fwd / M, "bwd_s": (both - fwd) / M})
            for name, costs in models.items():
                f, b = (M * costs.kernel(Kernel(d, n, q_rows, k_rows, pair_heads, heads.q_piece)) for d in ("fwd", "bwd"))
                predicted[name].append((f, b))
        row = {"measured_fwdbwd_max_over_mean": _max_over_mean([f + b for f, b in measured])}
        for name, pairs in predicted.items():
            ratios = {d: sorted(p[i] / m[i] for p, m in zip(pairs, measured) if m[i] > 0) for i, d in enumerate(("fwd", "bwd"))}
            row[name] = {d: {"median": statistics.median(r), "min": r[0], "max": r[-1]} for d, r in ratios.items()}
            row[name]["fwdbwd_max_over_mean"] = _max_over_mean([f + b for f, b in pairs])
            row[name]["worst_worker_predicted_over_measured"] = (max(f + b for f, b in pairs)
                                                                 / max(f + b for f, b in measured))
        out[trace.split("-")[0]] = row
    with open(os.path.join(ctx.out_dir, "pool_replay.json"), "w") as fh:
        json.dump({"device": str(ctx.device), "layout_heads": [sh["hq"], sh["hkv"], sh["head_dim"], H, M],
                   "calls": calls}, fh, indent=1)
    out["file"] = "pool_replay.json"
    out["layout"] = f"L={sh['pool_len']} P={sh['pool_p']} CP={sh['pool_cp']} B={config.block_size} H={H} M={M}, alg2 tiles"
    return out


def _max_over_mean(xs) -> float:
    mean = sum(xs) / len(xs)
    return max(xs) / mean if mean > 0 else 1.0


def section_call_shapes(ctx) -> dict:
    from libra_megatron.plan.model import StepTimeModel
    from libra_megatron.plan.model.events import OpCosts

    sh = DRY if ctx.dry else GPU
    models = {"default": OpCosts(StepTimeModel(sh["d"]))}
    if ctx.calibration is not None and ctx.calibration.head_dim == sh["d"]:
        models["calibrated"] = OpCosts(StepTimeModel(sh["d"], calibration=ctx.calibration))
    rows = []
    for heads in sh["heads"]:
        for block in sh["blocks"]:
            for mult in sh["k_mults"]:
                for n in sh["entries"]:
                    k_len = block * mult
                    if n * _pairs(block, k_len) * heads > sh["max_pairs"]:
                        continue
                    fwd, bwd = _measure(ctx, sh, heads, block, k_len, n)
                    row = {"heads": heads, "q_block": block, "k_len": k_len, "entries": n, "fwd_s": fwd, "bwd_s": bwd,
                           "fwd_tflops": 4 * sh["d"] * n * _pairs(block, k_len) * heads / fwd / 1e12}
                    for name, costs in models.items():
                        pf, pb = _priced(costs, heads, block, k_len, n)
                        row[f"{name}_fwd_over_measured"], row[f"{name}_bwd_over_measured"] = pf / fwd, pb / bwd
                    rows.append(row)
    with open(os.path.join(ctx.out_dir, "call_shapes.json"), "w") as fh:
        json.dump({"device": str(ctx.device), "rows": rows}, fh, indent=1)
    summary = {"shapes": len(rows), "file": "call_shapes.json"}
    for name in models:
        for phase in ("fwd", "bwd"):
            ratios = sorted(r[f"{name}_{phase}_over_measured"] for r in rows)
            summary[f"{name}_{phase}_predicted_over_measured"] = {
                "median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1],
                "p10": ratios[len(ratios) // 10], "p90": ratios[(9 * len(ratios)) // 10]}
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (what CI runs)")
    ap.add_argument("--out", default=".", help="folder for calibration.json and call_shapes.json")
    args = ap.parse_args(argv)
    import device_check

    os.makedirs(args.out, exist_ok=True)
    ctx = device_check.Ctx(args.dry_run, args.out)
    device_check.section_calibration(ctx)
    print(json.dumps(section_call_shapes(ctx), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def section_overhead_profile(ctx) -> dict:
    """Where the P=1 operator's time over the bare kernel goes (the ``overhead`` section's H=1 M=1 and H=2 M=2
    cases): torch.profiler over 3 fwd+bwd iterations of each, device time per kernel name; attention kernels
    (names with 'flash' or 'fmha' or 'attention') apart from everything else (copies, index ops, merges).
    Writes the per-name tables to ``overhead_profile.txt``."""
    import device_check as dc
    from torch.profiler import ProfilerActivity, profile

    from libra_megatron.plan.layout import HeadLayout
    from libra_megatron.runtime import libra_attn_func
    from libra_megatron.runtime.kernels import VarlenBatch, varlen_attn_func
    import torch.distributed as dist

    sh = ctx.shape
    segs, d = sh["overhead_segs"], sh["head_dim"]
    L = int(sum(segs))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    q, k, v = ctx.randn(L, sh["hq"], d, grad=True), ctx.randn(L, sh["hkv"], d, grad=True), ctx.randn(L, sh["hkv"], d, grad=True)
    do = ctx.randn(L, sh["hq"], d)
    batch = VarlenBatch.from_lengths(segs, segs, ctx.device)
    runs = {"bare": lambda: varlen_attn_func(q, k, v, batch).backward(do)}
    for H, M in ((1, 1), (2, 2)):
        plan = dc._p1_plan(segs, HeadLayout(sh["hq"], sh["hkv"], d, H, M, elem_bytes=2), sh["block"])
        runs[f"H={H} M={M}"] = (lambda p: lambda: libra_attn_func(q, k, v, p, dist.group.WORLD).backward(do))(plan)
    out, text = {}, []
    for name, fn in runs.items():
        fn()
        ctx.sync()
        with profile(activities=acts) as prof:
            for _ in range(3):
                fn()
            ctx.sync()
        rows = []
        for e in prof.key_averages():
            if ctx.cuda:  # device kernels only (their own time: no parent op counted twice)
                if str(getattr(e, "device_type", "")).split(".")[-1] != "CUDA":
                    continue
                t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            else:
                t = e.self_cpu_time_total
            if t:
                rows.append((float(t) / 3.0, e.key, e.count // 3))
        rows.sort(reverse=True)
        attn = sum(t for t, key, _ in rows if any(s in key.lower() for s in ("flash", "fmha", "attention")))
        total = sum(t for t, _, _ in rows)
        out[name] = {"device_us_per_iter": total, "attention_kernel_us": attn, "other_us": total - attn,
                     "top": [f"{key}: {t:.0f} us x{n}" for t, key, n in rows[:8]]}
        text.append(f"== {name}\n" + "\n".join(f"{t:12.1f} us  x{n:<5} {key}" for t, key, n in rows[:40]))
    with open(os.path.join(ctx.out_dir, "overhead_profile.txt"), "w") as fh:
        fh.write("\n\n".join(text) + "\n")
    out["file"] = "overhead_profile.txt"
    return out


def section_place_copies(ctx) -> dict:
    """How to place rows fastest (the P=1 overhead is mostly ``index_put_``, ``overhead_profile``): a Q-sized bf16
    buffer (32K rows x 32 heads x 128) written through a random permutation of its rows by ``index_put_`` with
    int32 and int64 rows, ``index_copy_`` (int64), and a gather through the inverse permutation (``index_select``),
    next to a plain copy; median seconds and GB/s (bytes read + written). Every variant's result is compared."""
    sh = ctx.shape
    rows_n = sh["seq_len"] if not ctx.dry else 64
    src = ctx.randn(rows_n, sh["hq"], sh["head_dim"])
    g = torch.Generator().manual_seed(0)
    perm64 = torch.randperm(rows_n, generator=g).to(ctx.device)
    perm32, inv64 = perm64.to(torch.int32), torch.argsort(perm64)
    inv32 = inv64.to(torch.int32)
    ref = torch.empty_like(src).index_put_((perm64,), src)
    variants = {
        "index_put_int32": lambda: torch.empty_like(src).index_put_((perm32,), src),
        "index_put_int64": lambda: torch.empty_like(src).index_put_((perm64,), src),
        "index_copy_int64": lambda: torch.empty_like(src).index_copy_(0, perm64, src),
        "gather_inverse_int32": lambda: src.index_select(0, inv32),
        "gather_inverse_int64": lambda: src.index_select(0, inv64),
        "plain_copy": lambda: torch.empty_like(src).copy_(src),
    }
    nbytes = 2 * src.numel() * src.element_size()
    out = {"rows": rows_n, "bytes_moved": nbytes}
    for name, fn in variants.items():
        same = name == "plain_copy" or bool(torch.equal(fn(), ref))
        t = ctx.seconds(fn, max(3, sh["reps"]))
        out[name] = {"seconds": t, "gb_per_s": nbytes / t / 1e9, "same_result": same}
    return out
