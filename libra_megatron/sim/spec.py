"""What a simulator run is: the model dims, the ``SimSpec`` (corpus x parallel layout x Libra grid x time model)
and its validation (ValueError names the flag), before any window is packed."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from ..config import (AUTO_CHUNKS, KvFetch, LibraConfig, PackingMode, SaveModeName, SequencePlacement, TilePlacement,
                      TilingPolicy, TokenLayoutKind)
from ..plan.model import StepTimeModel, saved_layers
from ..plan.packing import num_packed_upper_bound, packing_memory_bytes
from ..plan.sequences import PoolProxy, SyncLayout

__all__ = ["ModelDims", "SimSpec", "check_run_cost", "check_jobs", "MODEL_PRESETS", "MODEL_LAYERS", "DTYPE_BYTES",
           "MIN_SEQ_LEN",
           "MAX_TILES_PER_POOL", "VARIANTS"]

MODEL_PRESETS: Dict[str, Tuple[int, int, int]] = {  # (hq, hkv, head_dim), bf16
    "qwen3-8b": (32, 8, 128),
    "qwen3-30b-a3b": (32, 4, 128),
    "qwen3-235b-a22b": (64, 4, 128),
}
MODEL_LAYERS: Dict[str, int] = {"qwen3-8b": 36, "qwen3-30b-a3b": 48, "qwen3-235b-a22b": 94}  # num_hidden_layers
DTYPE_BYTES: Dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
MIN_SEQ_LEN = 64  # tokens per packed sequence: below it nothing is long-context, and tiny L only multiplies sequences
MAX_TILES_PER_POOL = 1 << 20  # SH-Tiles of one pool instance: 64x the 1M-token P=16 H=4 B=4096 case
VARIANTS = ("tap", "tap_vrsp", "libra")


@dataclass(frozen=True)
class ModelDims:
    """Attention shape: query heads, kv heads, head dim, bytes per element."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    elem_bytes: int = 2


