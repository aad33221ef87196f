"""Fit the time model's kernel price (``plan.model.kernel_fit``) on the device check's ``call_shapes.json`` rows.

Run:  .venv/bin/python benchmarks/gpu/fit_call_shapes.py [ROWS_JSON] [--out FIT_JSON] [--device NAME]

Defaults: the shipped H200 rows (``data/calibration/raw/h200-torch-fa2-call-shapes.json``, measured by
``bash benchmarks/gpu/run_all.sh`` on 2026-12-04) -> ``data/calibration/h200-torch-fa2-calls.json``, the fit
``--calibration h200-torch-fa2-calls`` names. Prints the constants and predicted / measured (median, p10, p90,
min, max) per direction, next to the square-block table's and the default rates' figures from the same rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from libra_megatron.plan.model import fit_kernel_calls, fit_quality  # noqa: E402

ROWS = os.path.join(ROOT, "data", "calibration", "raw", "h200-torch-fa2-call-shapes.json")
OUT = os.path.join(ROOT, "data", "calibration", "h200-torch-fa2-calls.json")


def build(rows_path: str, device: str) -> dict:
    with open(rows_path) as handle:
        rows = json.load(handle)["rows"]
    source = os.path.relpath(rows_path, ROOT)
    fit = fit_kernel_calls(rows, 128, device, source)
    return {"kind": "kernel_fit", "device": device, "head_dim": 128, "fwd": fit.fwd.to_mapping(),
            "bwd": fit.bwd.to_mapping(), "source": source, "quality": fit_quality(fit, rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="?", default=ROWS)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--device", default="NVIDIA H200 (torch 2.11.0+cu130, torch's FlashAttention-2 varlen kernel)")
    args = ap.parse_args(argv)
    data = build(args.rows, args.device)
    with open(args.out, "w") as handle:
        json.dump(data, handle, indent=1)
        handle.write("\n")
    with open(args.rows) as handle:
        rows = json.load(handle)["rows"]
    for direction in ("fwd", "bwd"):
        q = data["quality"][direction]
        print(f"{direction}: {data[direction]}  fit predicted/measured median {q['median']:.3f} "
              f"p10-p90 {q['p10']:.3f}-{q['p90']:.3f} (min {q['min']:.3f}, max {q['max']:.3f})")
        for name in ("default", "calibrated"):
            ratios = sorted(r[f"{name}_{direction}_over_measured"] for r in rows)
            print(f"   {name:>10}: median {ratios[len(ratios) // 2]:.3f} p10-p90 {ratios[len(ratios) // 10]:.3f}-"
                  f"{ratios[(9 * len(ratios)) // 10]:.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
