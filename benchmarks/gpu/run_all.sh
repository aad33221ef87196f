#!/usr/bin/env bash
# The prepared device check of issue 8 (one H200: <= 8 minutes; ten sections). Needs python3 with torch + numpy only.
# Usage: bash benchmarks/gpu/run_all.sh [--dry-run] [OUT_DIR]     (OUT_DIR defaults to $OUT, else ./gpu_out)
# Writes OUT_DIR/results.json, OUT_DIR/summary.txt, OUT_DIR/calibration.json, OUT_DIR/device.txt, OUT_DIR/log.txt.
# --dry-run: the same code on CPU at tiny shapes (CI runs it). Exit status 1 if any section failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=()
if [ "${1:-}" = "--dry-run" ]; then DRY=(--dry-run); shift; fi
OUT_DIR="${1:-${OUT:-gpu_out}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__)"
  "$PY" -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>/dev/null || echo "flash_attn: not installed"
} > "$OUT_DIR/device.txt" 2>&1
cat "$OUT_DIR/device.txt"
export PYTHONUNBUFFERED=1
timeout 470 "$PY" benchmarks/gpu/device_check.py --out "$OUT_DIR" "${DRY[@]}" 2>&1 | tee "$OUT_DIR/log.txt"
exit "${PIPESTATUS[0]}"
