"""Kernel calibration for the simulator + P=1 operator overhead, for one lent GPU (paper Fig. 5).

1. Throughput grid: for every (block_tokens, heads) one varlen causal call over n = max(1, T // b) entries
   of b x b tokens (T = --tokens-per-call), forward only, median of --repeats after warm-up.
   Writes the calibration JSON that ``sim.cost.CalibrationTable`` loads:
       {"device": str, "head_dim": int,
        "entries": [{"block_tokens": int, "heads": int, "seconds": float, "pairs": int}]}
   ``pairs`` = n * b*(b+1)/2: causal query-key pairs *per head* of the call (Eq. 6); ``seconds`` = forward
   time of that one call, so throughput = 4 * head_dim * pairs * heads / seconds FLOP/s (the simulator
   models one layer's forward, see sim/cost.py). The log also prints the fwd+bwd time of each shape.
2. Overhead: libra_attn_func at P=1 (home placement, world size 1) vs the bare varlen kernel on the same
   batch, forward + backward, median ratio printed side by side.

    python benchmarks/gpu/calibrate.py --out calibration.json              # on the GPU (flash backend)
    python benchmarks/gpu/calibrate.py --dry-run --out /tmp/cal.json       # CPU, torch backend, tiny grid
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from libra_megatron.plan.exchange import build_exchange_plan  # noqa: E402
from libra_megatron.plan.layout import HeadLayout, TokenLayout  # noqa: E402
from libra_megatron.plan.tiles import build_tiles  # noqa: E402
from libra_megatron.runtime import VarlenBatch, libra_attn_func, varlen_attn_func  # noqa: E402
from libra_megatron.testing.dist import free_port  # noqa: E402

FULL_GRID = dict(blocks=[128, 256, 512, 1024, 2048, 4096, 8192, 16384], heads=[1, 2, 4, 8, 16, 32])
DRY_GRID = dict(blocks=[8, 16], heads=[1, 2])


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fwd_bwd(q, k, v, do, batch, backend):
    def run():
        for x in (q, k, v):
            x.grad = None
        varlen_attn_func(q, k, v, batch, backend=backend).backward(do)
    return run


def grid_entry(block: int, heads: int, tokens_per_call: int, head_dim: int, dtype, device, backend, repeats):
    """One calibration entry (forward seconds, pairs per head) and the fwd+bwd seconds for the log."""
    n = max(1, tokens_per_call // block)
    batch = VarlenBatch.from_lengths([block] * n, [block] * n, device)
    q, k, v, do = (torch.randn(n * block, heads, head_dim, dtype=dtype, device=device) for _ in range(4))

    def fwd():
        with torch.no_grad():
            varlen_attn_func(q, k, v, batch, backend=backend)

    seconds = _median_seconds(fwd, device, repeats)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    both = _median_seconds(_fwd_bwd(q, k, v, do, batch, backend), device, repeats)
    entry = {"block_tokens": block, "heads": heads, "seconds": seconds, "pairs": n * block * (block + 1) // 2}
    return entry, both


def overhead(seq_len: int, segs, heads: HeadLayout, block: int, dtype, device, backend, repeats: int) -> float:
    """Median over repeats of libra_attn_func / bare kernel (fwd+bwd) at P=1, home placement."""
    layout = TokenLayout("contiguous", seq_len, 1)
    tiles = build_tiles([segs], layout, heads, block)
    plan = build_exchange_plan(tiles, tiles.tile_home()).for_rank(0)
    batch = VarlenBatch.from_lengths(segs, segs, device)
    hq, hkv, d = heads.num_q_heads, heads.num_kv_heads, heads.head_dim
    q = torch.randn(seq_len, hq, d, dtype=dtype, device=device).requires_grad_(True)
    k, v = (torch.randn(seq_len, hkv, d, dtype=dtype, device=device).requires_grad_(True) for _ in range(2))
    do = torch.randn(seq_len, hq, d, dtype=dtype, device=device)

    def libra():
        libra_attn_func(q, k, v, plan, dist.group.WORLD, backend=backend).backward(do)

    bare = _fwd_bwd(q, k, v, do, batch, backend)
    ratios = [_median_seconds(libra, device, 1) / _median_seconds(bare, device, 1) for _ in range(repeats)]
    return statistics.median(ratios)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="calibration JSON path")
    ap.add_argument("--dry-run", action="store_true", help="CPU, torch backend, tiny grid (for tests)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens-per-call", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    dry = a.dry_run
    device = torch.device("cpu" if dry or not torch.cuda.is_available() else "cuda")
    backend = "torch" if device.type == "cpu" else "auto"
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    head_dim, tokens = (8, 32) if dry else (a.head_dim, a.tokens_per_call)
    grid = DRY_GRID if dry else FULL_GRID
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (torch reference backend)"
    measured = [grid_entry(b, h, tokens, head_dim, dtype, device, backend, a.repeats)
                for b in grid["blocks"] for h in grid["heads"]]
    entries = [e for e, _ in measured]
    with open(a.out, "w") as fh:
        json.dump({"device": name, "head_dim": head_dim, "entries": entries}, fh, indent=1)
    for e, both in measured:
        tflops = 4 * head_dim * e["pairs"] * e["heads"] / e["seconds"] / 1e12
        print(f"block {e['block_tokens']:6d} heads {e['heads']:3d}: fwd {e['seconds'] * 1e3:9.3f} ms "
              f"({tflops:7.3f} TFLOP/s)  fwd+bwd {both * 1e3:9.3f} ms")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        seq_len = 64 if dry else 32768
        segs = [seq_len // 8, seq_len // 4, seq_len // 8, seq_len // 2]
        hl = HeadLayout(4, 2, head_dim, 1, 2, elem_bytes=2) if dry else HeadLayout(32, 8, head_dim, 1, 4, elem_bytes=2)
        ratio = overhead(seq_len, segs, hl, 16 if dry else 4096, dtype, device, backend, a.repeats)
        print(f"P=1 operator overhead (libra_attn_func / bare kernel, fwd+bwd, L={seq_len}, M={hl.num_chunks}): "
              f"{ratio:.3f}x")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
