#!/usr/bin/env bash
# One prepared device check for a lent GPU (a few minutes): flash-attn calibration grid + P=1 overhead.
# Usage: bash benchmarks/gpu/run_all.sh [OUT_DIR]   (defaults to $OUT, else ./gpu_out)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR="${1:-${OUT:-gpu_out}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT_DIR/device.txt" || true
"$PY" -c "import flash_attn; print('flash_attn', flash_attn.__version__)" | tee -a "$OUT_DIR/device.txt" || true
timeout 480 "$PY" benchmarks/gpu/calibrate.py --out "$OUT_DIR/calibration.json" --repeats 5 2>&1 | tee "$OUT_DIR/calibrate.log"
