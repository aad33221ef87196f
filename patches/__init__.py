"""Patch points that attach Libra to an unmodified Megatron-LM (tags core_v0.16.x and core_v0.19.x) — no fork.

Each patch point is its own module with the ``TargetSpec`` it verifies before replacing anything (see
``_base.py``): a Megatron-LM whose target changed fails loudly at start-up with ``PatchTargetChanged``.
``install_all(hooks)`` installs every point against a hooks object (``libra_megatron.megatron.hooks``
provides ``LibraHooks``) and returns the ``Patcher`` whose ``undo()`` restores Megatron.

The folder sits at the top of the repository, one module per patch point, and installs as
``libra_megatron.patches`` (``package_dir`` in ``setup.py``); it never installs as a top-level ``patches``.
From a checkout that is not installed, ``libra_megatron.launch.import_patches`` loads it under that name.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Tuple

from . import data_loader, get_batch, model_parallel, parse_args, training_log
from ._base import PatchTargetChanged, Patcher, check_megatron_core_version

__all__ = ["PATCH_POINTS", "PatchPoint", "PatchTargetChanged", "Patcher", "install_all"]


class PatchPoint(NamedTuple):
    name: str
    module: str  # our module under patches/
    targets: Tuple[str, ...]  # Megatron attributes replaced
    why: str


PATCH_POINTS: Tuple[PatchPoint, ...] = (
    PatchPoint(
        "argument registration", "patches/parse_args.py",
        ("megatron.training.arguments.parse_args", "megatron.training.initialize.parse_args"),
        "adds every --libra-* flag through extra_args_provider, chained after the program's own provider",
    ),
    PatchPoint(
        "pool groups + effective config", "patches/model_parallel.py",
        ("megatron.core.parallel_state.initialize_model_parallel",
         "megatron.core.parallel_state.destroy_model_parallel"),
        "validates LibraConfig against the parallel layout, logs/saves it, creates the P*CP pool groups "
        "right after Megatron's groups exist; tears them down with Megatron's",
    ),
    PatchPoint(
        "data loader", "patches/data_loader.py",
        ("megatron.training.datasets.data_samplers.build_pretraining_data_loader",
         "megatron.training.training.build_pretraining_data_loader"),
        "VRSP global-batch sampler: GA-major, pool-minor order and pool segment metadata per microbatch",
    ),
    PatchPoint(
        "get_batch", "patches/get_batch.py",
        ("megatron.training.pretrain", "megatron.training.training.pretrain",
         "<program>.get_batch (global used by forward_step)",
         "<program>.is_dataset_built_on_rank (global used by the dataset provider)"),
        "THD batch with cu_seqlens, per-document RoPE positions, the operator's CP token layout and the "
        "step's RankPlan on LibraPackedSeqParams, on every pipeline stage and model chunk (each builds the "
        "sample index and a loader; middle stages use only the document lengths)",
    ),
    PatchPoint(
        "per-step metrics", "patches/training_log.py",
        ("megatron.training.training.training_log",),
        "writes Libra imbalance / bytes / planner-latency scalars next to Megatron's loss in TensorBoard",
    ),
)


def install_all(hooks: Any) -> Patcher:
    """Verify every target, then install all patch points against ``hooks``; all or nothing."""
    import megatron.core

    check_megatron_core_version(megatron.core.__version__)
    patcher = Patcher()
    try:
        parse_args.install(patcher, hooks.add_args)
        model_parallel.install(patcher, hooks.on_model_parallel_ready, hooks.on_model_parallel_destroyed)
        data_loader.install(patcher, hooks.build_data_loader)
        get_batch.install(patcher, hooks.make_get_batch, hooks.make_dataset_rule)
        training_log.install(patcher, hooks.after_training_log)
    except BaseException:
        patcher.undo()
        raise
    return patcher
