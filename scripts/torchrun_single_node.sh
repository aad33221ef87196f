#!/usr/bin/env bash
# One node, GPUS_PER_NODE ranks: Megatron-LM pretrain_gpt.py with Libra, from a config in configs/.
#
#   MEGATRON_LM_PATH=/path/to/Megatron-LM bash scripts/torchrun_single_node.sh configs/qwen3-8b-256k.args \
#       --data-path /data/my_text_document --save /ckpt/run1 --train-iters 1000
#
# Environment (Megatron's usual names): MEGATRON_LM_PATH (required), GPUS_PER_NODE (default 8),
# MASTER_ADDR (default localhost), MASTER_PORT (default 6000), PYTHON (default python).
# Every argument after the config is passed to pretrain_gpt.py unchanged (later flags win).
# It is the multi-node launcher with NNODES=1, NODE_RANK=0.
set -euo pipefail
if [ -z "${MEGATRON_LM_PATH:-}" ]; then
  echo "$(basename "$0"): error: set MEGATRON_LM_PATH to a Megatron-LM checkout (tag core_v0.16.1)" >&2
  exit 2
fi
NNODES=1 NODE_RANK=0 MASTER_ADDR="${MASTER_ADDR:-localhost}" \
  exec bash "$(dirname "${BASH_SOURCE[0]}")/torchrun_multi_node.sh" "$@"
