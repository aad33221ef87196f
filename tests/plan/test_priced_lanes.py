"""Priced lanes (plan.sequences.priced_lanes): groupings, microbatch orders and every lane's choice, against hand-drawn
1F1B timelines and brute force; the PP > 1 placement's guard."""
import itertools

import numpy as np
import pytest

from libra_megatron.config import SequencePlacement
from libra_megatron.plan.sequences import SyncLayout, place_for_sync, place_sequences, run_lane_pipelines
from libra_megatron.plan.sequences.lanes import priced_lanes_apply
from libra_megatron.plan.sequences.priced_lanes import (CANDIDATES, PIPELINE_BALANCE_GA, assemble_order,
                                                        balance_lane_pipelines, balance_lane_seconds,
                                                        choose_lanes, fastest_balanced, lane_groupings,
                                                        microbatch_orders, place_for_pipelines, priced_lane_order,
                                                        priced_step_seconds)


def _span(f, b, layout):
    return run_lane_pipelines(np.asarray(f, dtype=float)[:, None], layout, np.asarray(b, dtype=float)[:, None]).makespan[0]


def test_choose_lanes_matches_hand_drawn_pipelines():
    layout = SyncLayout(2, 1, 2, pipeline_parallel_size=2)
    # PP=2, m=2, B = 2F. Times (3, 1): s0 F0 [0,3]; s1 F0 [3,6] B0 [6,12]; s0 F1 [3,4] B0 [12,18]; s1 F1 [12,13]
    # B1 [13,15]; s0 B1 [18,20] -> 20. Times (1, 3) -> 19 (tests/plan/test_sync.py). Times (2, 2): s0 F0 [0,2];
    # s1 F0 [2,4] B0 [4,8]; s0 F1 [2,4] B0 [8,12]; s1 F1 [8,10] B1 [10,14]; s0 B1 [14,18] -> 18.
    like_f, like_b = np.array([3.0, 1.0]), np.array([6.0, 2.0])
    grouping, order = choose_lanes(like_f[None, :, None], like_b[None, :, None], layout)
    assert (grouping.tolist(), order[:, 0].tolist()) == ([0], [1, 0])
    assert _span(like_f[order[:, 0]], like_b[order[:, 0]], layout) == pytest.approx(19.0)
    fwd = np.stack([like_f, [2.0, 2.0]])[:, :, None]
    bwd = np.stack([like_b, [4.0, 4.0]])[:, :, None]
    grouping, order = choose_lanes(fwd, bwd, layout)
    assert (grouping.tolist(), order[:, 0].tolist()) == ([1], [0, 1])  # alg1 at 18 beats like at 19
    # a tie keeps the earlier grouping: both groupings the same seconds
    grouping, _ = choose_lanes(np.stack([like_f, like_f])[:, :, None], np.stack([like_b, like_b])[:, :, None], layout)
    assert grouping.tolist() == [0]


def test_choose_lanes_is_each_lanes_best_candidate_and_never_below_brute_force():
    rng = np.random.default_rng(7)
    for pp, ga, lanes in ((2, 4, 3), (4, 5, 2), (3, 3, 4), (2, 6, 2)):
        layout = SyncLayout(2 * lanes, 2, ga, pipeline_parallel_size=pp)
        fwd, bwd = rng.uniform(1, 5, (2, ga, lanes)), rng.uniform(2, 12, (2, ga, lanes))
        grouping, order = choose_lanes(fwd, bwd, layout)
        for j in range(lanes):  # each lane apart, every candidate through its own pipeline
            g, o = int(grouping[j]), order[:, j]
            assert sorted(o.tolist()) == list(range(ga))
            span = _span(fwd[g, o, j], bwd[g, o, j], layout)
            for h in range(2):
                for cand in microbatch_orders(fwd[h, :, j] + bwd[h, :, j]):
                    assert _span(fwd[h, cand, j], bwd[h, cand, j], layout) >= span - 1e-12
            brute = min(_span(fwd[h, list(p), j], bwd[h, list(p), j], layout)
                        for h in range(2) for p in itertools.permutations(range(ga)))
            assert span >= brute - 1e-12
            if ga <= 5:  # EXHAUSTIVE_GA: few microbatches: every order is tried, so the lane's choice is optimal
                assert span == pytest.approx(brute, rel=1e-12)


