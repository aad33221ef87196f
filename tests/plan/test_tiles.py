"""SH-Tiles (§4.3.1, Eq. 5-7) from build_tiles, uniform and adaptive, checked against dense brute force per token."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from libra_megatron.config import KvFetch, TilingPolicy, TokenLayoutKind
from libra_megatron.plan.errors import PlanError
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.tiles import build_tiles


@st.composite
def pools(draw):
    """(tiles, segments, build options) of a random small pool, uniform or adaptive, group or prefix fetch."""
    kind = draw(st.sampled_from([TokenLayoutKind.ZIGZAG, TokenLayoutKind.CONTIGUOUS]))
    cp = draw(st.sampled_from([1, 2, 3, 4]))
    chunks = 2 * cp if kind is TokenLayoutKind.ZIGZAG and cp > 1 else cp
    seq_len = chunks * draw(st.integers(1, 12))
    pool = draw(st.integers(1, 3))
    segs = []
    for _ in range(pool):
        cuts = draw(st.sets(st.integers(1, seq_len - 1), max_size=8)) if seq_len > 1 else set()
        segs.append(np.diff([0, *sorted(cuts), seq_len]))
    H = draw(st.sampled_from([1, 2, 4]))
    hq, hkv = draw(st.sampled_from([(32, 8), (32, 4), (64, 4), (128, 16), (8, 8)]))
    heads = HeadLayout(hq, hkv, 16, H, 1, elem_bytes=2)
    opts = dict(tiling=draw(st.sampled_from(list(TilingPolicy))), kv_fetch=draw(st.sampled_from(list(KvFetch))),
                tau=draw(st.sampled_from([0.0, 0.03, 0.5])), min_block_size=draw(st.sampled_from([1, 2, 3, None])))
    block = draw(st.integers(1, seq_len + 2))
    return build_tiles(segs, TokenLayout(kind, seq_len, cp), heads, block, **opts), segs, opts


def dense_doc_ids(seg):
    return np.repeat(np.arange(len(seg)), seg)


def dense_masks(segs, L):
    return [(dense_doc_ids(s)[:, None] == dense_doc_ids(s)[None, :]) & np.tri(L, dtype=bool) for s in segs]


@settings(max_examples=80, deadline=None)
@given(pools())
def test_eq6_tile_flops_equal_pair_count_of_dense_causal_block_diagonal_mask(case):
    tiles, segs, _ = case
    L, H, hq = tiles.layout.seq_len, tiles.head_split, tiles.heads.num_q_heads
    masks = dense_masks(segs, L)
    expected = []
    for b in range(tiles.num_blocks):
        rows = masks[tiles.block_seq[b]][tiles.block_start[b] : tiles.block_end[b]]
        expected += [int(rows.sum()) * hq // H] * H
    np.testing.assert_array_equal(tiles.tile_flops(), expected)
    assert tiles.tile_flops().sum() == sum(int(m.sum()) for m in masks) * hq


@settings(max_examples=80, deadline=None)
@given(pools())
def test_eq6_cost_of_every_document_is_the_same_whichever_way_it_is_cut(case):
    tiles, segs, opts = case
    other = build_tiles(segs, tiles.layout, tiles.heads, tiles.block_size,
                        tiling="uniform" if opts["tiling"] is TilingPolicy.ADAPTIVE else "adaptive")
    for t in (tiles, other):
        per_doc = np.zeros(t.num_docs, dtype=np.int64)
        np.add.at(per_doc, t.frag_doc, (t.frag_q_end * (t.frag_q_end + 1) - t.frag_q_start * (t.frag_q_start + 1)) // 2)
        np.testing.assert_array_equal(per_doc, t.doc_len * (t.doc_len + 1) // 2)
    assert tiles.tile_flops().sum() == other.tile_flops().sum()


@settings(max_examples=80, deadline=None)
@given(pools())
def test_blocks_partition_tokens_and_never_straddle_a_q_home(case):
    tiles, segs, _ = case
    layout, B = tiles.layout, tiles.block_size
    rank, local = layout.global_to_local()
    for p in range(len(segs)):
        mine = np.flatnonzero(tiles.block_seq == p)
        starts, ends = tiles.block_start[mine], tiles.block_end[mine]
        covered = np.zeros(layout.seq_len, dtype=int)
        for a, e in zip(starts, ends):
            covered[a:e] += 1
        assert (covered == 1).all()
        for b, a, e in zip(mine, starts, ends):
            assert e - a <= B and (a // B) == ((e - 1) // B)  # inside one B-aligned block (adaptive: a part of it)
            assert len(set(rank[a:e].tolist())) == 1
            assert tiles.block_home[b] == p * layout.cp + rank[a]
            np.testing.assert_array_equal(local[a:e], tiles.block_local_start[b] + np.arange(e - a))


def _reference_adaptive_blocks(mask, uniform_blocks, max_pairs, min_block):
    """Recursive halving of each uniform block, pairs counted on the dense causal block-diagonal mask."""
    def cut(a, e):
        if mask[a:e].sum() > max_pairs and e - a >= 2 * min_block:
            m = a + (e - a) // 2
            return cut(a, m) + cut(m, e)
        return [(a, e)]
    return [blk for a, e in uniform_blocks for blk in cut(a, e)]


@settings(max_examples=80, deadline=None)
@given(pools())
def test_adaptive_blocks_are_uniform_blocks_halved_while_a_tile_exceeds_half_of_c(case):
    tiles, segs, opts = case
    uniform = build_tiles(segs, tiles.layout, tiles.heads, tiles.block_size, tiling="uniform")
    if opts["tiling"] is TilingPolicy.UNIFORM:
        assert (tiles.block_start.tolist(), tiles.block_end.tolist()) == (uniform.block_start.tolist(),
                                                                           uniform.block_end.tolist())
        return
    masks = dense_masks(segs, tiles.layout.seq_len)
    H = tiles.head_split
    # C/2 in pairs per head: a tile has f = pairs * hq/H and C = (1 + tau) * hq * (all pairs) / W
    max_pairs = 0.5 * (1 + opts["tau"]) * H * sum(int(m.sum()) for m in masks) / tiles.num_workers
    min_block = opts["min_block_size"] or max(1, tiles.block_size // 8)
    for p, mask in enumerate(masks):
        ub = [(int(a), int(e)) for a, e, q in zip(uniform.block_start, uniform.block_end, uniform.block_seq) if q == p]
        got = [(int(a), int(e)) for a, e, q in zip(tiles.block_start, tiles.block_end, tiles.block_seq) if q == p]
        assert got == _reference_adaptive_blocks(mask, ub, max_pairs, min_block)


def test_adaptive_hand_case_one_document_over_two_workers():
    # P=1, CP=2 contiguous, L=16, one document, B=8, tau=0: pairs 136, C = 68, C/2 = 34 pairs.
    # [0,8) = 36 > 34 -> [0,4) 10, [4,8) 26. [8,16) = 100 -> [8,12) 42 -> [8,10) 19, [10,12) 23;
    # [12,16) 58 -> [12,14) 27, [14,16) 31. Floor B/8 = 1 token never binds.
    tiles = build_tiles([[16]], TokenLayout("contiguous", 16, 2), HeadLayout(1, 1, 1, 1, 1), 8, tau=0.0)
    assert list(zip(tiles.block_start.tolist(), tiles.block_end.tolist())) == [(0, 4), (4, 8), (8, 10), (10, 12),
                                                                              (12, 14), (14, 16)]
    assert tiles.tile_flops().tolist() == [10, 26, 19, 23, 27, 31]
    assert tiles.block_home.tolist() == [0, 0, 1, 1, 1, 1]
    # with a floor of 4 tokens [8,12) and [12,16) stay whole although they exceed C/2
    floor = build_tiles([[16]], TokenLayout("contiguous", 16, 2), HeadLayout(1, 1, 1, 1, 1), 8, tau=0.0,
                        min_block_size=4)
    assert floor.tile_flops().tolist() == [10, 26, 42, 58]


def test_prefix_fetch_hand_case_kv_ends_are_the_last_query_rows():
    # docs [3, 5] in one sequence, B=4: blocks [0,4) (doc0 rows 0-2, doc1 row 0), [4,8) (doc1 rows 1-4)
    args = ([[3, 5]], TokenLayout("contiguous", 8, 1), HeadLayout(2, 1, 4, 1, 1), 4)
    prefix = build_tiles(*args, tiling="uniform", kv_fetch="prefix")
    group = build_tiles(*args, tiling="uniform", kv_fetch="group")
    assert prefix.frag_kv_end.tolist() == [3, 1, 5] and group.frag_kv_end.tolist() == [3, 5, 5]
    assert prefix.with_kv_fetch("group").frag_kv_end.tolist() == group.frag_kv_end.tolist()
    assert [e.tolist() for e in prefix.tile_kv_refs(0)] == [[0, 1], [3, 1]]


def test_tiling_arguments_are_checked():
    args = ([[8]], TokenLayout("contiguous", 8, 1), HeadLayout(1, 1, 1, 1, 1), 4)
    with pytest.raises(PlanError, match="min_block_size"):
        build_tiles(*args, min_block_size=0)
    with pytest.raises(ValueError, match="TilingPolicy"):
        build_tiles(*args, tiling="dyadic")


@settings(max_examples=80, deadline=None)
@given(pools())
def test_fragments_kv_prefixes_and_remote_bytes_match_documents(case):
    tiles, segs, _ = case
    layout, H, W = tiles.layout, tiles.head_split, tiles.num_workers
    rank, _ = layout.global_to_local()
    base = np.concatenate([[0], np.cumsum([len(s) for s in segs])])
    for b in range(tiles.num_blocks):
        p, a, e = tiles.block_seq[b], tiles.block_start[b], tiles.block_end[b]
        sid = dense_doc_ids(segs[p])
        starts = np.concatenate([[0], np.cumsum(segs[p])])
        lo, hi = tiles.frag_ptr[b], tiles.frag_ptr[b + 1]
        want = sorted(set(sid[a:e].tolist()))
        assert (tiles.frag_doc[lo:hi] - base[p]).tolist() == want
        for f, j in zip(range(lo, hi), want):
            assert tiles.frag_q_start[f] == max(a, starts[j]) - starts[j]
            assert tiles.frag_q_end[f] == min(e, starts[j + 1]) - starts[j]
            end = min(e, starts[j + 1]) if tiles.kv_fetch is KvFetch.PREFIX else starts[j + 1]
            assert tiles.frag_kv_end[f] == end - starts[j]  # the causal prefix, or the whole document
        hq, hkv, G = tiles.heads.num_q_heads, tiles.heads.num_kv_heads, min(H, tiles.heads.num_kv_heads)
        for h in range(H):
            groups, ends = tiles.tile_kv_refs(b * H + h)
            klass = h if H <= hkv else h * (hq // H) // (hq // hkv)  # its kv heads, or the kv head it lies in
            assert groups.tolist() == [(base[p] + j) * G + klass for j in want]
            assert ends.tolist() == tiles.frag_kv_end[lo:hi].tolist()
    kvb = tiles.heads.kv_bytes_per_token()
    for s in range(tiles.num_docs):
        p = tiles.doc_seq[s]
        a = tiles.doc_start[s]
        holders = rank[a : a + tiles.doc_len[s]] + p * layout.cp
        G = tiles.num_kv_classes
        for r in range(W):
            for end in {1, int(tiles.doc_len[s]) // 2 + 1, int(tiles.doc_len[s])}:
                assert tiles.group_remote_bytes(s * G, r, end) == int((holders[:end] != r).sum()) * kvb
            assert tiles.group_remote_bytes(s * G, r) == int((holders != r).sum()) * kvb
