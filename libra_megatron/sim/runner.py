"""Corpus simulator (§5 "Configuration simulator"): replay VRSP and TAP over every GBS window.

Imports only ``libra_megatron.plan`` and ``libra_megatron.config``. All times are per attention layer,
forward pass, from ``cost.CostModel``. Definitions (every number is a mean over windows unless noted):

window      GBS consecutive packed sequences of the corpus (packing order); a trailing partial window
            is dropped. With ``max_windows`` N only the first N*GBS sequences are packed (megatron
            packing; best_fit must pack the whole corpus, see ``plan.packing``). A window runs as
            GA = GBS/DP steps; pool k of an order runs at GA step k*P // DP on DP ranks (k % (DP/P))*P + j
            (``plan.sequences.assign_to_ranks``).
inter-pool  R - 1 = max/mean - 1 of pool loads sum_i F_i (Eq. 2/4) for the contiguous (sampler) order,
            Algorithm 1, and the configured ``--sequence-placement``; ``lower_bound`` is the same ratio for
            ``workload.pool_lower_bound_counting`` (no grouping can beat it); ``eq3`` is Eq. 3 with the
            window's CV of F_i and D = GBS.
intra-pool  max/mean - 1 of Eq. 6 worker loads after tile placement, mean over pool instances.
straggler   (per instance) per step, max over the DP*CP workers of compute + exposed comm (``cost``), as if
            every pool waited for every other after each microbatch; a candidate's
            ``estimated_step_seconds`` is its mean over all steps of all windows -- the objective the
            recommendation minimises. ``straggler_vs_ulysses`` = sum of Libra step stragglers / sum of
            Ulysses step stragglers (< 1 is faster); ``straggler_vs_lower_bound`` divides by the
            perfectly balanced, communication-free step: window compute at peak rate / (GA*DP*CP).
sync        the same pools under the synchronisation model (``sim.sync``, ``plan.sync``): lanes, EP ties,
            pipelines (--pp/--vpp), DP at step end; ``sync_*``, ``lane_imbalance``, ``pipeline_bubble_fraction*``.
bytes       per pool instance and layer forward (remote only), split Q / KV / O (``ExchangePlan`` totals).
variants    tap       contiguous order + Algorithm 2 (Libra "TAP")
            tap_vrsp  Algorithm 1 + Algorithm 2 (Libra "TAP+VRSP", the paper's full placement)
            libra     --sequence-placement + --tile-placement (the candidate's headline numbers)
            distca    one pool of P = DP per GA step (contiguous order) with --tile-placement, same H, B
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..config import KvFetch, LibraConfig, PackingMode, SequencePlacement, TilePlacement, TilingPolicy, TokenLayoutKind
from ..plan.layout import TokenLayout
from ..plan.packing import num_packed_upper_bound, pack_documents, packing_memory_bytes
from ..plan.sequences import place_sequences, pool_loads
from ..plan.sync import SyncLayout
from ..plan.workload import clt_expected_imbalance, imbalance, pool_lower_bound_counting, sequence_flops
from .baselines import sequence_pair_heads, ulysses_worker_seconds, wlb_repack
from .cost import CostModel
from .hybrid_cp import HybridCpBaseline, HybridCpDims
from .pools import PoolEvaluator, PoolKnobs, PoolResult
from .sync import SyncAccum, describe_layout, score_orders

__all__ = ["ModelDims", "SimSpec", "Candidate", "SimResult", "run_simulation", "check_run_cost", "check_jobs",
           "MODEL_PRESETS", "DTYPE_BYTES", "MIN_SEQ_LEN", "MAX_TILES_PER_POOL"]

MODEL_PRESETS: Dict[str, Tuple[int, int, int]] = {  # (hq, hkv, head_dim), bf16
    "qwen3-8b": (32, 8, 128),
    "qwen3-30b-a3b": (32, 4, 128),
    "qwen3-235b-a22b": (64, 4, 128),
}
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
    kv_fetches (in that nesting order). ``cost.num_chunks`` must be one of ``chunk_counts``; each candidate runs the cost
    model with its own M.
    """

    seq_len: int
    global_batch_size: int
    data_parallel_size: int
    context_parallel_size: int
    pool_sizes: Tuple[int, ...]
    head_splits: Tuple[int, ...]
    block_sizes: Tuple[int, ...]
    dims: ModelDims
    cost: CostModel
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
    # the synchronisation model (sim/sync.py): --pp, --vpp, --tp, --ep, --etp, --backward-ratio, --other-seconds
    pipeline_parallel_size: int = 1
    virtual_pipeline_size: int = 1
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    backward_ratio: float = 2.0
    other_seconds: float = 0.0
    dump_orders: bool = False  # keep every window's placed order for --dump-orders

    @property
    def num_steps(self) -> int:
        """GA steps per window: GBS / DP."""
        return self.global_batch_size // self.data_parallel_size

    def sync_layout(self, pool_size: int) -> SyncLayout:
        """The step's synchronisation layout at pool size ``pool_size`` (ValueError names the flag)."""
        return SyncLayout(self.data_parallel_size, pool_size, self.num_steps, self.pipeline_parallel_size,
                          self.virtual_pipeline_size, self.tensor_parallel_size, self.context_parallel_size,
                          self.expert_parallel_size, self.expert_tensor_parallel_size, self.backward_ratio,
                          self.other_seconds)

    def validate(self) -> "SimSpec":
        _validate_spec(self)
        return self


