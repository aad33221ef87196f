"""Every CPU shim of the project, in one file (tests, the CPU driver and ``scripts/cpu_pretrain.sh`` only).

Two layers:

* ``apply_megatron_cpu_shims()``: megatron-core 0.16.1 modules used directly on CPU (tests, the CPU
  end-to-end driver). No-op when a real GPU is present.
* ``emulate_cuda_on_cpu()`` + ``python -m libra_megatron.testing.cpu_shims [launcher flags] <pretrain_gpt.py
  flags>``: Megatron-LM's UNMODIFIED ``pretrain_gpt.py`` -> ``pretrain()`` on gloo through
  ``libra_megatron.launch`` (``--without-libra``: the same program unpatched, the reference run).
  ``torch.cuda`` answers as one GPU per process whose RNG is the CPU generator, a ``TorchFunctionMode`` maps
  every CUDA device to the CPU (``.cuda()`` is the identity), NCCL becomes gloo, ``torch.compile`` is the
  identity and dynamo is off. Nothing of Megatron's data, checkpoint or logging code and no Libra patch point
  is bypassed; two Megatron-LM start-up *build* steps are replaced: the fused-kernel loader (it runs
  ``nvcc``) and the dataset-helper compile (the megatron-core wheel's build of the identical ``helpers.cpp``
  is loaded instead).

Each shim carries one line on why it exists. Product code never imports this module
(``tests/test_layering.py``).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import time
from typing import Any, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["apply_megatron_cpu_shims", "emulate_cuda_on_cpu", "cuda_is_emulated", "main",
           "allow_megatron_lm_0_17_on_python_3_11", "put_megatron_lm_tree_first", "use_installed_dataset_helpers"]

_REAL_CUDA_AVAILABLE = torch.cuda.is_available
_ROPE_MODULES = (
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
)
_STATE = {"megatron_core": False, "emulation": None}


# ---------------------------------------------------------------------------------------------- layer 1
def apply_megatron_cpu_shims() -> bool:
    """Shims for megatron-core 0.16.1 on CPU-only torch; idempotent; True when active (no real CUDA).

    1. ``torch.cuda.current_device()`` returns the CPU device (called unconditionally by RoPE ``inv_freq``,
       ``GPTModel`` position ids, TP layers' device placement).
    2. ``get_pos_emb_on_this_cp_rank`` (CP RoPE slicing) without ``pin_memory``/``.cuda()``.
    3. ``moe_utils.te_general_gemm = None`` when Transformer Engine is absent (MoE router).

    Under ``emulate_cuda_on_cpu`` only 3 applies (the emulation covers 1 and 2 generically).
    """
    if _REAL_CUDA_AVAILABLE():
        return False
    if cuda_is_emulated():
        _define_missing_te_gemm()
        return True
    if not _STATE["megatron_core"]:
        torch.cuda.current_device = _cpu_current_device
        _patch_cp_pos_emb()
        _define_missing_te_gemm()
        _STATE["megatron_core"] = True
    return True


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16's MoE router tests ``te_general_gemm is not None`` but only defines the name when
    Transformer Engine imports; bind it to None so the router takes its torch matmul path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron-core's ``get_pos_emb_on_this_cp_rank`` (zigzag: chunks c and 2*CP-1-c of 2*CP) without
    its ``pin_memory=True`` / ``.cuda()`` index tensor; same result on the positional table's device."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _patch_cp_pos_emb() -> None:
    """Replace the CP RoPE slicer in every megatron-core module that imported it by name."""
    for name in _ROPE_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            module.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank


# ---------------------------------------------------------------------------------------------- layer 2
def cuda_is_emulated() -> bool:
    """True once ``emulate_cuda_on_cpu`` ran in this process."""
    return _STATE["emulation"] is not None


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare index means the accelerator


class _CudaToCpu(TorchFunctionMode):
    """Every torch call that names a CUDA device (``device='cuda'``, ``device=0``, ``.to('cuda')``,
    ``.cuda()``, ``pin_memory=True``) runs on the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:  # Megatron moves batches/modules with .cuda(); CPU is "the GPU" here
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # asserts 'torch.cuda.FloatTensor'
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda_device(kwargs.get("device")):  # factory calls name the GPU explicitly
            kwargs["device"] = torch.device("cpu")
        if kwargs.get("pin_memory"):  # pinning needs a CUDA host allocator
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.to, torch.Tensor.pin_memory):
            if func is torch.Tensor.pin_memory:  # nothing to pin for on a CPU run
                return args[0]
            args = tuple(torch.device("cpu") if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


class _Stream:
    """Stand-in for ``torch.cuda.Stream``: CPU work is synchronous, so waits and syncs are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _Event()


class _Event:
    """Stand-in for ``torch.cuda.Event``: wall-clock timestamps (Megatron's timers read elapsed_time)."""

    def __init__(self, *args, **kwargs):
        self._time = None

    def record(self, stream=None):
        self._time = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1000.0 * (end._time - self._time)


def _returning(value: Any):
    """A fresh function returning ``value`` (one per stub: dynamo's rule table rejects one object under two
    torch.cuda names)."""

    def stub(*args, **kwargs):
        return value

    return stub


def _eager_compile(model=None, **kwargs):
    """``torch.compile`` as the identity: Megatron's ``jit_fuser`` fusions then run eagerly (no dynamo)."""
    return (lambda fn: fn) if model is None else model


def _cuda_stubs() -> dict:
    """``torch.cuda`` attributes Megatron-LM's start-up and training loop call, answered for one CPU 'GPU'."""
    cpu_generator = torch.default_generator
    return {
        "is_available": lambda: True,  # initialize_megatron asserts CUDA; the launcher checks it too
        "device_count": lambda: 1,  # _initialize_distributed builds Megatron's groups only if > 0
        "current_device": lambda: 0,  # used as a device index; the mode maps index 0 to the CPU
        "set_device": _returning(None),  # one device per process, nothing to select
        "synchronize": _returning(None),  # CPU kernels are synchronous
        "empty_cache": _returning(None),  # no caching allocator on CPU
        "_lazy_call": lambda callback, **kwargs: callback(),  # Megatron sets RNG states through it: run now
        "default_generators": (cpu_generator,),  # Megatron's RNG tracker reads/writes generator 0
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),  # the "CUDA" RNG is the CPU one
        "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
        "manual_seed": lambda seed: cpu_generator.manual_seed(seed),  # (torch.manual_seed calls these too)
        "manual_seed_all": lambda seed: cpu_generator.manual_seed(seed),
        "Stream": _Stream,  # DDP set-up runs on a side stream
        "current_stream": lambda device=None: _Stream(),
        "default_stream": lambda device=None: _Stream(),  # --overlap-grad-reduce waits on it
        "stream": lambda stream=None: contextlib.nullcontext(),
        "Event": _Event,  # --log-straggler times with events
        "memory_allocated": _returning(0),  # Megatron's memory report: no device memory to count
        "max_memory_allocated": _returning(0),
        "memory_reserved": _returning(0),
        "max_memory_reserved": _returning(0),
        "memory_stats": lambda *a, **k: {},  # --log-memory-to-tensorboard
        "get_device_capability": lambda *a, **k: (9, 0),  # validate_args' capability checks (answer: Hopper)
        "get_device_properties": lambda *a, **k: _DeviceProperties(),  # get_device_arch_version
    }


class _DeviceProperties:
    """What Megatron reads from ``torch.cuda.get_device_properties`` (name, memory, SM count)."""

    name = "cpu (emulated CUDA device)"
    total_memory = 0
    multi_processor_count = 1
    major, minor = 9, 0


def _gloo_init_process_group(original):
    """NCCL needs GPUs; gloo runs the same collectives on CPU tensors."""

    def init_process_group(*args, **kwargs):
        if args:
            args = ("gloo",) + tuple(args[1:])
        else:
            kwargs["backend"] = "gloo"
        return original(*args, **kwargs)

    return init_process_group


def _gloo_new_group(original):
    """Megatron asks for NCCL subgroups by name (e.g. the PP backend); the default (gloo) serves them."""

    def new_group(*args, **kwargs):
        if kwargs.get("backend") in ("nccl", "ucc"):
            kwargs["backend"] = None
            kwargs.pop("pg_options", None)
        return original(*args, **kwargs)

    return new_group


def _copying_isend(original):
    """Megatron frees a pipeline output right after starting its send (``deallocate_output_tensor`` swaps its
    ``.data``); on GPUs the caching allocator keeps the memory valid for the NCCL stream, but gloo's isend reads
    the host buffer from its own thread later, so the freed memory could be reused before it goes out (seen as
    run-to-run differences under the interleaved schedule, whose sends overlap compute). Send a private copy."""

    def isend(tensor, *args, **kwargs):
        return original(tensor.detach().clone(), *args, **kwargs)

    return isend


_RNG_STUBS = ("_lazy_call", "default_generators", "get_rng_state", "set_rng_state")


def emulate_cuda_rng_on_cpu() -> None:
    """Only the CUDA-RNG part of the emulation, for megatron-core used in-process without it (the shipped-config
    step): Megatron's activation recompute saves and restores the "CUDA" RNG state around each recomputed
    layer. The "CUDA" RNG is the CPU generator; seeds are untouched. Idempotent; a no-op with a real GPU."""
    if _REAL_CUDA_AVAILABLE() or cuda_is_emulated():
        return
    stubs = _cuda_stubs()
    for name in _RNG_STUBS:
        setattr(torch.cuda, name, stubs[name])
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state  # Megatron calls the torch.cuda.random names
    torch.cuda.random.set_rng_state = torch.cuda.set_rng_state


def emulate_cuda_on_cpu() -> None:
    """Install the CPU-as-CUDA emulation for Megatron-LM's ``pretrain()``; idempotent."""
    if cuda_is_emulated():
        return
    if _REAL_CUDA_AVAILABLE():
        raise RuntimeError("emulate_cuda_on_cpu() is for CPU-only machines; a real GPU is present")
    import torch._dynamo
    import torch.distributed as dist

    for name, value in _cuda_stubs().items():
        setattr(torch.cuda, name, value)
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state  # Megatron calls the torch.cuda.random names
    torch.cuda.random.set_rng_state = torch.cuda.set_rng_state
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # validate_args asserts it for TP/CP on Hopper
    torch.compile = _eager_compile  # Megatron's jit_fuser = torch.compile would build C++ kernels on every rank
    torch._dynamo.config.disable = True  # and nothing else may start dynamo either
    dist.init_process_group = _gloo_init_process_group(dist.init_process_group)
    dist.new_group = _gloo_new_group(dist.new_group)
    import torch.distributed.distributed_c10d as c10d

    c10d.isend = dist.isend = _copying_isend(c10d.isend)  # both names: batch_isend_irecv checks op is isend
    mode = _CudaToCpu()
    mode.__enter__()  # process-wide: the whole run is "on the GPU"
    _STATE["emulation"] = mode


def allow_megatron_lm_0_17_on_python_3_11() -> None:
    """Megatron-LM >= core_v0.17 declares Python >= 3.12 and imports ``typing.override`` (3.12) in
    ``megatron/training/models/{gpt,hybrid}.py``; on the 3.11 test machines ``typing_extensions`` supplies it."""
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
        # processes Megatron-LM spawns (core_v0.19's checkpoint writer) re-import pretrain_gpt.py first
        site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "py311_site")
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if site not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([site] + paths)


