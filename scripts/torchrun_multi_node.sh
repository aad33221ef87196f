#!/usr/bin/env bash
# Several nodes: run this script once on every node (same arguments), each with its own NODE_RANK.
#
#   NNODES=8 NODE_RANK=$i MASTER_ADDR=node0 \
#       bash /path/to/libra_megatron/scripts/torchrun_multi_node.sh configs/qwen3-30b-a3b-256k.args \
#       --data-path ... --save ...
#
# Environment (Megatron's usual names): NNODES, NODE_RANK, MASTER_ADDR (all required), GPUS_PER_NODE
# (default 8), MASTER_PORT (default 6000), PYTHON (default python), MEGATRON_LM_PATH (optional: else the
# launcher's getter, libra_megatron.megatron_lm, uses the repository cache / the archive beside the checkout / a clone).
# World size = NNODES*GPUS_PER_NODE; DP = world/(TP*PP*CP) must be a multiple of the Libra pool size P.
# Runs in your working directory: your relative --data-path/--save stay yours. CONFIG.args is looked up
# in the working directory, then in the repository; paths inside it are relative to its own folder.
set -euo pipefail
# A user error is one line "<script>: error: <message>" on stderr and exit 2 (as every tool of the project).
die() { echo "$(basename "$0"): error: $*" >&2; exit 2; }
[ "$#" -ge 1 ] || die "give a run config: $0 CONFIG.args [pretrain_gpt flags...]"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="$1"; shift
[ -n "${NNODES:-}" ] || die "set NNODES (number of nodes)"
[ -n "${NODE_RANK:-}" ] || die "set NODE_RANK (0..NNODES-1) on every node"
[ -n "${MASTER_ADDR:-}" ] || die "set MASTER_ADDR (hostname of node 0)"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MASTER_PORT="${MASTER_PORT:-6000}"
PYTHON="${PYTHON:-python}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
if [ -z "${MEGATRON_LM_PATH:-}" ]; then  # once per node, so the ranks do not race to unpack or clone
  mlm="$(PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m libra_megatron.megatron_lm --from-launcher-args "$@")"
  export MEGATRON_LM_PATH="$mlm"
fi
# Every start-up check once, before any rank starts: a bad command line is one line, not one per rank.
WORLD_SIZE="$((NNODES * GPUS_PER_NODE))" "$PYTHON" "$root/scripts/pretrain_gpt_libra.py" --check-only \
  --megatron-args-file "$config" "$@"
exec "$PYTHON" -m torch.distributed.run \
  --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  "$root/scripts/pretrain_gpt_libra.py" \
  --megatron-args-file "$config" \
  "$@"
