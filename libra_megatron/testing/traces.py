"""Packed sequences built from real document-length traces, for tests and benchmarks (pure numpy).

Lengths come from ``plan.traces`` and packing from ``plan.packing`` (GPTDataset style), so every test
and benchmark packs real traces the same way the simulator does; only the scale differs.
"""
from __future__ import annotations

import functools
from typing import List

import numpy as np

from ..plan.packing import pack_documents
from ..plan.traces import find_trace, load_trace

__all__ = ["trace_lengths", "packed_trace_segments"]

LINUX_TRACE = "linux-6.12-files.qwen.txt"


@functools.lru_cache(maxsize=None)
def trace_lengths(name: str = LINUX_TRACE) -> np.ndarray:
    """Document lengths of a shipped trace (read once per process). Do not modify the returned array."""
    return load_trace(find_trace(name))


def packed_trace_segments(rng: np.random.Generator, num_seqs: int, seq_len: int, scale: float = 1.0,
                          name: str = LINUX_TRACE) -> List[List[int]]:
    """``num_seqs`` packed sequences of ``seq_len`` tokens: documents drawn with ``rng`` from the trace,
    lengths multiplied by ``scale`` (rounded, at least 1 token), packed GPTDataset-style (shuffle,
    concatenate, cut every seq_len). Each returned list sums to exactly ``seq_len``."""
    lens = trace_lengths(name)
    docs = np.zeros(0, dtype=np.int64)
    while docs.sum() < (num_seqs + 1) * seq_len:  # one spare sequence: packing drops the partial tail
        drawn = lens[rng.integers(0, lens.size, size=8 * num_seqs)]
        docs = np.concatenate([docs, np.maximum(1, np.round(drawn * scale)).astype(np.int64)])
    packed = pack_documents(docs, seq_len, "megatron", int(rng.integers(1 << 31)))
    return [[int(x) for x in seg] for seg in packed[:num_seqs]]
