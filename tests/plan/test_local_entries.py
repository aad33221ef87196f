"""plan.exchange.local_entries: which varlen entries read only self-sourced rows (the local-first split, issue 14)."""
import numpy as np
from hypothesis import given, settings

from libra_megatron.plan.exchange import build_exchange_plan
from libra_megatron.plan.exchange.local_entries import (LOCAL, SPLIT, foreign_rows_in, rank_entry_kinds,
                                                        rank_local_entries, self_tail_start)
from libra_megatron.plan.model import causal_pairs, entry_pair_heads
from libra_megatron.testing.unit_tables import entry_kinds_by_units, local_entries_by_units

from .test_exchange import SETTINGS, pools


def test_foreign_rows_in_a_hand_made_buffer():
    # rows 0-2 self, 3-4 foreign, 5 self, 6-9 foreign; runs given out of order, with an empty run
    start, count, foreign = [5, 0, 3, 6, 9], [1, 3, 2, 4, 0], [False, False, True, True, False]
    lo = np.array([0, 0, 2, 3, 5, 5, 4, 0])
    hi = np.array([3, 4, 6, 5, 6, 7, 10, 10])
    np.testing.assert_array_equal(foreign_rows_in(start, count, foreign, lo, hi), [0, 1, 2, 2, 0, 1, 5, 6])
    assert foreign_rows_in([], [], [], np.array([0]), np.array([0])).tolist() == [0]


def test_self_tail_start_in_a_hand_made_buffer():
    # rows 0-2 self, 3-4 foreign, 5 self, 6-9 foreign, 10-11 self
    start, count, foreign = [0, 3, 5, 6, 10], [3, 2, 1, 4, 2], [False, True, False, True, False]
    lo = np.array([0, 0, 0, 0, 2, 6, 10])
    hi = np.array([3, 5, 6, 12, 12, 10, 12])
    # [0,3) all self -> 0; [0,5) ends foreign -> 5 (empty tail); [0,6) -> 5; [0,12) -> 10; [6,10) all foreign -> 10
    np.testing.assert_array_equal(self_tail_start(start, count, foreign, lo, hi), [0, 5, 5, 10, 10, 10, 10])


def test_entry_pair_heads_are_bottom_right_causal_pairs():
    # 3 queries over 5 keys: the queries sit at doc rows 2, 3, 4 and see 3 + 4 + 5 keys
    assert entry_pair_heads([3], [5], 2).tolist() == [24]
    q, k = np.array([1, 4, 7, 7]), np.array([1, 9, 7, 20])
    np.testing.assert_array_equal(entry_pair_heads(q, k, 1), causal_pairs(k - q, k))


@given(pools())
@settings(**dict(SETTINGS, max_examples=60))
def test_local_entries_match_the_row_by_row_reference_and_loads_split_exactly(pool):
    """Every rank's entry kinds (local, split with its self-sourced key tail, remote) equal the row-by-row check
    on the expanded routes; the pool-wide (local, remote) loads that the simulator prices -- local entries and
    split entries' tails ahead of the dispatch -- equal the per-rank sums and add up to the Eq. 6 loads."""
    _, _, _, tiles, assign, _ = pool
    plan = build_exchange_plan(tiles, assign)
    loads = np.bincount(assign, weights=tiles.tile_flops(), minlength=tiles.num_workers)
    np.testing.assert_allclose(plan.hosted_pair_heads.sum(axis=0), loads)
    for rp in plan.ranks:
        local = rank_local_entries(rp)
        np.testing.assert_array_equal(local, local_entries_by_units(rp))
        kinds, tail = rank_entry_kinds(rp)
        want_kinds, want_tail = entry_kinds_by_units(rp)
        np.testing.assert_array_equal(kinds, want_kinds)
        split = kinds == SPLIT
        np.testing.assert_array_equal(tail[split], want_tail[split])
        np.testing.assert_array_equal(kinds == LOCAL, local)
        n, k = np.diff(rp.cu_seqlens_q), np.asarray(rp.seq_k_len)
        load = entry_pair_heads(n, k, tiles.heads.q_heads_per_shard)
        tail_len = np.asarray(rp.seq_kv_offset) + k - tail
        ahead = np.where(local, load, np.where(split, entry_pair_heads(n, tail_len, tiles.heads.q_heads_per_shard), 0))
        np.testing.assert_allclose(plan.hosted_pair_heads[:, rp.rank], [ahead.sum(), load.sum() - ahead.sum()])


def test_home_placement_of_single_chunk_documents_is_all_local():
    """Documents inside one CP chunk, tiles at home: nothing needs another worker, every entry is local."""
    from libra_megatron.plan.layout import HeadLayout, TokenLayout
    from libra_megatron.plan.tiles import build_tiles

    tiles = build_tiles([[5, 7, 4], [16]], TokenLayout("contiguous", 16, 1), HeadLayout(4, 2, 4, 2, 2), 4)
    plan = build_exchange_plan(tiles, tiles.tile_home())
    assert (plan.hosted_pair_heads[1] == 0).all() and (plan.hosted_pair_heads[0] > 0).all()
    moved = tiles.tile_home().copy()
    moved[0] = 1 - moved[0]  # one tile away from home: its entries at the new destination are remote
    plan = build_exchange_plan(tiles, moved)
    assert plan.hosted_pair_heads[1, moved[0]] == tiles.tile_flops()[0]
