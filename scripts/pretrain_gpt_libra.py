#!/usr/bin/env python
"""Megatron-LM pretrain_gpt.py with Libra attached: a thin wrapper around ``libra_megatron.launch``.

Usage (same flags as pretrain_gpt.py, plus --libra-* and the launcher flags):

    torchrun --nproc-per-node 8 scripts/pretrain_gpt_libra.py --megatron-lm-path /path/to/Megatron-LM \\
        --megatron-args-file configs/qwen3-30b-a3b-256k.args --data-path ... --save ...

Works from a checkout without installing the package: the repository root is put on sys.path.
"""
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from libra_megatron.launch import main  # noqa: E402

if __name__ == "__main__":
    main()
