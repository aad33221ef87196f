"""plan.model.kernel_cost (review objection 2): the calibrated tile cost model, its fit, and Algorithm 2 fed with it."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_megatron.config import TilePlacement
from libra_megatron.plan.model import FEATURES, TileCostModel, entry_features, fit_tile_cost_model, nnls, tile_features
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.tiles import build_tiles, place_tiles
from libra_megatron.plan.pool import plan_pool

from .test_placement import pools, reference_alg2
from .test_pool import setup as pool_setup

TRUE_MODEL = TileCostModel(2.5e-8, 2.0e-6, 4.5e-4, 3.0e-9, per_call=1.5e-3)


def synthetic_samples(model: TileCostModel, num: int, seed: int, noise: float = 0.0):
    """SYNTHETIC (not measured): random varlen calls priced by ``model``, times (1 + noise * N(0, 1))."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        n = int(rng.integers(1, 200))
        q = rng.integers(1, 512, n)
        k = q + np.where(rng.random(n) < 0.5, 0, rng.integers(0, 4096, n))
        feats = entry_features(q, k, int(rng.integers(1, 4)))
        seconds = float(model.predict(feats[None], 1)[0]) * (1.0 + noise * rng.standard_normal())
        out.append({**dict(zip(FEATURES, feats.tolist())), "calls": 1, "seconds": seconds})
    return out


@pytest.mark.parametrize("relative", [True, False])
def test_fit_recovers_known_coefficients_from_synthetic_samples(relative):
    fitted = fit_tile_cost_model(synthetic_samples(TRUE_MODEL, 40, seed=1), relative=relative)
    np.testing.assert_allclose(fitted.coefficients, TRUE_MODEL.coefficients, rtol=1e-6)
    assert fitted.per_call == pytest.approx(TRUE_MODEL.per_call, rel=1e-6)


def test_fit_with_noise_and_a_zero_term_predicts_fresh_calls_within_a_few_percent():
    truth = TileCostModel(2.5e-8, 2.0e-6, 4.5e-4, 0.0)  # synthetic, key-row term absent
    fitted = fit_tile_cost_model(synthetic_samples(truth, 200, seed=2, noise=0.02))
    assert (fitted.coefficients >= 0).all() and fitted.per_call >= 0
    fresh = synthetic_samples(truth, 50, seed=9)
    pred = fitted.predict([[s[f] for f in FEATURES] for s in fresh], 1)
    seconds = np.array([s["seconds"] for s in fresh])
    assert np.mean(np.abs(pred - seconds) / seconds) < 0.03


def test_fit_pairs_only_is_the_flops_proxy():
    fitted = fit_tile_cost_model(synthetic_samples(TRUE_MODEL, 30, seed=3), features=("pairs",))
    assert fitted.per_pair_head > 0
    assert (fitted.per_row_head, fitted.per_entry, fitted.per_key_row_head, fitted.per_call) == (0, 0, 0, 0)


def _brute_force_nnls_residual(a, b):
    """Smallest residual over every support set whose unconstrained least squares is non-negative."""
    best = np.linalg.norm(b)
    for size in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), size):
            x = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if (x >= 0).all():
                best = min(best, np.linalg.norm(a[:, cols] @ x - b))
    return best


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_numpy_nnls_reaches_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((9, 5)), rng.standard_normal(9)
    x = nnls(a, b)
    assert (x >= 0).all()
    assert np.linalg.norm(a @ x - b) <= _brute_force_nnls_residual(a, b) * (1 + 1e-9) + 1e-12


def _hand_tiles():
    # L=8, CP=1, P=1, B=4, samples [3, 5]; hq=4, H=2, M=2 -> 2 query heads per tile, 2 calls
    # block 0: sample 0 rows [0,3) (e=3), sample 1 rows [0,1) (e=1): pairs 6+1=7, rows 4, frags 2, keys 3+1=4
    # block 1: sample 1 rows [1,5) (e=5): pairs 15-1=14, rows 4, frags 1, keys 5
    return build_tiles([[3, 5]], TokenLayout("contiguous", 8, 1), HeadLayout(4, 2, 1, 2, 2, elem_bytes=1), 4)


def test_tile_costs_equal_a_hand_computed_case():
    tiles = _hand_tiles()
    expected_features = [[14, 8, 4, 8]] * 2 + [[28, 8, 2, 10]] * 2
    np.testing.assert_array_equal(tile_features(tiles), expected_features)
    costs = TileCostModel(1.0, 10.0, 100.0, 1000.0, per_call=1e6).tile_costs(tiles)
    np.testing.assert_array_equal(costs, [14 + 80 + 400 + 8000] * 2 + [28 + 80 + 200 + 10000] * 2)
    np.testing.assert_array_equal(TileCostModel.flops_only().tile_costs(tiles), tiles.tile_flops())


@settings(max_examples=60, deadline=None)
@given(pools(), st.sampled_from(list(TilePlacement)))
def test_place_tiles_with_tile_flops_as_cost_reproduces_the_default_assignment(case, method):
    tiles, tau = case
    default = place_tiles(tiles, tau=tau, method=method)
    same = place_tiles(tiles, tau=tau, method=method, tile_cost=tiles.tile_flops().astype(np.float64))
    np.testing.assert_array_equal(same.assignment, default.assignment)
    np.testing.assert_array_equal(same.loads, default.loads)
    assert (same.comm_bytes, same.num_fallback, same.capacity) == (default.comm_bytes, default.num_fallback,
                                                                   default.capacity)


@settings(max_examples=40, deadline=None)
@given(pools())
def test_place_tiles_with_calibrated_costs_equals_direct_reference(case):
    tiles, tau = case
    cost = TRUE_MODEL.tile_costs(tiles)
    expected, comm, fallbacks = reference_alg2(tiles, tau, cost)
    got = place_tiles(tiles, tau=tau, tile_cost=cost)
    np.testing.assert_array_equal(got.assignment, expected)
    assert (sum(got.comm_bytes), got.num_fallback) == (comm, fallbacks)


def test_place_tiles_rejects_bad_cost_vectors():
    tiles = _hand_tiles()
    with pytest.raises(ValueError, match="shape"):
        place_tiles(tiles, tile_cost=np.ones(3))
    with pytest.raises(ValueError, match=">= 0"):
        place_tiles(tiles, tile_cost=np.array([1.0, -1.0, 1.0, 1.0]))


def test_plan_pool_flops_only_model_keeps_the_fingerprint_and_calibrated_balances_seconds():
    segs, config, layout, heads = pool_setup(seed=5)
    default = plan_pool(segs, config, layout, heads)
    flops = plan_pool(segs, config, layout, heads, tile_cost_model=TileCostModel.flops_only())
    cal = plan_pool(segs, config, layout, heads, tile_cost_model=TRUE_MODEL)
    assert flops.fingerprint == default.fingerprint
    np.testing.assert_allclose(cal.placement.loads.sum(), TRUE_MODEL.tile_costs(cal.tiles).sum())


def test_model_json_round_trip_and_validation(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"model": TRUE_MODEL.to_dict(), "samples": []}))
    assert TileCostModel.from_json(path) == TRUE_MODEL
    with pytest.raises(ValueError, match="per_entry"):
        TileCostModel(1.0, 0.0, -1.0)
