#!/usr/bin/env bash
# The simulator on the shipped real trace (Linux 6.12 source files in Qwen tokens) at 256K, picking (P, H, B)
# for Qwen3-30B-A3B at DP=32, CP=8, GBS=128. Extra arguments are passed through (e.g. --json out.json --plots plots/).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup_env.sh")"
cd "$root"
exec "$py" -m libra_megatron.sim --trace data/traces/linux-6.12-files.qwen.txt --seq-len 262144 --gbs 128 \
  --dp 32 --cp 8 --pool-size 4 8 16 --head-split 1 2 4 --block-size 4096 8192 --model qwen3-30b-a3b --jobs 2 "$@"