def test_microbatch_orders_by_hand():
    orders = microbatch_orders(np.array([5.0, 1.0, 3.0, 2.0]))
    assert [o.tolist() for o in orders] == [[0, 1, 2, 3], [1, 3, 2, 0], [0, 2, 3, 1], [1, 2, 0, 3]]


def test_groupings_partition_each_lane_and_the_window():
    rng = np.random.default_rng(3)
    layout = SyncLayout(8, 2, 3, pipeline_parallel_size=2)  # 4 lanes x GA 3 x P 2
    flops = rng.pareto(1.2, 24) * 1e6
    lanes = lane_groupings(flops, layout)
    assert len(lanes) == 4
    seen = np.concatenate([g["like"].reshape(-1) for g in lanes])
    assert sorted(seen.tolist()) == list(range(24))
    for g in lanes:
        assert sorted(g["like"].reshape(-1).tolist()) == sorted(g["alg1"].reshape(-1).tolist())
        assert np.all(np.diff(flops[g["like"].reshape(-1)]) <= 0)  # like with like: F descending
    order = assemble_order([g["alg1"] for g in lanes], layout)
    assert sorted(order.tolist()) == list(range(24))
    pools = order.reshape(3, 4, 2)  # pool k = g*lanes + j is lane j's g-th microbatch
    for j, g in enumerate(lanes):
        assert np.array_equal(pools[:, j, :], g["alg1"])


def test_bad_input_is_a_clear_error():
    layout = SyncLayout(4, 2, 2, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="GA\\*DP"):
        lane_groupings(np.ones(7), layout)
    with pytest.raises(ValueError, match="GA = 2"):
        choose_lanes(np.ones((2, 3, 2)), np.ones((2, 3, 2)), layout)
    with pytest.raises(ValueError, match="GA = 2"):
        choose_lanes(np.ones((2, 2, 2)), np.ones((1, 2, 2)), layout)
    with pytest.raises(ValueError, match="lanes chosen"):
        assemble_order([np.zeros((2, 2))], layout)
    ones = lambda pools: (np.ones(len(pools)), np.ones(len(pools)))  # noqa: E731
    with pytest.raises(ValueError, match="balance_lane_pipelines: the order has 6 positions but GA\\*DP = 2\\*4 = 8"):
        balance_lane_pipelines(np.arange(6), layout, ones)
    with pytest.raises(ValueError, match="balance_lane_seconds: the order has 6 positions but GA\\*DP = 2\\*4 = 8"):
        balance_lane_seconds(np.arange(6), SyncLayout(4, 2, 2), ones)


def test_priced_step_seconds_by_hand():
    layout = SyncLayout(2, 1, 2, pipeline_parallel_size=2)  # 2 lanes x GA 2; pool k = g*2 + j runs in lane j
    fwd = np.array([3.0, 2.0, 1.0, 2.0])
    seconds = lambda pools: (fwd[pools[:, 0]], 2 * fwd[pools[:, 0]])  # noqa: E731
    # lane 0 runs (3, 1) -> 20, lane 1 (2, 2) -> 18 (hand-drawn above): the step waits for lane 0
    assert priced_step_seconds(np.arange(4), layout, seconds) == pytest.approx(20.0)
    # lanes (3, 2) and (2, 1): s0 F0 [0,3]; s1 F0 [3,6] B0 [6,12]; s0 F1 [3,5] B0 [12,18]; s1 F1 [12,14] B1 [14,18];
    # s0 B1 [18,22] -> 22 (lane 1: 14)
    assert priced_step_seconds(np.array([0, 1, 3, 2]), layout, seconds) == pytest.approx(22.0)
    assert priced_step_seconds(np.array([2, 1, 0, 3]), layout, seconds) == pytest.approx(19.0)  # lane 0 (1, 3)


def _skewed_window(seed, gbs):
    rng = np.random.default_rng(seed)
    flops = rng.pareto(1.2, gbs) * 1e6 + 1e5
    skew = rng.uniform(0.3, 3.0, gbs)  # a pool's seconds are not its F (what the proxy adds)

    def pool_seconds(pools):
        f = (flops[pools] * skew[pools]).sum(axis=1) / 1e6
        return f, 2.5 * f + flops[pools].max(axis=1) / 1e6

    return flops, pool_seconds


