"""SH-Tiles and KV groups of one sequence pool (§4.3.1, Eq. 5-7).

A pool holds P packed sequences of L tokens each, every one split over CP ranks by a ``TokenLayout``.
Each sequence is cut at global positions into blocks of at most B tokens. A block is *also* cut where
the holder of its tokens changes (a CP chunk boundary), so every block -- and every tile -- has exactly
one Q-home. When L/num_chunks is a multiple of B (the recommended setting) this adds no cut.

Tile id ``t = block*H + h`` pairs block ``t // H`` with head shard ``h = t % H``.
KV group id ``g = doc*H + h`` is the complete K/V of document ``doc`` on head shard ``h``.
Documents are numbered pool-wide in (sequence, position) order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import PlanError
from .layout import HeadLayout, TokenLayout

__all__ = ["TileSet", "build_tiles", "causal_pairs"]


def causal_pairs(a: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Eq. 6 inner sum: sum_{q=a}^{e-1} (q+1) causal query-key pairs for doc-local rows [a, e)."""
    a = np.asarray(a, dtype=np.int64)
    e = np.asarray(e, dtype=np.int64)
    return e * (e + 1) // 2 - a * (a + 1) // 2


@dataclass(frozen=True, eq=False)
class TileSet:
    """All SH-Tiles of one pool as a struct of int64 arrays. Built once by ``build_tiles``.

    docs  (n_docs):  doc_seq, doc_start (global pos in its sequence), doc_len
    doc_homes (CSR by doc): doc_home_ptr (n_docs+1), doc_home_worker, doc_home_count
             -- the workers holding the doc's tokens and how many each holds.
    blocks   (n_blocks):   block_seq, block_start, block_end (global pos), block_home (worker),
                           block_local_start (offset of block_start in the home's local buffer),
                           block_pairs (causal pairs for one head, Eq. 6)
    fragments (CSR by block): frag_ptr (n_blocks+1), frag_doc, frag_q_start, frag_q_end
             -- doc-local query rows [a, e) of each doc the block intersects, in position order.
    """

    pool_size: int
    layout: TokenLayout
    heads: HeadLayout
    block_size: int
    doc_seq: np.ndarray
    doc_start: np.ndarray
    doc_len: np.ndarray
    doc_home_ptr: np.ndarray
    doc_home_worker: np.ndarray
    doc_home_count: np.ndarray
    block_seq: np.ndarray
    block_start: np.ndarray
    block_end: np.ndarray
    block_home: np.ndarray
    block_local_start: np.ndarray
    block_pairs: np.ndarray
    frag_ptr: np.ndarray
    frag_doc: np.ndarray
    frag_q_start: np.ndarray
    frag_q_end: np.ndarray

    # ----------------------------------------------------------------- sizes
    @property
    def num_workers(self) -> int:
        return self.pool_size * self.layout.cp

    @property
    def head_split(self) -> int:
        return self.heads.head_split

    @property
    def num_docs(self) -> int:
        return int(self.doc_len.shape[0])

    @property
    def num_blocks(self) -> int:
        return int(self.block_start.shape[0])

    @property
    def num_tiles(self) -> int:
        return self.num_blocks * self.head_split

    @property
    def num_groups(self) -> int:
        return self.num_docs * self.head_split

    # ----------------------------------------------------------------- per-tile views
    def tile_block(self) -> np.ndarray:
        return np.arange(self.num_tiles, dtype=np.int64) // self.head_split

    def tile_head(self) -> np.ndarray:
        return np.arange(self.num_tiles, dtype=np.int64) % self.head_split

    def tile_home(self) -> np.ndarray:
        return self.block_home[self.tile_block()]

    def tile_tokens(self) -> np.ndarray:
        b = self.tile_block()
        return self.block_end[b] - self.block_start[b]

    def tile_flops(self) -> np.ndarray:
        """Eq. 6 proxy per tile: (hq/H) * causal pairs of its block (query-key pair-heads), int64."""
        return self.block_pairs[self.tile_block()] * self.heads.q_heads_per_shard

    def tile_groups(self, tile: int) -> np.ndarray:
        """K(t) of Eq. 7: KV group ids the tile references."""
        b, h = divmod(int(tile), self.head_split)
        docs = self.frag_doc[self.frag_ptr[b] : self.frag_ptr[b + 1]]
        return docs * self.head_split + h

    def group_remote_bytes(self, group: int, worker: int) -> int:
        """V_g seen from ``worker``: bytes of group g's K/V fragments that ``worker`` does not hold."""
        s = int(group) // self.head_split
        lo, hi = self.doc_home_ptr[s], self.doc_home_ptr[s + 1]
        held = self.doc_home_count[lo:hi][self.doc_home_worker[lo:hi] == worker].sum()
        return int(self.doc_len[s] - held) * self.heads.kv_bytes_per_token()

    def sequence_flops(self) -> np.ndarray:
        """Eq. 2 per packed sequence in this pool: sum_j l_j^2 (float64, P)."""
        sq = self.doc_len.astype(np.float64) ** 2
        return np.bincount(self.doc_seq, weights=sq, minlength=self.pool_size)