def _positive(value, flag: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{flag} must be a positive integer, got {value!r}")


_CONFIG_FLAGS = {"head_split": "--head-split", "num_chunks": "--num-chunks"}  # LibraConfig keys -> our flags


def _validate_heads(spec: SimSpec) -> None:
    """hkv | hq, then every (H, M) pair against ``LibraConfig.validate`` (the runtime's rule)."""
    hq, hkv = spec.dims.num_q_heads, spec.dims.num_kv_heads
    if hq % hkv:
        raise ValueError(f"--num-kv-heads {hkv} must divide --num-heads {hq} ({hq} % {hkv} = {hq % hkv})")
    for h in spec.head_splits:
        _positive(h, "--head-split")
    for m in spec.chunk_counts:
        _positive(m, "--num-chunks")
    for h in spec.head_splits:
        for m in spec.chunk_counts:
            try:
                LibraConfig.from_flags(dict(head_split=int(h), num_chunks=int(m)), _CONFIG_FLAGS).validate(
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
    chunks = TokenLayout.cp_chunk_count(spec.token_layout, cp)
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
    if spec.cost.num_chunks not in spec.chunk_counts or spec.cost.head_dim != spec.dims.head_dim:
        raise ValueError("CostModel.num_chunks/head_dim must be one of --num-chunks / equal --head-dim")


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


# --------------------------------------------------------------------------- accumulators
@dataclass
class _Steps:
    """Per-step straggler seconds of one variant over all windows."""

    seconds: List[float] = field(default_factory=list)
    compute: List[float] = field(default_factory=list)  # the straggler's compute part of each step (Libra variants)

    def extend(self, seconds, compute) -> None:
        self.seconds.extend(np.asarray(seconds, dtype=np.float64).tolist())
        self.compute.extend(np.asarray(compute, dtype=np.float64).tolist())

    def split(self) -> Dict[str, float]:
        """Mean per step of the straggler's compute and exposed communication (they sum to the mean step)."""
        if not self.compute:
            return {}
        s, c = np.asarray(self.seconds), np.asarray(self.compute)
        return {"compute_seconds": float(c.mean()), "exposed_comm_seconds": float((s - c).mean())}

    def summary(self, ulysses: "_Steps") -> Dict[str, float]:
        s, u = np.asarray(self.seconds), np.asarray(ulysses.seconds)
        return {"mean_step_seconds": float(s.mean()), "max_step_seconds": float(s.max()),
                "speedup_vs_ulysses": float(u.sum() / s.sum()), "max_speedup_vs_ulysses": float(u.max() / s.max()),
                **self.split()}


@dataclass
class WorstStep:
    """Per-worker seconds of the slowest step of a candidate (for the load-bar plot)."""

    window: int
    step: int
    compute_seconds: np.ndarray  # [DP*CP], Libra worker order (pool slot major)
    exposed_comm_seconds: np.ndarray
    ulysses_seconds: np.ndarray  # [DP*CP], the same window and step under Ulysses

    def to_json(self) -> Dict[str, object]:
        return {"window": self.window, "step": self.step,
                "compute_seconds": self.compute_seconds.tolist(),
                "exposed_comm_seconds": self.exposed_comm_seconds.tolist(),
                "ulysses_seconds": self.ulysses_seconds.tolist()}


@dataclass
class Candidate:
    """Accumulated measurements of one (P, H, B, tau, M, tiling, KV fetch)."""

    pool_size: int
    head_split: int
    block_size: int
    tau: float
    num_chunks: int
    tiling: TilingPolicy = TilingPolicy.ADAPTIVE
    kv_fetch: KvFetch = KvFetch.PREFIX
    inter: Dict[str, List[float]] = field(default_factory=lambda: {k: [] for k in ("contiguous", "alg1", "placed", "lower_bound", "eq3")})
    intra: List[float] = field(default_factory=list)
    bytes_qkvo: List[Tuple[int, int, int]] = field(default_factory=list)
    num_tiles: List[int] = field(default_factory=list)
    num_fallback: int = 0
    steps: Dict[str, _Steps] = field(default_factory=lambda: {k: _Steps() for k in VARIANTS + ("distca",)})
    lower_bound: List[float] = field(default_factory=list)
    worst: Optional[WorstStep] = None
    sync: SyncAccum = field(default_factory=SyncAccum)

    @property
    def knobs(self) -> PoolKnobs:
        """Everything but P that a pool evaluation depends on."""
        return PoolKnobs(self.head_split, self.block_size, self.tau, self.num_chunks, self.tiling, self.kv_fetch)

    @property
    def estimated_step_seconds(self) -> float:
        return float(np.mean(self.steps["libra"].seconds))

    def to_json(self, ulysses: _Steps, layout: SyncLayout) -> Dict[str, object]:
        libra = np.asarray(self.steps["libra"].seconds)
        bytes_mean = np.asarray(self.bytes_qkvo, dtype=np.float64).mean(axis=0)
        baselines = {k: self.steps[k].summary(ulysses) for k in ("tap", "tap_vrsp", "distca") if self.steps[k].seconds}
        return {
            "pool_size": self.pool_size, "head_split": self.head_split, "block_size": self.block_size,
            "tau": self.tau, "num_chunks": self.num_chunks, "tiling": self.tiling.value, "kv_fetch": self.kv_fetch.value,
            "num_tiles": int(round(float(np.mean(self.num_tiles)))),
            "inter_pool_imbalance": {k: float(np.mean(v)) for k, v in self.inter.items()},
            "intra_pool_imbalance": float(np.mean(self.intra)),
            "intra_pool_imbalance_max": float(np.max(self.intra)),
            "num_fallback_tiles": int(self.num_fallback),
            "straggler_vs_ulysses": float(libra.sum() / np.sum(ulysses.seconds)),
            "straggler_max_vs_ulysses": float(libra.max() / np.max(ulysses.seconds)),
            "straggler_vs_lower_bound": float(libra.sum() / np.sum(self.lower_bound)),
            **self.steps["libra"].split(),
            "bytes_per_layer": {"q": float(bytes_mean[0]), "kv": float(bytes_mean[1]), "o": float(bytes_mean[2])},
            "estimated_step_seconds": self.estimated_step_seconds,
            "max_step_seconds": float(libra.max()),
            "baselines": baselines,
            **self.sync.to_json(layout),
        }


# --------------------------------------------------------------------------- corpus and windows
@dataclass(frozen=True)
class _Corpus:
    """Packed corpus (the sequences the run replays): segments, Eq. 2 loads F_i and Eq. 6 pair-heads."""

    segments: List[np.ndarray]
    flops: np.ndarray  # float64 (num_packed,)
    pair_heads: np.ndarray  # float64 (num_packed,)
    num_documents: int
    num_sequences: int  # of the whole corpus; > num_packed when max_windows stopped megatron packing early


def _pack_corpus(doc_lens: np.ndarray, spec: SimSpec) -> _Corpus:
    """Pack (only the sequences ``max_windows`` needs) and count the whole corpus' sequences."""
    max_sequences = None if spec.max_windows is None else spec.max_windows * spec.global_batch_size
    if spec.packing is PackingMode.MEGATRON:  # stops early; the whole corpus' count is tokens // L
        segments = pack_documents(doc_lens, spec.seq_len, spec.packing, spec.seed, max_sequences)
        total = num_packed_upper_bound(doc_lens, spec.seq_len, spec.packing)
    else:  # best_fit packs everything anyway (plan.packing): count it, then keep what the windows need
        segments = pack_documents(doc_lens, spec.seq_len, spec.packing, spec.seed)
        total, segments = len(segments), segments[:max_sequences]
    return _Corpus(segments, sequence_flops(segments), sequence_pair_heads(segments, spec.dims.num_q_heads),
                   int(np.count_nonzero(doc_lens)), total)


def _num_windows(num_sequences: int, spec: SimSpec) -> int:
    full = num_sequences // spec.global_batch_size
    if full == 0:
        raise ValueError(f"the corpus packs into {num_sequences} sequences of --seq-len {spec.seq_len}, fewer than "
                         f"one --gbs {spec.global_batch_size} window; use a smaller --gbs/--seq-len or more --trace")
    return full if spec.max_windows is None else min(full, spec.max_windows)


def _pool_positions(num_pools: int, pool_size: int, dp: int) -> Tuple[np.ndarray, np.ndarray]:
    """(GA step, first DP rank) of every pool k of a GA-major, pool-minor order (Fig. 7)."""
    k = np.arange(num_pools, dtype=np.int64)
    return k * pool_size // dp, (k % (dp // pool_size)) * pool_size


@dataclass
class _OrderRun:
    """One placement variant on one window: per-step stragglers and the pools that ran."""

    step_seconds: np.ndarray  # [GA]
    pools: List[PoolResult]
    pool_step: np.ndarray
    pool_first_dp: np.ndarray
    step_compute: np.ndarray = None  # [GA] compute seconds of each step's straggler worker


def _straggler_compute(pools: List[PoolResult], pool_step: np.ndarray, num_steps: int) -> np.ndarray:
    """[GA]: compute seconds of the slowest worker of every step (its exposed comm is the rest of the step).
    Workers within 1e-9 (relative) of the step's maximum tie; the tie goes to the largest compute, so the
    exposed share is never overstated."""
    seconds = np.concatenate([p.seconds for p in pools])
    compute = np.concatenate([p.compute_seconds for p in pools])
    step = np.repeat(pool_step, [p.seconds.size for p in pools])
    top = np.zeros(num_steps)
    np.maximum.at(top, step, seconds)
    out = np.zeros(num_steps)
    tied = seconds >= top[step] * (1.0 - 1e-9)
    np.maximum.at(out, step[tied], compute[tied])
    return out


def _run_order(ev: PoolEvaluator, ids: np.ndarray, order: np.ndarray, pool_size: int,
               knobs: PoolKnobs, method, spec: SimSpec) -> _OrderRun:
    """Evaluate every pool of ``order`` (positions into the window ``ids``) and take per-step maxima."""
    num_pools = order.size // pool_size
    step, first_dp = _pool_positions(num_pools, pool_size, spec.data_parallel_size)
    cp = spec.context_parallel_size
    pools = [ev.evaluate(ids[order[k * pool_size:(k + 1) * pool_size]], knobs, method, int(first_dp[k]) * cp)
             for k in range(num_pools)]
    step_seconds = np.zeros(spec.num_steps)
    np.maximum.at(step_seconds, step, [float(p.seconds.max()) for p in pools])
    return _OrderRun(step_seconds, pools, step, first_dp, _straggler_compute(pools, step, spec.num_steps))


def _step_workers(run: _OrderRun, step: int) -> Tuple[np.ndarray, np.ndarray]:
    """(compute, exposed comm) per worker of one step, pools in DP-rank order."""
    chosen = sorted(np.flatnonzero(run.pool_step == step).tolist(), key=lambda k: run.pool_first_dp[k])
    compute = np.concatenate([run.pools[k].compute_seconds for k in chosen])
    total = np.concatenate([run.pools[k].seconds for k in chosen])
    return compute, total - compute


@dataclass
class _Window:
    """Candidate-independent data of one window."""

    index: int
    ids: np.ndarray  # corpus sequence ids, sampler order
    flops: np.ndarray  # their Eq. 4 workloads
    ulysses_seq_seconds: np.ndarray  # (GBS,)
    lower_bound_step: float


def _window_data(corpus: _Corpus, w: int, spec: SimSpec) -> _Window:
    gbs, cp = spec.global_batch_size, spec.context_parallel_size
    ids = np.arange(w * gbs, (w + 1) * gbs, dtype=np.int64)
    heads = (spec.dims.num_q_heads, spec.dims.num_kv_heads, spec.dims.elem_bytes)
    uly = ulysses_worker_seconds(corpus.pair_heads[ids], np.full(gbs, spec.seq_len), cp, heads, spec.cost)
    return _Window(w, ids, corpus.flops[ids], uly, _lower_bound_step(corpus, ids, spec))


def _lower_bound_step(corpus: "_Corpus", ids: np.ndarray, spec: SimSpec) -> float:
    """The window's attention work at peak rate spread perfectly over GA*DP*CP workers, no communication."""
    workers = spec.num_steps * spec.data_parallel_size * spec.context_parallel_size
    return float(spec.cost.peak_compute_seconds(corpus.pair_heads[ids].sum())) / workers


def _wlb_steps(corpus: _Corpus, win: _Window, spec: SimSpec) -> np.ndarray:
    bins = wlb_repack([corpus.segments[i] for i in win.ids], spec.global_batch_size, spec.wlb_cap_factor * spec.seq_len)
    tokens = np.array([b.sum() for b in bins], dtype=np.float64)
    heads = (spec.dims.num_q_heads, spec.dims.num_kv_heads, spec.dims.elem_bytes)
    secs = ulysses_worker_seconds(sequence_pair_heads(bins, spec.dims.num_q_heads), tokens,
                                  spec.context_parallel_size, heads, spec.cost)
    return secs.reshape(spec.num_steps, spec.data_parallel_size).max(axis=1)


def _distca_steps(ev: PoolEvaluator, win: _Window, knobs: PoolKnobs, spec: SimSpec) -> Tuple[np.ndarray, np.ndarray]:
    """(step seconds, straggler compute seconds) of the DistCA-scope variant."""
    order = np.arange(spec.global_batch_size, dtype=np.int64)
    run = _run_order(ev, win.ids, order, spec.data_parallel_size, knobs, spec.tile_placement, spec)
    return run.step_seconds, run.step_compute


def _inter_pool(cand_p: int, flops: np.ndarray, orders: Dict[str, np.ndarray]) -> Dict[str, float]:
    """Inter-pool R-1 of every order, of the counting lower bound, and Eq. 3 at the window CV."""
    out = {name: imbalance(pool_loads(flops, order, cand_p)) for name, order in orders.items()}
    mean_pool = float(flops.sum()) / (flops.size // cand_p)
    out["lower_bound"] = pool_lower_bound_counting(flops, cand_p) / mean_pool - 1.0 if mean_pool > 0 else 0.0
    cv = float(flops.std() / flops.mean()) if flops.mean() > 0 else 0.0
    out["eq3"] = clt_expected_imbalance(cv, cand_p, flops.size)
    return out


def _orders(flops: np.ndarray, pool_size: int, spec: SimSpec) -> Dict[str, np.ndarray]:
    return {
        "contiguous": place_sequences(flops, pool_size, SequencePlacement.CONTIGUOUS),
        "alg1": place_sequences(flops, pool_size, SequencePlacement.ALG1),
        "placed": place_sequences(flops, pool_size, spec.sequence_placement, spec.sync_layout(pool_size)),
    }


_VARIANT_PLAN = {  # variant -> (order name, tile method or None for --tile-placement)
    "tap": ("contiguous", TilePlacement.ALG2),
    "tap_vrsp": ("alg1", TilePlacement.ALG2),
    "libra": ("placed", None),
}


def _record_candidate(cand: Candidate, ev: PoolEvaluator, win: _Window,
                      orders: Dict[str, np.ndarray], spec: SimSpec) -> None:
    """Run the three Libra variants of one candidate on one window and accumulate."""
    for variant, (order_name, method) in _VARIANT_PLAN.items():
        method = method or spec.tile_placement
        run = _run_order(ev, win.ids, orders[order_name], cand.pool_size, cand.knobs, method, spec)
        cand.steps[variant].extend(run.step_seconds, run.step_compute)
        if variant == "libra":
            _record_libra(cand, run, win, spec)
    cand.lower_bound.extend([win.lower_bound_step] * spec.num_steps)
    _record_sync(cand, ev, win, orders, spec)


def _record_sync(cand: Candidate, ev: PoolEvaluator, win: _Window, orders: Dict[str, np.ndarray], spec: SimSpec) -> None:
    """Score every order under the sync model (sim/sync.py), each with the candidate's tile placement."""
    layout = spec.sync_layout(cand.pool_size)
    pools = {name: [p.seconds for p in _run_order(ev, win.ids, order, cand.pool_size, cand.knobs,
                                                   spec.tile_placement, spec).pools]
             for name, order in orders.items()}
    timings = score_orders(pools, win.lower_bound_step, layout)
    cand.sync.record(win.index, timings, timings["lower_bound"], win.flops, orders, layout)


def _record_libra(cand: Candidate, run: _OrderRun, win: _Window, spec: SimSpec) -> None:
    cand.intra.extend(p.intra_imbalance for p in run.pools)
    cand.bytes_qkvo.extend(p.bytes_qkvo for p in run.pools)
    cand.num_tiles.extend(p.num_tiles for p in run.pools)
    cand.num_fallback += sum(p.num_fallback for p in run.pools)
    step = int(np.argmax(run.step_seconds))
    if cand.worst is None or run.step_seconds[step] > _worst_seconds(cand.worst):
        compute, exposed = _step_workers(run, step)
        dp = spec.data_parallel_size
        uly = np.repeat(win.ulysses_seq_seconds[step * dp:(step + 1) * dp], spec.context_parallel_size)
        cand.worst = WorstStep(win.index, step, compute, exposed, uly)


def _worst_seconds(worst: WorstStep) -> float:
    return float((worst.compute_seconds + worst.exposed_comm_seconds).max())


# --------------------------------------------------------------------------- result and driver
OBJECTIVE = ("estimated_step_seconds = mean over GA steps of max over workers of the Pipeliner timeline "
             "(plan.timing.pipeline_seconds: compute + exposed comm); recommended = argmin, ties -> smaller P, H, B")


@dataclass
class SimResult:
    """Everything a run measured; ``to_json`` is the stable machine-readable form."""

    spec: SimSpec
    candidates: List[Candidate]
    ulysses: _Steps
    wlb: _Steps
    num_windows: int
    num_sequences: int
    num_documents: int
    seconds: float = 0.0
    window_cv: List[float] = field(default_factory=list)  # CV of F_i per window (Eq. 3 input)
    orders_dump: List[Dict[str, object]] = field(default_factory=list)  # --dump-orders lines, window order
    megatron_hybrid_cp: Optional[Dict[str, float]] = None  # ``sim.hybrid_cp`` summary when asked for

    def recommended(self) -> Candidate:
        """argmin of the objective (``OBJECTIVE``); ties go to smaller (P, H, B, tau, M), then the earlier
        (tiling, KV fetch) of the grid (candidates are kept in grid order)."""
        return min(enumerate(self.candidates), key=lambda ic: (ic[1].estimated_step_seconds, ic[1].pool_size,
                                                              ic[1].head_split, ic[1].block_size, ic[1].tau,
                                                              ic[1].num_chunks, ic[0]))[1]

    def _assumptions(self) -> Dict[str, object]:
        s = self.spec
        cost = s.cost.assumptions()
        cost["num_chunks"] = _scalar_or_list(s.chunk_counts)
        return {
            "seq_len": s.seq_len, "gbs": s.global_batch_size, "dp": s.data_parallel_size,
            "cp": s.context_parallel_size, "num_heads": s.dims.num_q_heads, "num_kv_heads": s.dims.num_kv_heads,
            "head_dim": s.dims.head_dim, "elem_bytes": s.dims.elem_bytes,
            "num_chunks": _scalar_or_list(s.chunk_counts), "tau": _scalar_or_list(s.taus),
            "tiling": _scalar_or_list(tuple(t.value for t in s.tilings)),
            "kv_fetch": _scalar_or_list(tuple(f.value for f in s.kv_fetches)),
            "token_layout": s.token_layout.value, "sequence_placement": s.sequence_placement.value,
            "tile_placement": s.tile_placement.value, "packing": s.packing.value, "seed": s.seed,
            "wlb_cap_factor": s.wlb_cap_factor, "cost": cost,
            "sync": describe_layout(s.sync_layout(s.pool_sizes[0])),
            "objective": OBJECTIVE + (", tau, M" if len(s.taus) * len(s.chunk_counts) > 1 else "")
            + (", then grid order of tiling, KV fetch" if len(s.tilings) * len(s.kv_fetches) > 1 else ""),
            "units": "seconds and bytes per attention layer, forward pass",
        }

    def to_json(self) -> Dict[str, object]:
        best = self.recommended()
        return {
            "num_windows": self.num_windows, "num_sequences": self.num_sequences,
            "num_documents": self.num_documents, "runtime_seconds": self.seconds,
            "assumptions": self._assumptions(),
            "baselines": {"ulysses": self.ulysses.summary(self.ulysses), "wlb_llm": self.wlb.summary(self.ulysses),
                          **({"megatron_hybrid_cp": self.megatron_hybrid_cp} if self.megatron_hybrid_cp else {})},
            **({"megatron_hybrid_cp_straggler_vs_lower_bound": self.megatron_hybrid_cp["straggler_vs_lower_bound"]}
               if self.megatron_hybrid_cp else {}),
            "candidates": [c.to_json(self.ulysses, self.spec.sync_layout(c.pool_size)) for c in self.candidates],
            "recommended": {"pool_size": best.pool_size, "head_split": best.head_split, "block_size": best.block_size,
                            "tau": best.tau, "num_chunks": best.num_chunks, "tiling": best.tiling.value,
                            "kv_fetch": best.kv_fetch.value, "estimated_step_seconds": best.estimated_step_seconds,
                            "worst_step": best.worst.to_json() if best.worst else None},
        }


def _scalar_or_list(values: Tuple) -> object:
    """A single swept value as itself (the JSON of a one-value run), several as a list."""
    return values[0] if len(values) == 1 else list(values)


def _make_candidates(spec: SimSpec) -> List[Candidate]:
    return [Candidate(p, h, b, t, m, tiling, fetch) for p in spec.pool_sizes for h in spec.head_splits
            for b in spec.block_sizes for t in spec.taus for m in spec.chunk_counts for tiling in spec.tilings
            for fetch in spec.kv_fetches]


def _simulate_window(corpus: _Corpus, w: int, spec: SimSpec, ev: PoolEvaluator, result: SimResult) -> None:
    win = _window_data(corpus, w, spec)
    dp = spec.data_parallel_size
    result.ulysses.seconds.extend(win.ulysses_seq_seconds.reshape(spec.num_steps, dp).max(axis=1).tolist())
    result.wlb.seconds.extend(_wlb_steps(corpus, win, spec).tolist())
    flops = corpus.flops[win.ids]
    result.window_cv.append(float(flops.std() / flops.mean()) if flops.mean() > 0 else 0.0)
    distca: Dict[PoolKnobs, Tuple[np.ndarray, np.ndarray]] = {}
    for p in spec.pool_sizes:
        orders = _orders(flops, p, spec)
        if spec.dump_orders:
            result.orders_dump.append(_order_record(corpus, win, p, orders["placed"], spec))
        inter = _inter_pool(p, flops, orders)
        for cand in (c for c in result.candidates if c.pool_size == p):
            for key, value in inter.items():
                cand.inter[key].append(value)
            _record_candidate(cand, ev, win, orders, spec)
            if spec.distca and cand.knobs not in distca:
                distca[cand.knobs] = _distca_steps(ev, win, cand.knobs, spec)
            if spec.distca:
                cand.steps["distca"].extend(*distca[cand.knobs])
    ev.clear()


def _order_record(corpus: _Corpus, win: _Window, pool_size: int, order: np.ndarray, spec: SimSpec) -> Dict[str, object]:
    """One --dump-orders line: the window's packed sequences (document lengths, sampler order) and the order."""
    return {"window": win.index, "dp": spec.data_parallel_size, "pool_size": pool_size, "ga": spec.num_steps,
            "seq_docs": [corpus.segments[i].tolist() for i in win.ids.tolist()], "order": order.tolist()}


def _merge_window(into: SimResult, part: SimResult) -> None:
    """Append one window's measurements (``part``) to ``into``; windows must arrive in order."""
    into.ulysses.seconds.extend(part.ulysses.seconds)
    into.wlb.seconds.extend(part.wlb.seconds)
    into.window_cv.extend(part.window_cv)
    into.orders_dump.extend(part.orders_dump)
    for mine, theirs in zip(into.candidates, part.candidates):
        for key, values in theirs.inter.items():
            mine.inter[key].extend(values)
        for name, steps in theirs.steps.items():
            mine.steps[name].extend(steps.seconds, steps.compute)
        mine.intra.extend(theirs.intra)
        mine.bytes_qkvo.extend(theirs.bytes_qkvo)
        mine.num_tiles.extend(theirs.num_tiles)
        mine.lower_bound.extend(theirs.lower_bound)
        mine.num_fallback += theirs.num_fallback
        mine.sync.merge(theirs.sync)
        if theirs.worst is not None and (mine.worst is None or _worst_seconds(theirs.worst) > _worst_seconds(mine.worst)):
            mine.worst = theirs.worst


_WORKER: Dict[str, object] = {}  # per-process state of window workers (set before forking)


def _window_job(w: int) -> SimResult:
    """Simulate window ``w`` alone (in a worker process or inline) into a fresh partial result."""
    corpus, spec, ev = _WORKER["corpus"], _WORKER["spec"], _WORKER["evaluator"]
    part = SimResult(spec, _make_candidates(spec), _Steps(), _Steps(), 1, 0, 0)
    _simulate_window(corpus, w, spec, ev, part)
    return part


def _window_results(num_windows: int, jobs: int):
    """Yield per-window partial results in window order, ``jobs`` processes at a time (fork)."""
    if jobs <= 1 or num_windows == 1:
        yield from (_window_job(w) for w in range(num_windows))
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(min(jobs, num_windows)) as pool:
        yield from pool.imap(_window_job, range(num_windows))


def _megatron_hybrid_cp(baseline: HybridCpBaseline, corpus: "_Corpus", num_windows: int, spec: SimSpec) -> Dict:
    """Megatron-LM's hybrid-CP balancer on every window's documents, priced by ``sim.hybrid_cp``."""
    gbs = spec.global_batch_size
    ids = [np.arange(w * gbs, (w + 1) * gbs) for w in range(num_windows)]
    windows = [np.concatenate([corpus.segments[i] for i in win]).astype(int).tolist() for win in ids]
    lower = [_lower_bound_step(corpus, win, spec) * spec.num_steps for win in ids]
    dims = HybridCpDims(spec.dims.num_q_heads, spec.dims.num_kv_heads, spec.dims.elem_bytes)
    return baseline.evaluate(windows, lower, spec.num_steps, dims, spec.cost,
                             spec.data_parallel_size * spec.context_parallel_size, spec.seq_len,
                             spec.context_parallel_size)


def run_simulation(doc_lens, spec: SimSpec, progress: Optional[Callable[[int, int], None]] = None,
                   jobs: int = 1, megatron_hybrid_cp: Optional[HybridCpBaseline] = None) -> SimResult:
    """Pack ``doc_lens`` (int, tokens), replay every GBS window for every (P, H, B, tau, M) and the baselines.

    ``jobs`` > 1 simulates windows in that many forked processes; results are identical to jobs=1.
    ``megatron_hybrid_cp`` adds Megatron-LM's hybrid-CP balancer on the same windows (``sim.hybrid_cp``).
    """
    start = time.perf_counter()
    spec.validate()
    check_jobs(jobs)
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    check_run_cost(doc_lens, spec)
    corpus = _pack_corpus(doc_lens, spec)
    num_windows = _num_windows(corpus.num_sequences, spec)
    layout = TokenLayout(spec.token_layout, spec.seq_len, spec.context_parallel_size)
    ev = PoolEvaluator(corpus.segments, layout, spec.dims.num_q_heads, spec.dims.num_kv_heads,
                       spec.dims.elem_bytes, spec.cost)
    result = SimResult(spec, _make_candidates(spec), _Steps(), _Steps(), num_windows,
                       corpus.num_sequences, corpus.num_documents)
    _WORKER.update(corpus=corpus, spec=spec, evaluator=ev)
    try:
        for done, part in enumerate(_window_results(num_windows, jobs), start=1):
            _merge_window(result, part)
            if progress is not None:
                progress(done, num_windows)
    finally:
        _WORKER.clear()
    if megatron_hybrid_cp is not None:
        result.megatron_hybrid_cp = _megatron_hybrid_cp(megatron_hybrid_cp, corpus, num_windows, spec)
    result.seconds = time.perf_counter() - start
    return result