@pytest.mark.parametrize("pp,vpp,dp,pool,ga", [(2, 1, 8, 2, 4), (4, 1, 16, 4, 8), (2, 2, 8, 2, 4)])
def test_place_for_pipelines_is_never_slower_than_its_candidates(pp, vpp, dp, pool, ga):
    for seed in range(4):
        layout = SyncLayout(dp, pool, ga, pipeline_parallel_size=pp, virtual_pipeline_size=vpp)
        flops, pool_seconds = _skewed_window(seed, dp * ga)
        order, name = place_for_pipelines(flops, layout, pool_seconds)
        assert sorted(order.tolist()) == list(range(dp * ga))  # the step's multiset
        best = priced_step_seconds(order, layout, pool_seconds)
        others = {"priced lanes": priced_lane_order(flops, layout, pool_seconds),
                  "alg1": place_sequences(flops, pool, SequencePlacement.ALG1), "sampler": np.arange(dp * ga)}
        for other in others.values():
            assert best <= priced_step_seconds(other, layout, pool_seconds)
        assert name in CANDIDATES and _pool_sets(order, pool) == _pool_sets(others[name], pool)  # lanes evened whole
        again = place_sequences(flops, pool, SequencePlacement.SYNC, layout, pool_seconds)
        assert np.array_equal(again, order)  # the entry point runs it, deterministically


def _pool_sets(order, pool):
    return sorted(sorted(p) for p in np.asarray(order).reshape(-1, pool).tolist())


def test_priced_lanes_beat_the_f_proxy_when_seconds_are_not_f():
    """On skewed pools the priced order is strictly faster than the F-proxy one in some window (it can fail:
    a placement that ignored ``pool_seconds`` would tie everywhere)."""
    layout = SyncLayout(8, 2, 4, pipeline_parallel_size=2)
    gains = []
    for seed in range(6):
        flops, pool_seconds = _skewed_window(seed, 32)
        sync = place_for_sync(flops, layout)
        priced = place_sequences(flops, 2, SequencePlacement.SYNC, layout, pool_seconds)
        gains.append(priced_step_seconds(sync, layout, pool_seconds) / priced_step_seconds(priced, layout, pool_seconds))
    assert min(gains) >= 1.0 and max(gains) > 1.05


def test_pool_seconds_are_read_only_where_lanes_run_apart():
    flops, pool_seconds = _skewed_window(1, 32)
    for layout in (SyncLayout(32, 2, 1, pipeline_parallel_size=2),  # GA = 1: nothing to order
                   SyncLayout(8, 8, 4, pipeline_parallel_size=2),  # DP = P: one lane keeps per-instance balance
                   SyncLayout(8, 2, 4, pipeline_parallel_size=2, expert_parallel_size=8)):  # EP ties the lanes
        assert not priced_lanes_apply(layout)
        with_seconds = place_sequences(flops, layout.pool_size, SequencePlacement.SYNC, layout, pool_seconds)
        assert np.array_equal(with_seconds, place_for_sync(flops, layout))
    assert priced_lanes_apply(SyncLayout(8, 2, 4, pipeline_parallel_size=2))
    assert priced_lanes_apply(SyncLayout(8, 2, 4))  # PP = 1: the lanes' pool totals (balance_lane_seconds)


def _lane_totals(order, layout, seconds_of_pool):
    pools = np.asarray(order).reshape(layout.num_microbatches, layout.num_lanes, layout.pool_size)
    return np.array([[seconds_of_pool(tuple(p)) for p in row] for row in pools]).sum(axis=0)


def test_balance_lane_seconds_swaps_whole_pools_by_hand():
    """Two lanes of two pools (P = 1): lane 0 runs pools priced 10 and 9 (19), lane 1 two of 1 (2). Swapping the 10
    or the 9 with a 1 both leave a pair maximum of 11; the first (the 10 for lane 1's first pool) is taken:
    lanes 1 + 9 = 10 and 10 + 1 = 11. Then no swap lowers 11."""
    layout = SyncLayout(2, 1, 2)
    price = {0: 10.0, 1: 1.0, 2: 9.0, 3: 1.0}  # window position -> its pool's seconds (one sequence a pool)
    pool_seconds = lambda pools: (np.array([price[int(p[0])] for p in pools]), np.zeros(len(pools)))  # noqa: E731
    out = balance_lane_seconds(np.arange(4), layout, pool_seconds)  # GA-major: lane 0 = positions 0, 2
    assert out.reshape(2, 2)[:, 0].tolist() == [1, 2] and out.reshape(2, 2)[:, 1].tolist() == [0, 3]
    assert _lane_totals(out, layout, lambda p: price[p[0]]).tolist() == [10.0, 11.0]


