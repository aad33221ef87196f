"""K/V relay (plan.exchange "Relay", issue 14): a home run that several workers of another node fetch
crosses nodes once, to the one that needs the most of it, which forwards each of the others its prefix (single),
or cut into stripes each fetched by one of them and forwarded to the others that need it (striped).

Every property is checked against the same plan without a relay: each destination ends up holding exactly
the same arranged K/V, attention through the plan matches the dense reference, the inverse routes are the
adjoint of the forward ones, and the inter-node K/V a source sends to a node is, per home run, the longest
prefix a destination there needs -- computed independently from the unrelayed plan's routes.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_megatron.plan.exchange.builder import _build_exchange_plan, build_exchange_plan
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.exchange.local_entries import LOCAL, SPLIT, rank_entry_kinds
from libra_megatron.plan.model import StepTimeModel, entry_pair_heads
from libra_megatron.plan.tiles import build_tiles
from libra_megatron.plan.exchange import plan_traffic, plan_worker_seconds, validate_plan
from libra_megatron.testing.execute import return_kv_grads_numpy, run_routes_numpy
from libra_megatron.testing.unit_tables import entry_kinds_by_units

from .test_exchange import SETTINGS, _check_attention, assert_inverse_is_adjoint, pools, token_ids


@st.composite
def relayed_pools(draw):
    """A pool from ``pools`` with a node per worker (1-3 workers per node, any order), its plan with the relay
    (as the planner chooses it, or forced onto a random set of senders' home runs; single or striped) and without
    it, the forced senders (None: the planner's choice) and the least stripe (None: the single relay)."""
    segs, layout, heads, tiles, assign, rng = draw(pools())
    W = tiles.num_workers
    nodes = tuple(int(x) for x in rng.integers(0, max(1, W // draw(st.sampled_from([1, 2, 3]))), W))
    timing = StepTimeModel(heads.head_dim, attn_tflops=1e-6, inter_node_gbps=1e-7, intra_node_gbps=1e-3,
                           worker_nodes=nodes, kv_relay=True)  # slow links between nodes: relays pay off
    senders = rng.random(W) < 0.5 if draw(st.booleans()) else None
    stripe = draw(st.sampled_from([None, 1, 2, 5]))  # the single relay, or striped with stripes >= this
    return segs, layout, heads, tiles, assign, rng, np.asarray(nodes), \
        _build_exchange_plan(tiles, assign, timing, relay_senders=senders, relay_stripe=stripe), \
        build_exchange_plan(tiles, assign, replace(timing, kv_relay=False)), senders, stripe


def _inter_node_kv_units(plan, nodes) -> np.ndarray:
    """int [W, nodes]: KV units each source sends to each other node (both hops; relay hops never cross)."""
    units = np.array(plan.peer_units[1], dtype=np.int64)
    if plan.relay_units is not None:
        units = units + plan.relay_units
    out = np.zeros((units.shape[0], nodes.max() + 1), dtype=np.int64)
    for d in range(units.shape[0]):
        out[:, nodes[d]] += np.where(nodes != nodes[d], units[:, d], 0)
    return out


def _expected_inter_node(direct, nodes) -> np.ndarray:
    """From the unrelayed plan's routes: per source, node and home run (first unit), the longest run count
    any destination on that node fetches -- what crosses nodes once when the source's runs relay."""
    longest = {}
    for s, rp in enumerate(direct.ranks):
        rt = rp.kv_route
        dest = np.repeat(np.arange(len(rt.send_splits)), rt.send_splits)
        starts = np.cumsum(rt.send_runs.count) - rt.send_runs.count
        for start, count, first in zip(rt.send_runs.start.tolist(), rt.send_runs.count.tolist(), starts.tolist()):
            if count == 0:
                continue
            d = int(dest[first])
            if nodes[d] != nodes[s]:
                key = (s, start, int(nodes[d]))
                longest[key] = max(longest.get(key, 0), count)
    out = np.zeros((direct.num_workers, nodes.max() + 1), dtype=np.int64)
    for (s, _, n), count in longest.items():
        out[s, n] += count
    return out


@given(relayed_pools())
@settings(**SETTINGS)
def test_relayed_plans_validate_and_hold_exactly_what_the_direct_plan_holds(pool):
    segs, layout, heads, tiles, assign, rng, nodes, relayed, direct, senders, stripe = pool
    validate_plan(relayed, tiles)
    P, H, G = len(segs), heads.head_split, heads.num_kv_classes
    ids, kv_ids = token_ids(layout, P, H), token_ids(layout, P, G)
    (aq, akv), (bq, bkv) = run_routes_numpy(relayed, ids, kv_ids), run_routes_numpy(direct, ids, kv_ids)
    for w in range(tiles.num_workers):
        np.testing.assert_array_equal(aq[w], bq[w])
        np.testing.assert_array_equal(akv[w], bkv[w])
    assert relayed.bytes_kv == direct.bytes_kv
    if relayed.relay_units is not None:  # the relay is part of what every rank must agree on
        assert relayed.fingerprint != direct.fingerprint
    got, once, each = (_inter_node_kv_units(relayed, nodes), _expected_inter_node(direct, nodes),
                       _inter_node_kv_units(direct, nodes))
    if senders is not None:  # exactly the chosen senders' runs cross nodes once
        want = np.where(senders[:, None] & (relayed.relay_units is not None), once, each)
        np.testing.assert_array_equal(got, want)
    else:  # the planner's choice: every source's runs cross once (relayed) or once per destination
        assert ((got == once).all(axis=1) | (got == each).all(axis=1)).all()
    traffic = plan_traffic(relayed)
    np.testing.assert_array_equal(traffic.bytes_sent()[:, 1], [rp.bytes_sent[1] for rp in relayed.ranks])


@given(relayed_pools())
@settings(**SETTINGS)
def test_a_plan_relays_unless_the_timeline_prices_its_slowest_worker_slower(pool):
    _, _, heads, tiles, assign, _, nodes, relayed, direct, senders, stripe = pool
    model = StepTimeModel(heads.head_dim, attn_tflops=1e-6, inter_node_gbps=1e-7, intra_node_gbps=1e-3,
                          worker_nodes=tuple(nodes.tolist()))
    if senders is not None:
        return
    chosen, other = plan_worker_seconds(relayed, model).max(), plan_worker_seconds(direct, model).max()
    assert chosen <= other * (1 + 1e-12)
    # the planner also priced relaying every home run; it kept the faster
    timing = replace(model, kv_relay=True)
    everyone = _build_exchange_plan(tiles, assign, timing, relay_senders=np.ones(tiles.num_workers, dtype=bool),
                                    relay_stripe=stripe)
    if everyone.relay_units is not None and plan_worker_seconds(everyone, model).max() <= other:
        assert chosen <= plan_worker_seconds(everyone, model).max() * (1 + 1e-12)


@given(relayed_pools())
@settings(**SETTINGS)
def test_attention_through_a_relayed_plan_matches_the_dense_reference(pool):
    segs, layout, heads, tiles, assign, rng, nodes, relayed, direct, senders, stripe = pool
    _check_attention(relayed, segs, layout, heads, rng)


@given(relayed_pools())
@settings(**SETTINGS)
def test_relay_inverse_is_the_adjoint_and_gradients_reach_home_once_per_fetch(pool):
    """<A x, G> == <x, A^T G> with the relay's inverse; ones sent back count the same fetches as without it."""
    _, layout, heads, tiles, assign, rng, nodes, relayed, direct, senders, stripe = pool
    assert_inverse_is_adjoint(relayed, layout, heads, rng)
    ones = [np.ones(rp.kv_route.target_len) for rp in relayed.ranks]
    for got, want in zip(return_kv_grads_numpy(relayed, ones), return_kv_grads_numpy(direct, ones)):
        np.testing.assert_array_equal(got, want)


def test_hand_made_relay_sends_the_longest_prefix_once_and_forwards_the_shorter_ones():
    """One 16-token document on worker 0 (node 0); blocks of 4 tokens; workers 1, 2, 3 (node 1) host block 1
    (needs rows [0, 8)), block 3 ([0, 16)) and block 2 ([0, 12)). Worker 0 sends 16 rows to worker 2 only;
    worker 2 forwards 8 of them to worker 1 and 12 to worker 3."""
    heads = HeadLayout(2, 2, 4, 1, 1)
    tiles = build_tiles([[16], [16], [16], [16]], TokenLayout("contiguous", 16, 1), heads, 4, tiling="uniform",
                        kv_fetch="prefix")
    assign = tiles.tile_home().copy()
    assign[1], assign[3], assign[2] = 1, 2, 3  # blocks of sequence 0 (worker 0)
    slow = StepTimeModel(4, attn_tflops=1e-6, inter_node_gbps=1e-7, intra_node_gbps=1e-3, worker_nodes=(0, 1, 1, 1),
                         kv_relay=True)
    plan = build_exchange_plan(tiles, assign, slow)
    validate_plan(plan, tiles)
    assert plan.peer_units[1][0].tolist() == [4, 0, 16, 0]  # block 0 stays home (4 rows), worker 2 gets 16
    assert plan.relay_units.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 8, 0, 12], [0, 0, 0, 0]]
    assert plan.ranks[1].relay_route.recv_splits.tolist() == [0, 0, 8, 0]
    direct = build_exchange_plan(tiles, assign)
    assert direct.peer_units[1][0].tolist() == [4, 8, 16, 12] and direct.relay_units is None
    costly = replace(slow, inter_node_gbps=1e6, intra_node_gbps=1e-9)  # forwarding inside a node is the slow part
    assert build_exchange_plan(tiles, assign, costly).relay_units is None
    assert plan.bytes_kv == direct.bytes_kv


@given(relayed_pools())
@settings(**SETTINGS)
def test_relayed_rows_are_foreign_to_the_local_split(pool):
    """Entry kinds of a relayed plan equal the row-by-row check (relayed rows never count as self-sourced),
    and the pool-wide local / remote loads the simulator prices are the per-rank sums."""
    _, _, heads, tiles, assign, _, nodes, relayed, direct, senders, stripe = pool
    hps = tiles.heads.q_heads_per_shard
    for rp in relayed.ranks:
        kinds, tail = rank_entry_kinds(rp)
        want_kinds, want_tail = entry_kinds_by_units(rp)
        np.testing.assert_array_equal(kinds, want_kinds)
        split = kinds == SPLIT
        np.testing.assert_array_equal(tail[split], want_tail[split])
        n, k = np.diff(rp.cu_seqlens_q), np.asarray(rp.seq_k_len)
        load = entry_pair_heads(n, k, hps)
        tail_len = np.asarray(rp.seq_kv_offset) + k - tail
        ahead = np.where(kinds == LOCAL, load, np.where(split, entry_pair_heads(n, tail_len, hps), 0))
        np.testing.assert_allclose(relayed.hosted_pair_heads[:, rp.rank], [ahead.sum(), load.sum() - ahead.sum()])


@given(relayed_pools())
@settings(**SETTINGS)
def test_striped_and_single_relays_of_the_same_senders_forward_the_same_rows_in_total(pool):
    """For one set of relayed senders, the striped layout forwards as many rows as the single one (a cut of the home
    run [c_(i+1), c_i) is needed by i + 1 fetchers and forwarded to i of them: sum_i i (c_i - c_(i+1)) = every
    fetcher's prefix but the longest's), each crosses nodes the same way (`_inter_node_kv_units`), and every rank's
    forwarding is at most the single layout's busiest relay's."""
    _, _, heads, tiles, assign, _, nodes, _, _, senders, stripe = pool
    senders = np.ones(tiles.num_workers, dtype=bool) if senders is None else senders
    model = StepTimeModel(heads.head_dim, attn_tflops=1e-6, inter_node_gbps=1e-7, intra_node_gbps=1e-3,
                          worker_nodes=tuple(nodes.tolist()), kv_relay=True)
    single = _build_exchange_plan(tiles, assign, model, relay_senders=senders)
    relayed = _build_exchange_plan(tiles, assign, model, relay_senders=senders, relay_stripe=stripe or 1)
    if single.relay_units is None:
        assert relayed.relay_units is None
        return
    validate_plan(relayed, tiles)
    assert single.relay_units.sum() == relayed.relay_units.sum()
    np.testing.assert_array_equal(_inter_node_kv_units(single, nodes), _inter_node_kv_units(relayed, nodes))
    assert relayed.relay_units.sum(axis=1).max() <= single.relay_units.sum()


def test_hand_made_striped_relay_spreads_the_home_run_over_the_node_and_forwards_each_stripe_once():
    """The hand-made pool above with stripes of >= 2 units. Worker 2 needs rows [0, 16), worker 3 [0, 12), worker 1
    [0, 8): the cuts [12, 16) (worker 2 alone), [8, 12) (workers 2, 3: stripes [8, 10) to 3, [10, 12) to 2) and
    [0, 8) (all three: [0, 2) to 1, [2, 5) to 3, [5, 8) to 2). The same 16 rows cross nodes once, now to three
    NICs (2 + 9 + 5); the busiest forwarder sends 8 rows over NVLink, not the single relay's 20."""
    heads = HeadLayout(2, 2, 4, 1, 1)
    tiles = build_tiles([[16], [16], [16], [16]], TokenLayout("contiguous", 16, 1), heads, 4, tiling="uniform",
                        kv_fetch="prefix")
    assign = tiles.tile_home().copy()
    assign[1], assign[3], assign[2] = 1, 2, 3
    slow = StepTimeModel(4, attn_tflops=1e-6, inter_node_gbps=1e-7, intra_node_gbps=1e-3, worker_nodes=(0, 1, 1, 1),
                         kv_relay=True)
    plan = build_exchange_plan(tiles, assign, slow, relay_stripe=2)
    validate_plan(plan, tiles)
    assert plan.peer_units[1][0].tolist() == [4, 2, 9, 5]
    assert plan.relay_units.tolist() == [[0, 0, 0, 0], [0, 0, 2, 2], [0, 3, 0, 5], [0, 3, 5, 0]]
    single = build_exchange_plan(tiles, assign, slow)
    assert single.relay_units.sum(axis=1).max() == 20 and plan.relay_units.sum(axis=1).max() == 8
    assert plan.bytes_kv == single.bytes_kv and plan.fingerprint != single.fingerprint
    wide = build_exchange_plan(tiles, assign, slow, relay_stripe=16)  # no cut reaches 16 rows: one owner per cut
    validate_plan(wide, tiles)
    assert wide.peer_units[1][0].tolist() == [4, 8, 4, 4]  # cuts owned by the member needing the fewest rows
    P, H, G = 4, heads.head_split, heads.num_kv_classes
    ids, kv_ids = token_ids(tiles.layout, P, H), token_ids(tiles.layout, P, G)
    for relayed in (plan, wide):
        (aq, akv), (bq, bkv) = run_routes_numpy(relayed, ids, kv_ids), run_routes_numpy(single, ids, kv_ids)
        for w in range(tiles.num_workers):
            np.testing.assert_array_equal(akv[w], bkv[w])


def test_config_kv_relay_reaches_plan_pool():
    """kv_relay: auto lets plan_pool relay over the timing model's nodes; off never relays (the same model)."""
    from libra_megatron.config import LibraConfig
    from libra_megatron.plan.pool import plan_pool

    heads = HeadLayout(4, 4, 4, 2, 2)
    layout = TokenLayout("zigzag", 64, 2)
    segs = [[64], [8] * 8, [16] * 4, [4] * 16]  # one long document to spread over the other sequences' workers
    model = StepTimeModel(4, attn_tflops=1e-6, inter_node_gbps=1e-7, intra_node_gbps=1e-3,
                          worker_nodes=(0, 0, 1, 1, 1, 1, 2, 2))
    got = {}
    for relay in ("auto", "off"):
        config = LibraConfig(pool_size=4, head_split=2, num_chunks=2, block_size=8, kv_relay=relay)
        got[relay] = plan_pool(segs, config, layout, heads, validate=True, timing=model).exchange
    assert got["auto"].relay_units is not None and got["auto"].relay_units.sum() > 0
    assert got["off"].relay_units is None
    np.testing.assert_array_equal(got["auto"].assignment, got["off"].assignment)