@dataclass(frozen=True)
class SimSpec:
    """Everything one simulator run depends on (the CLI builds it; ``validate`` names CLI flags).

    The candidate grid is pool_sizes x head_splits x block_sizes x taus x chunk_counts x tilings x
    kv_fetches (in that nesting order); each candidate prices its own M with ``cost`` (the one
    ``plan.model.StepTimeModel``).
    """

    seq_len: int
    global_batch_size: int
    data_parallel_size: int
    context_parallel_size: int
    pool_sizes: Tuple[int, ...]
    head_splits: Tuple[int, ...]
    block_sizes: Tuple[int, ...]
    dims: ModelDims
    cost: StepTimeModel
    chunk_counts: Tuple[int, ...] = (4,)  # M values (Pipeliner head chunks), --num-chunks
    taus: Tuple[float, ...] = (0.03,)  # Algorithm 2 load slack values, --tau
    tilings: Tuple[TilingPolicy, ...] = (TilingPolicy.ADAPTIVE,)  # --tiling
    kv_fetches: Tuple[KvFetch, ...] = (KvFetch.PREFIX,)  # --kv-fetch
    token_layout: TokenLayoutKind = TokenLayoutKind.ZIGZAG
    sequence_placement: SequencePlacement = SequencePlacement.SYNC
    tile_placement: TilePlacement = TilePlacement.ALG2
    packing: PackingMode = PackingMode.MEGATRON
    seed: int = 1234
    max_windows: Optional[int] = None
    wlb_cap_factor: float = 1.25
    distca: bool = True
    memory_limit_gib: float = 2.0  # packing is refused when ``packing_memory_bytes`` estimates more
    # the synchronisation model (sim/sync.py): --pp, --vpp, --tp, --ep, --etp, --other-seconds
    pipeline_parallel_size: int = 1
    virtual_pipeline_size: int = 1
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    other_seconds: float = 0.0
    dump_orders: bool = False  # keep every window's placed order for --dump-orders
    # the backward as the runtime runs it: --save-mode, --activation-budget-gb, --num-layers (auto's budget)
    save_mode: SaveModeName = LibraConfig.save_mode
    activation_budget_gb: float = LibraConfig.activation_budget_gb
    num_layers: int = 1
    recompute_num_layers: int = 1  # --recompute-num-layers: full uniform recompute of n layers at a time; 0 = none
    libra_config: Optional[str] = None  # --libra-config FILE the knobs' defaults came from (reported only)

    @property
    def num_steps(self) -> int:
        """GA steps per window: GBS / DP."""
        return self.global_batch_size // self.data_parallel_size

    @property
    def layers_per_stage(self) -> int:
        """Transformer layers of one pipeline stage: ceil(num_layers / PP) (the planner's count for save_mode auto)."""
        return -(-self.num_layers // self.pipeline_parallel_size)

    @property
    def saved_layers(self) -> int:
        """Layers whose saved attention is alive at once (``plan.model.memory.saved_layers``): save_mode auto's
        budget covers that many, as the planner counts them from Megatron-LM's recompute flags."""
        n = self.recompute_num_layers
        return saved_layers(self.layers_per_stage, "full" if n else None, "uniform", n or None)

    def sync_layout(self, pool_size: int) -> SyncLayout:
        """The step's synchronisation layout at pool size ``pool_size`` (ValueError names the flag). Its
        ``backward_ratio`` keeps SyncLayout's default, as the runtime's sampler does: the sync placement's F
        proxies use it; the simulator's scores pass every pool's priced backward instead."""
        return SyncLayout(self.data_parallel_size, pool_size, self.num_steps, self.pipeline_parallel_size,
                          self.virtual_pipeline_size, self.tensor_parallel_size, self.context_parallel_size,
                          self.expert_parallel_size, self.expert_tensor_parallel_size,
                          other_seconds=self.other_seconds)

    def pool_proxy(self, pool_size: int) -> PoolProxy:
        """The priced-pool proxy the sync placement reads at PP > 1 (``plan.sequences.pool_proxy``): this run's
        pools (P x CP workers, L tokens), heads and the time model's rates."""
        return PoolProxy(pool_size, self.context_parallel_size, self.seq_len, self.dims.num_q_heads,
                         self.dims.num_kv_heads, self.dims.head_dim, self.dims.elem_bytes, self.cost.attn_tflops,
                         self.cost.inter_node_gbps)

    def validate(self) -> "SimSpec":
        _validate_spec(self)
        return self


def _positive(value, flag: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{flag} must be a positive integer, got {value!r}")


_CONFIG_FLAGS = {"head_split": "--head-split", "num_chunks": "--num-chunks"}  # LibraConfig keys -> our flags


def chunks_for_split(spec: SimSpec, head_split: int, num_chunks) -> int:
    """The M a candidate with H = ``head_split`` prices: ``num_chunks``, or for ``auto`` the K/V heads of one
    head shard of ``spec.dims`` (``LibraConfig.chunks_for``, as the runtime resolves it)."""
    config = LibraConfig(head_split=head_split, num_chunks=num_chunks)
    return config.chunks_for(spec.dims.num_q_heads, spec.dims.num_kv_heads)


def _validate_heads(spec: SimSpec) -> None:
    """hkv | hq, then every (H, M) pair against ``LibraConfig.validate`` (the runtime's rule)."""
    hq, hkv = spec.dims.num_q_heads, spec.dims.num_kv_heads
    if hq % hkv:
        raise ValueError(f"--num-kv-heads {hkv} must divide --num-heads {hq} ({hq} % {hkv} = {hq % hkv})")
    for h in spec.head_splits:
        _positive(h, "--head-split")
    for m in spec.chunk_counts:
        if m != AUTO_CHUNKS:
            _positive(m, "--num-chunks")
    for h in spec.head_splits:
        for m in spec.chunk_counts:
            try:
                LibraConfig.from_flags(dict(head_split=int(h), num_chunks=m if m == AUTO_CHUNKS else int(m)),
                                       _CONFIG_FLAGS).validate(
                    num_attention_heads=hq, num_query_groups=hkv)
            except ValueError as err:
                raise ValueError(f"--head-split {h} x --num-chunks {m} is invalid for --num-heads {hq}, "
                                 f"--num-kv-heads {hkv}: {err}") from None


def _finite(value, flag: str, rule: str, accept: Callable[[float], bool]) -> None:
    """``value`` must be a finite real number that ``accept``s (``rule`` says which, for the message)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not math.isfinite(value) \
            or not accept(value):
        raise ValueError(f"{flag} must be a finite number {rule}, got {value!r}")


def _validate_layout(spec: SimSpec) -> None:
    for value, flag in ((spec.seq_len, "--seq-len"), (spec.global_batch_size, "--gbs"),
                        (spec.data_parallel_size, "--dp"), (spec.context_parallel_size, "--cp")):
        _positive(value, flag)
    if spec.seq_len < MIN_SEQ_LEN:
        raise ValueError(f"--seq-len {spec.seq_len} is below the minimum {MIN_SEQ_LEN} tokens per packed sequence")
    gbs, dp, cp = spec.global_batch_size, spec.data_parallel_size, spec.context_parallel_size
    if gbs % dp:
        raise ValueError(f"--gbs {gbs} must be divisible by --dp {dp} ({gbs} % {dp} = {gbs % dp})")
    chunks = TokenLayoutKind(spec.token_layout).num_cp_chunks(cp)
    if spec.seq_len % chunks:
        raise ValueError(f"--seq-len {spec.seq_len} must be divisible by {chunks} CP chunks (--token-layout "
                         f"{spec.token_layout.value}, --cp {cp}): {spec.seq_len} % {chunks} = {spec.seq_len % chunks}")


def _validate_grid(spec: SimSpec) -> None:
    if not (spec.pool_sizes and spec.head_splits and spec.block_sizes and spec.taus and spec.chunk_counts
            and spec.tilings and spec.kv_fetches):
        raise ValueError("--pool-size, --head-split, --block-size, --tau, --num-chunks, --tiling and --kv-fetch "
                         "each need at least one value")
    dp = spec.data_parallel_size
    for p in spec.pool_sizes:
        _positive(p, "--pool-size")
        if dp % p:
            raise ValueError(f"--pool-size {p} must divide --dp {dp} ({dp} % {p} = {dp % p})")
    for b in spec.block_sizes:
        _positive(b, "--block-size")
    for tau in spec.taus:
        _finite(tau, "--tau", ">= 0", lambda v: v >= 0)
    _validate_heads(spec)
    _validate_tile_counts(spec)
    for p in spec.pool_sizes:
        spec.sync_layout(p)


def _validate_tile_counts(spec: SimSpec) -> None:
    """Bound the tiles of one pool: P * (ceil(L / B) + 2*CP block cuts) * H <= MAX_TILES_PER_POOL."""
    p, h, b = max(spec.pool_sizes), max(spec.head_splits), min(spec.block_sizes)
    tiles = p * (-(-spec.seq_len // b) + 2 * spec.context_parallel_size) * h
    if tiles > MAX_TILES_PER_POOL:
        raise ValueError(f"--pool-size {p} x --head-split {h} x (--seq-len {spec.seq_len} / --block-size {b} "
                         f"blocks) gives about {tiles} SH-Tiles per pool, more than the {MAX_TILES_PER_POOL} this "
                         f"simulator accepts; use a larger --block-size or a smaller --seq-len")


def _validate_spec(spec: SimSpec) -> None:
    _validate_layout(spec)
    _validate_grid(spec)
    _finite(spec.wlb_cap_factor, "--wlb-cap-factor", ">= 1 (token cap = factor * --seq-len)", lambda v: v >= 1)
    _finite(spec.memory_limit_gib, "--memory-limit-gib", "> 0", lambda v: v > 0)
    if spec.max_windows is not None:
        _positive(spec.max_windows, "--max-windows")
    _positive(spec.num_layers, "--num-layers")
    if int(spec.recompute_num_layers) < 0:
        raise ValueError(f"--recompute-num-layers must be >= 0 (0 = no recompute), got {spec.recompute_num_layers}")
    _finite(spec.activation_budget_gb, "--activation-budget-gb", ">= 0", lambda v: v >= 0)
    SaveModeName(spec.save_mode)
    if spec.cost.head_dim != spec.dims.head_dim:
        raise ValueError(f"SimSpec.cost.head_dim {spec.cost.head_dim} must equal --head-dim {spec.dims.head_dim}")


def check_jobs(jobs: int) -> None:
    """``--jobs``: 1 .. number of CPUs (each worker process holds a copy of the packed corpus)."""
    _positive(jobs, "--jobs")
    cpus = os.cpu_count() or 1
    if jobs > cpus:
        raise ValueError(f"--jobs {jobs} is more than the {cpus} CPUs of this machine")


def check_run_cost(doc_lens, spec: SimSpec) -> None:
    """Refuse, before packing, a corpus whose packing ``plan.packing.packing_memory_bytes`` estimates above
    ``--memory-limit-gib``, or one too small for a single GBS window."""
    limit = spec.memory_limit_gib * (1 << 30)
    max_sequences = None if spec.max_windows is None else spec.max_windows * spec.global_batch_size
    need = packing_memory_bytes(doc_lens, spec.seq_len, spec.packing, max_sequences)
    if need > limit:
        total = int(np.asarray(doc_lens, dtype=np.int64).sum())
        num_seq = num_packed_upper_bound(doc_lens, spec.seq_len, spec.packing)
        hint = ("a larger --seq-len, --max-windows N, or a larger --memory-limit-gib" if spec.packing is PackingMode.MEGATRON
                else "a larger --seq-len or a larger --memory-limit-gib (best_fit packs the whole corpus even with "
                     "--max-windows)")
        raise ValueError(
            f"--seq-len {spec.seq_len} packs the {total}-token corpus into {num_seq} sequences; packing would need "
            f"about {need / (1 << 30):.2f} GiB, more than --memory-limit-gib {spec.memory_limit_gib:g}; use {hint}")
    _num_windows(num_packed_upper_bound(doc_lens, spec.seq_len, spec.packing), spec)


def _num_windows(num_sequences: int, spec: SimSpec) -> int:
    full = num_sequences // spec.global_batch_size
    if full == 0:
        raise ValueError(f"the corpus packs into {num_sequences} sequences of --seq-len {spec.seq_len}, fewer than "
                         f"one --gbs {spec.global_batch_size} window; use a smaller --gbs/--seq-len or more --trace")
    return full if spec.max_windows is None else min(full, spec.max_windows)