def test_balance_lane_seconds_keeps_pools_and_never_raises_the_heaviest_lane():
    rng = np.random.default_rng(3)
    for dp, pool, ga in ((8, 2, 4), (16, 4, 6), (12, 3, 5)):
        layout = SyncLayout(dp, pool, ga)
        gbs = dp * ga
        weight = rng.lognormal(0.0, 1.5, gbs)
        pool_seconds = lambda pools: (weight[pools].sum(axis=1) ** 1.3, 0.5 * weight[pools].max(axis=1))  # noqa: E731
        order = rng.permutation(gbs)
        out = balance_lane_seconds(order, layout, pool_seconds)
        assert sorted(out.tolist()) == list(range(gbs))
        assert {frozenset(p) for p in out.reshape(-1, pool).tolist()} == {frozenset(p) for p in order.reshape(-1, pool).tolist()}
        price = lambda p: float(sum(x.sum() for x in pool_seconds(np.array([p]))))  # noqa: E731
        before, after = _lane_totals(order, layout, price), _lane_totals(out, layout, price)
        assert after.max() <= before.max() + 1e-12 and after.sum() == pytest.approx(before.sum())
        assert after.max() < before.max()  # these skewed windows always leave a swap that helps
        # no single pool swap between the heaviest and the lightest lane lowers the heavier of the two any further
        heavy, light = int(after.argmax()), int(after.argmin())
        grid = out.reshape(ga, layout.num_lanes, pool)
        sec = np.array([[price(tuple(p)) for p in row] for row in grid])
        moved = sec[:, heavy][:, None] - sec[:, light][None, :]
        assert np.maximum(after[heavy] - moved, after[light] + moved).min() >= after[heavy] - 1e-9


def test_bad_pool_seconds_are_a_clear_error():
    layout = SyncLayout(8, 2, 4, pipeline_parallel_size=2)
    flops = np.arange(1.0, 33.0)
    with pytest.raises(ValueError, match="pool_seconds gave 3 forward"):
        place_sequences(flops, 2, SequencePlacement.SYNC, layout, lambda pools: (np.ones(3), np.ones(3)))
    with pytest.raises(ValueError, match="finite seconds >= 0"):
        place_sequences(flops, 2, SequencePlacement.SYNC, layout,
                        lambda pools: (np.full(len(pools), np.nan), np.ones(len(pools))))


def _by_sequence(price):
    """pool_seconds of one-sequence pools: forward ``price[position]``, backward twice that."""
    def pool_seconds(pools):
        f = np.array([price[int(p[0])] for p in pools])
        return f, 2.0 * f
    return pool_seconds


def test_balance_lane_pipelines_by_hand():
    """PP = 2, two lanes of two one-sequence pools, B = 2F. Lane 0 runs F (3, 3): s0 F0 [0,3]; s1 F0 [3,6] B0 [6,12];
    s0 F1 [3,6] B0 [12,18]; s1 F1 [12,15] B1 [15,21]; s0 B1 [21,27] -> 27. Lane 1 runs (1, 1) -> 9. Any swap of a
    3 with a 1 gives lanes (1, 3) -> 19 and (3, 1), whose best order (1, 3) is 19 (test_choose_lanes' timelines).
    Then the lanes are even: no swap lowers 19."""
    layout = SyncLayout(2, 1, 2, pipeline_parallel_size=2)
    pool_seconds = _by_sequence({0: 3.0, 1: 1.0, 2: 3.0, 3: 1.0})  # GA-major: lane 0 = positions 0, 2
    assert priced_step_seconds(np.arange(4), layout, pool_seconds) == pytest.approx(27.0)
    out, step = balance_lane_pipelines(np.arange(4), layout, pool_seconds)
    assert step == pytest.approx(19.0)
    assert priced_step_seconds(out, layout, pool_seconds) == pytest.approx(19.0)
    lanes = out.reshape(2, 2).T  # [lane, GA]
    assert all(sorted(pool_seconds(lane[:, None])[0].tolist()) == [1.0, 3.0] for lane in lanes)
    assert all(pool_seconds(lane[:, None])[0].tolist() == [1.0, 3.0] for lane in lanes)  # light first: 19, not 20
    # lanes already even: nothing moves, and a lane's order is only changed where that is shorter
    even, _ = balance_lane_pipelines(np.array([1, 3, 0, 2]), layout, _by_sequence({0: 3.0, 1: 1.0, 2: 3.0, 3: 1.0}))
    assert even.tolist() == [1, 3, 0, 2]


