"""Pipeline-bubble proxy (Fig. 12): max/mean over a step's GA microbatches of the worst worker's Eq. 6 load."""
from __future__ import annotations

import numpy as np
import pytest

from libra_megatron.config import LibraConfig, TilePlacement
from libra_megatron.megatron.metrics import microbatch_metrics, microbatch_worst_workers
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.pool import plan_pool

L, P, DP = 16, 2, 4  # GBS 8: GA = 2 microbatches, DP/P = 2 pools at each GA index, CP = 1
CONFIG = LibraConfig(pool_size=P, head_split=1, num_chunks=1, block_size=4, token_layout="contiguous",
                     tiling="uniform")
LAYOUT = TokenLayout("contiguous", L, 1)
HEADS = HeadLayout(2, 2, 8, 1, 1)
# causal pairs per sequence (sum of l(l+1)/2 over its documents):  136  72     40      136    24     88
WINDOW = [[16], [8, 8], [4] * 4, [16], [2] * 8, [12, 4], [1] * 16, [8, 4, 4]]  # ...  16  56


def test_worst_worker_of_each_ga_index_is_the_max_over_its_consecutive_pools():
    # DP/P = 2 pools per GA index: GA 0 = pools 0, 1; GA 1 = pools 2, 3; GA 2 = pools 4, 5
    assert microbatch_worst_workers([3, 7, 2, 2, 5, 1], 4, 2).tolist() == [7, 2, 5]
    assert microbatch_worst_workers([3, 7, 2], 2, 2).tolist() == [3, 7, 2]  # one pool per GA index


def test_max_over_mean_of_home_loads_matches_the_hand_computation():
    """With every tile at home (CP = 1), worker p's Eq. 6 load is hq * the causal pairs of sequence p."""
    home = CONFIG.replace(tile_placement=TilePlacement.HOME)
    order = [0, 6, 1, 2, 3, 4, 5, 7]  # pools {136, 16} {72, 40} | {136, 24} {88, 56}
    out = microbatch_metrics(WINDOW, order, DP, home, LAYOUT, HEADS)
    # sampler order: pools {136, 72} {40, 136} at GA 0 -> 136; {24, 88} {16, 56} at GA 1 -> 88
    assert out["microbatch_max_mean_before"] == pytest.approx(136 / ((136 + 88) / 2))
    assert out["microbatch_max_mean_after"] == pytest.approx(1.0)  # 136 at both GA indices
    assert out["microbatch_slowest_after_over_before"] == pytest.approx(1.0)  # 136 at both orders


def test_after_is_the_worst_worker_of_the_planners_tap_placement():
    """``after`` uses the placement the planner's ``plan_pool`` runs; TAP lowers it below the home value."""
    order = [3, 4, 0, 6, 1, 2, 5, 7]
    out = microbatch_metrics(WINDOW, order, DP, CONFIG, LAYOUT, HEADS)
    pools = np.asarray(order).reshape(-1, P)
    worst = [plan_pool([WINDOW[i] for i in pool], CONFIG, LAYOUT, HEADS).placement.loads.max() for pool in pools]
    per_ga = np.asarray(worst).reshape(-1, DP // P).max(axis=1)
    assert out["microbatch_max_mean_after"] == pytest.approx(per_ga.max() / per_ga.mean())
    assert out["microbatch_slowest_after_over_before"] == pytest.approx(per_ga.max() / (HEADS.num_q_heads * 136))
    at_home = microbatch_metrics(WINDOW, order, DP, CONFIG.replace(tile_placement=TilePlacement.HOME), LAYOUT, HEADS)
    assert out["microbatch_max_mean_after"] < at_home["microbatch_max_mean_after"]
    assert out["microbatch_max_mean_before"] == at_home["microbatch_max_mean_before"]  # before is always at home
