#!/usr/bin/env bash
# One node, GPUS_PER_NODE ranks: Megatron-LM pretrain_gpt.py with Libra, from a config in configs/.
#
#   bash scripts/torchrun_single_node.sh configs/qwen3-8b-256k.args \
#       --data-path /data/my_text_document --save /ckpt/run1 --train-iters 1000
#
# Environment (Megatron's usual names): GPUS_PER_NODE (default 8), MASTER_ADDR (default localhost),
# MASTER_PORT (default 6000), PYTHON (default python), MEGATRON_LM_PATH (optional, see the multi-node script).
# Every argument after the config is passed to pretrain_gpt.py unchanged (later flags win); relative paths
# resolve against your working directory. It is the multi-node launcher with NNODES=1, NODE_RANK=0.
set -euo pipefail
NNODES=1 NODE_RANK=0 MASTER_ADDR="${MASTER_ADDR:-localhost}" \
  exec bash "$(dirname "${BASH_SOURCE[0]}")/torchrun_multi_node.sh" "$@"
