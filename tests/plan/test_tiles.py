"""SH-Tiles (§4.3.1, Eq. 5-7) from build_tiles, checked against dense brute force per token."""
import numpy as np
from hypothesis import given, settings, strategies as st

from libra_megatron.config import TokenLayoutKind
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.tiles import build_tiles


@st.composite
def pools(draw):
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
    block = draw(st.integers(1, seq_len + 2))
    return build_tiles(segs, TokenLayout(kind, seq_len, cp), heads, block), segs


def dense_doc_ids(seg):
    return np.repeat(np.arange(len(seg)), seg)


@settings(max_examples=80, deadline=None)
@given(pools())
def test_eq6_tile_flops_equal_pair_count_of_dense_causal_block_diagonal_mask(case):
    tiles, segs = case
    L, H, hq = tiles.layout.seq_len, tiles.head_split, tiles.heads.num_q_heads
    masks = []
    for seg in segs:
        sid = dense_doc_ids(seg)
        masks.append((sid[:, None] == sid[None, :]) & np.tri(L, dtype=bool))
    expected = []
    for b in range(tiles.num_blocks):
        rows = masks[tiles.block_seq[b]][tiles.block_start[b] : tiles.block_end[b]]
        expected += [int(rows.sum()) * hq // H] * H
    np.testing.assert_array_equal(tiles.tile_flops(), expected)
    assert tiles.tile_flops().sum() == sum(int(m.sum()) for m in masks) * hq


@settings(max_examples=80, deadline=None)
@given(pools())
def test_blocks_partition_tokens_and_never_straddle_a_q_home(case):
    tiles, segs = case
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
            assert e - a <= B and (a // B) == ((e - 1) // B)  # cut at multiples of B
            assert len(set(rank[a:e].tolist())) == 1
            assert tiles.block_home[b] == p * layout.cp + rank[a]
            np.testing.assert_array_equal(local[a:e], tiles.block_local_start[b] + np.arange(e - a))


@settings(max_examples=80, deadline=None)
@given(pools())
def test_fragments_groups_and_remote_bytes_match_samples(case):
    tiles, segs = case
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
        for h in range(H):
            assert tiles.tile_groups(b * H + h).tolist() == [(base[p] + j) * H + h for j in want]
    kvb = tiles.heads.kv_bytes_per_token()
    for s in range(tiles.num_docs):
        p = tiles.doc_seq[s]
        a = tiles.doc_start[s]
        holders = rank[a : a + tiles.doc_len[s]] + p * layout.cp
        for r in range(W):
            for h in range(H):
                expected = int((holders != r).sum()) * kvb
                assert tiles.group_remote_bytes(s * H + h, r) == expected


def test_sequence_flops_of_tiles_is_eq2():
    layout = TokenLayout(TokenLayoutKind.ZIGZAG, 16, 2)
    tiles = build_tiles([[10, 6], [16]], layout, HeadLayout(4, 2, 8, 2, 1), 4)
    np.testing.assert_array_equal(tiles.sequence_flops(), [136.0, 256.0])