def put_megatron_lm_tree_first(megatron_lm_path: Any) -> bool:
    """Put the tree first on ``sys.path`` when its release differs from the installed megatron-core (the
    test-only core_v0.19 tree on Python 3.11, where megatron-core 0.16.1 is installed): the tree's own
    ``megatron/core`` is then the one imported, and the launcher's pairing check sees it. True if moved."""
    from importlib import metadata

    from libra_megatron.megatron_lm import release_line, tree_version

    try:
        installed = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        installed = None
    tree = tree_version(megatron_lm_path)
    if tree is None or (installed is not None and release_line(installed) == release_line(tree)):
        return False
    path = str(megatron_lm_path)
    if path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)
    return True


def _skip_fused_kernel_build() -> None:
    """Megatron-LM's legacy fused-kernel loader runs ``nvcc``; the CPU run uses the unfused torch paths.
    core_v0.19 has no ``megatron.legacy`` (and no start-up fused-kernel build): nothing to skip."""
    if importlib.util.find_spec("megatron.legacy") is None:
        return
    from megatron.legacy import fused_kernels

    fused_kernels.load = _returning(None)


def use_installed_dataset_helpers() -> None:
    """Megatron-LM compiles ``helpers.cpp`` at start-up with make, pybind11 and whatever ``python3-config`` is on
    PATH (here: another Python's suffix, and no pybind11); the pinned megatron-core 0.16.1 wheel ships the file
    compiled. The build is reused only when the imported ``megatron.core``'s ``helpers.cpp`` is byte-identical
    to the wheel's (core_v0.16.1 and core_v0.19.0 both are); otherwise this stops naming both files."""
    from importlib import metadata, util

    from megatron.core.datasets import utils

    wheel = metadata.distribution("megatron-core")
    files = {str(f): f for f in wheel.files or ()}
    so = next(f for name, f in files.items() if name.startswith("megatron/core/datasets/helpers_cpp"))
    theirs = wheel.locate_file(files["megatron/core/datasets/helpers.cpp"])
    ours = os.path.join(os.path.dirname(utils.__file__), "helpers.cpp")
    with open(theirs, "rb") as a, open(ours, "rb") as b:
        if a.read() != b.read():
            raise RuntimeError(f"{ours} differs from the megatron-core {wheel.version} wheel's {theirs}; its "
                               f"compiled helpers cannot be reused for this Megatron-LM tree")
    spec = util.spec_from_file_location("megatron.core.datasets.helpers_cpp", wheel.locate_file(so))
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[spec.name] = module
    utils.compile_helpers = _returning(None)


