"""Helpers for the tests that need a real Megatron-LM checkout (``MEGATRON_LM_PATH``)."""
import os
import sys
from pathlib import Path

import pytest

MEGATRON_LM_PATH = os.environ.get("MEGATRON_LM_PATH")
REPO = Path(__file__).resolve().parents[2]
needs_megatron_lm = pytest.mark.skipif(
    not MEGATRON_LM_PATH, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.1 checkout to run these"
)

# A tiny Qwen3-shaped model: RoPE, qk-layernorm, GQA, RMSNorm, SwiGLU, no bias, untied embeddings.
TINY_MODEL_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--qk-layernorm",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--position-embedding-type", "rope", "--rotary-base", "1000000", "--no-rope-fusion",
    "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--attention-dropout", "0",
    "--hidden-dropout", "0",
    "--transformer-impl", "local", "--use-cpu-initialization", "--micro-batch-size", "1",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--seed", "1234", "--mock-data",
    "--no-create-attention-mask-in-dataloader", "--train-iters", "4", "--lr", "1e-3", "--num-workers", "0",
]


def put_megatron_lm_on_path() -> None:
    """Megatron-LM and the repository root (for ``patches``) at the end of sys.path.

    Appended, not prepended: ``megatron.core`` then comes from the installed megatron-core 0.16.1 wheel
    (same tag, with its compiled dataset helpers) and ``megatron.training`` from the checkout (``megatron``
    is a namespace package in both). The launcher prepends instead and lets Megatron-LM compile its helpers.
    """
    path = os.environ.get("MEGATRON_LM_PATH") or MEGATRON_LM_PATH  # read at call time (worker processes)
    if path not in sys.path:
        sys.path.append(path)
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))


def import_megatron_training():
    """Import Megatron-LM's training package or fail naming the missing dependency."""
    put_megatron_lm_on_path()
    try:
        import megatron.training.training  # noqa: F401
    except ImportError as err:
        pytest.fail(f"Megatron-LM at {MEGATRON_LM_PATH} does not import ({err}); its training package needs "
                    f"six, pydantic and triton: pip install six pydantic triton")


def emulate_hopper_for_argument_validation(monkeypatch) -> None:
    """``validate_args`` queries the GPU (arch < 10 check, grouped-GEMM capability); answer as an H100 would.

    Only argument validation sees this; no kernel runs.
    """
    import torch

    import megatron.training.arguments as arguments

    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
