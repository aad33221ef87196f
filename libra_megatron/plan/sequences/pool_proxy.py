"""Priced pools without plans (issue 26): a pool's attention-layer seconds predicted from its documents.

Pure numpy. At PP > 1 the placement has to know which pool instances are slow before any of them is planned
(the sampler emits a window's order before the planner sees it), and F = sum l^2 alone cannot see what the
whole-layer model charges on top of the kernels: the exchange of a long document's K/V prefix, the per-token
copies and the work TAP has to move. ``PoolProxy`` prices a pool of P packed sequences as a weighted sum of five
terms, each in seconds of the configured layout (so one set of weights serves every head count, sequence length
and pool size):

    compute   F/2 x query heads x 4 d / peak rate / W        the pool's kernels spread perfectly (W = P x CP)
    excess    the same for sum_i max(0, F_i - mean F)          work TAP must move off the heavy sequences
    prefix    longest document x K|V bytes per token / inter-node rate   a long document's prefix crossing nodes
    documents documents x 1024 x K|V bytes per token / inter-node rate / W   per-document K/V groups
    tokens    P x L x (Q + K|V bytes per token) / W / 1 TB/s    the per-token copies of every worker

The weights (``FORWARD_WEIGHTS``, ``BACKWARD_WEIGHTS``) are fitted by ``benchmarks/fit_pool_proxy.py`` (non-negative
least squares on relative error) against the priced layer of the plans the planner makes -- the dense placement at
the shipped knobs, peers coupled, forward and backward apart -- on real pools of the two shipped traces at 256K
(Qwen3-30B-A3B and Qwen3-8B heads) and 1M; ``tests/sim/test_pool_proxy_prices.py`` checks the proxy against freshly
priced plans. Heads are per TP rank (a pool's workers share one TP rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import numpy as np

from ..model import DEFAULT_ATTN_TFLOPS, DEFAULT_INTER_NODE_GBPS, GB, TFLOP

__all__ = ["SequenceStats", "PoolProxy", "FORWARD_WEIGHTS", "BACKWARD_WEIGHTS", "FEATURES"]

FEATURES = ("compute", "excess", "prefix", "documents", "tokens")
# ``benchmarks/fit_pool_proxy.py`` (1630 pools, windows 8-13 of both traces, 256K 30B / 8B and 1M 30B; median
# relative error 1.5-15% forward, 1.4-6.3% backward; docs/plan-algos.md), refitted after the arranged Q was grouped
# by entry kind (each entry set one slice: fewer copies). The compute weights come out near the model's own
# (backward 2.51 ~ BACKWARD_FLOPS_FACTOR 2.5 x forward's 0.90 minus the forward's copies and exposure)
FORWARD_WEIGHTS = (0.8998, 0.2226, 0.5801, 0.0, 6.827)
BACKWARD_WEIGHTS = (2.511, 0.2282, 0.7398, 0.0, 8.218)
_TOKEN_BYTES_PER_SECOND = 1e12  # the tokens term's unit (1 TB/s): a scale, the weight carries the rate
_DOCUMENT_TOKENS = 1024  # the documents term's unit: K/V of 1024 tokens per document (the weight carries the rest)


@dataclass(frozen=True)
class SequenceStats:
    """What the proxy reads of every packed sequence of a window: F = sum l^2, the longest document, the number
    of documents (float64 [n] each)."""

    flops: np.ndarray
    max_doc: np.ndarray
    num_docs: np.ndarray

    @staticmethod
    def of(segments: Sequence[Sequence[int]]) -> "SequenceStats":
        """From every sequence's document lengths (> 0; at least one per sequence), in one pass over all of them:
        F equals ``plan.model.sequence_flops`` exactly (integer-valued float64 sums below 2**53)."""
        if len(segments) == 0:
            return SequenceStats(np.zeros(0), np.zeros(0), np.zeros(0))
        counts = np.fromiter(map(len, segments), dtype=np.int64, count=len(segments))
        if counts.min() < 1:
            raise ValueError(f"sequence {int(np.argmin(counts))}: a packed sequence needs at least one document")
        lengths = np.concatenate(segments).astype(np.float64, copy=False)  # one C pass (the sampler's int64 arrays)
        if lengths.ndim != 1 or lengths.size != int(counts.sum()):
            raise ValueError("every sequence's document lengths must be a flat sequence of numbers")
        ends = np.cumsum(counts)
        if (lengths <= 0).any():
            first = int(np.searchsorted(ends, int(np.argmax(lengths <= 0)), side="right"))
            raise ValueError(f"sequence {first}: document lengths must be positive, got min {lengths.min()}")
        starts = ends - counts
        return SequenceStats(np.add.reduceat(lengths * lengths, starts), np.maximum.reduceat(lengths, starts),
                             counts.astype(np.float64))

    @property
    def size(self) -> int:
        return int(self.flops.size)


@dataclass(frozen=True)
class PoolProxy:
    """The layout the pools run on (heads per TP rank) and the rates of the time model's defaults."""

    pool_size: int
    context_parallel_size: int
    seq_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    elem_bytes: int = 2
    attn_tflops: float = DEFAULT_ATTN_TFLOPS
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS

    def __post_init__(self) -> None:
        for key in ("pool_size", "context_parallel_size", "seq_len", "num_q_heads", "num_kv_heads", "head_dim",
                    "elem_bytes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"PoolProxy.{key} must be a positive integer, got {value!r}")
        for key in ("attn_tflops", "inter_node_gbps"):
            if not float(getattr(self, key)) > 0:
                raise ValueError(f"PoolProxy.{key} must be > 0, got {getattr(self, key)!r}")

    @property
    def num_workers(self) -> int:
        return self.pool_size * self.context_parallel_size

    def features(self, stats: SequenceStats, pools: np.ndarray) -> np.ndarray:
        """float64 [n, 5]: the terms of ``FEATURES`` (seconds) of every pool, ``pools`` int [n, P] window positions."""
        pools = np.asarray(pools, dtype=np.int64)
        if pools.ndim != 2 or pools.shape[1] != self.pool_size:
            raise ValueError(f"pools must be [n, P = {self.pool_size}] window positions, got shape {pools.shape}")
        W = self.num_workers
        flops = stats.flops[pools]
        mean = flops.mean(axis=1, keepdims=True)
        per_pair_head = 4.0 * self.head_dim / (self.attn_tflops * TFLOP)

        def kernel_seconds(f):  # F/2 query-key pairs x heads at the peak rate, spread over W workers
            return f / 2.0 * self.num_q_heads * per_pair_head / W

        kv_bytes = 2 * self.num_kv_heads * self.head_dim * self.elem_bytes  # K|V of one token, all kv heads
        q_bytes = self.num_q_heads * self.head_dim * self.elem_bytes
        inter = self.inter_node_gbps * GB
        compute = kernel_seconds(flops.sum(axis=1))
        excess = kernel_seconds(np.maximum(flops - mean, 0.0).sum(axis=1))
        prefix = stats.max_doc[pools].max(axis=1) * kv_bytes / inter
        documents = stats.num_docs[pools].sum(axis=1) * _DOCUMENT_TOKENS * kv_bytes / inter / W
        tokens = np.full(pools.shape[0], self.pool_size * self.seq_len * (q_bytes + kv_bytes) / W / _TOKEN_BYTES_PER_SECOND)
        return np.stack([compute, excess, prefix, documents, tokens], axis=1)

    def seconds(self, stats: SequenceStats, pools: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(forward, backward) float64 [n]: every pool's predicted slowest-worker seconds of one attention layer."""
        x = self.features(stats, pools)
        return x @ np.asarray(FORWARD_WEIGHTS), x @ np.asarray(BACKWARD_WEIGHTS)

    def pricer(self, stats: SequenceStats):
        """``pool_seconds`` for ``place_sequences``: pools [n, P] of the window ``stats`` describes -> seconds."""
        if stats.size % self.pool_size:
            raise ValueError(f"the window's {stats.size} sequences do not split into pools of P = {self.pool_size}")
        return lambda pools: self.seconds(stats, pools)
