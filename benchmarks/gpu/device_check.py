"""The prepared device check (issue 8): thirteen independent sections on one GPU, results as JSON + text.

Needs only torch, numpy and this repository (plan/, sim/, runtime/ and testing/reference need nothing
else; no flash-attn, TE, megatron-core or pyyaml). ``--dry-run`` runs the same code on CPU at tiny shapes
(CI runs it). Each section is timed and fenced: an exception is recorded in its entry and the next
section runs. Sections:

  backends     every backend that can run here, bf16 fwd+bwd on GQA varlen entries with k_len > q_len
               (bottom-right) against the fp64 exact backend: out, lse, dq, dk, dv errors, and
               FlashAttention's rule (error <= 2 x the error of naive same-dtype attention)
  sync_free    libra_attn_func at world size 1, 3 x fwd+bwd under torch.cuda.set_sync_debug_mode("error")
  overhead     P=1 libra_attn_func / bare varlen kernel, fwd+bwd, median ratio (target <= 1.10)
  calibration  the simulator's calibration table (plan.model.CalibrationTable JSON) -> calibration.json
  straggler    real 256K P=8 CP=8 pools from the shipped trace: every worker's hosted tiles replayed in
               turn (M chunk calls, fwd and fwd+bwd) vs Ulysses per-rank calls on the same sequences;
               measured max/mean next to the simulator's prediction (Eq. 6 and calibrated seconds)
  memory       peak and retained memory of one layer (P=1, real 256K sequence) per save mode vs plan.model.memory
  tables       the heaviest rank's run tables of a real 1M pool (shipped knobs) expanded on the device under
               set_sync_debug_mode("error"): rows equal the host expansion; upload + expansion time
  exchange     a real multi-worker pool: P worker processes on gloo (one GPU each when P GPUs are visible,
               else every worker on the one GPU; gloo moves CUDA tensors) run libra_attn_func fwd+bwd on a skewed pool whose
               tiles Alg. 2 moves; errors against the exact backend in fp64, at each kernel call the exchanges
               in flight and those already placed that still hold their receive buffer (must be 0), and
               the wall time of the pipelined call next to its hosted kernels alone (overlap)
  step_model   the whole-layer time model on one GPU (issue 23, ``step_model_gpu.py``): kernel and copy rates
               fitted with CUDA events, a world-1 real-trace pool's predicted forward / backward vs measured
  call_shapes  kernel calls shaped like Libra's (q blocks over long causal prefixes, ``call_shapes_gpu.py``) timed
               and priced as the model prices them, default rates and the calibration table: predicted / measured
  pool_replay  real 256K pools at the shipped knobs, every worker's chunk call timed and priced by the default
               rates and the shipped kernel fit (``call_shapes_gpu.py``)
  overhead_profile  torch.profiler over the P=1 operator and the bare kernel: device time per kernel name
  place_copies  index_put_ / index_copy_ / inverse gather of a Q-sized buffer: which placement is fastest

    python benchmarks/gpu/device_check.py --out OUT_DIR [--dry-run] [--only SECTION ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from libra_megatron.config import LibraConfig, TilePlacement  # noqa: E402
from libra_megatron.plan.exchange import build_exchange_plan, build_rank_tables, rank_tables  # noqa: E402
from libra_megatron.plan.layout import HeadLayout, TokenLayout  # noqa: E402
from libra_megatron.plan.model import saved_bytes_per_rank, sequence_flops  # noqa: E402
from libra_megatron.plan.packing import pack_documents  # noqa: E402
from libra_megatron.plan.pool import plan_pool  # noqa: E402
from libra_megatron.plan.sequences import place_sequences  # noqa: E402
from libra_megatron.plan.tiles import build_tiles  # noqa: E402
from libra_megatron.plan.traces import find_trace, load_trace  # noqa: E402
from libra_megatron.runtime import libra_attn_func, routes  # noqa: E402
from libra_megatron.runtime.kernels import VarlenBatch, resolve_backend, torch_flash, varlen_attn_func  # noqa: E402
from step_model_gpu import section_step_model  # noqa: E402  (benchmarks/gpu/, this file's folder)
from call_shapes_gpu import (section_call_shapes, section_overhead_profile, section_place_copies,  # noqa: E402
                             section_pool_replay)

GPU = dict(head_dim=128, hq=32, hkv=4, entries=[(1024, 3072), (2048, 2048), (1, 777), (512, 4096), (3000, 3000)],
           seq_len=32768, overhead_segs=(4096, 8192, 4096, 16384), calib_tokens=32768,
           calib_blocks=(128, 256, 512, 1024, 2048, 4096, 8192, 16384), calib_heads=(1, 2, 4, 8, 16, 32),
           pool_len=1 << 18, pool_cp=8, pool_p=8, block=4096, memory_len=1 << 18, reps=5,
           tables_len=1 << 20, tables_cp=16, tables_p=8, tables_block=4096, tables_hm=(2, 4))
DRY = dict(head_dim=8, hq=4, hkv=2, entries=[(5, 9), (7, 7), (1, 4)], seq_len=64, overhead_segs=(8, 16, 8, 32),
           calib_tokens=32, calib_blocks=(8, 16), calib_heads=(1, 2), pool_len=128, pool_cp=2, pool_p=2, block=16,
           memory_len=64, reps=1, tables_len=128, tables_cp=2, tables_p=2, tables_block=16, tables_hm=(2, 2))


class Ctx:
    def __init__(self, dry: bool, out_dir: str):
        self.dry, self.out_dir = dry, out_dir
        self.device = torch.device("cpu" if dry or not torch.cuda.is_available() else "cuda")
        self.cuda = self.device.type == "cuda"
        self.shape = DRY if dry else GPU
        self.dtype = torch.bfloat16
        self.calibration = None  # filled by the calibration section, read by the straggler section

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, fn, reps: int) -> float:
        """Median seconds of fn() after one warm-up (CUDA events on GPU, perf_counter on CPU)."""
        fn()
        samples = []
        for _ in range(reps):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def randn(self, *shape, dtype=None, grad=False):
        x = torch.randn(*shape, device=self.device, dtype=torch.float32).to(dtype or self.dtype)
        return x.requires_grad_(True) if grad else x


def _max_err(a, b) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def naive_varlen(q, k, v, batch, scale):
    """Per-entry dense attention with plain torch ops in the inputs' dtype (FlashAttention's test baseline)."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for q0, q1, k0, k1 in batch.bounds:
        ke, ve = k[k0:k1].repeat_interleave(group, 1), v[k0:k1].repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1], ke) * scale
        i = torch.arange(q1 - q0, device=q.device)[:, None]
        j = torch.arange(k1 - k0, device=q.device)[None, :]
        s = s.masked_fill((j > i + (k1 - k0) - (q1 - q0))[None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), ve))
    return torch.cat(outs)


