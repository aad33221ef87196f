"""Libra microbatch construction: CP sharding of one packed sequence, per-document RoPE positions, cu_seqlens.

Shapes (mbs = 1, L = seq_length, CP = context-parallel size, t = L / CP local tokens, n = documents):
    sample["tokens"|"labels"|"loss_mask"]: (L,) or (1, L) -- a GPTDataset sample, collated or not
    out tokens, labels, position_ids: (1, t) int64; loss_mask: (1, t) float32
    out cu_seqlens: (n+1,) int32 over the WHOLE packed sequence (megatron-core 0.16 GPTDataset emits none)
    out local_to_global: (t,) int64, the global position of every local token

The step's plan travels explicitly on ``LibraPackedSeqParams`` (a ``PackedSeqParams`` subclass), never
through module globals.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ..config import TokenLayoutKind
from ..plan.layout import TokenLayout

__all__ = ["LibraPackedSeqParams", "cp_shard_indices", "segment_position_ids", "build_libra_batch"]


@dataclass
class LibraPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` (qkv_format="thd", cu_seqlens of the whole packed sequence) plus the step's plan.

    libra_plan: this worker's ``plan.exchange.RankPlan`` (None before planning / when Libra is off).
    libra_pool_segments: list of P int64 arrays, the segment lengths of the pool's packed sequences.
    libra_position: p, which of them is this DP rank's sequence.
    libra_kernel_backend: the run's ``kernel_backend`` (LibraCoreAttention runs with it).
    libra_save_mode: ``arranged`` | ``refetch`` for this plan (the planner's ``save_mode=auto`` decision).
    """

    libra_plan: Any = None
    libra_pool_segments: Optional[List[np.ndarray]] = None
    libra_position: int = 0
    libra_kernel_backend: Optional[str] = None
    libra_save_mode: Optional[str] = None


def cp_shard_indices(seq_len: int, cp: int, cp_rank: int, layout) -> np.ndarray:
    """Global positions CP rank ``cp_rank`` holds, in local order: int64 (seq_len / cp,).

    ``plan.layout.TokenLayout.local_to_global`` (contiguous: ``[c*L/CP, (c+1)*L/CP)``; zigzag, CP > 1: CP
    chunks c and 2*CP-1-c of L/(2*CP) tokens, megatron-core's ``get_batch_on_this_cp_rank``), with the
    error naming the flags.
    """
    layout = TokenLayoutKind(layout)
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"CP rank {cp_rank} must lie in [0, CP={cp})")
    chunks = TokenLayoutKind(layout).num_cp_chunks(cp)
    if seq_len % chunks:
        raise ValueError(
            f"--seq-length {seq_len} must be divisible by {chunks} CP chunks "
            f"(--libra-token-layout={layout.value}, CP={cp}; {seq_len} % {chunks} = {seq_len % chunks})"
        )
    return TokenLayout(layout, seq_len, cp).local_to_global(cp_rank)


def segment_position_ids(segments) -> np.ndarray:
    """RoPE positions of the packed sequence: 0..l_j-1 inside every segment j. int64 (sum(segments),)."""
    segments = np.asarray(segments, dtype=np.int64).reshape(-1)
    starts = np.cumsum(segments) - segments
    return np.arange(int(segments.sum()), dtype=np.int64) - np.repeat(starts, segments)


def _flat(value: Any, name: str, seq_len: Optional[int] = None) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    if tensor.dim() == 2 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 1 or (seq_len is not None and tensor.numel() != seq_len):
        raise ValueError(f"sample[{name!r}] must have shape (L,) or (1, L) with L={seq_len}, got {tuple(tensor.shape)}")
    return tensor


def build_libra_batch(sample: dict, segments, cp_size: int, cp_rank: int, layout) -> dict:
    """This CP rank's shard of one packed sequence, with per-segment positions and whole-sequence cu_seqlens.

    ``segments``: the sequence's segment lengths (all > 0, summing to L). Returns the keys listed in the
    module docstring plus ``max_seqlen`` (int). Raises ValueError on inconsistent lengths.
    """
    tokens = _flat(sample["tokens"], "tokens")
    seq_len = tokens.numel()
    segments = np.asarray(segments, dtype=np.int64).reshape(-1)
    if segments.size == 0 or (segments <= 0).any() or int(segments.sum()) != seq_len:
        raise ValueError(f"segments must be positive and sum to the sample length {seq_len}, "
                         f"got {segments.size} segments summing to {int(segments.sum())}")
    local = cp_shard_indices(seq_len, cp_size, cp_rank, layout)
    index = torch.from_numpy(local)
    positions = torch.from_numpy(segment_position_ids(segments))
    cu_seqlens = torch.from_numpy(np.concatenate([[0], np.cumsum(segments)]).astype(np.int32))
    return {
        "tokens": tokens.long()[index][None],
        "labels": _flat(sample["labels"], "labels", seq_len).long()[index][None],
        "loss_mask": _flat(sample["loss_mask"], "loss_mask", seq_len).float()[index][None],
        "position_ids": positions[index][None],
        "cu_seqlens": cu_seqlens,
        "max_seqlen": int(segments.max()),
        "local_to_global": index,
    }
