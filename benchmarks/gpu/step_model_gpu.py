"""Device-check section ``step_model`` (issue 23): the whole-layer time model's compute part against one GPU.

World 1 has no exchanges, so this checks what one GPU can: the kernel and copy rates and a world-1 pool's
compute. Fitted with CUDA events (median of reps, after a warm-up), by the same least squares as
``benchmarks/bench_step_model_cpu.py`` (its ``fit_kernels`` / ``fit_copies``):
    kernels   the ``auto`` backend's fwd and bwd on sub-runs of the pool's own chunk calls (bf16):
              seconds = launch + entries x per_entry + 4 d pairs x heads / rate, fwd and bwd apart
    copies    index_select / index_put_ / index_add_ of Q and K|V rows: seconds = launch + 2 bytes / rate
Predicted: ``plan.exchange.plan_layer_timing`` of a real-trace P=1 pool under the fitted ``StepTimeModel`` (the
backward at its own fitted rate, ``attn_bwd_tflops``, as on CPU); measured: CUDA events around
``libra_attn_func`` forward and forward+backward (backward = the difference). The exchange part of the model
(alpha, beta, coupling) needs several GPUs; ``bench_step_model_cpu.py`` checks it on gloo. Not required to pass on
CPU: ``--dry-run`` runs the same code at tiny shapes.

    python benchmarks/gpu/device_check.py --out OUT --only step_model [--dry-run]
    python benchmarks/gpu/step_model_gpu.py [--dry-run]          (this section alone, JSON to stdout)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))

GPU_SHAPE = dict(hq=32, hkv=4, d=128, H=4, M=4, block=2048, seq_len=65536, samples=24, copy_rows=(256, 4096, 32768))
DRY_SHAPE = dict(hq=4, hkv=2, d=8, H=2, M=2, block=16, seq_len=128, samples=4, copy_rows=(4, 32))


def _pool(ctx, sh):
    """(HeadLayout, RankPlan, segments) of a P=1 pool: one real-trace packed sequence, tiles at home."""
    from libra_megatron.plan.exchange import build_exchange_plan
    from libra_megatron.plan.layout import HeadLayout, TokenLayout
    from libra_megatron.plan.packing import pack_documents
    from libra_megatron.plan.tiles import build_tiles
    from libra_megatron.plan.traces import find_trace, load_trace

    docs = load_trace(find_trace("linux-6.12-files.qwen.txt"))
    if ctx.dry:
        docs = np.maximum(1, docs // 64)
    segs = [int(x) for x in pack_documents(docs, sh["seq_len"], "megatron", 1234)[0]]
    heads = HeadLayout(sh["hq"], sh["hkv"], sh["d"], sh["H"], sh["M"], elem_bytes=2)
    tiles = build_tiles([segs], TokenLayout("contiguous", sh["seq_len"], 1), heads, sh["block"])
    return heads, build_exchange_plan(tiles, tiles.tile_home()), segs


def kernel_samples(ctx, heads, plan, samples: int, reps: int):
    """[(entries, pairs x heads, fwd s, bwd s)] of sub-runs of the pool's chunk call (CUDA events)."""
    from bench_step_model_cpu import _kernel_shape, call_shapes

    from libra_megatron.plan.exchange import entry_pairs
    from libra_megatron.runtime.kernels import VarlenBatch, resolve_backend

    shapes, rng = call_shapes([plan]), np.random.default_rng(0)
    be = resolve_backend("auto", ctx.device, ctx.dtype, heads.head_dim)
    scale, out = heads.head_dim ** -0.5, []
    for i in range(samples):
        q_lens, k_lens = shapes[0] if i == 0 else _kernel_shape(rng, shapes)
        q, do = (ctx.randn(sum(q_lens), heads.q_piece, heads.head_dim) for _ in range(2))
        k, v = (ctx.randn(sum(k_lens), heads.kv_piece, heads.head_dim) for _ in range(2))
        batch = VarlenBatch.from_lengths(q_lens, k_lens, ctx.device)
        o, lse = be.fwd(q, k, v, batch, scale)
        fwd = ctx.seconds(lambda: be.fwd(q, k, v, batch, scale), reps)
        bwd = ctx.seconds(lambda: be.bwd(do, q, k, v, o, lse, batch, scale), reps)
        out.append((len(q_lens), entry_pairs(q_lens, k_lens) * heads.q_piece, fwd, bwd))
    return out


