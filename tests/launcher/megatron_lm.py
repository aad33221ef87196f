"""Helpers for the tests that need Megatron-LM's training code, found by the project's one getter, per release.

``libra_megatron.megatron_lm.get_megatron_lm()`` (``MEGATRON_LM_PATH``, the repository cache, the archive
beside the checkout, a shallow clone) of each release in ``RELEASES`` (core_v0.16.1, core_v0.19.0). Under CI
(``CI`` set) a getter failure FAILS every such test; outside CI (a user's clone with neither that archive nor
network) they are skipped with the getter's message.

How the two releases are imported (the harness's choice, ``cpu_shims.put_megatron_lm_tree_first``):

* core_v0.16.1: the tree at the END of sys.path: ``megatron.core`` is the installed megatron-core 0.16.1
  wheel (same tag, with its compiled dataset helpers), ``megatron.training`` the tree's;
* core_v0.19.0 on Python 3.11 (test-only: megatron-core 0.19 needs Python 3.12 on the package index): the
  tree FIRST on sys.path, so its own ``megatron/core`` is imported, plus the ``typing.override`` shim.

One Python process holds one ``megatron`` package. In-process tests switch it with ``release_imported``:
the megatron modules (and ``libra_megatron.megatron``, which imports them) of the other release are set
aside and restored, unchanged, when the module's tests are done (the ``megatron_lm_release`` fixture in
conftest.py does this). Worker processes get ``MEGATRON_LM_PATH`` and call ``put_megatron_lm_on_path``.
"""
import contextlib
import functools
import os
import sys
from pathlib import Path
from typing import Optional

import pytest

from libra_megatron.megatron_lm import (
    MEGATRON_LM_TAG,
    RELEASES,
    MegatronLMNotFound,
    get_megatron_lm,
    release_line,
    tree_version,
)

REPO = Path(__file__).resolve().parents[2]
needs_megatron_lm = pytest.mark.usefixtures("megatron_lm_path")  # the fixture is in conftest.py
_ACTIVE = {"release": None}  # the release whose megatron package this process has imported (None: not yet)


def in_ci(environ=None) -> bool:
    """True when the ``CI`` variable is set to a true value (CI=true on the project's CI)."""
    value = (os.environ if environ is None else environ).get("CI", "")
    return value.strip().lower() not in ("", "0", "false", "no")


@functools.lru_cache(maxsize=None)
def _getter_result(release: str):
    """(path, None) or (None, the getter's error), asked once per process and release."""
    try:
        environ = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_PATH"}
        return str(get_megatron_lm(environ, release=release)), None
    except MegatronLMNotFound as err:
        return None, err


def megatron_lm_path(release: str = MEGATRON_LM_TAG) -> str:
    """The Megatron-LM root of ``release`` from the getter; fails under CI, skips elsewhere, when it cannot be
    had."""
    path, err = _getter_result(release)
    if err is None:
        return path
    if in_ci():
        pytest.fail(f"CI must run every Megatron-LM test, but the getter failed for {release}: {err}", pytrace=False)
    pytest.skip(f"Megatron-LM {release} not available: {err}")


def active_release() -> str:
    """The release the in-process tests use now: the fixture's; in a worker process the release of its
    ``$MEGATRON_LM_PATH`` tree; else ``MEGATRON_LM_TAG``."""
    if _ACTIVE["release"]:
        return _ACTIVE["release"]
    path = os.environ.get("MEGATRON_LM_PATH")
    if path:
        line = release_line(tree_version(path))
        return next((tag for tag in RELEASES if release_line(tag) == line), MEGATRON_LM_TAG)
    return MEGATRON_LM_TAG


def tiny_model_args(release: Optional[str] = None) -> list:
    """``TINY_MODEL_ARGS`` with the NullTokenizer size of ``release`` (256 ids, EOD 255, in both)."""
    vocab = "256" if release_line(release or active_release()) != "0.16" else "255"
    args = list(TINY_MODEL_ARGS)
    args[args.index("--vocab-size") + 1] = vocab
    return args


def release_config_args(release: Optional[str] = None) -> list:
    """What a user of ``release`` adds after a shipped run config (configs/common/core_v0.19.args from 0.19 on)."""
    if release_line(release or active_release()) == "0.16":
        return []
    return ["--megatron-args-file", str(REPO / "configs" / "common" / "core_v0.19.args")]


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
"""core_v0.16's NullTokenizer size; use ``tiny_model_args(release)`` where the release may be core_v0.19."""