# ============================================================================ 1. backends
def _fwd_bwd(run, q, k, v, do):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out = run(*leaves)
    out.backward(do)
    return [out.detach()] + [x.grad for x in leaves]


def section_backends(ctx: Ctx) -> dict:
    sh = ctx.shape
    q_lens, k_lens = [a for a, _ in sh["entries"]], [b for _, b in sh["entries"]]
    batch = VarlenBatch.from_lengths(q_lens, k_lens, ctx.device)
    d, scale = sh["head_dim"], sh["head_dim"] ** -0.5
    q, do = ctx.randn(sum(q_lens), sh["hq"], d), ctx.randn(sum(q_lens), sh["hq"], d)
    k, v = ctx.randn(sum(k_lens), sh["hkv"], d), ctx.randn(sum(k_lens), sh["hkv"], d)
    exact = resolve_backend("torch", ctx.device, torch.float64, d)
    q64, k64, v64, do64 = (x.double() for x in (q, k, v, do))
    ref_out, ref_lse = exact.fwd(q64, k64, v64, batch, scale)
    ref = [ref_out, *exact.bwd(do64, q64, k64, v64, ref_out, ref_lse, batch, scale)]
    base = _fwd_bwd(lambda *x: naive_varlen(*x, batch, scale), q, k, v, do)
    base_err = [_max_err(a, b) for a, b in zip(base, ref)]
    candidates = {"torch": ("torch", {}), "flash": ("flash", {}), "torch_flash": ("torch_flash", {})}
    candidates["torch_flash expand_kv"] = ("torch_flash", {"expand_kv": True})
    results = {"naive_bf16_errors(out,dq,dk,dv)": base_err}
    for label, (name, extra) in candidates.items():
        try:
            backend = resolve_backend(name, ctx.device, ctx.dtype, d)
        except ValueError as exc:
            results[label] = {"status": "unavailable", "reason": str(exc)}
            continue
        results[label] = _check_backend(backend, extra, q, k, v, do, batch, scale, ref, ref_lse, base_err)
    return results


