"""plan.exchange.arranged_order: every destination's entries grouped remote | split | local, each entry set one slice.

The reference is the plan built in hosted order (``group_by_kind=False``): the grouped plan must be the same plan
up to a permutation of every destination's arranged Q rows -- the same source units reach the same entry rows,
the same entries (kinds, key ranges), the same bytes -- with every entry set one contiguous slice."""
import numpy as np
from hypothesis import given, settings

from libra_megatron.plan.exchange import build_exchange_plan, rank_sizes, rank_tables, validate_plan
from libra_megatron.plan.exchange.pool_sizes import pool_rank_sizes
from libra_megatron.plan.exchange.arranged_order import KIND_ORDER
from libra_megatron.plan.exchange.builder import _build_exchange_plan
from libra_megatron.plan.exchange.local_entries import LOCAL, REMOTE, SPLIT, rank_entry_kinds
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.tiles import build_tiles

from .test_exchange import SETTINGS, pools


def _entry_units(plan, d):
    """Per entry of destination d: (the source (rank, Q unit) of each of its rows, in row order; its kind, kv offset
    and key length). A row is identified by what the route moves into it: the sender's unit."""
    rp = plan.ranks[d]
    route = rp.q_route
    units = np.full(int(route.target_len), -1, dtype=np.int64)
    source = np.full(int(route.target_len), -1, dtype=np.int64)
    rows = route.recv_runs.expand()  # received rows land here, grouped by source rank in rank order
    first = np.concatenate([[0], np.cumsum(route.recv_splits)])
    for s in range(plan.num_workers):
        sender = plan.ranks[s].q_route
        sent = sender.send_runs.expand()
        lo = int(np.sum(sender.send_splits[:d]))
        units[rows[first[s]:first[s + 1]]] = sent[lo:lo + int(sender.send_splits[d])]
        source[rows[first[s]:first[s + 1]]] = s
    assert (units >= 0).all()
    kinds, _ = rank_entry_kinds(rp)
    cu = np.asarray(rp.cu_seqlens_q)
    return [(tuple(zip(source[a:b].tolist(), units[a:b].tolist())), int(k), int(o), int(n))
            for a, b, k, o, n in zip(cu[:-1], cu[1:], kinds, rp.seq_kv_offset, rp.seq_k_len)]


@given(pools())
@settings(**dict(SETTINGS, max_examples=200))
def test_grouped_plan_is_the_hosted_plan_with_its_arranged_rows_permuted(pool):
    _, _, _, tiles, assign, _ = pool
    _check_grouped(tiles, assign)


def test_a_tile_whose_middle_entry_moves_keeps_its_units_apart():
    """The Megatron-LM CPU run's pool (DP2 CP2 P2, L=1024, B=256, tiny Qwen3 heads) that a first version got wrong:
    worker 3's own tile [512, 768) holds a remote entry's tail, a local document and a remote entry's head; the
    local one moves to the end, and the two pieces left of the tile meet in the new order with a gap in their source
    units between them (one run would have sent the gap's units twice)."""
    from libra_megatron.config import LibraConfig
    from libra_megatron.plan.pool import place_pool_tiles, pool_timing

    config = LibraConfig(pool_size=2, block_size=256)
    heads = HeadLayout(4, 2, 16, config.head_split, config.chunks_for(4, 2), elem_bytes=4)
    config = config._with_chunks(heads.num_chunks)
    timing = pool_timing(config, heads)
    tiles, placement = place_pool_tiles([[1024], [545, 162, 249, 68]], config, TokenLayout("zigzag", 1024, 2), heads,
                                        timing=timing)
    grouped = _check_grouped(tiles, placement.assignment, timing)
    assert rank_entry_kinds(grouped.ranks[3])[0].tolist() == [REMOTE, REMOTE, REMOTE, LOCAL]


