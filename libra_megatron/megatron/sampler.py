"""VRSP global-batch sampler (§4.2, §5 "Data and planning path"): Megatron's data sampler, pool-aware.

Windows. Window ``v`` is one optimizer step: GBS dataset indices. ``single`` (Megatron's
MegatronPretrainingSampler): indices ``[v*GBS, (v+1)*GBS)``; windows are anchored at index 0 and the
trailing partial window is dropped (VRSP needs the whole step). ``cyclic`` (MegatronPretrainingRandomSampler):
epoch ``e`` is a permutation of ``range(total_samples)`` drawn from ``numpy.random.default_rng([seed, e])``,
cut into ``total_samples // GBS`` windows (the tail is dropped); one ``__iter__`` yields the rest of the
current epoch and advances ``consumed_samples`` (Megatron's cyclic_iter calls it again). Every DP
rank computes the same windows: there is no per-rank data sharding (VRSP needs the global window).

Placement. For each window every rank reads the segment lengths of all GBS samples (metadata only,
``segments_fn``), computes Eq. 4 workloads and runs ``place_sequences`` (sync -- lane totals and each
lane's microbatches under the step's ``plan.sequences.sync.SyncLayout`` --, Algorithm 1, refined or identity): a
permutation ``order`` in GA-major, pool-minor order. Position ``n`` of the window runs at
GA index ``n // DP`` on DP rank ``n % DP`` (mbs = 1), so pool ``k = n // P`` holds positions
``[k*P, (k+1)*P)`` and DP rank r sits at pool position ``p = r % P`` (Fig. 7). The window's multiset
of samples is preserved (a permutation).

Resume. ``consumed_samples = c`` (a multiple of DP) means the first ``c`` samples in run order were
consumed: the sampler restarts at window ``c // GBS`` (single; cyclic: in epoch ``c // (windows*GBS)``),
GA index ``(c % GBS) // DP``, and yields exactly the suffix of an uninterrupted run.

Plan-ahead. ``on_window_planned(window, keys)``, if given, is called once per window with exactly the keys
``__iter__`` is about to yield for it (this rank's, GA order; on resume only the unconsumed suffix), before
the first of them. ``LibraHooks`` uses it to queue the window's pool plans on the background planner.
The sampler runs in the training process (DataLoader workers only load samples), so the callback does too.

Output. Each item is ``[LibraSampleKey]`` (mbs = 1). ``LibraPoolDataset[key]`` returns the wrapped
dataset's sample plus the pool metadata (see its docstring for the encoding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..config import SequencePlacement
from ..plan.sequences import PoolProxy, SequenceStats, SyncLayout, place_sequences, priced_lanes_apply
from ..plan.model import sequence_flops
from .args import activation_bytes, attention_heads_of_rank
from .segments import gpt_sample_segments

__all__ = [
    "LibraSampleKey",
    "WindowPlan",
    "LibraGlobalBatchSampler",
    "LibraPoolDataset",
    "build_libra_data_loader",
    "sync_layout_from_args", "pool_proxy_from_args",
    "encode_pool_segments",
    "decode_pool_segments",
]

_LOADER_TYPES = ("single", "cyclic")


@dataclass(frozen=True)
class LibraSampleKey:
    """One microbatch of one DP rank: the dataset index and its pool's metadata (picklable, hashable)."""

    sample_index: int
    pool_segments: Tuple[Tuple[int, ...], ...]  # P rows: segment lengths of the pool's sequences, pool order p
    pool_position: int  # p: this rank's sequence is pool_segments[p]
    window: int  # optimizer-step window v
    ga_index: int  # g in [0, GBS/DP)


@dataclass(frozen=True)
class WindowPlan:
    """A window after VRSP: ``sample_indices[n]`` runs at GA ``n // DP`` on DP rank ``n % DP``."""

    window: int
    sample_indices: np.ndarray  # int64 (GBS,), run order
    segments: Tuple[np.ndarray, ...]  # aligned with sample_indices


WindowListener = Callable[[int, Tuple[LibraSampleKey, ...]], None]  # (window, this rank's keys) -> None