def _fragments(cuts_a: np.ndarray, cuts_b: np.ndarray):
    """Elementary intervals of two partitions of [0, L): (start, end, index in a, index in b)."""
    cuts = np.union1d(cuts_a, cuts_b)
    start, end = cuts[:-1], cuts[1:]
    ia = np.searchsorted(cuts_a, start, side="right") - 1
    ib = np.searchsorted(cuts_b, start, side="right") - 1
    return start, end, ia, ib


def _check_segments(seq_segments: Sequence[Sequence[int]], layout: TokenLayout, pool_size: int):
    if len(seq_segments) != pool_size:
        raise PlanError(f"expected {pool_size} packed sequences for the pool, got {len(seq_segments)}")
    out = []
    for p, seg in enumerate(seq_segments):
        seg = np.asarray(seg, dtype=np.int64).reshape(-1)
        if seg.size == 0 or (seg <= 0).any():
            raise PlanError(f"sequence {p}: segment lengths must be positive, got {seg.tolist()[:8]}...")
        if int(seg.sum()) != layout.seq_len:
            raise PlanError(f"sequence {p}: segment lengths sum to {int(seg.sum())}, expected {layout.seq_len}")
        out.append(seg)
    return out


def build_tiles(
    seq_segments: Sequence[Sequence[int]],
    layout: TokenLayout,
    heads: HeadLayout,
    block_size: int,
) -> TileSet:
    """Cut the pool's P packed sequences into SH-Tiles (Eq. 5) and record their KV groups (Eq. 7).

    ``seq_segments[p]`` are the document lengths of the p-th packed sequence (sum == layout.seq_len).
    """
    if block_size < 1:
        raise PlanError(f"block_size must be >= 1, got {block_size}")
    segs = _check_segments(seq_segments, layout, len(seq_segments))
    pool_size = len(segs)
    L, cp = layout.seq_len, layout.cp
    chunk_cuts = layout.boundaries()
    chunk_rank = np.array([c.cp_rank for c in layout.cp_chunks()], dtype=np.int64)
    chunk_local = np.array([c.local_start for c in layout.cp_chunks()], dtype=np.int64)
    block_cuts = np.union1d(np.arange(0, L + 1, block_size, dtype=np.int64), chunk_cuts)
    block_cuts = np.union1d(block_cuts, [L])
    acc = {k: [] for k in ("sseq", "sstart", "slen", "hptr", "hwork", "hcnt", "bseq", "bstart", "bend",
                           "bhome", "bloc", "fcount", "fdoc", "fa", "fe")}
    doc_base = 0
    for p, seg in enumerate(segs):
        doc_cuts = np.concatenate([[0], np.cumsum(seg)])
        acc["sseq"].append(np.full(seg.size, p, dtype=np.int64))
        acc["sstart"].append(doc_cuts[:-1])
        acc["slen"].append(seg)
        # doc homes
        hs, he, hi_s, hi_c = _fragments(doc_cuts, chunk_cuts)
        acc["hptr"].append(np.bincount(hi_s, minlength=seg.size))
        acc["hwork"].append(p * cp + chunk_rank[hi_c])
        acc["hcnt"].append(he - hs)
        # blocks
        bstart, bend = block_cuts[:-1], block_cuts[1:]
        bchunk = np.searchsorted(chunk_cuts, bstart, side="right") - 1
        acc["bseq"].append(np.full(bstart.size, p, dtype=np.int64))
        acc["bstart"].append(bstart)
        acc["bend"].append(bend)
        acc["bhome"].append(p * cp + chunk_rank[bchunk])
        acc["bloc"].append(chunk_local[bchunk] + bstart - chunk_cuts[bchunk])
        # fragments: (block, doc) intersections, in position order
        fs, fe, fb, fdoc = _fragments(block_cuts, doc_cuts)
        acc["fcount"].append(np.bincount(fb, minlength=bstart.size))
        acc["fdoc"].append(fdoc + doc_base)
        acc["fa"].append(fs - doc_cuts[fdoc])
        acc["fe"].append(fe - doc_cuts[fdoc])
        doc_base += seg.size
    cat = {k: np.concatenate(v).astype(np.int64) for k, v in acc.items()}
    frag_ptr = np.concatenate([[0], np.cumsum(cat["fcount"])]).astype(np.int64)
    home_ptr = np.concatenate([[0], np.cumsum(cat["hptr"])]).astype(np.int64)
    pairs = np.add.reduceat(causal_pairs(cat["fa"], cat["fe"]), frag_ptr[:-1]) if frag_ptr[-1] else np.zeros(0, np.int64)
    return TileSet(
        pool_size=pool_size, layout=layout, heads=heads, block_size=block_size,
        doc_seq=cat["sseq"], doc_start=cat["sstart"], doc_len=cat["slen"],
        doc_home_ptr=home_ptr, doc_home_worker=cat["hwork"], doc_home_count=cat["hcnt"],
        block_seq=cat["bseq"], block_start=cat["bstart"], block_end=cat["bend"],
        block_home=cat["bhome"], block_local_start=cat["bloc"], block_pairs=pairs.astype(np.int64),
        frag_ptr=frag_ptr, frag_doc=cat["fdoc"], frag_q_start=cat["fa"], frag_q_end=cat["fe"],
    )