def _check_backend(backend, extra, q, k, v, do, batch, scale, ref, ref_lse, base_err) -> dict:
    fwd = (lambda *a: torch_flash.torch_flash_fwd(*a, expand_kv=True)) if extra else backend.fwd
    bwd = (lambda *a: torch_flash.torch_flash_bwd(*a, expand_kv=True)) if extra else backend.bwd
    out, lse = fwd(q, k, v, batch, scale)
    grads = bwd(do, q, k, v, out, lse, batch, scale)
    errs = [_max_err(a, b) for a, b in zip([out, *grads], ref)]
    finite = torch.isfinite(ref_lse)
    lse_err = _max_err(lse[finite].float(), ref_lse[finite].float())
    rule = [e <= 2 * b for e, b in zip(errs, base_err)]
    return {"status": "ok" if all(rule) and lse_err < 1e-2 else "FAIL", "errors(out,dq,dk,dv)": errs,
            "lse_error": lse_err, "flash_rule(out,dq,dk,dv)": rule, "lse_shape": list(lse.shape),
            "lse_dtype": str(lse.dtype)}


# ============================================================================ 2. no host sync
def _p1_plan(segs, heads, block):
    seq_len = int(sum(segs))
    tiles = build_tiles([list(segs)], TokenLayout("contiguous", seq_len, 1), heads, block)
    return build_exchange_plan(tiles, tiles.tile_home()).for_rank(0)


def section_sync_free(ctx: Ctx) -> dict:
    sh = ctx.shape
    segs = sh["overhead_segs"]
    heads = HeadLayout(sh["hq"], sh["hkv"], sh["head_dim"], 2, 2, elem_bytes=2)
    plan = _p1_plan(segs, heads, sh["block"])
    L = int(sum(segs))
    q, k, v = ctx.randn(L, sh["hq"], sh["head_dim"], grad=True), ctx.randn(L, sh["hkv"], sh["head_dim"], grad=True), \
        ctx.randn(L, sh["hkv"], sh["head_dim"], grad=True)
    do = ctx.randn(L, sh["hq"], sh["head_dim"])
    ctx.sync()
    outs = []
    if ctx.cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # the first call uploads the plan's tables: pinned, non-blocking
            out = libra_attn_func(q, k, v, plan, dist.group.WORLD)
            out.backward(do)
            outs.append(out.detach())
    finally:
        if ctx.cuda:
            torch.cuda.set_sync_debug_mode("default")
    ctx.sync()
    bare = varlen_attn_func(q.detach(), k.detach(), v.detach(), VarlenBatch.from_lengths(segs, segs, ctx.device))
    return {"status": "ok", "mode": "error" if ctx.cuda else "n/a (CPU)", "calls": 3,
            "backend": resolve_backend("auto", ctx.device, ctx.dtype, sh["head_dim"]).name.value,
            "max_err_vs_bare_kernel": _max_err(outs[-1], bare)}


# ============================================================================ 3. P=1 overhead
def section_overhead(ctx: Ctx) -> dict:
    sh = ctx.shape
    segs, L, d = sh["overhead_segs"], int(sum(sh["overhead_segs"])), sh["head_dim"]
    out = {}
    for H, M in ((1, 1), (1, 4), (2, 2)):
        heads = HeadLayout(sh["hq"], sh["hkv"], d, H, M, elem_bytes=2)
        plan = _p1_plan(segs, heads, sh["block"])
        q = ctx.randn(L, sh["hq"], d, grad=True)
        k, v = ctx.randn(L, sh["hkv"], d, grad=True), ctx.randn(L, sh["hkv"], d, grad=True)
        do = ctx.randn(L, sh["hq"], d)
        batch = VarlenBatch.from_lengths(segs, segs, ctx.device)

        def libra():
            libra_attn_func(q, k, v, plan, dist.group.WORLD).backward(do)

        def bare():
            varlen_attn_func(q, k, v, batch).backward(do)

        ratios = [ctx.seconds(libra, 1) / ctx.seconds(bare, 1) for _ in range(2 * sh["reps"] + 1)]
        out[f"H={H} M={M}"] = {"libra_over_bare": statistics.median(ratios), "target": 1.10,
                               "libra_s": ctx.seconds(libra, sh["reps"]), "bare_s": ctx.seconds(bare, sh["reps"])}
    out["L"], out["backend"] = L, resolve_backend("auto", ctx.device, ctx.dtype, d).name.value
    return out