class LibraGlobalBatchSampler:
    """Yields this DP rank's microbatches (mbs = 1) GA-major, pool-minor, window by window. See module doc."""

    def __init__(self, dataset: Any, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 global_batch_size: int, data_parallel_rank: int, data_parallel_size: int, pool_size: int,
                 sequence_placement=SequencePlacement.SYNC, dataloader_type: str = "single", seed: int = 1234,
                 segments_fn: Callable[[Any, int], np.ndarray] = gpt_sample_segments,
                 on_window_planned: Optional[WindowListener] = None,
                 sync_layout: Optional[SyncLayout] = None, pool_proxy: Optional[PoolProxy] = None) -> None:
        _check_sampler_args(total_samples, consumed_samples, micro_batch_size, global_batch_size,
                            data_parallel_rank, data_parallel_size, pool_size, dataloader_type)
        self.dataset = dataset
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.global_batch_size = int(global_batch_size)
        self.data_parallel_rank = int(data_parallel_rank)
        self.data_parallel_size = int(data_parallel_size)
        self.pool_size = int(pool_size)
        self.sequence_placement = SequencePlacement(sequence_placement)
        self.dataloader_type = dataloader_type
        self.seed = int(seed)
        self.segments_fn = segments_fn
        self.on_window_planned = on_window_planned
        self.windows_per_epoch = self.total_samples // self.global_batch_size
        # what the sync placement balances; without one: PP=1, EP inside a replica (lanes of P replicas)
        self.sync_layout = sync_layout or SyncLayout(self.data_parallel_size, self.pool_size, self.num_ga)
        _check_sync_layout(self.sync_layout, self)
        # at PP > 1 the sync placement prices candidate pools with it (plan.sequences.pool_proxy); None: F only
        self.pool_proxy = pool_proxy
        self._epoch_cache: Tuple[int, Optional[np.ndarray]] = (-1, None)

    def __len__(self) -> int:
        return self.total_samples

    @property
    def num_ga(self) -> int:
        """GA indices per window: GBS / DP."""
        return self.global_batch_size // self.data_parallel_size

    # ---------------------------------------------------------------- windows
    def window_indices(self, window: int) -> np.ndarray:
        """Dataset indices of ``window`` in sampler (pre-VRSP) order, int64 (GBS,)."""
        gbs = self.global_batch_size
        if self.dataloader_type == "single":
            if not 0 <= window < self.windows_per_epoch:
                raise IndexError(f"window {window} outside [0, {self.windows_per_epoch})")
            return np.arange(window * gbs, (window + 1) * gbs, dtype=np.int64)
        epoch, local = divmod(window, self.windows_per_epoch)
        return self._epoch_permutation(epoch)[local * gbs : (local + 1) * gbs]

    def _epoch_permutation(self, epoch: int) -> np.ndarray:
        if self._epoch_cache[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.total_samples).astype(np.int64)
            self._epoch_cache = (epoch, perm)
        return self._epoch_cache[1]

    def plan_window(self, window: int) -> WindowPlan:
        """VRSP for one window: segments of its GBS samples, Eq. 4 workloads, ``place_sequences`` order."""
        indices = self.window_indices(window)
        segments = [np.asarray(self.segments_fn(self.dataset, int(i)), dtype=np.int64) for i in indices]
        order = self.placement_order(segments)
        return WindowPlan(window, indices[order], tuple(segments[i] for i in order))

    def placement_order(self, segments) -> np.ndarray:
        """The window's run order from its sequences' document lengths (``place_sequences`` with this sampler's
        method and sync layout; at PP > 1 its pools priced by ``pool_proxy`` when it has one)."""
        if self.pool_proxy is None:
            return place_sequences(sequence_flops(segments), self.pool_size, self.sequence_placement, self.sync_layout)
        stats = SequenceStats.of(segments)
        return place_sequences(stats.flops, self.pool_size, self.sequence_placement, self.sync_layout,
                               self.pool_proxy.pricer(stats))

    def keys_for_window(self, plan: WindowPlan, first_ga: int = 0) -> List[LibraSampleKey]:
        """This rank's keys for GA indices ``first_ga ..`` of a planned window."""
        dp, pool, rank = self.data_parallel_size, self.pool_size, self.data_parallel_rank
        keys = []
        for ga in range(first_ga, self.num_ga):
            n = ga * dp + rank
            start = (n // pool) * pool
            rows = tuple(tuple(int(x) for x in plan.segments[m]) for m in range(start, start + pool))
            keys.append(LibraSampleKey(int(plan.sample_indices[n]), rows, n % pool, plan.window, ga))
        return keys

    # ---------------------------------------------------------------- iteration
    def _start(self) -> Tuple[int, int]:
        """(window, GA index) of the first unconsumed microbatch."""
        window, within = divmod(self.consumed_samples, self.global_batch_size)
        return window, within // self.data_parallel_size

    def _last_window(self, first_window: int) -> int:
        if self.dataloader_type == "single":
            return self.windows_per_epoch
        epoch = first_window // self.windows_per_epoch
        return (epoch + 1) * self.windows_per_epoch

    def __iter__(self) -> Iterator[List[LibraSampleKey]]:
        window, ga = self._start()
        for v in range(window, self._last_window(window)):
            keys = tuple(self.keys_for_window(self.plan_window(v), ga if v == window else 0))
            if self.on_window_planned is not None:
                self.on_window_planned(v, keys)
            for key in keys:
                if self.dataloader_type == "cyclic":
                    self.consumed_samples += self.data_parallel_size
                yield [key]


def _check_sync_layout(layout: SyncLayout, sampler: "LibraGlobalBatchSampler") -> None:
    got = (layout.data_parallel_size, layout.pool_size, layout.num_microbatches)
    want = (sampler.data_parallel_size, sampler.pool_size, sampler.num_ga)
    if got != want:
        raise ValueError(f"the sync layout's (DP, P, GA) {got} differs from the sampler's {want}")


def _check_sampler_args(total, consumed, mbs, gbs, dp_rank, dp, pool, loader) -> None:
    if mbs != 1:
        raise ValueError(f"Libra requires --micro-batch-size 1 (one packed sequence per microbatch), got {mbs}")
    if loader not in _LOADER_TYPES:
        raise ValueError(f"--dataloader-type {loader!r}: the Libra sampler supports {_LOADER_TYPES}")
    if dp < 1 or not 0 <= dp_rank < dp:
        raise ValueError(f"data-parallel rank {dp_rank} must lie in [0, DP={dp})")
    if dp % pool:
        raise ValueError(f"--libra-pool-size {pool} must divide the data-parallel size {dp} ({dp} % {pool} = {dp % pool})")
    if gbs % dp:
        raise ValueError(f"--global-batch-size {gbs} must be divisible by DP*mbs = {dp}*1 ({gbs} % {dp} = {gbs % dp})")
    if total < gbs:
        raise ValueError(f"the dataset has {total} samples, fewer than one window of --global-batch-size {gbs}")
    if consumed < 0 or consumed % dp:
        raise ValueError(
            f"consumed_samples {consumed} must be a non-negative multiple of DP*mbs = {dp} "
            f"({consumed} % {dp} = {consumed % dp})"
        )
    if loader == "single" and consumed >= (total // gbs) * gbs:
        raise ValueError(f"no samples left: consumed_samples {consumed} >= {total // gbs} windows * GBS {gbs}")


# -------------------------------------------------------------------------------------- dataset wrapper
def encode_pool_segments(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """int64 ``[P, max_segs]``: row p holds sequence p's segment lengths, right-padded with -1."""
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for p, row in enumerate(rows):
        out[p, : len(row)] = torch.as_tensor(list(row), dtype=torch.int64)
    return out


def decode_pool_segments(encoded) -> List[np.ndarray]:
    """Inverse of ``encode_pool_segments``; accepts a leading batch dim of 1 (DataLoader collation)."""
    raw = np.asarray(encoded.cpu().numpy() if hasattr(encoded, "cpu") else encoded, dtype=np.int64)
    while raw.ndim > 2:
        assert raw.shape[0] == 1, f"libra_pool_segments must have a batch dim of 1 (mbs=1), got {raw.shape}"
        raw = raw[0]
    return [row[row >= 0] for row in raw]


class LibraPoolDataset(torch.utils.data.Dataset):
    """Wraps a GPTDataset/BlendedDataset; ``self[key]`` = ``dataset[key.sample_index]`` plus pool metadata.

    Added keys: ``libra_pool_segments`` int64 ``[P, max_segs]`` padded with -1 (``encode_pool_segments``;
    collated to ``[1, P, max_segs]``), ``libra_pool_position`` / ``libra_window`` / ``libra_ga_index`` /
    ``libra_sample_index``: 0-d int64 tensors (collated to shape ``[1]``).
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: LibraSampleKey) -> dict:
        sample = dict(self.dataset[key.sample_index])
        sample["libra_pool_segments"] = encode_pool_segments(key.pool_segments)
        for name, value in (("libra_pool_position", key.pool_position), ("libra_window", key.window),
                            ("libra_ga_index", key.ga_index), ("libra_sample_index", key.sample_index)):
            sample[name] = torch.tensor(value, dtype=torch.int64)
        return sample


def build_libra_data_loader(dataset: Any, consumed_samples: int, args: Any, *, config=None,
                            data_parallel_rank: Optional[int] = None, data_parallel_size: Optional[int] = None,
                            segments_fn: Callable[[Any, int], np.ndarray] = gpt_sample_segments,
                            on_window_planned: Optional[WindowListener] = None):
    """Drop-in for Megatron's ``build_pretraining_data_loader(dataset, consumed_samples)``.

    ``args``: Megatron args (micro_batch_size, global_batch_size, dataloader_type, seed, num_workers and
    the ``--libra-*`` flags; ``config`` overrides the flags). DP rank/size default to ``parallel_state``.
    ``on_window_planned``: the sampler's plan-ahead listener (see the module doc). Returns None for a None
    dataset.
    """
    if dataset is None:
        return None
    if config is None:
        from .args import libra_config_from_args

        config = libra_config_from_args(args)
    if data_parallel_rank is None or data_parallel_size is None:
        from megatron.core import parallel_state

        data_parallel_rank = parallel_state.get_data_parallel_rank()
        data_parallel_size = parallel_state.get_data_parallel_world_size()
    layout = sync_layout_from_args(args, data_parallel_size, config.pool_size)
    sampler = LibraGlobalBatchSampler(
        dataset, len(dataset), consumed_samples, args.micro_batch_size, args.global_batch_size,
        data_parallel_rank, data_parallel_size, config.pool_size, config.sequence_placement,
        getattr(args, "dataloader_type", None) or "single", getattr(args, "seed", 1234), segments_fn,
        on_window_planned, layout, pool_proxy_from_args(args, config.pool_size) if priced_lanes_apply(layout) else None,
    )
    workers = int(getattr(args, "num_workers", 0) or 0)
    return torch.utils.data.DataLoader(
        LibraPoolDataset(dataset), batch_sampler=sampler, num_workers=workers,
        pin_memory=torch.cuda.is_available(), persistent_workers=workers > 0,
    )


_MEGATRON_FLAGS = {
    "data_parallel_size": "the data-parallel size", "pool_size": "--libra-pool-size",
    "num_microbatches": "--global-batch-size / DP", "pipeline_parallel_size": "--pipeline-model-parallel-size",
    "virtual_pipeline_size": "--num-layers-per-virtual-pipeline-stage", "tensor_parallel_size": "--tensor-model-parallel-size",
    "context_parallel_size": "--context-parallel-size", "expert_parallel_size": "--expert-model-parallel-size",
    "expert_tensor_parallel_size": "--expert-tensor-parallel-size", "backward_ratio": "backward_ratio",
    "other_seconds": "other_seconds",
}


def pool_proxy_from_args(args: Any, pool_size: int) -> PoolProxy:
    """The priced-pool proxy of a Megatron run (``plan.sequences.pool_proxy``): a pool is P CP groups of
    ``--seq-length`` tokens at one TP rank (its heads: ``--num-attention-heads`` and ``--num-query-groups`` over
    TP, head dim ``--kv-channels``), bf16 / fp16 elements or fp32, the time model's default rates."""
    heads, kv_heads, head_dim = attention_heads_of_rank(args)
    return PoolProxy(int(pool_size), int(getattr(args, "context_parallel_size", None) or 1), int(args.seq_length),
                     heads, kv_heads, head_dim, activation_bytes(args))


def sync_layout_from_args(args: Any, data_parallel_size: int, pool_size: int) -> SyncLayout:
    """The step's synchronisation layout from Megatron args: PP, VPP (``virtual_pipeline_model_parallel_size``),
    TP, CP, and EP/ETP when the model has experts (ETP defaults to TP, as Megatron's ``validate_args`` does)."""
    def size(name: str, default: int = 1) -> int:
        return int(getattr(args, name, None) or default)

    tp = size("tensor_model_parallel_size")
    moe = getattr(args, "num_experts", None)
    return SyncLayout(
        data_parallel_size=int(data_parallel_size), pool_size=int(pool_size),
        num_microbatches=int(args.global_batch_size) // (int(data_parallel_size) * size("micro_batch_size")),
        pipeline_parallel_size=size("pipeline_model_parallel_size"),
        virtual_pipeline_size=size("virtual_pipeline_model_parallel_size"), tensor_parallel_size=tp,
        context_parallel_size=size("context_parallel_size"),
        expert_parallel_size=size("expert_model_parallel_size") if moe else 1,
        expert_tensor_parallel_size=size("expert_tensor_parallel_size", tp) if moe else 1,
        flags=_MEGATRON_FLAGS,
    )
