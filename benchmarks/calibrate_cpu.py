"""Calibrate ``plan.model.kernel_cost.TileCostModel`` for the torch varlen backend on this CPU (review objection 2).

Times ``runtime.kernels.varlen_fwd`` + ``varlen_bwd`` (torch backend, one thread, thread CPU time) on
single-process varlen batches of varied shapes -- 1 to 256 entries, 256 to 4096 query rows, key prefixes
equal to the query rows (fragment at a sample's start) or up to --max-key-offset longer (a later block of a
long sample; per-pair cost falls with the key length, so cover the workload's sequence length) -- then
fits the model by relative non-negative least squares and writes

    {"model": {per_pair_head, per_row_head, per_entry, per_key_row_head, per_call},   seconds per unit
     "flops_only": {...},          the same data fitted with the pairs term only (Eq. 6 proxy in seconds)
     "setup": {...}, "fit": {"mare_calibrated", "mare_flops_only"},
     "samples": [{"pairs", "rows", "entries", "key_rows", "calls", "seconds", "q_lens", "k_lens"}, ...]}

The heads of one call must match the runtime's calls: q heads = hq / (H * M), kv heads = the kv piece
(``HeadLayout.q_piece`` / ``kv_piece``); the defaults match ``bench_straggler_cpu.py``.

    .venv/bin/python benchmarks/calibrate_cpu.py --out calibration_cpu.json [--samples 64] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from libra_megatron.cli import ArgumentParser, run_cli  # noqa: E402
from libra_megatron.paths import check_output_file  # noqa: E402
from libra_megatron.plan.model import FEATURES, entry_features, fit_tile_cost_model  # noqa: E402

ENTRY_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOTAL_ROWS = (256, 512, 1024, 2048, 4096)
MAX_KEY_OFFSET = 12288  # tokens of a sample before its fragment (late blocks of a 16K sample): k up to 16K


def random_shape(rng: np.random.Generator, max_key_offset: int = MAX_KEY_OFFSET):
    """(q_lens, k_lens) of one varlen call: ``n`` entries splitting ``rows`` query rows at random; half the
    entries start at their sample's start (k = q), the others up to ``max_key_offset // n`` tokens later."""
    n = int(rng.choice(ENTRY_COUNTS))
    rows = max(n, int(rng.choice(TOTAL_ROWS)))
    cuts = np.sort(rng.choice(np.arange(1, rows), size=n - 1, replace=False)) if n > 1 else np.zeros(0, int)
    q_lens = np.diff(np.concatenate([[0], cuts, [rows]]))
    offsets = np.where(rng.random(n) < 0.5, 0, rng.integers(0, max_key_offset // n + 1, n))
    return q_lens.astype(int).tolist(), (q_lens + offsets).astype(int).tolist()


def time_call(q_lens, k_lens, hq: int, hkv: int, head_dim: int, reps: int, reduce=np.median) -> float:
    """Thread CPU seconds of one varlen_fwd + varlen_bwd (torch backend, fp32), ``reduce`` over reps."""
    import torch

    from libra_megatron.runtime.kernels import VarlenBatch, varlen_bwd, varlen_fwd

    g = torch.Generator().manual_seed(len(q_lens) * 7919 + sum(q_lens))
    nq, nk = sum(q_lens), sum(k_lens)
    q, do = (torch.randn(nq, hq, head_dim, generator=g) for _ in range(2))
    k, v = (torch.randn(nk, hkv, head_dim, generator=g) for _ in range(2))
    batch = VarlenBatch.from_lengths(q_lens, k_lens, "cpu")
    scale = head_dim ** -0.5
    times = []
    for _ in range(reps):
        start = time.thread_time()
        out, lse = varlen_fwd(q, k, v, batch, scale, backend="torch")
        varlen_bwd(do, q, k, v, out, lse, batch, scale, backend="torch")
        times.append(time.thread_time() - start)
    return float(reduce(times))


def measure_samples(num_samples: int, hq: int, hkv: int, head_dim: int, reps: int, seed: int,
                    max_key_offset: int = MAX_KEY_OFFSET):
    """List of sample dicts (``FEATURES`` + calls + seconds + the shape itself)."""
    import torch

    torch.set_num_threads(1)  # thread CPU time only sees the calling thread
    rng = np.random.default_rng(seed)
    time_call([512], [512], hq, hkv, head_dim, 2)  # warm-up: allocator, kernels' first-call costs
    samples = []
    for _ in range(num_samples):
        q_lens, k_lens = random_shape(rng, max_key_offset)
        feats = entry_features(q_lens, k_lens, hq)
        seconds = time_call(q_lens, k_lens, hq, hkv, head_dim, reps)
        samples.append({**dict(zip(FEATURES, feats.tolist())), "calls": 1, "seconds": seconds,
                        "q_lens": q_lens, "k_lens": k_lens})
    return samples


def mean_abs_rel_error(model, samples) -> float:
    feats = np.array([[s[f] for f in FEATURES] for s in samples])
    seconds = np.array([s["seconds"] for s in samples])
    return float(np.mean(np.abs(model.predict(feats, 1) - seconds) / seconds))


def calibrate(num_samples=64, hq=1, hkv=1, head_dim=16, reps=3, seed=0, max_key_offset=MAX_KEY_OFFSET) -> dict:
    """Measure, fit (calibrated and pairs-only), and return the JSON-ready dict."""
    samples = measure_samples(num_samples, hq, hkv, head_dim, reps, seed, max_key_offset)
    model = fit_tile_cost_model(samples)
    flops = fit_tile_cost_model(samples, features=("pairs",))
    return {"model": model.to_dict(), "flops_only": flops.to_dict(),
            "setup": dict(backend="torch", dtype="float32", hq=hq, hkv=hkv, head_dim=head_dim, reps=reps,
                          clock="thread CPU time, fwd+bwd, torch.set_num_threads(1)", seed=seed,
                          max_key_offset=max_key_offset),
            "fit": {"mare_calibrated": mean_abs_rel_error(model, samples),
                    "mare_flops_only": mean_abs_rel_error(flops, samples)},
            "samples": samples}


def run(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="calibration_cpu.json")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hq", type=int, default=1, help="query heads per kernel call (HeadLayout.q_piece)")
    ap.add_argument("--hkv", type=int, default=1, help="kv heads per kernel call (HeadLayout.kv_piece)")
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-key-offset", type=int, default=MAX_KEY_OFFSET,
                    help="largest sample prefix before a fragment (cover the workload's sequence length)")
    a = ap.parse_args(argv)
    check_output_file(a.out, f"--out {a.out}")  # before minutes of timing, not after
    start = time.perf_counter()
    result = calibrate(a.samples, a.hq, a.hkv, a.head_dim, a.reps, a.seed, a.max_key_offset)
    with open(a.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    m, f = result["model"], result["fit"]
    print(f"{a.samples} samples in {time.perf_counter() - start:.1f} s -> {a.out}")
    print("model: " + ", ".join(f"{k}={v:.3e}" for k, v in m.items()))
    print(f"mean |rel. error| on the samples: calibrated {f['mare_calibrated']:.3f}, "
          f"pairs only {f['mare_flops_only']:.3f}")



def main(argv=None):
    run_cli("calibrate_cpu.py", run, argv)


if __name__ == "__main__":
    main()
