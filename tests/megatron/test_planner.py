"""Background planner (determinism, fingerprints, failures surface at get) and the per-step metrics."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from libra_megatron.config import LibraConfig, TilePlacement
from libra_megatron.megatron.metrics import (aggregate_pool_metrics, inter_pool_metrics, pool_plan_metrics,
                                             write_metrics)
from libra_megatron.megatron.planner import BackgroundPlanner, PlannerError, pool_key
from libra_megatron.plan.errors import PlanError
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.pool import plan_pool

L, CP, P = 64, 2, 2
CONFIG = LibraConfig(pool_size=P, head_split=2, num_chunks=2, block_size=8, token_layout="zigzag")
LAYOUT = TokenLayout("zigzag", L, CP)
HEADS = HeadLayout(8, 2, 16, 2, 2, elem_bytes=2)
POOL_A = [[40, 3, 21], [64]]
POOL_B = [[10] * 6 + [4], [1, 63]]


def test_every_planner_instance_reproduces_the_direct_plan_fingerprint():
    direct = {pool_key(p): plan_pool(p, CONFIG, LAYOUT, HEADS).fingerprint for p in (POOL_A, POOL_B)}
    assert len(set(direct.values())) == 2  # different pools, different plans
    for _ in range(2):  # two independent "ranks"
        with BackgroundPlanner(CONFIG, LAYOUT, HEADS, mode="thread") as planner:
            planner.submit_many([POOL_A, POOL_B])
            for pool in (POOL_B, POOL_A):
                assert planner.get_pool(pool).pool_plan.fingerprint == direct[pool_key(pool)]


def test_get_returns_the_rank_plan_of_worker_position_times_cp_plus_cp_rank():
    with BackgroundPlanner(CONFIG, LAYOUT, HEADS, worker=3, mode="thread") as planner:
        for position in range(P):
            for cp_rank in range(CP):
                plan = planner.get(POOL_A, position=position, cp_rank=cp_rank)
                assert plan.rank == position * CP + cp_rank
                assert plan.local_tokens == L // CP
        assert len(planner.latencies()) == 1 and planner.latencies()[0] > 0  # planned once, cached


def test_a_failing_plan_surfaces_at_get_with_the_original_error_and_the_thread_survives():
    bad_pool = [[30, 30], [64]]  # sums to 60, not L = 64
    with BackgroundPlanner(CONFIG, LAYOUT, HEADS, mode="thread") as planner:
        planner.submit(bad_pool)
        with pytest.raises(PlannerError) as info:
            planner.get_pool(bad_pool, timeout=60)
        assert isinstance(info.value.__cause__, (PlanError, ValueError))
        assert "planner thread traceback" in str(info.value)
        assert planner.get_pool(POOL_A, timeout=60).pool_plan.fingerprint  # still serving


def test_a_stuck_plan_times_out_instead_of_hanging():
    release = threading.Event()

    def slow_plan(*args, **kwargs):
        release.wait(30)
        return plan_pool(*args, **kwargs)

    planner = BackgroundPlanner(CONFIG, LAYOUT, HEADS, plan_fn=slow_plan, mode="thread")
    start = time.perf_counter()
    with pytest.raises(PlannerError, match="did not finish"):
        planner.get_pool(POOL_A, timeout=0.3)
    assert time.perf_counter() - start < 5
    release.set()
    assert planner.get_pool(POOL_A, timeout=60).latency_s > 0
    planner.close()
    with pytest.raises(PlannerError, match="closed"):
        planner.submit(POOL_B)


def test_pool_key_depends_on_segment_boundaries_and_order():
    assert pool_key([[1, 2], [3]]) != pool_key([[1], [2, 3]])
    assert pool_key([[1, 2], [3]]) != pool_key([[3], [1, 2]])
    assert pool_key([[1, 2], [3]]) == pool_key([np.array([1, 2]), (3,)])


# ------------------------------------------------------------------ metrics
def _brute_force_r1(segments, order, pool_size):
    flops = [sum(x * x for x in seg) for seg in segments]
    pools = [sum(flops[i] for i in order[k:k + pool_size]) for k in range(0, len(order), pool_size)]
    return max(pools) / (sum(pools) / len(pools)) - 1


def test_inter_pool_metrics_match_brute_force_pool_sums():
    segments = [[4], [1, 1, 1, 1], [2, 2], [3, 1], [4], [2, 1, 1]]
    order = [0, 1, 2, 3, 4, 5][::-1]
    out = inter_pool_metrics(segments, order, 2)
    assert out["inter_pool_r1_before"] == pytest.approx(_brute_force_r1(segments, list(range(6)), 2))
    assert out["inter_pool_r1_after"] == pytest.approx(_brute_force_r1(segments, order, 2))


def test_pool_plan_metrics_home_equals_placed_without_migration_and_bytes_match_the_plan():
    home = plan_pool(POOL_B, CONFIG.replace(tile_placement=TilePlacement.HOME), LAYOUT, HEADS)
    m = pool_plan_metrics(home, planner_latency_s=0.5)
    assert m["intra_pool_max_over_mean_home"] == pytest.approx(m["intra_pool_max_over_mean_placed"])
    assert m["bytes_q"] == 0 and m["bytes_o"] == 0  # no tile leaves its Q-home
    placed = plan_pool(POOL_B, CONFIG, LAYOUT, HEADS)
    m2 = pool_plan_metrics(placed)
    loads = np.bincount(placed.placement.assignment, weights=placed.tiles.tile_flops(), minlength=P * CP)
    assert m2["intra_pool_max_over_mean_placed"] == pytest.approx(loads.max() / loads.mean())
    assert m2["intra_pool_max_over_mean_placed"] < m2["intra_pool_max_over_mean_home"]
    assert (m2["bytes_q"], m2["bytes_kv"], m2["bytes_o"]) == (placed.exchange.bytes_q, placed.exchange.bytes_kv,
                                                              placed.exchange.bytes_o)
    agg = aggregate_pool_metrics([m, m2])
    assert agg["bytes_kv"] == m["bytes_kv"] + m2["bytes_kv"] and agg["planner_latency_max_s"] == 0.5


def test_write_metrics_uses_the_writer_and_is_a_noop_without_one():
    class Writer:
        def __init__(self):
            self.rows = []

        def add_scalar(self, tag, value, step):
            self.rows.append((tag, value, step))

    writer = Writer()
    assert write_metrics({"a": 1.0, "b": 2}, 7, writer=writer) == 2
    assert writer.rows == [("libra/a", 1.0, 7), ("libra/b", 2.0, 7)]
    assert write_metrics({"a": 1.0}, 7) == 0  # no Megatron-LM writer in this process


def test_step_metrics_combines_window_and_pool_levels():
    from libra_megatron.megatron.metrics import step_metrics

    segments = [seg for pool in (POOL_A, POOL_B) for seg in pool]
    plans = [plan_pool(POOL_A, CONFIG, LAYOUT, HEADS), plan_pool(POOL_B, CONFIG, LAYOUT, HEADS)]
    out = step_metrics(segments, [0, 1, 2, 3], P, plans, latencies=[0.1, 0.3])
    assert out["inter_pool_r1_before"] == pytest.approx(_brute_force_r1(segments, [0, 1, 2, 3], P))
    per_pool = [pool_plan_metrics(p) for p in plans]
    assert out["intra_pool_max_over_mean_placed"] == max(m["intra_pool_max_over_mean_placed"] for m in per_pool)
    assert out["bytes_q"] == sum(p.exchange.bytes_q for p in plans)
    assert out["planner_latency_mean_s"] == pytest.approx(0.2) and out["planner_latency_max_s"] == 0.3
