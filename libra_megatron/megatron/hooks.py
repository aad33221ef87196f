"""The Libra side of the Megatron-LM patch points: what each patched function does instead.

``patches/`` (top level of the repository) verifies and replaces Megatron-LM functions; every wrapper
calls back into one ``LibraHooks`` object, so all Libra behaviour of a launched run lives here and the
per-run state (the validated ``LibraConfig``, the planner) is held by that object, never in module
globals:

=============================  =================================================================
callback                       called from
=============================  =================================================================
``add_args(parser)``           ``parse_args`` (chained after the program's extra_args_provider)
``on_model_parallel_ready()``  right after ``parallel_state.initialize_model_parallel``
``on_model_parallel_destroyed``just before ``parallel_state.destroy_model_parallel``
``build_data_loader(ds, n)``   ``build_pretraining_data_loader`` (data_samplers and training)
``make_get_batch(original)``   when ``pretrain(...)`` receives the program's ``forward_step``
``make_dataset_rule(original)``when ``pretrain(...)`` receives the program's dataset provider
``after_training_log(it)``     after Megatron's ``training_log`` of iteration ``it``
=============================  =================================================================

Plan-ahead (§5 "Data and planning path"). Every loader built here gets ``_plan_ahead`` as its sampler's
``on_window_planned`` listener: when the sampler plans a window (VRSP, in the training process), the pool
plans this rank needs at each of the window's GA indices are queued on the background planner at once, so
``get_batch``'s ``planner.get`` normally finds them finished instead of planning on the critical path.
Ranks without a loader (TP rank > 0) still plan on demand in ``get``.

Pipeline stages (any PP depth, interleaved virtual stages). Megatron-LM's ``pretrain_gpt.py`` builds datasets
and loaders only on the first and last (virtual) stage and its ``get_batch`` returns nothing elsewhere, so
attention on a middle stage would see one causal document per packed sequence. Libra's dataset rule
(``make_dataset_rule``) builds the sample index on TP rank 0 of *every* stage and model chunk, so each chunk
has its own loader and sampler. The sampler is deterministic (VRSP is a pure function of the window's
document lengths, the same on every rank), so chunk ``c`` of stage ``s`` reads exactly the microbatch
sequence of the first stage, and Megatron's schedules (1F1B and interleaved alike) run each chunk's
microbatches in increasing order and pass ``data_iterator[chunk]``: the microbatch a chunk computes is the
one its iterator yields, the same rule that gives the last stage its labels. A middle stage's ``get_batch``
returns only the carrier (document boundaries and the plan; the pool plan comes from this stage's own
background planner, planned ahead from its own sampler). No collective runs between stages for it.

Megatron-LM's training package (``megatron.training``) is imported lazily inside the callbacks: it is not
on PyPI and is only importable once ``libra_megatron.launch`` has put ``MEGATRON_LM_PATH`` on sys.path.

Batch shapes (mbs = 1, L = --seq-length, CP = context-parallel size, t = L/CP local tokens):
    tokens, labels, position_ids: (1, t) int64; loss_mask: (1, t) float32; cu_seqlens: (num_docs+1,) int32
    libra_pool_segments: the P packed sequences' document lengths of this rank's pool (sampler format).

Carrier. megatron-core applies RoPE before core attention, from ``packed_seq_params``: with
``--reset-position-ids`` the batch is THD (positions restart in every document; CP = 1 only), otherwise
sbhd with the whole sequence's cu_seqlens (positions run over the packed sequence, Megatron-LM's default,
sliced zigzag for CP > 1). RoPE scores depend only on q-k position differences and attention never crosses
a document, so both give the same result up to rounding (a test checks it). ``LibraCoreAttention`` reads
cu_seqlens and the plan from the same carrier.
"""
from __future__ import annotations

import argparse
import logging
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from ..config import KvRelay, LibraConfig
from .layout_checks import carrier_format, check_supported_layout, validate_run

__all__ = ["LibraHooks", "check_supported_layout", "validate_run", "carrier_format"]

logger = logging.getLogger(__name__)

GetBatch = Callable[..., tuple]
_SAMPLE_KEYS = ("tokens", "labels", "loss_mask")


