"""Patch point: ``get_batch`` of the training program — the Libra batch path.

``pretrain_gpt.py``'s ``forward_step`` calls the module-global ``get_batch(data_iterator, vp_stage)``. Libra
needs a different batch: cu_seqlens from the sampler's segment metadata, RoPE positions restarting in every
document (THD), the CP shard laid out exactly as the operator's ``TokenLayout``, and the step's ``RankPlan``
attached to a ``LibraPackedSeqParams`` (the carrier). The hooks' ``make_get_batch(original)`` returns a
function giving ``(tokens, labels, loss_mask, attention_mask, position_ids, carrier)``; how that reaches the
model depends on the release:

* core_v0.16: ``get_batch`` returns those six values and ``forward_step`` passes the sixth to the model as
  ``packed_seq_params``: the Libra function replaces ``get_batch`` as it is;
* core_v0.19: ``get_batch`` returns the ten ``BATCH_KEYS`` values and ``forward_step`` builds
  ``PackedSeqParams(qkv_format="thd", ...)`` itself when ``cu_seqlens`` is not None. The Libra function is
  adapted to ``BATCH_KEYS`` (``cu_seqlens`` and a host ``max_seqlen`` from the carrier, so upstream's
  ``max_seqlen.item()`` reads no device value), and the program's ``PackedSeqParams`` name is replaced by a
  function returning the carrier that same ``get_batch`` call produced (Libra's qkv_format and plan, never
  upstream's forced "thd").

``pretrain_gpt.py`` runs as ``__main__`` (we start it with ``runpy``), so its ``get_batch`` cannot be
imported and patched beforehand. It does ``from megatron.training import pretrain`` and hands
``forward_step`` to ``pretrain(...)``; we therefore wrap ``pretrain`` (in ``megatron.training`` and
``megatron.training.training``) and, when it is called, swap the globals of that ``forward_step``'s module.
The original ``get_batch`` is passed to the factory so the Libra path can defer to it where it does not apply.

Every pipeline stage reads the sample index. ``pretrain_gpt.py`` builds datasets (hence loaders and data
iterators) only where ``is_dataset_built_on_rank(vp_stage, ...)`` holds: TP rank 0 of the first and the last
(virtual) pipeline stage. A middle stage's attention still needs its microbatch's document boundaries and
plan, so the same ``pretrain`` wrapper swaps that predicate, the global the program's dataset provider
passes to ``BlendedMegatronDatasetBuilder``, for the Libra one (``make_dataset_rule(original)``): every
stage and every model chunk then gets its own loader, consumed in microbatch order like Megatron's own
first- and last-stage iterators.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional

from ._base import Patcher, PatchTargetChanged, TargetSpec, active_release, require_source_fragments, \
    resolve_target, spec_for

__all__ = ["PRETRAIN", "GET_BATCH_PARAMS", "FORWARD_STEP_FRAGMENTS", "BATCH_KEYS", "DATASET_RULE_PARAMS",
           "PROVIDER_FRAGMENTS", "swap_get_batch", "swap_dataset_rule", "install"]

PRETRAIN = {
    "0.16": TargetSpec("megatron.training.training", "pretrain", (
        "train_valid_test_dataset_provider", "model_provider", "model_type", "forward_step_func",
        "process_non_loss_data_func", "extra_args_provider", "args_defaults", "get_embedding_ranks",
        "get_position_embedding_ranks", "non_loss_data_func", "store", "inprocess_call_wrapper",
    ), ("initialize_megatron(",), "0.16"),
    "0.19": TargetSpec("megatron.training.training", "pretrain", (
        "cfg_container", "train_valid_test_dataset_provider", "model_type", "forward_step_func", "model_provider",
        "process_non_loss_data_func", "get_embedding_ranks", "get_position_embedding_ranks", "non_loss_data_func",
        "store", "inprocess_call_wrapper", "p2p_communicator", "pg_collection", "skip_model_parallel_init",
    ), ("initialize_megatron(",), "0.19"),
}
GET_BATCH_PARAMS = ("data_iterator", "vp_stage")
FORWARD_STEP_FRAGMENTS = {
    "0.16": ("packed_seq_params = get_batch(data_iterator, vp_stage)", "packed_seq_params=packed_seq_params"),
    "0.19": (") = get_batch(data_iterator, vp_stage)", "if cu_seqlens is not None:",
             "packed_seq_params = PackedSeqParams(", "packed_seq_params=packed_seq_params"),
}
BATCH_KEYS = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels", "local_cp_size",
              "loss_mask", "max_seqlen", "position_ids", "tokens")
"""core_v0.19 ``pretrain_gpt.BATCH_KEYS``: the order of the values its ``get_batch`` returns (verified)."""
DATASET_RULE_PARAMS = {"0.16": ("vp_stage",), "0.19": ("vp_stage", "is_packed_sequence")}
PROVIDER_FRAGMENTS = {
    "0.16": ("partial(is_dataset_built_on_rank, vp_stage=vp_stage)",),
    "0.19": ("is_dataset_built_on_rank, vp_stage=vp_stage, is_packed_sequence=is_packed_sequence",),
}
GetBatch = Callable[..., Any]
DatasetRule = Callable[..., bool]


def _verified_global(func: Callable[..., Any], name: str, params: tuple, where: str, tag: str,
                     why: str) -> tuple:
    """``(func's module globals, the callable global name)``, verified to take exactly ``params``; else
    ``PatchTargetChanged`` naming ``where`` and the release ``tag``."""
    module_globals = getattr(func, "__globals__", None)
    original = None if module_globals is None else module_globals.get(name)
    if original is None or not callable(original):
        raise PatchTargetChanged(f"{where} has no module-level {name} to replace ({tag} pretrain_gpt.py defines "
                                 f"one); {why}")
    found = tuple(inspect.signature(original).parameters)
    if found != params:
        raise PatchTargetChanged(f"{name} used by {where} changed its signature: expected parameters "
                                 f"{list(params)} ({tag}), found {list(found)}")
    return module_globals, original


def swap_get_batch(forward_step_func: Callable[..., Any], make_get_batch: Callable[[GetBatch], GetBatch],
                   release: str = "0.16") -> GetBatch:
    """Replace the ``get_batch`` global that ``forward_step_func`` calls (and, core_v0.19, its
    ``PackedSeqParams``); return the original ``get_batch``.

    Raises ``PatchTargetChanged`` naming the release unless ``forward_step_func`` looks like that release's
    ``pretrain_gpt.forward_step`` (the source lines above, ``get_batch(data_iterator, vp_stage)``, core_v0.19's
    ``BATCH_KEYS``); nothing is replaced then.
    """
    fragments = spec_for(FORWARD_STEP_FRAGMENTS, release)
    tag = spec_for(PRETRAIN, release).tag
    where = f"{getattr(forward_step_func, '__module__', '?')}.forward_step"
    module_globals, original = _verified_global(inspect.unwrap(forward_step_func), "get_batch", GET_BATCH_PARAMS,
                                                where, tag, "the Libra batch path needs the pretrain_gpt.py forward_step")
    require_source_fragments(where, inspect.unwrap(forward_step_func), fragments, tag)
    libra_get_batch = make_get_batch(original)
    if release == "0.16":
        module_globals["get_batch"] = libra_get_batch
        return original
    _check_batch_keys(module_globals, where, tag)
    carrier: List[Any] = []  # the carrier of the get_batch call whose cu_seqlens forward_step is packing
    module_globals["get_batch"] = _keyed_get_batch(libra_get_batch, carrier)
    module_globals["PackedSeqParams"] = _carrier_of_last_batch(carrier)
    return original


def swap_dataset_rule(dataset_provider: Callable[..., Any], make_rule: Callable[[DatasetRule], DatasetRule],
                      release: str = "0.16") -> DatasetRule:
    """Replace the ``is_dataset_built_on_rank`` global that ``dataset_provider`` hands to the dataset builder;
    return the original.

    Raises ``PatchTargetChanged`` naming the release unless the provider looks like that release's
    ``pretrain_gpt.train_valid_test_datasets_provider``: it passes ``partial(is_dataset_built_on_rank,
    vp_stage=vp_stage[, is_packed_sequence=is_packed_sequence])`` and that global takes those parameters.
    """
    params, fragments = spec_for(DATASET_RULE_PARAMS, release), spec_for(PROVIDER_FRAGMENTS, release)
    tag = spec_for(PRETRAIN, release).tag
    provider = inspect.unwrap(getattr(dataset_provider, "func", dataset_provider))  # a functools.partial too
    where = f"{getattr(provider, '__module__', '?')}.{getattr(provider, '__name__', 'dataset provider')}"
    module_globals, original = _verified_global(provider, "is_dataset_built_on_rank", params, where, tag,
                                                "Libra needs every pipeline stage to read the sample index")
    require_source_fragments(where, provider, fragments, tag)
    module_globals["is_dataset_built_on_rank"] = make_rule(original)
    return original


def _check_batch_keys(module_globals: Dict[str, Any], where: str, tag: str) -> None:
    keys = module_globals.get("BATCH_KEYS")
    if keys is None or tuple(keys) != BATCH_KEYS or "PackedSeqParams" not in module_globals:
        raise PatchTargetChanged(
            f"{where}: expected BATCH_KEYS {list(BATCH_KEYS)} and a module-level PackedSeqParams ({tag}), found "
            f"BATCH_KEYS {keys if keys is None else list(keys)}"
        )


def _keyed_get_batch(libra_get_batch: GetBatch, carrier: List[Any]) -> GetBatch:
    """core_v0.19's ``get_batch``: the Libra six values as the ten ``BATCH_KEYS`` values."""

    def get_batch(data_iterator, vp_stage=None):
        import torch

        tokens, labels, loss_mask, attention_mask, position_ids, packed = libra_get_batch(data_iterator, vp_stage)
        carrier[:] = [packed]
        values = dict.fromkeys(BATCH_KEYS)
        values.update(tokens=tokens, labels=labels, loss_mask=loss_mask, attention_mask=attention_mask,
                      position_ids=position_ids)
        if packed is not None:
            values["cu_seqlens"] = packed.cu_seqlens_q[None]  # forward_step squeezes this batch dim
            values["max_seqlen"] = torch.tensor(packed.max_seqlen_q)  # host tensor: its .item() is no sync
        return [values[key] for key in BATCH_KEYS]

    get_batch.libra_get_batch = libra_get_batch  # type: ignore[attr-defined]
    return get_batch


def _carrier_of_last_batch(carrier: List[Any]) -> Callable[..., Any]:
    """Stands in for ``PackedSeqParams`` in core_v0.19's ``forward_step``: returns the Libra carrier."""

    def packed_seq_params(**upstream_fields):
        if not carrier or carrier[0] is None:
            raise RuntimeError("forward_step built PackedSeqParams without a Libra batch before it")
        return carrier.pop()

    return packed_seq_params


def install(patcher: Patcher, make_get_batch: Callable[[GetBatch], GetBatch],
            make_dataset_rule: Optional[Callable[[DatasetRule], DatasetRule]] = None) -> None:
    """Wrap ``pretrain`` so the program's ``forward_step`` gets the Libra ``get_batch`` and (when
    ``make_dataset_rule`` is given) its dataset provider builds datasets on every pipeline stage."""
    release = active_release()
    spec = spec_for(PRETRAIN, release)
    original = resolve_target(spec)
    forward_index = spec.params.index("forward_step_func")
    provider_index = spec.params.index("train_valid_test_dataset_provider")

    def pretrain(*args, **kwargs):
        forward_step_func = kwargs["forward_step_func"] if "forward_step_func" in kwargs else args[forward_index]
        swap_get_batch(forward_step_func, make_get_batch, release)
        if make_dataset_rule is not None:
            provider = (kwargs["train_valid_test_dataset_provider"] if "train_valid_test_dataset_provider" in kwargs
                        else args[provider_index])
            swap_dataset_rule(provider, make_dataset_rule, release)
        return original(*args, **kwargs)

    pretrain.__wrapped_megatron__ = original  # type: ignore[attr-defined]
    patcher.replace("megatron.training.training", "pretrain", pretrain)
    patcher.replace("megatron.training", "pretrain", pretrain)
