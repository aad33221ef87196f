"""plan.rank_tables: the runtime's int32 row tables equal the plain row formulas of plan.exchange."""
import numpy as np
import pytest

from libra_megatron.plan.exchange import build_exchange_plan, kv_rows, q_rows
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.rank_tables import build_rank_tables, rank_tables
from libra_megatron.plan.tiles import build_tiles

# (hq, hkv, H, M): affine kv rows (shared and disjoint kv pieces), H not a power of two, H > hkv
HEADS = [(8, 8, 2, 2), (8, 2, 1, 4), (8, 1, 4, 2), (8, 2, 4, 1), (16, 2, 2, 1), (4, 4, 4, 1), (8, 8, 1, 4),
         (16, 4, 2, 2), (12, 12, 3, 2), (18, 6, 3, 2), (12, 2, 3, 2), (128, 4, 4, 4), (32, 8, 4, 4)]


@pytest.mark.parametrize("hq, hkv, H, M", HEADS)
def test_tables_equal_row_formulas_for_every_rank(hq, hkv, H, M):
    rng = np.random.default_rng(hq * 100 + hkv * 10 + H + M)
    heads = HeadLayout(hq, hkv, 4, H, M)
    layout = TokenLayout("zigzag", 48, 2)
    tiles = build_tiles([[20, 28], [3, 45]], layout, heads, 5)
    plan = build_exchange_plan(tiles, rng.integers(0, tiles.num_workers, tiles.num_tiles))
    for w in range(tiles.num_workers):
        rp, t = plan.for_rank(w), build_rank_tables(plan.for_rank(w))
        for m in range(M):
            np.testing.assert_array_equal(t.kv_send[m], kv_rows(rp.kv_route.send_index, heads, m))
            np.testing.assert_array_equal(t.q_send[m], q_rows(rp.q_route.send_index, heads, m))
        np.testing.assert_array_equal(t.kv_arranged, rp.kv_route.recv_index)
        expected = [np.arange(o, o + n) for o, n in zip(rp.seq_kv_offset, rp.seq_k_len)]
        np.testing.assert_array_equal(t.k_gather, np.concatenate(expected) if expected else np.zeros(0))
        np.testing.assert_array_equal(t.cu_k, np.concatenate([[0], np.cumsum(rp.seq_k_len)]))
        arrays = [*t.q_send, *t.kv_send, t.q_arranged, t.kv_arranged, t.k_gather, t.cu_q, t.cu_k]
        assert all(a.dtype == np.int32 and not a.flags.writeable for a in arrays)
        assert t.kv_splits.send == tuple(rp.kv_route.send_splits) and t.q_back_splits.send == tuple(rp.q_route.recv_splits)


def test_chunks_reading_the_same_kv_pieces_share_one_array_and_tables_are_cached_per_plan():
    heads = HeadLayout(32, 8, 4, 4, 4)  # chunks (0, 1) and (2, 3) read the same kv heads
    tiles = build_tiles([[30, 18], [48]], TokenLayout("zigzag", 48, 2), heads, 6)
    rp = build_exchange_plan(tiles, tiles.tile_home()).for_rank(1)
    t = rank_tables(rp)
    assert t.kv_send[0] is t.kv_send[1] and t.kv_send[2] is t.kv_send[3] and t.kv_send[0] is not t.kv_send[2]
    assert rank_tables(rp) is t