def _check_grouped(tiles, assign, timing=None):
    grouped = build_exchange_plan(tiles, assign, timing)
    hosted = _build_exchange_plan(tiles, assign, timing, group_by_kind=False)
    validate_plan(grouped, tiles)
    assert np.array_equal(grouped.peer_units, hosted.peer_units)
    assert (grouped.bytes_q, grouped.bytes_kv, grouped.bytes_o) == (hosted.bytes_q, hosted.bytes_kv, hosted.bytes_o)
    np.testing.assert_array_equal(grouped.hosted_pair_heads, hosted.hosted_pair_heads)
    for d, (g, h) in enumerate(zip(grouped.ranks, hosted.ranks)):
        assert np.array_equal(g.kv_route.recv_runs.expand(), h.kv_route.recv_runs.expand())
        np.testing.assert_array_equal(g.q_route.send_splits, h.q_route.send_splits)
        # the sender's units of every destination, in the order they are sent: the same set (their order follows
        # the arranged rows, which moved)
        gs, hs = g.q_route.send_runs.expand(), h.q_route.send_runs.expand()
        assert sorted(gs.tolist()) == sorted(hs.tolist())
        # every entry keeps its rows' source units in order, its kind and its keys; entries ordered by kind group
        ge, he = _entry_units(grouped, d), _entry_units(hosted, d)
        assert sorted(ge) == sorted(he)
        rank_of = [KIND_ORDER.index(kind) for _, kind, _, _ in ge]
        assert rank_of == sorted(rank_of)
        sets = rank_tables(g).entry_sets()
        assert all(part.q_span is not None for part in sets if part.num_entries)
        for part in sets:
            if part.num_entries:
                start, rows = part.q_span
                np.testing.assert_array_equal(part.q_rows.expand(), np.arange(start, start + rows))
    for plan in (grouped, hosted):  # the pool-wide sizes (the planner's pricing) give every set's span as the rank's
        for r, sizes in enumerate(pool_rank_sizes(plan)):
            want = rank_sizes(plan.for_rank(r))
            for name in ("local", "remote", "heads"):
                got_set, want_set = getattr(sizes, name), getattr(want, name)
                assert (got_set is None) == (want_set is None)
                assert got_set is None or got_set.q_span == want_set.q_span, (r, name)
    return grouped


def test_interleaved_kinds_are_regrouped_in_a_hand_made_pool():
    """Two sequences of one worker each (P=2, CP=1): worker 0 hosts its own 4-token document's tiles (local), one
    tile of worker 1's document (remote: its Q comes from worker 1) and, between them in hosted order, its own
    second document's tiles; the grouped order puts the remote entry first and keeps hosted order inside groups."""
    layout = TokenLayout("contiguous", 8, 1)
    heads = HeadLayout(2, 2, 4, 1, 1, elem_bytes=2)
    tiles = build_tiles([[4, 4], [8]], layout, heads, 4, tiling="uniform", kv_fetch="group", min_block_size=1)
    assign = tiles.tile_home().copy()
    blocks = tiles.block_home
    theirs = int(np.flatnonzero(blocks == 1)[0])  # worker 1's first block -> worker 0
    assign[theirs] = 0
    hosted = _build_exchange_plan(tiles, assign, group_by_kind=False).ranks[0]
    grouped = build_exchange_plan(tiles, assign).ranks[0]
    h_kinds, g_kinds = rank_entry_kinds(hosted)[0], rank_entry_kinds(grouped)[0]
    assert sorted(h_kinds.tolist()) == sorted(g_kinds.tolist()) == [REMOTE, LOCAL, LOCAL]
    assert h_kinds.tolist() != g_kinds.tolist()  # hosted order: worker 0's own blocks first
    assert g_kinds.tolist() == [REMOTE, LOCAL, LOCAL]
    assert np.diff(grouped.cu_seqlens_q).tolist() == [4, 4, 4]
    assert SPLIT not in g_kinds.tolist()
