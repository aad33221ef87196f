#!/usr/bin/env bash
# The main job on a CPU machine: a tiny Qwen3-shaped megatron-core GPTModel trained on gloo with Libra
# (VRSP sampler + sequence-pool groups + LibraCoreAttention executing TAP plans), side by side with the
# same run on plain per-sample attention and the unmodified sampler; exits non-zero if loss/grad-norm
# parity fails. Sets up ./.venv on first use. Extra arguments go to the driver, e.g.
#   bash scripts/main.sh --dp 4 --pool-size 4            bash scripts/main.sh --dp 2 --cp 2 --pool-size 2
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup_env.sh")"
cd "$root"
exec "$py" -m libra_megatron.megatron.train_cpu --compare --dp 4 --pool-size 2 --steps 20 "$@"
