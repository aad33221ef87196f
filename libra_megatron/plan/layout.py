"""Token and head layouts of one sequence pool: who holds which tokens, which heads a chunk reads.

Pure Python + numpy. Worker ids are pool-local: worker ``w = p*CP + c`` holds CP shard ``c`` of the
pool's ``p``-th packed sequence (p in [0, P)). This matches the rank order of the pool process group,
which lists the CP groups of P consecutive DP replicas.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from ..config import TokenLayoutKind
from .errors import PlanError

__all__ = ["TokenLayout", "HeadLayout", "CpChunk"]


@dataclass(frozen=True)
class CpChunk:
    """A run of global positions ``[start, end)`` of one packed sequence held by one CP rank."""

    cp_rank: int
    start: int
    end: int
    local_start: int  # offset of ``start`` in that rank's local token buffer


@dataclass(frozen=True)
class TokenLayout:
    """How each packed sequence of ``seq_len`` tokens is split over ``cp`` ranks.

    contiguous: rank c holds [c*L/CP, (c+1)*L/CP).
    zigzag:     L is cut into 2*CP equal CP chunks; rank c holds chunk c then chunk 2*CP-1-c
                (Megatron's load-balanced causal CP split). With CP=1 both are identical.
    The chunk count is ``TokenLayoutKind.num_cp_chunks`` (config); this class states where each chunk goes.
    """

    kind: TokenLayoutKind
    seq_len: int
    cp: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", TokenLayoutKind(self.kind))
        if self.cp < 1 or self.seq_len < 1:
            raise PlanError(f"TokenLayout needs seq_len >= 1 and cp >= 1, got {self.seq_len}, {self.cp}")
        if self.seq_len % self.num_cp_chunks:
            raise PlanError(
                f"seq_len {self.seq_len} is not divisible by {self.num_cp_chunks} CP chunks "
                f"({self.kind.value} layout, CP={self.cp})"
            )

    @property
    def num_cp_chunks(self) -> int:
        """CP chunks of the sequence (``TokenLayoutKind.num_cp_chunks``)."""
        return self.kind.num_cp_chunks(self.cp)

    @property
    def local_len(self) -> int:
        """Tokens per CP rank."""
        return self.seq_len // self.cp

    def cp_chunks(self) -> List[CpChunk]:
        """All CP chunks sorted by global start."""
        n = self.num_cp_chunks
        size = self.seq_len // n
        out = []
        for i in range(n):
            if n == self.cp:
                rank, local = i, 0
            else:
                rank = i if i < self.cp else 2 * self.cp - 1 - i
                local = 0 if i < self.cp else size
            out.append(CpChunk(rank, i * size, (i + 1) * size, local))
        return out

    def boundaries(self) -> np.ndarray:
        """Global positions where the holder changes (CP chunk starts, plus seq_len), int64."""
        size = self.seq_len // self.num_cp_chunks
        return np.arange(0, self.seq_len + 1, size, dtype=np.int64)

    def global_to_local(self) -> Tuple[np.ndarray, np.ndarray]:
        """For every global position: (cp_rank, local index). Two int64 arrays of length seq_len."""
        rank = np.empty(self.seq_len, dtype=np.int64)
        local = np.empty(self.seq_len, dtype=np.int64)
        for ch in self.cp_chunks():
            rank[ch.start : ch.end] = ch.cp_rank
            local[ch.start : ch.end] = ch.local_start + np.arange(ch.end - ch.start)
        return rank, local

    def local_to_global(self, cp_rank: int) -> np.ndarray:
        """Global positions of rank ``cp_rank``'s local tokens, in local order (int64, local_len)."""
        parts = [np.arange(c.start, c.end, dtype=np.int64) for c in self.cp_chunks() if c.cp_rank == cp_rank]
        return np.concatenate(parts)


@dataclass(frozen=True)
class HeadLayout:
    """Query/KV head bookkeeping for H head shards and M pipeliner chunks (§4.3.1, §4.4).

    Head shard h covers query heads [h*hq/H, (h+1)*hq/H). Chunk m of shard h covers its m-th piece of
    ``q_piece = hq/(H*M)`` query heads. Query head i reads kv head floor(i*hkv/hq). The kv heads a piece
    reads form one aligned run of ``kv_piece`` heads: ``q_piece/group`` when the GQA group divides the
    piece, else 1 (the piece lies inside one kv head, which several pieces then share).

    KV classes. A shard covers whole kv heads (H | hkv: hkv/H of them) or lies inside one (hkv | H: H/hkv
    shards share it); other splits are rejected. The G = min(H, hkv) *KV classes* are the disjoint sets of
    kv heads the shards read: class c = shard c when H <= hkv, else kv head c. K/V travel per class, once:
    a KV unit is ``local_token*G + c`` and a KV group is (document, class), whichever shards and chunks
    read it. Within a step each kv piece is fetched by the first chunk that reads it (``kv_send_chunks``)
    and reused by the following ones; its dK/dV is summed until the last one (``kv_return_chunks``).
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_split: int
    num_chunks: int
    elem_bytes: int = 2

    def __post_init__(self) -> None:
        hq, hkv, H, M = self.num_q_heads, self.num_kv_heads, self.head_split, self.num_chunks
        if min(hq, hkv, H, M, self.head_dim, self.elem_bytes) < 1:
            raise PlanError(f"HeadLayout needs positive sizes, got {self}")
        if hq % hkv or hq % (H * M):
            raise PlanError(f"HeadLayout: need hkv | hq and H*M | hq, got hq={hq} hkv={hkv} H={H} M={M}")
        piece, group = hq // (H * M), hq // hkv
        if piece % group and group % piece:
            raise PlanError(f"HeadLayout: q piece {piece} must be a multiple or divisor of GQA group {group}")
        if H % hkv and hkv % H:
            raise PlanError(f"HeadLayout: head shards H={H} and kv heads hkv={hkv}: one must divide the other "
                            f"(a shard covers whole kv heads or lies inside one)")

    @property
    def q_heads_per_shard(self) -> int:
        return self.num_q_heads // self.head_split

    @property
    def q_piece(self) -> int:
        """Query heads per (shard, chunk) piece."""
        return self.num_q_heads // (self.head_split * self.num_chunks)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def kv_piece(self) -> int:
        """KV heads per (shard, chunk) piece."""
        return max(1, self.q_piece // self.group)

    @property
    def kv_pieces_per_token(self) -> int:
        return self.num_kv_heads // self.kv_piece

    @property
    def num_kv_classes(self) -> int:
        """G = min(H, hkv): KV classes (see the class docstring)."""
        return min(self.head_split, self.num_kv_heads)

    def kv_piece_index(self) -> np.ndarray:
        """int64 [H, M]: index of the kv piece (in units of ``kv_piece`` heads) read by chunk m of shard h."""
        h = np.arange(self.head_split)[:, None]
        m = np.arange(self.num_chunks)[None, :]
        first_q = h * self.q_heads_per_shard + m * self.q_piece
        return ((first_q // self.group) // self.kv_piece).astype(np.int64)

    def kv_class_of_shard(self) -> np.ndarray:
        """int64 [H]: the KV class shard h reads (h when H <= hkv, its kv head when H > hkv)."""
        return (np.arange(self.head_split) * self.num_kv_classes // self.head_split).astype(np.int64)

    def kv_piece_of_class(self) -> np.ndarray:
        """int64 [G, M]: the kv piece every shard of class c reads in chunk m."""
        first_shard = np.arange(self.num_kv_classes) * self.head_split // self.num_kv_classes
        return self.kv_piece_index()[first_shard]

    def kv_send_chunks(self) -> np.ndarray:
        """bool [M] (read-only): chunk m fetches K/V (its pieces are read by no earlier chunk); other chunks reuse
        them. The pattern is the same for every class (shards start at kv-head boundaries), and the chunks that
        read one piece are consecutive. Cached per head shape (the planner's op lists ask per rank)."""
        return _kv_send_chunks(self)

    def kv_return_chunks(self) -> np.ndarray:
        """bool [M] (read-only): chunk m is the last to read its pieces, so dK/dV summed over their chunks goes
        home then."""
        return _kv_return_chunks(self)

    def relay_inverse_deferred(self) -> np.ndarray:
        """bool [M] (read-only): chunk m returns dK/dV and a kernel follows the next chunk's (m + 2 < M), so a relaying
        plan's relay inverse of chunk m is waited after chunk m+1's kernel (``runtime.libra_attn._bwd``; the schedule
        and ``plan.model.memory.deferred_relay_bytes`` read the same rule)."""
        return _relay_inverse_deferred(self)

    # -------- byte volumes per token (one layer, forward), used by Eq. 8 and the exchange plan
    def q_bytes_per_token(self) -> int:
        """V_Q per tile token: hq/H heads * d * elem."""
        return self.q_heads_per_shard * self.head_dim * self.elem_bytes

    def o_bytes_per_token(self) -> int:
        """V_O per tile token (same shape as Q)."""
        return self.q_bytes_per_token()

    def kv_bytes_per_token(self) -> int:
        """V_g per group token: K and V of the hkv/G kv heads of one class, sent once per step whichever
        shards and chunks read them."""
        return 2 * (self.num_kv_heads // self.num_kv_classes) * self.head_dim * self.elem_bytes


@functools.lru_cache(maxsize=256)
def _kv_send_chunks(heads: HeadLayout) -> np.ndarray:
    pieces = heads.kv_piece_of_class()
    sends = np.ones(heads.num_chunks, dtype=bool)
    sends[1:] = pieces[0, 1:] != pieces[0, :-1]
    assert (np.diff(pieces, axis=1) >= 0).all() and ((pieces[:, 1:] != pieces[:, :-1]) == sends[1:]).all()
    sends.setflags(write=False)
    return sends


@functools.lru_cache(maxsize=256)
def _kv_return_chunks(heads: HeadLayout) -> np.ndarray:
    returns = np.ones(heads.num_chunks, dtype=bool)
    returns[:-1] = _kv_send_chunks(heads)[1:]
    returns.setflags(write=False)
    return returns


@functools.lru_cache(maxsize=256)
def _relay_inverse_deferred(heads: HeadLayout) -> np.ndarray:
    deferred = _kv_return_chunks(heads) & (np.arange(heads.num_chunks) + 2 < heads.num_chunks)
    deferred.setflags(write=False)
    return deferred
