"""SH-Tiles and KV groups of one sequence pool (§4.3.1, Eq. 5-7), uniform or adaptive.

A pool holds P packed sequences of L tokens each, every one split over CP ranks by a ``TokenLayout``.
Each sequence is cut at global positions into blocks of at most B tokens. A block is *also* cut where
the holder of its tokens changes (a CP chunk boundary), so every block -- and every tile -- has exactly
one Q-home. When L/num_cp_chunks is a multiple of B (the recommended setting) this adds no cut.

Tilings (``TilingPolicy``):
    uniform   the paper's blocks.
    adaptive  the uniform blocks, then every block whose tile load (Eq. 6) exceeds ``tile_fraction`` of
              Algorithm 2's C = (1+tau) * mean worker load is halved, repeatedly, while its halves keep
              at least ``min_block_size`` tokens (default B/8: at most three halvings). C is the same for
              every cutting (Eq. 6 totals do not depend on where a document is cut), so it is known first.
              Only blocks of long documents (late positions) are heavy enough to split.

Tile id ``t = block*H + h`` pairs block ``t // H`` with head shard ``h = t % H``.
KV group id ``g = doc*G + c`` is the K/V of document ``doc`` on KV class ``c`` (``HeadLayout``: the kv heads
shard h reads; G = min(H, hkv), c = h when H <= hkv, so shards inside one kv head share it). A tile references,
per document fragment, the rows ``[0, frag_kv_end)`` of that group (Eq. 7 with a prefix): the whole
document for ``KvFetch.GROUP`` (the paper), only the causal prefix up to the fragment's last query row
for ``KvFetch.PREFIX``. Documents are numbered pool-wide in (sequence, position) order.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from ...config import KvFetch, TilingPolicy
from ..errors import PlanError
from ..layout import HeadLayout, TokenLayout
from ..model import causal_pairs

__all__ = ["TileSet", "build_tiles", "ADAPTIVE_TILE_FRACTION", "ADAPTIVE_MAX_HALVINGS"]

ADAPTIVE_TILE_FRACTION = 0.5  # adaptive tiling: no tile above this fraction of C, where blocks allow
ADAPTIVE_MAX_HALVINGS = 3  # default floor of adaptive blocks: B / 2**3 tokens


@dataclass(frozen=True, eq=False)
class TileSet:
    """All SH-Tiles of one pool as a struct of int64 arrays. Built once by ``build_tiles``.

    docs     (n_docs):     doc_seq, doc_start (global pos in its sequence), doc_len
    doc homes (CSR by doc): doc_home_ptr (n_docs+1), doc_home_worker, doc_home_count, doc_home_offset
             -- runs of the doc's tokens held by one worker: doc-local rows [offset, offset+count)
                (a worker may hold two runs of one doc under the zigzag layout).
    blocks   (n_blocks):   block_seq, block_start, block_end (global pos), block_home (worker),
                           block_local_start (offset of block_start in the home's local buffer),
                           block_pairs (causal pairs for one head, Eq. 6)
    fragments (CSR by block): frag_ptr (n_blocks+1), frag_doc, frag_q_start, frag_q_end, frag_kv_end
             -- doc-local query rows [a, e) of each doc the block intersects, in position order, and the
                end of the key rows [0, frag_kv_end) the fragment needs fetched (e, or doc_len for GROUP).
    """

    pool_size: int
    layout: TokenLayout
    heads: HeadLayout
    block_size: int
    tiling: TilingPolicy
    kv_fetch: KvFetch
    doc_seq: np.ndarray
    doc_start: np.ndarray
    doc_len: np.ndarray
    doc_home_ptr: np.ndarray
    doc_home_worker: np.ndarray
    doc_home_count: np.ndarray
    doc_home_offset: np.ndarray
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
    frag_kv_end: np.ndarray

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

    # ----------------------------------------------------------------- per-tile views
    def tile_block(self) -> np.ndarray:
        return np.arange(self.num_tiles, dtype=np.int64) // self.head_split

    def tile_home(self) -> np.ndarray:
        return self.block_home[self.tile_block()]

    def tile_tokens(self) -> np.ndarray:
        b = self.tile_block()
        return self.block_end[b] - self.block_start[b]

    def tile_flops(self) -> np.ndarray:
        """Eq. 6 proxy per tile: (hq/H) * causal pairs of its block (query-key pair-heads), int64."""
        return self.block_pairs[self.tile_block()] * self.heads.q_heads_per_shard

    def tile_groups(self, tile: int) -> np.ndarray:
        """K(t) of Eq. 7: KV group ids the tile references (one per document fragment)."""
        return self.tile_kv_refs(tile)[0]

    @property
    def num_kv_classes(self) -> int:
        return self.heads.num_kv_classes

    def tile_kv_refs(self, tile: int):
        """(group ids, kv ends): the tile needs rows [0, kv_end) of each group it references."""
        b, h = divmod(int(tile), self.head_split)
        lo, hi = self.frag_ptr[b], self.frag_ptr[b + 1]
        klass = int(self.heads.kv_class_of_shard()[h])
        return self.frag_doc[lo:hi] * self.num_kv_classes + klass, self.frag_kv_end[lo:hi]

    def held_rows(self, doc: int, worker: int, end: int) -> int:
        """Rows of document ``doc`` in [0, end) that ``worker`` holds locally."""
        lo, hi = self.doc_home_ptr[doc], self.doc_home_ptr[doc + 1]
        mine = self.doc_home_worker[lo:hi] == worker
        offset, count = self.doc_home_offset[lo:hi][mine], self.doc_home_count[lo:hi][mine]
        return int(np.clip(int(end) - offset, 0, count).sum())

    def group_remote_bytes(self, group: int, worker: int, kv_end: Optional[int] = None) -> int:
        """V_g seen from ``worker``: bytes of group g's rows [0, kv_end) (default: all) it does not hold."""
        doc = int(group) // self.num_kv_classes
        end = int(self.doc_len[doc]) if kv_end is None else int(kv_end)
        return (end - self.held_rows(doc, worker, end)) * self.heads.kv_bytes_per_token()

    def with_kv_fetch(self, kv_fetch) -> "TileSet":
        """The same tiles referencing KV the ``kv_fetch`` way (e.g. place by one, execute by the other)."""
        kv_fetch = KvFetch(kv_fetch)
        return replace(self, kv_fetch=kv_fetch,
                       frag_kv_end=_kv_ends(kv_fetch, self.frag_q_end, self.doc_len[self.frag_doc]))


def _kv_ends(kv_fetch: KvFetch, q_end: np.ndarray, doc_len: np.ndarray) -> np.ndarray:
    out = np.array(q_end if kv_fetch is KvFetch.PREFIX else doc_len, dtype=np.int64)
    out.setflags(write=False)
    return out


def _fragments(cuts_a: np.ndarray, cuts_b: np.ndarray):
    """Elementary intervals of two partitions of [0, L): (start, end, index in a, index in b)."""
    cuts = np.union1d(cuts_a, cuts_b)
    start, end = cuts[:-1], cuts[1:]
    ia = np.searchsorted(cuts_a, start, side="right") - 1
    ib = np.searchsorted(cuts_b, start, side="right") - 1
    return start, end, ia, ib


def _check_segments(seq_segments: Sequence[Sequence[int]], layout: TokenLayout):
    out = []
    for p, seg in enumerate(seq_segments):
        seg = np.asarray(seg, dtype=np.int64).reshape(-1)
        if seg.size == 0 or (seg <= 0).any():
            raise PlanError(f"sequence {p}: segment lengths must be positive, got {seg.tolist()[:8]}...")
        if int(seg.sum()) != layout.seq_len:
            raise PlanError(f"sequence {p}: segment lengths sum to {int(seg.sum())}, expected {layout.seq_len}")
        out.append(seg)
    if not out:
        raise PlanError("a pool needs at least one packed sequence")
    return out


# ----------------------------------------------------------------------------- block cuts
class _PairPrefix:
    """Causal pairs of one packed sequence before every position x: P(x), so pairs of [s, e) = P(e) - P(s)."""

    def __init__(self, doc_cuts: np.ndarray):
        self.cuts = doc_cuts
        lens = np.diff(doc_cuts)
        self.full = np.concatenate([[0], np.cumsum(lens * (lens + 1) // 2)]).astype(np.int64)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(self.cuts, x, side="right") - 1
        r = x - self.cuts[k]
        return self.full[k] + r * (r + 1) // 2


def _adaptive_cuts(cuts: np.ndarray, pairs_before: _PairPrefix, max_pairs: float, min_block: int) -> np.ndarray:
    """Halve every block of ``cuts`` with more than ``max_pairs`` causal pairs while halves keep
    >= ``min_block`` tokens; repeat on the halves."""
    while True:
        start, end = cuts[:-1], cuts[1:]
        heavy = (pairs_before(end) - pairs_before(start) > max_pairs) & (end - start >= 2 * min_block)
        if not heavy.any():
            return cuts
        cuts = np.union1d(cuts, start[heavy] + (end[heavy] - start[heavy]) // 2)


def _max_block_pairs(segs, heads: HeadLayout, num_workers: int, tau: float, fraction: float) -> float:
    """Pairs per head of the heaviest block that keeps a tile <= fraction * C, C = (1+tau) * sum(f) / W.

    f_t = pairs * hq/H and sum(f) = hq * (pairs of all docs), so the bound is fraction*(1+tau)*H*total/W.
    """
    total = sum(int((seg * (seg + 1) // 2).sum()) for seg in segs)
    return fraction * (1.0 + float(tau)) * heads.head_split * total / num_workers


def _block_cuts(doc_cuts: np.ndarray, base_cuts: np.ndarray, adaptive: Optional[tuple]) -> np.ndarray:
    if adaptive is None:
        return base_cuts
    max_pairs, min_block = adaptive
    return _adaptive_cuts(base_cuts, _PairPrefix(doc_cuts), max_pairs, min_block)


def _check_tiling(block_size: int, tiling, tau: float, min_block_size, tile_fraction: float):
    if block_size < 1:
        raise PlanError(f"block_size must be >= 1, got {block_size}")
    tiling = TilingPolicy(tiling)
    if tiling is TilingPolicy.UNIFORM:
        return tiling, None
    if not tau >= 0 or not tile_fraction > 0:
        raise PlanError(f"adaptive tiling needs tau >= 0 and tile_fraction > 0, got {tau!r}, {tile_fraction!r}")
    min_block = max(1, block_size >> ADAPTIVE_MAX_HALVINGS) if min_block_size is None else int(min_block_size)
    if min_block < 1:
        raise PlanError(f"min_block_size must be >= 1, got {min_block_size}")
    return tiling, min_block


# ----------------------------------------------------------------------------- build
def build_tiles(
    seq_segments: Sequence[Sequence[int]],
    layout: TokenLayout,
    heads: HeadLayout,
    block_size: int,
    *,
    tiling=TilingPolicy.ADAPTIVE,
    tau: float = 0.03,
    kv_fetch=KvFetch.PREFIX,
    min_block_size: Optional[int] = None,
    tile_fraction: float = ADAPTIVE_TILE_FRACTION,
) -> TileSet:
    """Cut the pool's P packed sequences into SH-Tiles (Eq. 5) and record their KV references (Eq. 7).

    ``seq_segments[p]`` are the document lengths of the p-th packed sequence (sum == layout.seq_len).
    ``tiling``: uniform B-token blocks, or adaptive (module docstring; ``tau`` is Algorithm 2's slack,
    ``min_block_size`` defaults to max(1, B // 8), ``tile_fraction`` of C is the split threshold).
    ``kv_fetch``: which rows of a referenced group a tile needs (GROUP: all, PREFIX: [0, last query + 1)).
    """
    tiling, min_block = _check_tiling(block_size, tiling, tau, min_block_size, tile_fraction)
    segs = _check_segments(seq_segments, layout)
    pool_size = len(segs)
    adaptive = None
    if min_block is not None:
        adaptive = (_max_block_pairs(segs, heads, pool_size * layout.cp, tau, tile_fraction), min_block)
    L, cp = layout.seq_len, layout.cp
    chunk_cuts = layout.boundaries()
    chunk_rank = np.array([c.cp_rank for c in layout.cp_chunks()], dtype=np.int64)
    chunk_local = np.array([c.local_start for c in layout.cp_chunks()], dtype=np.int64)
    uniform_cuts = np.union1d(np.union1d(np.arange(0, L + 1, block_size, dtype=np.int64), chunk_cuts), [L])
    acc = {k: [] for k in ("sseq", "sstart", "slen", "hptr", "hwork", "hcnt", "hoff", "bseq", "bstart", "bend",
                           "bhome", "bloc", "fcount", "fdoc", "fa", "fe")}
    doc_base = 0
    for p, seg in enumerate(segs):
        doc_cuts = np.concatenate([[0], np.cumsum(seg)])
        block_cuts = _block_cuts(doc_cuts, uniform_cuts, adaptive)
        acc["sseq"].append(np.full(seg.size, p, dtype=np.int64))
        acc["sstart"].append(doc_cuts[:-1])
        acc["slen"].append(seg)
        # doc homes: runs of a doc held by one CP rank
        hs, he, hi_s, hi_c = _fragments(doc_cuts, chunk_cuts)
        acc["hptr"].append(np.bincount(hi_s, minlength=seg.size))
        acc["hwork"].append(p * cp + chunk_rank[hi_c])
        acc["hcnt"].append(he - hs)
        acc["hoff"].append(hs - doc_cuts[hi_s])
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
    kv_fetch = KvFetch(kv_fetch)
    return TileSet(
        pool_size=pool_size, layout=layout, heads=heads, block_size=block_size, tiling=tiling, kv_fetch=kv_fetch,
        doc_seq=cat["sseq"], doc_start=cat["sstart"], doc_len=cat["slen"],
        doc_home_ptr=home_ptr, doc_home_worker=cat["hwork"], doc_home_count=cat["hcnt"], doc_home_offset=cat["hoff"],
        block_seq=cat["bseq"], block_start=cat["bstart"], block_end=cat["bend"],
        block_home=cat["bhome"], block_local_start=cat["bloc"], block_pairs=pairs.astype(np.int64),
        frag_ptr=frag_ptr, frag_doc=cat["fdoc"], frag_q_start=cat["fa"], frag_q_end=cat["fe"],
        frag_kv_end=_kv_ends(kv_fetch, cat["fe"], cat["slen"][cat["fdoc"]]),
    )
