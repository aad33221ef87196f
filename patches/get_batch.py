"""Patch point: ``get_batch`` of the training program — the Libra batch path.

``pretrain_gpt.py``'s ``forward_step`` calls the module-global ``get_batch(data_iterator, vp_stage)``,
which returns ``(tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params)``. Libra needs
a different batch: cu_seqlens from the sampler's segment metadata (megatron-core 0.16 GPTDataset emits
none), RoPE positions restarting in every document (THD), the CP shard laid out exactly as the
operator's ``TokenLayout``, and the step's ``RankPlan`` attached to a ``LibraPackedSeqParams``.

``pretrain_gpt.py`` runs as ``__main__`` (we start it with ``runpy``), so its ``get_batch`` cannot be
imported and patched beforehand. It does ``from megatron.training import pretrain`` and hands
``forward_step`` to ``pretrain(...)``; we therefore wrap ``pretrain`` (in ``megatron.training`` and
``megatron.training.training``) and, when it is called, swap the ``get_batch`` global of that
``forward_step``'s module for the Libra one. The original ``get_batch`` is passed to the factory so the
Libra path can defer to it where it does not apply.

Every pipeline stage reads the sample index. ``pretrain_gpt.py`` builds datasets (hence loaders and data
iterators) only where ``is_dataset_built_on_rank(vp_stage)`` holds: TP rank 0 of the first and the last
(virtual) pipeline stage. A middle stage's attention still needs its microbatch's document boundaries and
plan, so the same ``pretrain`` wrapper swaps that predicate, the global the program's dataset provider
passes to ``BlendedMegatronDatasetBuilder``, for the Libra one (``make_dataset_rule(original)``): every
stage and every model chunk then gets its own loader, consumed in microbatch order like Megatron's own
first- and last-stage iterators.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from ._base import Patcher, PatchTargetChanged, TargetSpec, require_source_fragments, resolve_target

__all__ = ["PRETRAIN", "GET_BATCH_PARAMS", "FORWARD_STEP_FRAGMENTS", "DATASET_RULE_PARAMS", "PROVIDER_FRAGMENTS",
           "swap_get_batch", "swap_dataset_rule", "install"]

PRETRAIN = TargetSpec(
    module="megatron.training.training",
    attr="pretrain",
    params=(
        "train_valid_test_dataset_provider", "model_provider", "model_type", "forward_step_func",
        "process_non_loss_data_func", "extra_args_provider", "args_defaults", "get_embedding_ranks",
        "get_position_embedding_ranks", "non_loss_data_func", "store", "inprocess_call_wrapper",
    ),
    source_fragments=("initialize_megatron(",),
)
GET_BATCH_PARAMS = ("data_iterator", "vp_stage")
FORWARD_STEP_FRAGMENTS = (
    "packed_seq_params = get_batch(data_iterator, vp_stage)",
    "packed_seq_params=packed_seq_params",
)
DATASET_RULE_PARAMS = ("vp_stage",)
PROVIDER_FRAGMENTS = ("partial(is_dataset_built_on_rank, vp_stage=vp_stage)",)
GetBatch = Callable[..., tuple]
DatasetRule = Callable[..., bool]


def swap_get_batch(forward_step_func: Callable[..., Any], make_get_batch: Callable[[GetBatch], GetBatch]) -> GetBatch:
    """Replace the ``get_batch`` global that ``forward_step_func`` calls; return the original.

    Raises ``PatchTargetChanged`` unless ``forward_step_func`` looks like core_v0.16.1's
    ``pretrain_gpt.forward_step``: calls ``get_batch(data_iterator, vp_stage)`` for six values and passes
    ``packed_seq_params`` to the model.
    """
    where = f"{getattr(forward_step_func, '__module__', '?')}.forward_step"
    module_globals = getattr(inspect.unwrap(forward_step_func), "__globals__", None)
    original = None if module_globals is None else module_globals.get("get_batch")
    if original is None or not callable(original):
        raise PatchTargetChanged(
            f"{where} has no module-level get_batch to replace (core_v0.16.1 pretrain_gpt.py defines one); "
            f"the Libra batch path needs the pretrain_gpt.py forward_step"
        )
    found = tuple(inspect.signature(original).parameters)
    if found != GET_BATCH_PARAMS:
        raise PatchTargetChanged(
            f"get_batch used by {where} changed its signature: expected parameters {list(GET_BATCH_PARAMS)} "
            f"(core_v0.16.1), found {list(found)}"
        )
    require_source_fragments(where, inspect.unwrap(forward_step_func), FORWARD_STEP_FRAGMENTS)
    module_globals["get_batch"] = make_get_batch(original)
    return original


def swap_dataset_rule(dataset_provider: Callable[..., Any],
                      make_rule: Callable[[DatasetRule], DatasetRule]) -> DatasetRule:
    """Replace the ``is_dataset_built_on_rank`` global that ``dataset_provider`` hands to the dataset builder;
    return the original.

    Raises ``PatchTargetChanged`` unless the provider looks like core_v0.16.1's
    ``pretrain_gpt.train_valid_test_datasets_provider``: it passes ``partial(is_dataset_built_on_rank,
    vp_stage=vp_stage)`` and that global takes ``(vp_stage)``.
    """
    provider = inspect.unwrap(getattr(dataset_provider, "func", dataset_provider))  # a functools.partial too
    where = f"{getattr(provider, '__module__', '?')}.{getattr(provider, '__name__', 'dataset provider')}"
    module_globals = getattr(provider, "__globals__", None)
    original = None if module_globals is None else module_globals.get("is_dataset_built_on_rank")
    if original is None or not callable(original):
        raise PatchTargetChanged(
            f"{where} has no module-level is_dataset_built_on_rank to replace (core_v0.16.1 pretrain_gpt.py "
            f"defines one); Libra needs every pipeline stage to read the sample index"
        )
    found = tuple(inspect.signature(original).parameters)
    if found != DATASET_RULE_PARAMS:
        raise PatchTargetChanged(
            f"is_dataset_built_on_rank used by {where} changed its signature: expected parameters "
            f"{list(DATASET_RULE_PARAMS)} (core_v0.16.1), found {list(found)}"
        )
    require_source_fragments(where, provider, PROVIDER_FRAGMENTS)
    module_globals["is_dataset_built_on_rank"] = make_rule(original)
    return original


def install(patcher: Patcher, make_get_batch: Callable[[GetBatch], GetBatch],
            make_dataset_rule: Optional[Callable[[DatasetRule], DatasetRule]] = None) -> None:
    """Wrap ``pretrain`` so the program's ``forward_step`` gets the Libra ``get_batch`` and (when
    ``make_dataset_rule`` is given) its dataset provider builds datasets on every pipeline stage."""
    original = resolve_target(PRETRAIN)
    forward_index = PRETRAIN.params.index("forward_step_func")
    provider_index = PRETRAIN.params.index("train_valid_test_dataset_provider")

    def pretrain(*args, **kwargs):
        forward_step_func = kwargs["forward_step_func"] if "forward_step_func" in kwargs else args[forward_index]
        swap_get_batch(forward_step_func, make_get_batch)
        if make_dataset_rule is not None:
            provider = (kwargs["train_valid_test_dataset_provider"] if "train_valid_test_dataset_provider" in kwargs
                        else args[provider_index])
            swap_dataset_rule(provider, make_dataset_rule)
        return original(*args, **kwargs)

    pretrain.__wrapped_megatron__ = original  # type: ignore[attr-defined]
    patcher.replace("megatron.training.training", "pretrain", pretrain)
    patcher.replace("megatron.training", "pretrain", pretrain)
