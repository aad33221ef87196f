#!/usr/bin/env bash
# One node, GPUS_PER_NODE ranks: Megatron-LM pretrain_gpt.py with Libra, from a config in configs/.
#
#   MEGATRON_LM_PATH=/path/to/Megatron-LM bash scripts/torchrun_single_node.sh configs/qwen3-8b-256k.args \
#       --data-path /data/my_text_document --save /ckpt/run1 --train-iters 1000
#
# Environment (Megatron's usual names): MEGATRON_LM_PATH (required), GPUS_PER_NODE (default 8),
# MASTER_ADDR (default localhost), MASTER_PORT (default 6000), PYTHON (default python).
# Every argument after the config is passed to pretrain_gpt.py unchanged (later flags win).
set -euo pipefail
if [ "$#" -lt 1 ]; then
  echo "usage: $0 CONFIG.args [pretrain_gpt flags...]" >&2
  exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="$1"; shift
: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (tag core_v0.16.1)}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-6000}"
PYTHON="${PYTHON:-python}"
# Megatron-LM asserts this for TP>1 or CP>1 on pre-Blackwell GPUs (arguments.py).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
cd "$root"  # paths inside configs/ are relative to the repository root
exec "$PYTHON" -m torch.distributed.run \
  --nproc-per-node "$GPUS_PER_NODE" --nnodes 1 --node-rank 0 \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  scripts/pretrain_gpt_libra.py \
  --megatron-lm-path "$MEGATRON_LM_PATH" \
  --megatron-args-file "$config" \
  "$@"