def put_megatron_lm_on_path(path: Optional[str] = None) -> None:
    """Megatron-LM ``path`` (default ``$MEGATRON_LM_PATH``, which worker processes get) on sys.path the way the
    harness does it: at the end for the release of the installed megatron-core, first for another one."""
    from libra_megatron.testing.cpu_shims import allow_megatron_lm_0_17_on_python_3_11, put_megatron_lm_tree_first

    path = path or os.environ.get("MEGATRON_LM_PATH") or megatron_lm_path(active_release())
    allow_megatron_lm_0_17_on_python_3_11()
    if put_megatron_lm_tree_first(path):
        core = sys.modules.get("megatron.core")
        if core is not None and not str(getattr(core, "__file__", "")).startswith(str(path)):
            # a worker forked from a server that preloaded the installed megatron-core: drop it
            for name in [name for name in sys.modules if _is_megatron_module(name)]:
                del sys.modules[name]
    elif path not in sys.path:
        sys.path.append(path)


def _is_megatron_module(name: str) -> bool:
    return any(name == root or name.startswith(root + ".")
               for root in ("megatron", "libra_megatron.megatron", "pretrain_gpt", "gpt_builders", "model_provider"))


@contextlib.contextmanager
def release_imported(release: str):
    """In this process, ``import megatron`` gives ``release`` inside the block; afterwards the modules and
    sys.path of before are back (the same module objects, so nothing imported earlier sees a mix)."""
    if _ACTIVE["release"] in (None, release) and release_line(release) == _installed_megatron_core_line():
        _ACTIVE["release"] = release
        yield
        return
    saved_modules = {name: module for name, module in sys.modules.items() if _is_megatron_module(name)}
    saved_path, saved_active = list(sys.path), _ACTIVE["release"]
    for name in saved_modules:
        del sys.modules[name]
    _ACTIVE["release"] = release
    try:
        yield
    finally:
        for name in [name for name in sys.modules if _is_megatron_module(name)]:
            del sys.modules[name]
        sys.modules.update(saved_modules)
        for name, module in saved_modules.items():  # parents' attributes too (``import a.b as c`` reads them)
            parent, _, child = name.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, module)
        sys.path[:] = saved_path
        _ACTIVE["release"] = saved_active


def _installed_megatron_core_line() -> Optional[str]:
    from importlib import metadata

    try:
        return release_line(metadata.version("megatron-core"))
    except metadata.PackageNotFoundError:
        return None


def import_megatron_training():
    """Import the active release's Megatron-LM training package or fail naming the missing dependency."""
    path = megatron_lm_path(active_release())
    put_megatron_lm_on_path(path)
    try:
        import megatron.training.training  # noqa: F401
    except ImportError as err:
        from libra_megatron.megatron_lm import missing_package_error

        pytest.fail(f"{missing_package_error(err)} (scripts/setup_env.sh installs them)", pytrace=False)
    import megatron.core

    assert release_line(megatron.core.__version__) == release_line(tree_version(path)), (
        f"imported megatron-core {megatron.core.__version__} from {megatron.core.__file__}, tree {path}")


def emulate_hopper_for_argument_validation(monkeypatch) -> None:
    """``validate_args`` queries the GPU (arch < 10 check, grouped-GEMM capability); answer as an H100 would.

    Only argument validation sees this; no kernel runs.
    """
    import torch

    import megatron.training.arguments as arguments

    if hasattr(arguments, "get_device_arch_version"):  # core_v0.16 (core_v0.19 asks torch.cuda directly)
        monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def pairs_with_installed_megatron_core(release: Optional[str] = None) -> bool:
    """Whether ``release`` (default: the imported one) is the installed megatron-core's release line. Where it
    is not (core_v0.19 on this Python 3.11 install, test-only), the launcher needs the CPU harness's import
    set-up of the tree (``cpu_shims._before_megatron_import``): its own megatron/core first."""
    from importlib import metadata

    return release_line(metadata.version("megatron-core")) == release_line(release or active_release())


def launcher_import_set_up():
    """``before_megatron_import`` for an in-process ``launch.main``: None (exactly the user's launcher) where the
    release pairs with the installed megatron-core; else (core_v0.19 on Python 3.11, test-only) the CPU
    harness's import set-up of the tree, without its CUDA emulation."""
    if pairs_with_installed_megatron_core():
        return None
    from libra_megatron.testing import cpu_shims

    return cpu_shims._before_megatron_import
