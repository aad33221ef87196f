#!/usr/bin/env bash
# The main job on a CPU machine: a tiny Qwen3-shaped megatron-core GPTModel trained on gloo with Libra
# (VRSP sampler + sequence-pool groups + LibraCoreAttention executing TAP plans), side by side with the
# same run on plain per-sample attention and the unmodified sampler, on 2048-token sequences packed from
# documents with the Wikipedia trace's real lengths (stdlib text); prints the per-step table and a closing
# summary, exits non-zero if loss/grad-norm parity fails. Sets up ./.venv on first use. Extra arguments go
# to the driver (python -m libra_megatron.testing.train_cpu --help), e.g.
#   bash scripts/main.sh --json summary.json     bash scripts/main.sh --dp 2 --cp 2 --pool-size 2
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup_env.sh")"
cd "$root"
exec "$py" -m libra_megatron.testing.train_cpu --compare "$@"