def copy_samples(ctx, heads, rows, reps: int):
    """[(kind, bytes, s)] of index_select / index_put_ / index_add_ of Q and K|V rows (CUDA events)."""
    out, n_max = [], max(rows)
    for width in (heads.q_piece * heads.head_dim, 2 * heads.kv_piece * heads.head_dim):
        src = ctx.randn(n_max, width)
        for n in rows:
            idx = torch.randperm(n_max, device=ctx.device)[:n].to(torch.int32)
            vals, nbytes = src[:n].clone(), n * width * src.element_size()
            out.append(("gather", nbytes, ctx.seconds(lambda: src.index_select(0, idx), reps)))
            out.append(("place", nbytes, ctx.seconds(lambda: src.index_put_((idx,), vals), reps)))
            out.append(("add", nbytes, ctx.seconds(lambda: src.index_add_(0, idx, vals), reps)))
    return out


def _model(fits, d: int):
    """``StepTimeModel`` with the fitted rates (the backward's own rate on its 2.5x FLOPs: ``attn_bwd_tflops``)."""
    from libra_megatron.plan.model import BACKWARD_FLOPS_FACTOR, StepTimeModel

    (fl, fe, fr, _), (bl, be, br, _) = fits["kernels"]["fwd"], fits["kernels"]["bwd"]
    c_launch, c_gbps, _ = fits["copies"]["all"]
    kinds = {kind + "_gbps": fits["copies"][kind][1] for kind in ("gather", "place", "add")}
    return StepTimeModel(d, attn_tflops=fr / 1e3, worker_nodes=(0,), kernel_launch_us=fl, kernel_entry_us=fe,
                         copy_gbps=c_gbps, **kinds, copy_launch_us=c_launch, attn_bwd_tflops=br * BACKWARD_FLOPS_FACTOR / 1e3,
                         bwd_kernel_launch_us=bl, bwd_kernel_entry_us=be)


def _measured(ctx, heads, rank_plan, L: int, reps: int):
    """(forward s, backward s) of libra_attn_func at world 1 (CUDA events; backward = fwd+bwd - fwd)."""
    import torch.distributed as dist

    from libra_megatron.runtime import libra_attn_func

    q, do = ctx.randn(L, heads.num_q_heads, heads.head_dim, grad=True), ctx.randn(L, heads.num_q_heads, heads.head_dim)
    k, v = (ctx.randn(L, heads.num_kv_heads, heads.head_dim, grad=True) for _ in range(2))
    fwd = ctx.seconds(lambda: libra_attn_func(q, k, v, rank_plan, dist.group.WORLD), reps)
    both = ctx.seconds(lambda: libra_attn_func(q, k, v, rank_plan, dist.group.WORLD).backward(do), reps)
    return fwd, both - fwd


def section_step_model(ctx) -> dict:
    """The device check's ``step_model`` section (``device_check.Ctx``: device, dtype, dry, seconds, randn)."""
    from bench_step_model_cpu import fit_copies, fit_kernels

    from libra_megatron.plan.exchange import plan_layer_timing

    sh = DRY_SHAPE if ctx.dry else GPU_SHAPE
    reps = 1 if ctx.dry else 5
    heads, plan, segs = _pool(ctx, sh)
    fits = {"kernels": fit_kernels(kernel_samples(ctx, heads, plan, sh["samples"], reps), heads.head_dim),
            "copies": fit_copies(copy_samples(ctx, heads, sh["copy_rows"], reps))}
    model = _model(fits, heads.head_dim)
    out = {"pool": f"P=1 CP=1, {sh['seq_len']} tokens ({len(segs)} documents), hq={sh['hq']} hkv={sh['hkv']} "
                   f"d={sh['d']} H={sh['H']} M={sh['M']} B={sh['block']}, tiles at home, bf16",
           "fits": {"kernel_" + k: dict(zip(("launch_us", "entry_us", "gflops", "mare"), v))
                    for k, v in fits["kernels"].items()},
           "bwd_over_fwd_seconds_per_flop": fits["kernels"]["fwd"][2] / fits["kernels"]["bwd"][2]}
    out["fits"].update({"copy_" + k: dict(zip(("launch_us", "gbps", "mare"), v)) for k, v in fits["copies"].items()})
    rank_plan = plan.for_rank(0)
    meas = _measured(ctx, heads, rank_plan, sh["seq_len"], reps)
    for mode in ("arranged", "refetch"):
        timing = plan_layer_timing(plan, model, mode, "pool")
        pred = (float(timing.forward.seconds[0]), float(timing.backward.seconds[0]))
        out[mode] = {"predicted_fwd_s": pred[0], "predicted_bwd_s": pred[1]}
    out["measured_fwd_s"], out["measured_bwd_s"] = meas  # libra_attn_func's default save mode: arranged
    out["measured_over_predicted"] = {"fwd": meas[0] / out["arranged"]["predicted_fwd_s"],
                                      "bwd": meas[1] / out["arranged"]["predicted_bwd_s"]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (what CI runs)")
    args = ap.parse_args(argv)
    import device_check
    import torch.distributed as dist

    from libra_megatron.testing.dist import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        print(json.dumps(section_step_model(device_check.Ctx(args.dry_run, "")), indent=1, default=str))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
