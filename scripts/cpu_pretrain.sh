#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py -> pretrain() on CPU: torchrun on gloo with the test-only CUDA emulation of
# libra_megatron/testing/cpu_shims.py, through the Libra launcher (python -m libra_megatron.launch).
# For tests and for trying a tiny flag set on a laptop; real training runs on GPUs (scripts/torchrun_*.sh).
#
#   bash scripts/cpu_pretrain.sh [--nproc-per-node N] [--without-libra] <launcher flags> <pretrain_gpt.py flags>
#
# --nproc-per-node N   ranks (default 2); DP = N / (TP*PP*CP)
# --without-libra      plain Megatron-LM: the same program, flags and CPU shims, no Libra patch point installed
# Everything else goes to the launcher unchanged (--megatron-args-file, --spec, --libra-*, --data-path, ...);
# relative paths resolve against your working directory. Sets up ./.venv on first use and gets Megatron-LM
# through libra_megatron.megatron_lm (MEGATRON_LM_PATH, the repo cache, the archive beside the checkout, or a clone).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup_env.sh")"
nproc=2
case "${1:-}" in
  --nproc-per-node) nproc="${2:?--nproc-per-node needs a number}"; shift 2 ;;
  --nproc-per-node=*) nproc="${1#*=}"; shift ;;
esac
mlm="$("$py" -m libra_megatron.megatron_lm --from-launcher-args "$@")"  # once here (its --megatron-lm-release), so ranks do not race
export MEGATRON_LM_PATH="$mlm"
case " $* " in  # every Libra start-up check once, before any rank starts (one line on a bad command line)
  *" --without-libra "*) ;;
  *) WORLD_SIZE="$nproc" "$py" -m libra_megatron.testing.cpu_shims --check-only "$@" ;;
esac
exec "$py" -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
  -m libra_megatron.testing.cpu_shims "$@"
