"""Patch point: per-step Libra metrics into Megatron's logger / TensorBoard writer.

``train()`` in ``megatron/training/training.py`` calls the module-level ``training_log(...)`` once per
iteration on every rank, after the optimizer step, with the iteration number; Megatron's own TensorBoard
writer (``get_tensorboard_writer()``) is live there. Wrapping that attribute lets Libra add its scalars
(inter-pool R-1 before/after VRSP, intra-pool max/mean, bytes exchanged, planner latency) at the same
``iteration`` as Megatron's loss, without touching the training loop.
"""
from __future__ import annotations

from typing import Callable

from ._base import Patcher, TargetSpec, require_source_fragments, resolve_target, spec_for

__all__ = ["TRAINING_LOG", "install"]

_PARAMS_016 = (
    "loss_dict", "total_loss_dict", "learning_rate", "iteration", "loss_scale", "report_memory_flag",
    "skipped_iter", "grad_norm", "params_norm", "num_zeros_in_grad", "max_attention_logit",
    "pg_collection", "is_first_iteration",
)
TRAINING_LOG = {
    "0.16": TargetSpec("megatron.training.training", "training_log", _PARAMS_016,
                       ("writer = get_tensorboard_writer()",), "0.16"),
    "0.19": TargetSpec("megatron.training.training", "training_log",
                       _PARAMS_016 + ("seqlen_squared_sum_in_batch", "total_real_tokens_in_batch"),
                       ("writer = get_tensorboard_writer()",), "0.19"),
}
TRAIN_LOOP = "report_memory_flag = training_log("


def install(patcher: Patcher, after_log: Callable[[int], None]) -> None:
    """Call ``after_log(iteration)`` after each ``training_log`` call; its return value is kept."""
    spec = spec_for(TRAINING_LOG)
    original = resolve_target(spec)
    import megatron.training.training as training_module

    require_source_fragments("megatron.training.training.train", training_module.train, (TRAIN_LOOP,), spec.tag)
    iteration_index = spec.params.index("iteration")

    def training_log(*args, **kwargs):
        result = original(*args, **kwargs)
        iteration = kwargs["iteration"] if "iteration" in kwargs else args[iteration_index]
        after_log(int(iteration))
        return result

    training_log.__wrapped_megatron__ = original  # type: ignore[attr-defined]
    patcher.replace(spec.module, "training_log", training_log)