class LibraHooks:
    """Callbacks for ``patches.install_all``; one instance per launched run."""

    def __init__(self) -> None:
        self.config: Optional[LibraConfig] = None
        self.planner: Any = None
        self.qkv_format = "sbhd"
        self.train_sampler: Any = None  # the train loader's LibraGlobalBatchSampler (TP rank 0 only)
        self.tp_cpu_group: Any = None  # gloo twin of this rank's TP group (sample broadcast without device syncs)
        self._microbatch_jobs: dict = {}  # window -> Future of its microbatch_* scalars (computed a step ahead)
        self._microbatch_executor: Any = None  # one background thread, on the rank that writes TensorBoard

    # ------------------------------------------------------------------ arguments
    def add_args(self, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        from .args import add_libra_args

        return add_libra_args(parser)

    # ------------------------------------------------------------------ start-up / teardown
    def on_model_parallel_ready(self) -> None:
        """Validate and record the effective config, then create the pool groups (every rank, same order)."""
        from megatron.training import get_args

        from .args import log_and_save_libra_config
        from .groups import initialize_pool_groups
        from .model_checks import check_model

        args = get_args()
        config = validate_run(args)
        check_model(args, validate=False)  # Megatron validated these args itself; the launcher checked before
        log_and_save_libra_config(config, args, _run_dir(args))
        self.qkv_format = carrier_format(args)
        logger.info("Libra batches use the %s carrier (%s)", self.qkv_format,
                    "RoPE positions restart per document" if self.qkv_format == "thd"
                    else "RoPE positions run over the packed sequence")
        initialize_pool_groups(config.pool_size, order=_rank_order(args), relay=config.kv_relay is KvRelay.AUTO)
        _size_table_cache(args)
        self.tp_cpu_group = _tp_gloo_group()
        self.config = config
        self.planner = _start_planner(config, args)

    def on_model_parallel_destroyed(self) -> None:
        from .groups import destroy_pool_groups

        if self._microbatch_executor is not None:
            self._microbatch_executor.shutdown(wait=False, cancel_futures=True)
            self._microbatch_executor, self._microbatch_jobs = None, {}
        if self.planner is not None and hasattr(self.planner, "close"):
            self.planner.close()
        self.planner = None
        destroy_pool_groups()

    # ------------------------------------------------------------------ data
    def build_data_loader(self, dataset: Any, consumed_samples: int) -> Any:
        """Megatron's ``build_pretraining_data_loader(dataset, consumed_samples)``, Libra sampler inside."""
        if dataset is None:
            return None
        from megatron.training import get_args

        from .sampler import build_libra_data_loader

        loader = build_libra_data_loader(dataset, consumed_samples, get_args(), config=self.config,
                                         on_window_planned=self._plan_ahead)
        if self.train_sampler is None:  # training.py builds the train loader first
            self.train_sampler = loader.batch_sampler
        return loader

    def _plan_ahead(self, window: int, keys: Sequence[Any]) -> None:
        """Sampler listener: queue the pool plan of each of this rank's upcoming microbatches of ``window``."""
        if self.planner is not None:
            self.planner.submit_many([key.pool_segments for key in keys])

    def make_get_batch(self, original: GetBatch) -> GetBatch:
        """The ``get_batch(data_iterator, vp_stage=None)`` that replaces the program's ``original``."""

        def get_batch(data_iterator, vp_stage=None):
            return self.get_batch(data_iterator, vp_stage)

        get_batch.megatron_get_batch = original  # type: ignore[attr-defined]
        return get_batch

    def make_dataset_rule(self, original: Callable[..., bool]) -> Callable[..., bool]:
        """The ``is_dataset_built_on_rank`` that replaces the program's ``original``: TP rank 0 of every pipeline
        stage and model chunk builds the dataset (see the module doc, "Pipeline stages"). core_v0.19's provider
        also passes ``is_packed_sequence``, for which upstream builds on TP rank 0 too."""

        def is_dataset_built_on_rank(vp_stage=None, is_packed_sequence=False):
            from megatron.core import parallel_state

            return parallel_state.get_tensor_model_parallel_rank() == 0

        is_dataset_built_on_rank.megatron_rule = original  # type: ignore[attr-defined]
        return is_dataset_built_on_rank

    def get_batch(self, data_iterator: Any, vp_stage: Optional[int] = None) -> tuple:
        """Six values like pretrain_gpt's get_batch; packed_seq_params is a LibraPackedSeqParams with the plan.

        Every (virtual) stage reads its chunk's next microbatch; stages that are neither first nor last get
        None for the five tensors, as from Megatron-LM, and the carrier with this microbatch's plan.
        """
        from megatron.core import parallel_state
        from megatron.training.utils import is_first_or_last_pipeline_stage

        if data_iterator is None and parallel_state.get_tensor_model_parallel_rank() == 0:
            raise RuntimeError(
                f"Libra get_batch on pipeline stage {parallel_state.get_pipeline_model_parallel_rank()} "
                f"(model chunk {vp_stage}) has no data iterator: the program's dataset provider did not build "
                f"the dataset on this stage (Libra's is_dataset_built_on_rank was not installed)"
            )
        sample = _read_sample_across_tp(data_iterator, self.tp_cpu_group)
        pool_segments, position = _pool_metadata(sample)
        cp_size = parallel_state.get_context_parallel_world_size()
        cp_rank = parallel_state.get_context_parallel_rank()
        return self._assemble(sample, pool_segments, position, cp_size, cp_rank,
                              with_tensors=is_first_or_last_pipeline_stage(vp_stage))

    def _assemble(self, sample: dict, pool_segments: List[np.ndarray], position: int, cp_size: int,
                  cp_rank: int, with_tensors: bool = True) -> tuple:
        """The six values; without ``with_tensors`` (a middle stage) only the carrier goes to the device."""
        from .batch import LibraPackedSeqParams, build_libra_batch

        config = self._require_config()
        batch = build_libra_batch(sample, pool_segments[position], cp_size, cp_rank, config.token_layout)
        plan, save_mode = _plan_for_rank(self.planner, pool_segments, position, cp_rank)
        packed = _packed_seq_params(LibraPackedSeqParams, self.qkv_format, batch, plan, pool_segments, position)
        packed.libra_kernel_backend = config.kernel_backend.value
        packed.libra_save_mode = None if save_mode is None else save_mode.value
        if not with_tensors:
            return None, None, None, None, None, packed
        # RoPE ignores position_ids in megatron-core; they are returned consistent with the carrier anyway.
        positions = batch["position_ids"] if self.qkv_format == "thd" else batch["local_to_global"][None]
        device = _device()
        return (
            _to_device(batch["tokens"], device), _to_device(batch["labels"], device),
            _to_device(batch["loss_mask"], device), None, _to_device(positions, device), packed,
        )

    # ------------------------------------------------------------------ metrics
    def after_training_log(self, iteration: int) -> None:
        """Write this step's Libra scalars with Megatron's TensorBoard writer (a no-op on ranks without one).

        Intra-pool balance, bytes and planner latency come from the last plan this rank used; inter-pool
        R-1 before/after VRSP from the window just trained (``args.consumed_train_samples``), when this
        rank holds the train sampler (TP rank 0 of every pipeline stage).
        """
        from megatron.training import get_args, get_tensorboard_writer

        from . import metrics

        writer = get_tensorboard_writer()
        if writer is None:
            return
        values = _planner_metrics(self.planner)
        values.update(_window_metrics(self.train_sampler, get_args()))
        values.update(self._microbatch_metrics(get_args(), iteration))
        if values:
            metrics.write_metrics(values, iteration, writer=writer)

    def _microbatch_metrics(self, args: argparse.Namespace, iteration: int) -> dict:
        """The trained window's ``microbatch_max_mean_*`` scalars (``metrics.microbatch_metrics``).

        They read the planner's placement of every pool of the window (pools of other ranks are planned by
        this rank's planner behind its own), so they are computed on a background thread a step ahead: each call takes this window's and queues the next one's unless
        ``iteration`` is the run's last (the first window of a run is computed here, once). Only the rank
        that writes TensorBoard calls this.
        """
        sampler, window = self.train_sampler, _trained_window(self.train_sampler, args)
        if window is None or self.planner is None:
            return {}
        job = self._microbatch_jobs.pop(window, None)
        values = job.result() if job is not None else _microbatch_window_metrics(sampler, window, self.planner)
        if _window_exists(sampler, window + 1) and iteration < int(getattr(args, "train_iters", 0) or 0):
            if self._microbatch_executor is None:
                from concurrent.futures import ThreadPoolExecutor

                self._microbatch_executor = ThreadPoolExecutor(1, thread_name_prefix="libra-microbatch-metrics")
            self._microbatch_jobs[window + 1] = self._microbatch_executor.submit(
                _microbatch_window_metrics, sampler, window + 1, self.planner)
        return values

    def _require_config(self) -> LibraConfig:
        if self.config is None:
            raise RuntimeError(
                "Libra get_batch ran before initialize_model_parallel: the Libra hooks were installed after "
                "Megatron initialised, so pool groups and the config are missing"
            )
        return self.config


# ---------------------------------------------------------------------- helpers (module-private)
def _rank_order(args: argparse.Namespace) -> str:
    """The RankGenerator order initialize._initialize_distributed passes to initialize_model_parallel."""
    return "tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp"


def _size_table_cache(args: argparse.Namespace) -> None:
    """Keep the device tables of every microbatch a pipeline holds in flight: up to PP microbatches at the
    first stage under 1F1B, about twice that with interleaved stages (a microbatch's chunks share one
    RankPlan); at most the GA count of a step. A miss only re-uploads tables, so this is a bound, not a rule."""
    from ..runtime import set_table_cache_size

    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    dp = int(getattr(args, "data_parallel_size", 1) or 1)
    ga = max(1, int(args.global_batch_size) // (int(getattr(args, "micro_batch_size", 1) or 1) * dp))
    set_table_cache_size(max(4, min(ga, pp * (2 if vpp else 1))))


def _run_dir(args: argparse.Namespace) -> Optional[str]:
    return getattr(args, "save", None) or getattr(args, "tensorboard_dir", None)


def _device():
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_device(tensor: Any, device: Any) -> Any:
    """Host tensor -> device without a host sync (pinned, non_blocking for CUDA)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _tp_gloo_group() -> Any:
    """A gloo group over this rank's TP group (None at TP = 1). Every rank creates every TP group's twin,
    in the same order, from one all_gather_object of the TP rank lists (start-up only)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    mine = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    lists: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(lists, list(mine))
    unique = list(dict.fromkeys(tuple(x) for x in lists))
    groups = {ranks: parallel_state.create_group(list(ranks), backend="gloo", group_desc="LIBRA_TP_GLOO")
              for ranks in unique}
    return groups[tuple(mine)]


def _read_sample_across_tp(data_iterator: Any, cpu_group: Any = None) -> dict:
    """TP rank 0 reads the next sample; other TP ranks receive it over the gloo TP twin ``cpu_group``
    (Megatron builds loaders on TP rank 0 only). Host tensors only: nothing waits on the GPU."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return next(data_iterator)
    sample = next(data_iterator) if parallel_state.get_tensor_model_parallel_rank() == 0 else None
    return _broadcast_sample(sample, cpu_group, parallel_state.get_tensor_model_parallel_src_rank())


def _broadcast_sample(sample: Optional[dict], group: Any, src: int) -> dict:
    """Broadcast tokens/labels/loss_mask and the pool metadata from ``src`` as int64/float32 CPU tensors over
    a gloo ``group`` (shapes first, then values): no device memory is touched, so no host-device sync."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    keys = _SAMPLE_KEYS + ("libra_pool_segments", "libra_pool_position")
    shapes = torch.zeros(len(keys), 4, dtype=torch.int64, device=device)
    if sample is not None:
        for i, key in enumerate(keys):
            shape = tuple(torch.as_tensor(sample[key]).shape)
            shapes[i, 0] = len(shape)
            shapes[i, 1:1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    dist.broadcast(shapes, src, group=group)
    out = {}
    for i, key in enumerate(keys):
        dtype = torch.float32 if key == "loss_mask" else torch.int64
        shape = tuple(int(x) for x in shapes[i, 1:1 + int(shapes[i, 0])])
        value = (torch.as_tensor(sample[key]).to(device=device, dtype=dtype).contiguous() if sample is not None
                 else torch.empty(shape, dtype=dtype, device=device))
        dist.broadcast(value, src, group=group)
        out[key] = value
    return out


def _pool_metadata(sample: dict) -> tuple:
    """(segment lengths of each of the pool's P sequences, this rank's position p) from a collated sample.

    The sampler pads ``libra_pool_segments`` to ``[P, max_segs]`` with -1 (a leading batch dim of 1 from the
    DataLoader's collation is dropped).
    """
    raw = np.asarray(_to_numpy(sample["libra_pool_segments"]), dtype=np.int64)
    while raw.ndim > 2:
        assert raw.shape[0] == 1, f"libra_pool_segments must have a batch dim of 1 (mbs=1), got {raw.shape}"
        raw = raw[0]
    segments = [row[row >= 0] for row in raw]
    position = int(np.asarray(_to_numpy(sample["libra_pool_position"])).reshape(-1)[0])
    return segments, position


def _to_numpy(value: Any) -> Any:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else value


def _start_planner(config: LibraConfig, args: argparse.Namespace) -> Any:
    from .planner_setup import build_planner_from_args

    return build_planner_from_args(config, args)


def _plan_for_rank(planner: Any, pool_segments: Sequence[np.ndarray], position: int, cp_rank: int) -> tuple:
    """(RankPlan of this worker (pool-local id p*CP + c), the plan's resolved save mode or None)."""
    plan, planned = planner.get_planned(pool_segments, position=position, cp_rank=cp_rank)
    return plan, getattr(planned, "save_mode", None)


def _packed_seq_params(cls: Any, qkv_format: str, batch: dict, plan: Any, pool_segments: Sequence[np.ndarray],
                       position: int) -> Any:
    """The plan carrier. thd: max_seqlen = longest document (RoPE per document); sbhd: max_seqlen = L, so
    megatron-core computes RoPE for the whole packed sequence and slices it for this CP rank."""
    host_cu = batch["cu_seqlens"]  # CPU tensor: reading it here costs no device sync
    max_seqlen = int(batch["max_seqlen"]) if qkv_format == "thd" else int(host_cu[-1])
    cu_seqlens = _to_device(host_cu, _device())
    return cls(
        qkv_format=qkv_format, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen, libra_plan=plan, libra_pool_segments=[np.asarray(s) for s in pool_segments],
        libra_position=position,
    )


def _trained_window(sampler: Any, args: argparse.Namespace) -> Optional[int]:
    """The window of the step just trained (``args.consumed_train_samples``), or None (no sampler / none yet)."""
    window = int(getattr(args, "consumed_train_samples", 0) or 0) // int(args.global_batch_size) - 1
    return None if sampler is None or window < 0 else window


def _window_exists(sampler: Any, window: int) -> bool:
    return getattr(sampler, "dataloader_type", "single") != "single" or window < sampler.windows_per_epoch


def _window_order(sampler: Any, window: int) -> tuple:
    """(segments of the window's GBS samples in sampler order, the sampler's VRSP order of them)."""
    indices = sampler.window_indices(window)
    segments = [np.asarray(sampler.segments_fn(sampler.dataset, int(i)), dtype=np.int64) for i in indices]
    return segments, sampler.placement_order(segments)


def _window_metrics(sampler: Any, args: argparse.Namespace) -> dict:
    """Inter-pool and lane R-1 (Eq. 4 workloads) of the last trained window, sampler order vs VRSP order."""
    from .metrics import inter_pool_metrics

    window = _trained_window(sampler, args)
    if window is None:
        return {}
    segments, order = _window_order(sampler, window)
    return inter_pool_metrics(segments, order, sampler.pool_size, sampler.data_parallel_size)


def _microbatch_window_metrics(sampler: Any, window: int, planner: Any) -> dict:
    """``metrics.microbatch_metrics`` of ``window`` with the planner's config, token and head layouts, and its
    placements (``get_for_metrics``: this rank's plans, the others planned behind training's)."""
    from .metrics import microbatch_metrics

    segments, order = _window_order(sampler, window)
    return microbatch_metrics(segments, order, sampler.data_parallel_size, planner.config, planner.layout,
                              planner.heads, plans=getattr(planner, "get_for_metrics", None))


def _planner_metrics(planner: Any) -> dict:
    if planner is None or not hasattr(planner, "latest_metrics"):
        return {}
    return dict(planner.latest_metrics() or {})
