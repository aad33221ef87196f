"""Priced lanes (plan.sequences.priced_lanes): groupings, microbatch orders and the lane's choice, against hand-drawn
1F1B timelines and brute force."""
import itertools

import numpy as np
import pytest

from libra_megatron.plan.sequences import SyncLayout, run_lane_pipelines
from libra_megatron.plan.sequences.priced_lanes import (assemble_order, choose_lane, lane_groupings,
                                                        microbatch_orders)


def test_choose_lane_matches_hand_drawn_pipelines():
    layout = SyncLayout(2, 1, 2, pipeline_parallel_size=2)
    # PP=2, m=2, B = 2F. Times (3, 1): s0 F0 [0,3]; s1 F0 [3,6] B0 [6,12]; s0 F1 [3,4] B0 [12,18]; s1 F1 [12,13]
    # B1 [13,15]; s0 B1 [18,20] -> 20. Times (1, 3) -> 19 (tests/plan/test_sync.py). Times (2, 2): s0 F0 [0,2];
    # s1 F0 [2,4] B0 [4,8]; s0 F1 [2,4] B0 [8,12]; s1 F1 [8,10] B1 [10,14]; s0 B1 [14,18] -> 18.
    like = (np.array([3.0, 1.0]), np.array([6.0, 2.0]))
    name, order, span = choose_lane({"like": like}, layout)
    assert (name, order.tolist(), span) == ("like", [1, 0], pytest.approx(19.0))
    name, order, span = choose_lane({"like": like, "alg1": (np.array([2.0, 2.0]), np.array([4.0, 4.0]))}, layout)
    assert (name, order.tolist(), span) == ("alg1", [0, 1], pytest.approx(18.0))


def test_choose_lane_is_the_best_of_its_candidates_and_never_below_brute_force():
    rng = np.random.default_rng(7)
    for pp, ga in ((2, 4), (4, 5), (3, 3)):
        layout = SyncLayout(2, 1, ga, pipeline_parallel_size=pp)
        priced = {g: (rng.uniform(1, 5, ga), rng.uniform(2, 12, ga)) for g in ("like", "alg1")}
        name, order, span = choose_lane(priced, layout)
        fwd, bwd = priced[name]
        assert sorted(order.tolist()) == list(range(ga))
        got = run_lane_pipelines(fwd[order][:, None], layout, bwd[order][:, None]).makespan[0]
        assert span == pytest.approx(got)
        for g, (f, b) in priced.items():  # no candidate of any grouping is shorter
            for o in microbatch_orders(f + b):
                assert run_lane_pipelines(f[o][:, None], layout, b[o][:, None]).makespan[0] >= span - 1e-12
        brute = min(run_lane_pipelines(f[list(p)][:, None], layout, b[list(p)][:, None]).makespan[0]
                    for f, b in priced.values() for p in itertools.permutations(range(ga)))
        assert span >= brute - 1e-12


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
        choose_lane({"like": (np.ones(3), np.ones(3))}, layout)
    with pytest.raises(ValueError, match="unknown groupings \\['typo'\\]"):
        choose_lane({"like": (np.ones(2), np.ones(2)), "typo": (np.ones(2), np.ones(2))}, layout)
    with pytest.raises(ValueError, match="no grouping"):
        choose_lane({}, layout)
    with pytest.raises(ValueError, match="lanes chosen"):
        assemble_order([np.zeros((2, 2))], layout)
