"""Patch point: the data loader — Megatron's samplers are replaced by Libra's VRSP global-batch sampler.

VRSP must see a whole optimizer-step window (GBS packed sequences) to place them into pools, and every
microbatch must carry its pool's segment metadata for the planner; Megatron's
``MegatronPretrainingSampler`` / ``MegatronPretrainingRandomSampler`` do neither. The loader is built by
``build_pretraining_data_loader(dataset, consumed_samples)`` in
``megatron/training/datasets/data_samplers.py``; ``training.py`` *from-imports* that name, so the
replacement must be written into both modules or ``build_train_valid_test_data_loaders`` would keep
calling the original.
"""
from __future__ import annotations

from typing import Any, Callable

from ._base import Patcher, per_release, require_source_fragments, resolve_target, spec_for

__all__ = ["BUILD_LOADER", "TRAINING_IMPORT", "install"]

BUILD_LOADER = per_release("megatron.training.datasets.data_samplers", "build_pretraining_data_loader",
                           ("dataset", "consumed_samples"),
                           ("MegatronPretrainingSampler(", "args.dataloader_type == 'cyclic'"))
"""Same in core_v0.16.1 and core_v0.19.0."""
TRAINING_IMPORT = "from megatron.training.datasets.data_samplers import build_pretraining_data_loader"
TRAINING_CALL = "build_pretraining_data_loader(train_ds, "


def install(patcher: Patcher, build_loader: Callable[[Any, int], Any]) -> None:
    """Route ``build_pretraining_data_loader(dataset, consumed_samples)`` to ``build_loader``."""
    spec = spec_for(BUILD_LOADER)
    resolve_target(spec)
    import megatron.training.training as training_module

    require_source_fragments("megatron.training.training", training_module, (TRAINING_IMPORT, TRAINING_CALL),
                             spec.tag)

    def build_pretraining_data_loader(dataset, consumed_samples):
        return build_loader(dataset, consumed_samples)

    patcher.replace(spec.module, "build_pretraining_data_loader", build_pretraining_data_loader)
    patcher.replace("megatron.training.training", "build_pretraining_data_loader", build_pretraining_data_loader)