def _on_megatron_ready(plan: Any) -> None:
    """Launcher callback: Megatron-LM is importable and patched; apply the shims that import megatron."""
    _skip_fused_kernel_build()
    use_installed_dataset_helpers()
    apply_megatron_cpu_shims()


WITHOUT_LIBRA = "--without-libra"


def _before_megatron_import(plan: Any) -> None:
    """Launcher callback before Megatron-LM is imported: the test-only import set-up of its tree."""
    allow_megatron_lm_0_17_on_python_3_11()
    put_megatron_lm_tree_first(plan.megatron_lm_path)


def _main_without_libra(argv: Sequence[str]) -> int:
    """The reference run: the same program, flags and shims, Megatron-LM unpatched (no Libra at all)."""
    from libra_megatron import launch

    plan = launch.parse_launch_args(argv)
    _before_megatron_import(plan)
    launch.import_megatron_training(plan.megatron_lm_path)
    _on_megatron_ready(plan)
    launch.run_program(plan)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m libra_megatron.testing.cpu_shims [--without-libra] [launcher flags] <pretrain_gpt.py flags>``.

    With Libra (default): exactly ``python -m libra_megatron.launch``, on emulated CUDA. ``--without-libra``:
    Megatron-LM's program as it is (launcher flags such as ``--megatron-args-file`` still apply).
    """
    from libra_megatron import launch
    from libra_megatron.cli import run_cli

    args = list(sys.argv[1:] if argv is None else argv)
    emulate_cuda_on_cpu()
    if WITHOUT_LIBRA in args:
        args.remove(WITHOUT_LIBRA)
        run_cli(launch.TOOL, _main_without_libra, args)
    launch.main(args, before_megatron_import=_before_megatron_import, on_megatron_ready=_on_megatron_ready)


if __name__ == "__main__":
    main()