def _brute_force_step(pools, layout, pool_seconds):
    """The shortest step over every split of ``pools`` [n, P] into two lanes of GA and every microbatch order: each
    GA-subset's shortest pipeline over all its orders (one pipeline run), then the best split."""
    ga = layout.num_microbatches
    fwd, bwd = pool_seconds(pools)
    subsets = list(itertools.combinations(range(len(pools)), ga))
    perms = np.array([[s[i] for i in p] for s in subsets for p in itertools.permutations(range(ga))]).T  # [GA, cols]
    spans = run_lane_pipelines(fwd[perms], layout, bwd[perms]).makespan.reshape(len(subsets), -1).min(axis=1)
    best = dict(zip(subsets, spans))
    return min(max(best[s], best[tuple(k for k in range(len(pools)) if k not in s)]) for s in subsets)


def test_balance_lane_pipelines_keeps_pools_never_lengthens_and_never_beats_brute_force():
    rng = np.random.default_rng(11)
    gains = []
    for seed in range(6):
        for pp, vpp in ((2, 1), (3, 1), (2, 2)):
            ga = 4 if vpp == 2 else 3
            layout = SyncLayout(4, 2, ga, pipeline_parallel_size=pp, virtual_pipeline_size=vpp)
            weight = rng.lognormal(0.0, 1.2, 4 * ga)
            pool_seconds = lambda pools: (weight[pools].sum(axis=1), 2.5 * weight[pools].sum(axis=1)  # noqa: E731
                                          + weight[pools].max(axis=1))
            order = rng.permutation(4 * ga)
            out, step = balance_lane_pipelines(order, layout, pool_seconds)
            assert sorted(out.tolist()) == list(range(4 * ga)) and _pool_sets(out, 2) == _pool_sets(order, 2)
            before, after = (priced_step_seconds(o, layout, pool_seconds) for o in (order, out))
            assert after <= before + 1e-12 and step == after  # the step it reports is the order's
            assert after >= _brute_force_step(out.reshape(-1, 2), layout, pool_seconds) - 1e-12
            gains.append(before - after)
    assert max(gains) > 0  # some window is evened (a pass that returned its input would fail here)


def test_fastest_balanced_evens_only_lanes_of_few_microbatches():
    """Hand cases through ``fastest_balanced``: the fastest candidate evened at GA = 2; a heavy and a light lane at
    GA above ``PIPELINE_BALANCE_GA`` come back as they are, though evening them would help."""
    layout = SyncLayout(2, 1, 2, pipeline_parallel_size=2)
    pool_seconds = _by_sequence({0: 3.0, 1: 1.0, 2: 3.0, 3: 1.0})
    # the second candidate runs lanes (3, 1) and (3, 1): 20 against the first's 27; evened (each lane 1 then 3): 19
    order, best = fastest_balanced([np.arange(4), np.array([0, 2, 1, 3])], layout, pool_seconds)
    assert best == 1 and priced_step_seconds(order, layout, pool_seconds) == pytest.approx(19.0)
    ga = PIPELINE_BALANCE_GA + 1
    long = SyncLayout(2, 1, ga, pipeline_parallel_size=2)
    heavy_lane_0 = _by_sequence({k: 3.0 if k % 2 == 0 else 1.0 for k in range(2 * ga)})  # position k: lane k % 2
    start = np.arange(2 * ga)
    _, step = balance_lane_pipelines(start, long, heavy_lane_0)
    assert step < priced_step_seconds(start, long, heavy_lane_0)  # evening would help here ...
    order, best = fastest_balanced([start], long, heavy_lane_0)
    assert best == 0 and np.array_equal(order, start)  # ... but lanes this long are left as they are

