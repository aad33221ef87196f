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

from ._base import Patcher, TargetSpec, per_release, resolve_target, spec_for

__all__ = ["INITIALIZE_MODEL_PARALLEL", "DESTROY_MODEL_PARALLEL", "CALLER", "install"]

_INIT_PARAMS_016 = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "pipeline_model_parallel_comm_backend", "use_sharp", "context_parallel_size",
    "hierarchical_context_parallel_sizes", "hybrid_context_parallel", "expert_model_parallel_size",
    "num_distributed_optimizer_instances", "expert_tensor_parallel_size",
    "nccl_communicator_config_path", "distributed_timeout_minutes", "order", "get_embedding_ranks",
    "get_position_embedding_ranks", "create_gloo_process_groups", "high_priority_stream_groups",
    "sharp_enabled_group", "create_all_gather_group",
)
_INIT_PARAMS_019 = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "pipeline_model_parallel_comm_backend", "use_sharp", "context_parallel_size",
    "hierarchical_context_parallel_sizes", "hybrid_context_parallel", "expert_model_parallel_size",
    "gtp_remat_size", "expert_gtp_remat_size", "num_distributed_optimizer_instances",
    "expert_tensor_parallel_size", "nccl_communicator_config_path", "distributed_timeout_minutes", "order",
    "get_embedding_ranks", "get_position_embedding_ranks", "create_gloo_process_groups",
    "high_priority_stream_groups", "sharp_enabled_group", "rank_offset", "local_world_size",
)
_ORDER_DEFAULT = ('order: str = "tp-cp-ep-dp-pp"',)
INITIALIZE_MODEL_PARALLEL = {
    "0.16": TargetSpec("megatron.core.parallel_state", "initialize_model_parallel", _INIT_PARAMS_016,
                       _ORDER_DEFAULT, "0.16"),
    "0.19": TargetSpec("megatron.core.parallel_state", "initialize_model_parallel", _INIT_PARAMS_019,
                       _ORDER_DEFAULT, "0.19"),
}
DESTROY_MODEL_PARALLEL = per_release("megatron.core.parallel_state", "destroy_model_parallel", ())
_CALLER_FRAGMENTS = (
    "mpu.initialize_model_parallel(",
    "order='tp-cp-ep-dp-pp' if not args.use_tp_pp_dp_mapping else 'tp-cp-ep-pp-dp'",  # see hooks._rank_order
)
CALLER = {
    "0.16": TargetSpec("megatron.training.initialize", "_initialize_distributed",
                       ("get_embedding_ranks", "get_position_embedding_ranks", "store"), _CALLER_FRAGMENTS, "0.16"),
    "0.19": TargetSpec("megatron.training.initialize", "_initialize_distributed",
                       ("get_embedding_ranks", "get_position_embedding_ranks", "store", "skip_model_parallel_init"),
                       _CALLER_FRAGMENTS, "0.19"),
}


def install(patcher: Patcher, on_ready: Callable[[], None], on_destroy: Callable[[], None]) -> None:
    """Run ``on_ready()`` after every ``initialize_model_parallel`` and ``on_destroy()`` before teardown."""
    init_spec = spec_for(INITIALIZE_MODEL_PARALLEL)
    init_original = resolve_target(init_spec)
    destroy_original = resolve_target(spec_for(DESTROY_MODEL_PARALLEL))
    resolve_target(spec_for(CALLER))

    def initialize_model_parallel(*args, **kwargs):
        init_original(*args, **kwargs)
        on_ready()

    def destroy_model_parallel():
        on_destroy()
        destroy_original()

    initialize_model_parallel.__wrapped_megatron__ = init_original  # type: ignore[attr-defined]
    patcher.replace(init_spec.module, "initialize_model_parallel", initialize_model_parallel)
    patcher.replace(init_spec.module, "destroy_model_parallel", destroy_model_parallel)