# ============================================================================ 4. calibration table
def section_calibration(ctx: Ctx) -> dict:
    sh = ctx.shape
    d, entries, log = sh["head_dim"], [], []
    for block in sh["calib_blocks"]:
        for heads in sh["calib_heads"]:
            n = max(1, sh["calib_tokens"] // block)
            batch = VarlenBatch.from_lengths([block] * n, [block] * n, ctx.device)
            q, k, v = (ctx.randn(n * block, heads, d) for _ in range(3))
            with torch.no_grad():
                secs = ctx.seconds(lambda: varlen_attn_func(q, k, v, batch), sh["reps"])
            pairs = n * block * (block + 1) // 2
            entries.append({"block_tokens": block, "heads": heads, "seconds": secs, "pairs": pairs})
            log.append(f"block {block} heads {heads}: {secs * 1e3:.3f} ms, {4 * d * pairs * heads / secs / 1e12:.1f} TFLOP/s")
    name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu (dry run)"
    table = {"device": name, "head_dim": d, "entries": entries}
    with open(os.path.join(ctx.out_dir, "calibration.json"), "w") as fh:
        json.dump(table, fh, indent=1)
    from libra_megatron.plan.model import CalibrationTable

    ctx.calibration = CalibrationTable.from_mapping(table)
    return {"entries": len(entries), "file": "calibration.json", "log": log}


# ============================================================================ 5. straggler
def _pool_segments(ctx: Ctx, seq_len=None, pool_size=None, docs=None):
    sh = ctx.shape
    seq_len, pool_size = seq_len or sh["pool_len"], pool_size or sh["pool_p"]
    docs = load_trace(find_trace("linux-6.12-files.qwen.txt")) if docs is None else docs
    if ctx.dry:
        docs = np.maximum(1, docs // 64)
    segs = [np.asarray(s) for s in pack_documents(docs, seq_len, "megatron", 1234)]
    gbs = pool_size * 4
    order = place_sequences(sequence_flops(segs[:gbs]), pool_size)
    return [[segs[i].tolist() for i in order[k * pool_size:(k + 1) * pool_size]] for k in range(2)]


def _replay_worker(ctx: Ctx, rp, heads, reps: int):
    """(forward s, fwd+bwd s) of one worker's M chunk calls over its hosted tiles."""
    t = rank_tables(rp)
    if t.num_entries == 0:
        return 0.0, 0.0
    batch = VarlenBatch.from_lengths(t.q_lens, t.k_lens, ctx.device)
    nq, nk, d = sum(t.q_lens), sum(t.k_lens), heads.head_dim
    q, do = ctx.randn(nq, heads.q_piece, d, grad=True), ctx.randn(nq, heads.q_piece, d)
    k, v = ctx.randn(nk, heads.kv_piece, d, grad=True), ctx.randn(nk, heads.kv_piece, d, grad=True)
    with torch.no_grad():
        fwd = ctx.seconds(lambda: varlen_attn_func(q, k, v, batch), reps)
    both = ctx.seconds(lambda: varlen_attn_func(q, k, v, batch).backward(do), reps)
    return heads.num_chunks * fwd, heads.num_chunks * both


def _ulysses_rank(ctx: Ctx, segs, cp: int, heads, reps: int):
    """(forward s, fwd+bwd s) of one Ulysses CP rank: all tokens of the sequence, hq/CP heads (kv expanded)."""
    hs = heads.num_q_heads // cp
    kvh = heads.num_kv_heads // cp if heads.num_kv_heads % cp == 0 else hs
    batch = VarlenBatch.from_lengths(segs, segs, ctx.device)
    L, d = int(sum(segs)), heads.head_dim
    q, do = ctx.randn(L, hs, d, grad=True), ctx.randn(L, hs, d)
    k, v = ctx.randn(L, kvh, d, grad=True), ctx.randn(L, kvh, d, grad=True)
    with torch.no_grad():
        fwd = ctx.seconds(lambda: varlen_attn_func(q, k, v, batch), reps)
    return fwd, ctx.seconds(lambda: varlen_attn_func(q, k, v, batch).backward(do), reps)


def _ratio(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(x.max() / x.mean()) if x.mean() > 0 else 1.0


def section_straggler(ctx: Ctx) -> dict:
    from libra_megatron.sim.baselines import sequence_pair_heads
    from libra_megatron.plan.model import StepTimeModel
    from libra_megatron.sim.pools import pool_result

    sh = ctx.shape
    cp, P = sh["pool_cp"], sh["pool_p"]
    config = LibraConfig(pool_size=P, head_split=1, block_size=sh["block"], num_chunks=4,
                         tile_placement=TilePlacement.ALG2)
    layout = TokenLayout("zigzag", sh["pool_len"], cp)
    heads = HeadLayout(sh["hq"], sh["hkv"], sh["head_dim"], 1, 4, elem_bytes=2)
    out = []
    for segs in _pool_segments(ctx)[:1]:
        plan = plan_pool(segs, config, layout, heads, validate=False)
        libra = [_replay_worker(ctx, plan.exchange.for_rank(w), heads, sh["reps"]) for w in range(P * cp)]
        ulysses = [_ulysses_rank(ctx, s, cp, heads, sh["reps"]) for s in segs]
        row = {"libra_fwd_max_over_mean": _ratio([f for f, _ in libra]),
               "libra_fwdbwd_max_over_mean": _ratio([b for _, b in libra]),
               "ulysses_fwd_max_over_mean": _ratio([f for f, _ in ulysses]),
               "ulysses_fwdbwd_max_over_mean": _ratio([b for _, b in ulysses]),
               "speedup_fwd": max(f for f, _ in ulysses) / max(f for f, _ in libra),
               "speedup_fwdbwd": max(b for _, b in ulysses) / max(b for _, b in libra),
               "pred_eq6_libra": _ratio(plan.placement.loads),
               "pred_eq6_ulysses": _ratio(sequence_pair_heads([np.asarray(s) for s in segs], sh["hq"]))}
        for label, table in (("400tflops", None), ("calibrated", ctx.calibration)):
            if label == "calibrated" and table is None:
                continue
            cost = StepTimeModel(head_dim=sh["head_dim"], calibration=table, kv_relay=True)
            row[f"pred_{label}_libra"] = _ratio(pool_result(plan.tiles, plan.placement, cost, 0).compute_seconds)
            row[f"pred_{label}_libra_max_s"] = float(pool_result(plan.tiles, plan.placement, cost, 0).compute_seconds.max())
        row["measured_libra_fwd_max_s"] = max(f for f, _ in libra)
        out.append(row)
    return {"pools": out, "layout": f"L={sh['pool_len']} P={P} CP={cp} B={sh['block']} H=1 M=4"}


# ============================================================================ 6. memory
def section_memory(ctx: Ctx) -> dict:
    sh = ctx.shape
    docs = load_trace(find_trace("linux-6.12-files.qwen.txt"))
    segs = [int(x) for x in pack_documents(docs if not ctx.dry else np.maximum(1, docs // 64), sh["memory_len"],
                                           "megatron", 99)[0]]
    heads = HeadLayout(sh["hq"], sh["hkv"], sh["head_dim"], 1, 4, elem_bytes=2)
    tiles = build_tiles([segs], TokenLayout("contiguous", sh["memory_len"], 1), heads, sh["block"])
    exchange = build_exchange_plan(tiles, tiles.tile_home())
    L, d, out = sh["memory_len"], sh["head_dim"], {}
    for mode in ("arranged", "refetch"):
        q = ctx.randn(L, sh["hq"], d, grad=True)
        k, v = ctx.randn(L, sh["hkv"], d, grad=True), ctx.randn(L, sh["hkv"], d, grad=True)
        saved = []
        ctx.sync()
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        before = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            y = libra_attn_func(q, k, v, exchange.for_rank(0), dist.group.WORLD, save_mode=mode)
        ctx.sync()
        row = {"predicted_saved_bytes": int(saved_bytes_per_rank(exchange, heads, L, mode)[0]),
               "saved_bytes": int(sum(saved)), "out_bytes": y.numel() * y.element_size()}
        if ctx.cuda:
            row["retained_bytes"] = torch.cuda.memory_allocated(ctx.device) - before
            row["forward_peak_bytes"] = torch.cuda.max_memory_allocated(ctx.device) - before
            torch.cuda.reset_peak_memory_stats(ctx.device)
            y.backward(torch.ones_like(y))
            ctx.sync()
            row["backward_peak_bytes"] = torch.cuda.max_memory_allocated(ctx.device) - before
        row["saved_equals_predicted"] = row["saved_bytes"] == row["predicted_saved_bytes"]
        out[mode] = row
        del q, k, v, y
    out["L"], out["heads"] = L, f"hq={sh['hq']} hkv={sh['hkv']} d={d} M=4 bf16"
    return out


# ============================================================================ 7. device tables
def section_tables(ctx: Ctx) -> dict:
    """The heaviest rank of a real pool at the shipped 1M knobs (P=8, CP=16, H=2, M=4, B=4096): its run tables
    expanded on the device under set_sync_debug_mode("error"), rows equal to the host expansion, device time."""
    sh = ctx.shape
    P, cp, L, (H, M) = sh["tables_p"], sh["tables_cp"], sh["tables_len"], sh["tables_hm"]
    config = LibraConfig(pool_size=P, head_split=H, block_size=sh["tables_block"], num_chunks=M)
    heads = HeadLayout(sh["hq"], sh["hkv"], sh["head_dim"], H, M, elem_bytes=2)
    plan = plan_pool(_pool_segments(ctx, L, P)[0], config, TokenLayout("zigzag", L, cp), heads, validate=False)
    start = time.thread_time()
    tables = [build_rank_tables(plan.exchange.for_rank(w)) for w in range(P * cp)]
    host_ms = (time.thread_time() - start) * 1e3 / (P * cp)
    worst = max(tables, key=lambda t: t.nbytes())
    ctx.sync()
    if ctx.cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        dev = routes.upload_tables(worst, ctx.device)
    finally:
        if ctx.cuda:
            torch.cuda.set_sync_debug_mode("default")
    pairs = [(dev.k_gather, worst.k_gather), (dev.chunks[0].q_fwd.recv_rows, worst.q_arranged),
             (dev.chunks[0].kv_fwd.recv_rows, worst.kv_arranged), (dev.batch.cu_q, worst.cu_q), (dev.batch.cu_k, worst.cu_k)]
    for chunk, q_send, kv_send in zip(dev.chunks, worst.q_send, worst.kv_send):
        pairs += [(chunk.q_fwd.send_rows, q_send), (chunk.kv_fwd.send_rows, kv_send)]
    equal = all(np.array_equal(got.cpu().numpy(), want if isinstance(want, np.ndarray) else want.expand())
                for got, want in pairs)
    return {"rows_equal_host_expansion": bool(equal), "sync_debug_mode": "error" if ctx.cuda else "n/a (CPU)",
            "rows": sum(r.total for r in worst.distinct_runs()), "runs": sum(r.num_runs for r in worst.distinct_runs()),
            "device_mib": worst.nbytes() / 2**20, "host_tables_ms_per_rank": host_ms,
            "upload_and_expand_ms": 1e3 * ctx.seconds(lambda: routes.upload_tables(worst, ctx.device), sh["reps"]),
            "layout": f"L={L} P={P} CP={cp} B={sh['tables_block']} H={H} M={M}"}


# ============================================================================ 8. multi-worker exchange
def _exchange_pool(ctx: Ctx, num_workers: int):
    """(segments, heads, exchange plan) of a skewed pool: sequence 0 is one long document, the others short
    ones, so Alg. 2 moves tiles off worker 0 and every chunk exchanges Q, K|V and O."""
    from libra_megatron.plan.tiles import place_tiles

    sh = ctx.shape
    L = sh["memory_len"] // 4 if not ctx.dry else sh["seq_len"]
    segs = [[L]] + [[L // 8] * 8 for _ in range(num_workers - 1)]
    split, chunks = (2, 4) if sh["hq"] >= 8 else (1, 2)
    heads = HeadLayout(sh["hq"], sh["hkv"], sh["head_dim"], split, chunks, elem_bytes=2)
    tiles = build_tiles(segs, TokenLayout("contiguous", L, 1), heads, sh["block"] // 4)
    return segs, heads, build_exchange_plan(tiles, place_tiles(tiles, 0.03, TilePlacement.ALG2).assignment)


def _live_receive_buffers(stats):
    """Instrument PendingExchange and stats.timed_kernel: at each kernel call, (exchanges in flight, exchanges
    already placed/copied that still hold their receive buffer -- 0 when an exchange releases it at once;
    counted on the exchange objects: a completed gloo work may hold the tensor itself a moment longer)."""
    import weakref

    made, at_kernel = [], []
    saved = (routes.PendingExchange.__init__, routes.PendingExchange.placed, routes.PendingExchange.into,
             routes.PendingExchange.rest_placed)

    def init(self, *args, **kwargs):  # PendingExchange's own parameters, passed through unchanged
        saved[0](self, *args, **kwargs)
        made.append(weakref.ref(self))

    def consuming(original):
        def call(self, *args):
            self.consumed_by_check = True  # an attribute, not id(): ids of freed exchanges are reused
            return original(self, *args)
        return call

    def timed(fn, *args, _timed=stats.timed_kernel):
        alive = [x for x in (r() for r in made) if x is not None]
        done = [getattr(x, "consumed_by_check", False) for x in alive]
        at_kernel.append((done.count(False), sum(d and x.received is not None for d, x in zip(done, alive))))
        return _timed(fn, *args)

    routes.PendingExchange.__init__ = init
    routes.PendingExchange.placed, routes.PendingExchange.into = consuming(saved[1]), consuming(saved[2])
    routes.PendingExchange.rest_placed = consuming(saved[3])
    stats.timed_kernel = timed

    def restore():
        (routes.PendingExchange.__init__, routes.PendingExchange.placed, routes.PendingExchange.into,
         routes.PendingExchange.rest_placed) = saved

    return at_kernel, restore


def _reference_in_turn(rank, world_size, ctx, batch, q64, k64, v64, do64):
    """The fp64 exact reference, one worker at a time (the workers may share one GPU, and a 65K-token fp64
    document's row tiles need tens of GiB), kept on the host; each worker empties its cache after its turn."""
    ref = None
    for turn in range(world_size):
        if turn == rank:
            run = lambda q, k, v: varlen_attn_func(q, k, v, batch, backend="torch")  # noqa: E731
            ref = [x.cpu() for x in _fwd_bwd(run, q64, k64, v64, do64)]
            if ctx.cuda:
                torch.cuda.empty_cache()
        dist.barrier()
    return ref


def _exchange_worker(rank, world_size, dry, reps):
    from libra_megatron.runtime import ExchangeStats

    ctx = Ctx(dry, "")
    if ctx.cuda:
        ctx.device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(ctx.device)
    segs, heads, plan = _exchange_pool(ctx, world_size)
    rp, L = plan.for_rank(rank), int(sum(segs[rank]))
    g = torch.Generator().manual_seed(rank)
    q64, k64, v64 = (torch.randn(L, h, heads.head_dim, generator=g, dtype=torch.float64).to(ctx.device)
                     for h in (heads.num_q_heads, heads.num_kv_heads, heads.num_kv_heads))
    do64 = torch.randn(L, heads.num_q_heads, heads.head_dim, generator=g, dtype=torch.float64).to(ctx.device)
    batch = VarlenBatch.from_lengths(segs[rank], segs[rank], ctx.device)
    ref = _reference_in_turn(rank, world_size, ctx, batch, q64, k64, v64, do64)
    q, k, v, do = (x.to(ctx.dtype) for x in (q64, k64, v64, do64))
    stats = ExchangeStats()
    at_kernel, restore = _live_receive_buffers(stats)
    try:
        got = _fwd_bwd(lambda *a: libra_attn_func(*a, rp, dist.group.WORLD, stats=stats), q, k, v, do)
    finally:
        restore()
    M = heads.num_chunks
    tables = rank_tables(rp)  # local-first: a chunk with local and remote entries makes two forward calls
    fwd_calls = M * (2 if tables.local is not None and tables.remote.num_entries else 1)
    libra_s = ctx.seconds(lambda: _fwd_bwd(lambda *a: libra_attn_func(*a, rp, dist.group.WORLD), q, k, v, do), reps)
    kernels_s = _replay_worker(ctx, rp, heads, reps)[1]
    got = [x.cpu() for x in got]
    return {"rel_err_out_dq_dk_dv": [_max_err(a, b) / max(float(b.abs().max()), 1e-30) for a, b in zip(got, ref)],
            "exchanges_in_flight_at_kernel": [n for n, _ in at_kernel],
            "placed_but_alive_at_kernel": [n for _, n in at_kernel], "kernel_calls": len(at_kernel) == fwd_calls + M,
            "bytes_sent": dict(stats.bytes_sent), "libra_fwd_bwd_s": libra_s, "hosted_kernels_fwd_bwd_s": kernels_s,
            "device": str(ctx.device)}


def section_exchange(ctx: Ctx) -> dict:
    from libra_megatron.testing.dist import run_distributed

    num_workers = 2 if ctx.dry else 4
    gpus = torch.cuda.device_count() if ctx.cuda else 0
    mode = "one GPU per worker, gloo" if gpus >= num_workers else (
        f"{num_workers} workers share {max(gpus, 1)} {'GPU' if ctx.cuda else 'CPU'}, gloo")
    if ctx.cuda:  # the workers are new processes: free this one's cached blocks, and let theirs grow in place
        torch.cuda.empty_cache()
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    workers = run_distributed(_exchange_worker, num_workers, ctx.dry, ctx.shape["reps"], timeout=400)
    released = all(w["kernel_calls"] and max(w["placed_but_alive_at_kernel"]) == 0 for w in workers)
    errors_ok = all(max(w["rel_err_out_dq_dk_dv"]) <= 2e-2 for w in workers)
    moved = sum(sum(w["bytes_sent"].values()) for w in workers)
    return {"workers": num_workers, "mode": mode, "errors_ok": errors_ok, "receive_buffers_released": released,
            "bytes_exchanged": moved, "per_worker": workers,
            "libra_over_kernels": [w["libra_fwd_bwd_s"] / max(w["hosted_kernels_fwd_bwd_s"], 1e-12) for w in workers]}


SECTIONS = {"backends": section_backends, "sync_free": section_sync_free, "overhead": section_overhead,
            "calibration": section_calibration, "straggler": section_straggler, "memory": section_memory,
            "tables": section_tables, "exchange": section_exchange, "step_model": section_step_model,
            "call_shapes": section_call_shapes, "pool_replay": section_pool_replay,
            "overhead_profile": section_overhead_profile, "place_copies": section_place_copies}


def _summary(results: dict) -> str:
    lines = [f"device: {results['device']}  torch {results['torch']}  dry_run={results['dry_run']}"]
    for name, entry in results["sections"].items():
        lines.append(f"[{name}] {entry['status']} in {entry['seconds']:.1f} s")
        if entry["status"] != "ok":
            lines.append("  " + entry.get("error", "").strip().splitlines()[-1] if entry.get("error") else "")
            continue
        lines += [f"  {k}: {json.dumps(v)}" for k, v in entry["result"].items() if k != "log"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--only", nargs="*", choices=list(SECTIONS), default=list(SECTIONS))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    ctx = Ctx(args.dry_run, args.out)
    torch.manual_seed(0)
    from libra_megatron.testing.dist import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    results = {"device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu", "torch": torch.__version__,
               "dry_run": ctx.dry, "sections": {}}
    try:
        for name in args.only:
            start = time.perf_counter()
            try:
                entry = {"status": "ok", "result": SECTIONS[name](ctx)}
            except Exception:  # noqa: BLE001 - recorded, the next section still runs
                entry = {"status": "error", "error": traceback.format_exc()}
            entry["seconds"] = time.perf_counter() - start
            results["sections"][name] = entry
            print(f"[{name}] {entry['status']} ({entry['seconds']:.1f} s)", flush=True)
            with open(os.path.join(args.out, "results.json"), "w") as fh:
                json.dump(results, fh, indent=1, default=str)
    finally:
        dist.destroy_process_group()
    text = _summary(results)
    with open(os.path.join(args.out, "summary.txt"), "w") as fh:
        fh.write(text)
    print(text)
    return 0 if all(e["status"] == "ok" for e in results["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
