"""Patch point: sequence-pool groups (and the Libra config check) right after model-parallel init.

Pool groups partition the DP axis (P*CP ranks with the same TP rank and PP stage), so they can only be
built once ``parallel_state`` knows the TP/CP/DP/PP layout, and every rank must create them in the same
order, at the same point, like Megatron's own groups. ``_initialize_distributed`` in
``megatron/training/initialize.py`` calls ``mpu.initialize_model_parallel(...)`` through the module
attribute (``mpu`` is ``megatron.core.parallel_state``), so wrapping that attribute runs our callback
immediately after Megatron's groups exist and before the model, optimizer or data loaders are built.
``destroy_model_parallel`` is wrapped too so pool groups never outlive the groups they are cut from.
"""
from __future__ import annotations

from typing import Callable

from ._base import Patcher, TargetSpec, resolve_target

__all__ = ["INITIALIZE_MODEL_PARALLEL", "DESTROY_MODEL_PARALLEL", "CALLER", "install"]

INITIALIZE_MODEL_PARALLEL = TargetSpec(
    module="megatron.core.parallel_state",
    attr="initialize_model_parallel",
    params=(
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "pipeline_model_parallel_comm_backend", "use_sharp", "context_parallel_size",
        "hierarchical_context_parallel_sizes", "hybrid_context_parallel", "expert_model_parallel_size",
        "num_distributed_optimizer_instances", "expert_tensor_parallel_size",
        "nccl_communicator_config_path", "distributed_timeout_minutes", "order", "get_embedding_ranks",
        "get_position_embedding_ranks", "create_gloo_process_groups", "high_priority_stream_groups",
        "sharp_enabled_group", "create_all_gather_group",
    ),
    source_fragments=('order: str = "tp-cp-ep-dp-pp"',),
)
DESTROY_MODEL_PARALLEL = TargetSpec(
    module="megatron.core.parallel_state", attr="destroy_model_parallel", params=()
)
CALLER = TargetSpec(
    module="megatron.training.initialize",
    attr="_initialize_distributed",
    params=("get_embedding_ranks", "get_position_embedding_ranks", "store"),
    source_fragments=(
        "mpu.initialize_model_parallel(",
        "order='tp-cp-ep-dp-pp' if not args.use_tp_pp_dp_mapping else 'tp-cp-ep-pp-dp'",  # see hooks._rank_order
    ),
)


def install(patcher: Patcher, on_ready: Callable[[], None], on_destroy: Callable[[], None]) -> None:
    """Run ``on_ready()`` after every ``initialize_model_parallel`` and ``on_destroy()`` before teardown."""
    init_original = resolve_target(INITIALIZE_MODEL_PARALLEL)
    destroy_original = resolve_target(DESTROY_MODEL_PARALLEL)
    resolve_target(CALLER)

    def initialize_model_parallel(*args, **kwargs):
        init_original(*args, **kwargs)
        on_ready()

    def destroy_model_parallel():
        on_destroy()
        destroy_original()

    initialize_model_parallel.__wrapped_megatron__ = init_original  # type: ignore[attr-defined]
    patcher.replace(INITIALIZE_MODEL_PARALLEL.module, "initialize_model_parallel", initialize_model_parallel)
    patcher.replace(DESTROY_MODEL_PARALLEL.module, "destroy_model_parallel", destroy_model_parallel)
