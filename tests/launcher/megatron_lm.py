"""Helpers for the tests that need Megatron-LM's training code, found by the project's one getter.

``libra_megatron.megatron_lm.get_megatron_lm()`` (``MEGATRON_LM_PATH``, the repository cache, the
archive beside the checkout, a shallow clone). Under CI (``CI`` set) a getter failure FAILS every such test; outside
CI (a user's clone with neither that archive nor network) they are skipped with the getter's message.
"""
import functools
import os
import sys
from pathlib import Path

import pytest

from libra_megatron.megatron_lm import MegatronLMNotFound, get_megatron_lm

REPO = Path(__file__).resolve().parents[2]
needs_megatron_lm = pytest.mark.usefixtures("megatron_lm_path")  # the fixture is in conftest.py


def in_ci(environ=None) -> bool:
    """True when the ``CI`` variable is set to a true value (CI=true on the project's CI)."""
    value = (os.environ if environ is None else environ).get("CI", "")
    return value.strip().lower() not in ("", "0", "false", "no")


@functools.lru_cache(maxsize=None)
def _getter_result():
    """(path, None) or (None, the getter's error), asked once per process (a failed clone is not retried)."""
    try:
        return str(get_megatron_lm()), None
    except MegatronLMNotFound as err:
        return None, err


def _find_megatron_lm() -> str:
    path, err = _getter_result()
    if err is not None:
        raise err
    return path


def megatron_lm_path() -> str:
    """The Megatron-LM root from the getter; fails under CI, skips elsewhere, when it cannot be had."""
    path, err = _getter_result()
    if err is None:
        return path
    if in_ci():
        pytest.fail(f"CI must run every Megatron-LM test, but the getter failed: {err}", pytrace=False)
    pytest.skip(f"Megatron-LM not available: {err}")

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
    """Megatron-LM at the end of sys.path.

    Appended, not prepended: ``megatron.core`` then comes from the installed megatron-core 0.16.1 wheel
    (same tag, with its compiled dataset helpers) and ``megatron.training`` from the checkout (``megatron``
    is a namespace package in both). The launcher prepends instead (the CPU harness then reuses the wheel's
    compiled dataset helpers).
    """
    path = os.environ.get("MEGATRON_LM_PATH") or _find_megatron_lm()  # worker processes get the variable
    if path not in sys.path:
        sys.path.append(path)


def import_megatron_training():
    """Import Megatron-LM's training package or fail naming the missing dependency."""
    put_megatron_lm_on_path()
    try:
        import megatron.training.training  # noqa: F401
    except ImportError as err:
        from libra_megatron.megatron_lm import missing_package_error

        pytest.fail(f"{missing_package_error(err)} (scripts/setup_env.sh installs them)", pytrace=False)


def emulate_hopper_for_argument_validation(monkeypatch) -> None:
    """``validate_args`` queries the GPU (arch < 10 check, grouped-GEMM capability); answer as an H100 would.

    Only argument validation sees this; no kernel runs.
    """
    import torch

    import megatron.training.arguments as arguments

    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
