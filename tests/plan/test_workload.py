"""Eq. 2 / Eq. 3 and the pool/worker lower bounds, against brute force on tiny instances."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from libra_megatron.plan.model import (clt_expected_imbalance, imbalance, pool_lower_bound,
    pool_lower_bound_counting, sequence_flops, worker_lower_bound)


def optimal_max_pool(flops, pool_size):
    """Exhaustive: min over all groupings into pools of exactly P of the heaviest pool load."""
    items = list(range(len(flops)))

    def best(rest):
        if not rest:
            return 0.0
        first, others = rest[0], rest[1:]
        out = math.inf
        for mates in itertools.combinations(others, pool_size - 1):
            left = [i for i in others if i not in mates]
            load = flops[first] + sum(flops[i] for i in mates)
            out = min(out, max(load, best(left)))
        return out

    return best(items)


def optimal_max_worker(work, num_workers):
    return min(
        max(sum(w for w, a in zip(work, assign) if a == r) for r in range(num_workers))
        for assign in itertools.product(range(num_workers), repeat=len(work))
    )


def test_sequence_flops_is_sum_of_squares():
    got = sequence_flops([[3, 4], [7], [1, 1, 1]])
    np.testing.assert_array_equal(got, [25.0, 49.0, 3.0])
    with pytest.raises(ValueError, match="positive"):
        sequence_flops([[2, 0]])


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([(2, 1), (4, 2), (6, 2), (6, 3), (8, 2), (8, 4)]),
    st.lists(st.integers(0, 1000), min_size=8, max_size=8),
)
def test_pool_lower_bounds_never_exceed_the_exhaustive_optimum(shape, values):
    gbs, pool_size = shape
    flops = [float(v) for v in values[:gbs]]
    opt = optimal_max_pool(flops, pool_size)
    simple = pool_lower_bound(flops, pool_size)
    counting = pool_lower_bound_counting(flops, pool_size)
    assert simple <= counting + 1e-9
    assert counting <= opt + 1e-9


def test_pool_lower_bound_hand_case():
    # P=2, K=2: F = 10, 1, 1, 1 -> mean pool 6.5, outlier pool 10 + 1 = 11 (also optimal)
    assert pool_lower_bound([10, 1, 1, 1], 2) == 11.0
    # P=2, K=2: F = 5, 5, 5, 1: counting with j=1, x=1: top 3 items -> some pool has two fives = 10
    assert pool_lower_bound([5, 5, 5, 1], 2) == 8.0
    assert pool_lower_bound_counting([5, 5, 5, 1], 2) == 10.0 == optimal_max_pool([5, 5, 5, 1], 2)
    with pytest.raises(ValueError, match="5 % 2 = 1"):
        pool_lower_bound([1, 2, 3, 4, 5], 2)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=6), st.integers(1, 3))
def test_worker_lower_bound_never_exceeds_the_exhaustive_optimum(work, num_workers):
    assert worker_lower_bound(work, num_workers) <= optimal_max_worker(work, num_workers) + 1e-9


def test_imbalance_is_max_over_mean_minus_one():
    assert imbalance([1, 1, 1, 1]) == 0.0
    assert imbalance([3, 1]) == pytest.approx(0.5)
    assert imbalance([0, 0]) == 0.0


def test_clt_formula_matches_eq3_and_simulation_order_of_magnitude():
    assert clt_expected_imbalance(1.0, 4, 64) == pytest.approx(0.5 * math.sqrt(2 * math.log(16)))
    assert clt_expected_imbalance(1.0, 8, 8) == 0.0
    # Random grouping of i.i.d. exponential workloads (CV = 1): Eq. 3 is an approximation of E[R]-1.
    rng = np.random.default_rng(0)
    draws = rng.exponential(size=(400, 256, 16)).sum(axis=2)
    empirical = float(np.mean(draws.max(axis=1) / draws.mean(axis=1) - 1))
    assert 0.5 < empirical / clt_expected_imbalance(1.0, 16, 256 * 16) < 1.5
