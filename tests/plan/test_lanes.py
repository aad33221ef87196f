"""Sync-aware VRSP (plan/sequences/lanes.py): a permutation in GA-major, pool-minor order whose lane totals are balanced,
checked against brute force on small windows and against Algorithm 1 under the same model."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_megatron.config import SequencePlacement
from libra_megatron.plan.sequences import (SyncLayout, assign_to_ranks, lane_loads, place_for_sync, place_sequences,
                                           sync_proxy_seconds)
from libra_megatron.plan.model import imbalance


def _long_tailed(rng, n):
    return np.floor(rng.pareto(1.2, size=n) * 1000.0) ** 2 + 1.0


def _lane_max_brute_force(flops, num_lanes, lane_size):
    """Smallest possible heaviest lane over every split of the window into equal-size lanes."""
    best = np.inf
    items = range(flops.size)

    def split(rest, lanes_left, worst):
        nonlocal best
        if worst >= best:
            return
        if lanes_left == 1:
            best = min(best, max(worst, flops[list(rest)].sum()))
            return
        first, others = rest[0], rest[1:]
        for mates in itertools.combinations(others, lane_size - 1):
            lane = (first,) + mates
            split(tuple(i for i in others if i not in mates), lanes_left - 1, max(worst, flops[list(lane)].sum()))

    split(tuple(items), num_lanes, 0.0)
    return best


@pytest.mark.parametrize("dp,pool,ga,pp", [(4, 1, 3, 1), (4, 2, 2, 1), (8, 2, 4, 1), (8, 2, 4, 2), (16, 4, 2, 4)])
def test_sync_order_is_a_ga_major_pool_minor_permutation_with_lanes_balanced(dp, pool, ga, pp):
    rng = np.random.default_rng(dp * 31 + ga)
    flops = _long_tailed(rng, dp * ga)
    layout = SyncLayout(dp, pool, ga, pipeline_parallel_size=pp)
    order = place_sequences(flops, pool, SequencePlacement.SYNC, layout)
    assert sorted(order.tolist()) == list(range(dp * ga))
    assert np.array_equal(order, place_sequences(flops, pool, SequencePlacement.SYNC, layout))  # deterministic
    # lane j = the DP ranks j*P .. j*P+P-1 at every GA step (assign_to_ranks is the runtime's rule)
    _, rank = assign_to_ranks(order, dp, pool)
    by_ranks = np.bincount(rank // pool, weights=flops[order], minlength=dp // pool)
    assert np.allclose(by_ranks, lane_loads(flops, order, dp, pool))
    alg1 = place_sequences(flops, pool, SequencePlacement.ALG1)
    assert sync_proxy_seconds(flops, order, layout) <= sync_proxy_seconds(flops, alg1, layout) * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=8, max_size=8), st.sampled_from([(4, 1), (2, 1), (4, 2)]))
def test_pp1_lane_maximum_is_no_worse_than_alg1_and_near_the_brute_force_optimum(values, dp_pool):
    dp, pool = dp_pool
    flops = np.asarray(values, dtype=np.float64) ** 2
    ga = flops.size // dp
    layout = SyncLayout(dp, pool, ga)
    order = place_for_sync(flops, layout)
    ours = lane_loads(flops, order, dp, pool).max()
    alg1 = lane_loads(flops, place_sequences(flops, pool, SequencePlacement.ALG1), dp, pool).max()
    optimum = _lane_max_brute_force(flops, dp // pool, ga * pool)
    assert ours <= alg1 * (1 + 1e-12)
    assert optimum <= ours * (1 + 1e-12) and ours <= optimum * 4 / 3  # LPT's worst case, with swaps on top


def test_lanes_beat_per_instance_placement_when_one_sequence_dominates():
    # DP=4, P=2, GA=2: the whale fills its instance; per-instance balancing adds it on top of a second
    # heavy instance in the same lane, the lane placement gives its lane the lightest partners
    flops = np.array([100.0, 10, 10, 10, 10, 10, 1, 1])
    layout = SyncLayout(4, 2, 2)
    order = place_for_sync(flops, layout)
    lanes = lane_loads(flops, order, 4, 2)
    assert lanes.max() == pytest.approx(100 + 1 + 1 + 10)
    alg1 = place_sequences(flops, 2, SequencePlacement.ALG1)
    assert lane_loads(flops, alg1, 4, 2).max() > lanes.max()


def test_an_ep_group_across_lanes_falls_back_to_per_instance_refined():
    rng = np.random.default_rng(5)
    flops = _long_tailed(rng, 32)
    layout = SyncLayout(8, 2, 4, expert_parallel_size=8)  # TP=CP=1: one EP group ties all four lanes
    assert layout.ep_ties_lanes
    assert np.array_equal(place_for_sync(flops, layout), place_sequences(flops, 2, SequencePlacement.REFINED))


def test_pipeline_lanes_flatten_their_microbatches():
    rng = np.random.default_rng(11)
    flops = rng.uniform(1.0, 100.0, size=64) ** 2  # no sequence outweighs a microbatch: flattening can work
    layout = SyncLayout(8, 2, 8, pipeline_parallel_size=4)
    order = place_for_sync(flops, layout)
    per_mb = flops[order].reshape(8, 4, 2).sum(axis=2)  # [GA, lanes]
    contiguous = flops.reshape(8, 4, 2).sum(axis=2)
    assert np.mean([imbalance(per_mb[:, j]) for j in range(4)]) < np.mean([imbalance(contiguous[:, j]) for j in range(4)])
    assert sync_proxy_seconds(flops, order, layout) <= sync_proxy_seconds(flops, np.arange(64), layout)


def test_sync_without_a_layout_is_refined_and_a_mismatched_layout_is_refused():
    flops = np.arange(1.0, 17.0) ** 2
    assert np.array_equal(place_sequences(flops, 4, SequencePlacement.SYNC),
                          place_sequences(flops, 4, SequencePlacement.REFINED))
    with pytest.raises(ValueError, match="pool size 2 differs from pool_size"):
        place_sequences(flops, 4, SequencePlacement.SYNC, SyncLayout(4, 2, 4))
    with pytest.raises(ValueError, match="16 sequences but GA\\*DP = 2\\*4 = 8"):
        place_for_sync(flops, SyncLayout(4, 2, 2))


@pytest.mark.parametrize("values", ["ties", "long-tailed"])
def test_nearest_half_gap_search_is_the_brute_force_best_swap_in_python_and_numpy(values, monkeypatch):
    """The swap search of the lane balancing (``lanes._nearest_half_gap``): its small-lane plain-Python form and its
    numpy form pick the same swap (slot, slot, moved F) on every case, and that swap leaves the pair maximum no
    pair of the two lanes beats (brute force over all pairs)."""
    from libra_megatron.plan.sequences import lanes

    rng = np.random.default_rng(7 if values == "ties" else 8)
    found = 0
    for _ in range(1500):
        n = int(rng.integers(1, 17))
        raw = rng.integers(0, 6, size=2 * n) if values == "ties" else _long_tailed(rng, 2 * n)
        heavy, light = raw[:n].astype(float), raw[n:].astype(float)
        gap = float(abs(heavy.sum() - light.sum()))
        python = lanes._nearest_half_gap(heavy, light, gap)
        monkeypatch.setattr(lanes, "_SMALL_LANE", 0)
        vectorised = lanes._nearest_half_gap(heavy, light, gap)
        monkeypatch.undo()
        moved = heavy[:, None] - light[None, :]
        score = np.where((moved > 0) & (moved < gap), np.abs(moved - gap / 2.0), np.inf)
        if not np.isfinite(score.min()):
            assert python is None and vectorised is None
            continue
        found += 1
        assert python is not None and vectorised is not None
        assert (python[0], int(python[1]), python[2]) == (vectorised[0], int(vectorised[1]), vectorised[2])
        slot_h, slot_l, moved_f = python
        assert moved_f == heavy[slot_h] - light[slot_l]
        assert abs(moved_f - gap / 2.0) == score.min()
    assert found > 500
