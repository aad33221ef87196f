"""Plan-ahead (§5 "Data and planning path"): the sampler announces each window's keys, LibraHooks queues
their pool plans on the background planner before get_batch asks, the cache stays bounded, and lazily
built RankPlans are safe to share between the planner thread and the training thread."""
from __future__ import annotations

import argparse
import pickle
import sys
import threading
import time
import types

import numpy as np
import pytest

from libra_megatron.config import LibraConfig
from libra_megatron.megatron.hooks import LibraHooks
from libra_megatron.megatron.planner import BackgroundPlanner, PlannerError, pool_key
from libra_megatron.megatron.planner_setup import build_planner_from_args
from libra_megatron.megatron.sampler import LibraGlobalBatchSampler, pool_proxy_from_args, sync_layout_from_args
from libra_megatron.plan.sequences.lanes import priced_lanes_apply
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.pool import plan_pool

from conftest import SEQ_LENGTH

DP, POOL, GBS, RANK = 4, 2, 16, 1
NUM_GA = GBS // DP
CONFIG = LibraConfig(pool_size=POOL, block_size=64, num_chunks=2)


def _toy_dataset(num_samples: int = 96, seq_len: int = 64, seed: int = 0) -> list:
    """Segment lengths (summing to seq_len) of each sample; the sampler reads them through ``segments_fn``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_samples):
        cuts = np.sort(rng.choice(np.arange(1, seq_len), size=int(rng.integers(0, 4)), replace=False))
        out.append(np.diff(np.concatenate([[0], cuts, [seq_len]])))
    return out


def _toy_sampler(dataset, consumed=0, loader="single", listener=None) -> LibraGlobalBatchSampler:
    return LibraGlobalBatchSampler(dataset, len(dataset), consumed, 1, GBS, RANK, DP, POOL,
                                   dataloader_type=loader, seed=5, segments_fn=lambda ds, i: ds[i],
                                   on_window_planned=listener)


# ---------------------------------------------------------------------------------------------- sampler
@pytest.mark.parametrize("loader, consumed", [("single", 0), ("single", GBS + 2 * DP), ("cyclic", 3 * DP)])
def test_sampler_announces_each_window_with_exactly_the_keys_it_then_yields_before_the_first(loader, consumed):
    dataset, events = _toy_dataset(), []
    sampler = _toy_sampler(dataset, consumed, loader, listener=lambda v, keys: events.append(("planned", v, keys)))
    for batch in sampler:
        events.append(("yield", batch[0].window, batch[0]))
    announced = [e for e in events if e[0] == "planned"]
    assert [v for _, v, _ in announced] == sorted({e[1] for e in events})  # once per window, in order
    for _, window, keys in announced:
        at = events.index(("planned", window, keys))
        yielded = [e[2] for e in events if e[0] == "yield" and e[1] == window]
        assert list(keys) == yielded
        assert events[at + 1] == ("yield", window, keys[0])  # announced right before its first key
    first_ga = (consumed % GBS) // DP
    assert announced[0][2][0].ga_index == first_ga  # resume: only the unconsumed suffix is announced
    plain = [b[0] for b in _toy_sampler(dataset, consumed, loader)]
    assert plain == [e[2] for e in events if e[0] == "yield"]  # the listener changes nothing yielded


# ---------------------------------------------------------------------------------------------- hooks
class _RecordingPlanner:
    """Delegates to a real BackgroundPlanner; records submissions and what had been submitted at each get."""

    def __init__(self, inner: BackgroundPlanner):
        self.inner, self.submitted, self.gets = inner, [], []

    def submit_many(self, pools):
        self.submitted.extend(pool_key(p) for p in pools)
        return self.inner.submit_many(pools)

    def get_planned(self, pool_segments, *, position, cp_rank):
        self.gets.append((pool_key(pool_segments), tuple(self.submitted)))
        return self.inner.get_planned(pool_segments, position=position, cp_rank=cp_rank)

    def close(self):
        self.inner.close()


def _megatron_args() -> argparse.Namespace:
    return argparse.Namespace(
        micro_batch_size=1, global_batch_size=GBS, data_parallel_size=DP, dataloader_type="single", seed=3,
        num_workers=0, seq_length=SEQ_LENGTH, context_parallel_size=1, tensor_model_parallel_size=1,
        num_attention_heads=4, num_query_groups=2, group_query_attention=True, kv_channels=16, hidden_size=64,
        bf16=False)


@pytest.fixture
def wired_hooks(monkeypatch):
    """``make(planner)``: LibraHooks with that planner, as on a DP rank RANK of DP, CP = TP = 1 (no Megatron-LM)."""
    from megatron.core import parallel_state

    args = _megatron_args()
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args
    utils = types.ModuleType("megatron.training.utils")
    utils.is_first_or_last_pipeline_stage = lambda vp_stage=None: True
    training.utils = utils
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.utils", utils)
    for name, value in (("get_data_parallel_rank", RANK), ("get_data_parallel_world_size", DP),
                        ("get_context_parallel_rank", 0), ("get_context_parallel_world_size", 1),
                        ("get_tensor_model_parallel_world_size", 1)):
        monkeypatch.setattr(parallel_state, name, lambda value=value, **kw: value)
    made = []

    def make(planner):
        hooks = LibraHooks()
        hooks.config, hooks.planner = CONFIG, planner
        made.append(hooks)
        return hooks, args

    yield make
    for hooks in made:
        hooks.planner.close()


def test_hooks_queue_every_ga_plan_of_a_window_before_get_batch_and_get_matches_sync_planning(
        wired_hooks, trace_gpt_dataset):
    recorder = _RecordingPlanner(build_planner_from_args(CONFIG, _megatron_args()))
    hooks, args = wired_hooks(recorder)
    iterator = iter(hooks.build_data_loader(trace_gpt_dataset, 0))
    # the loader's own placement: its sync layout and (where lanes are priced) the Megatron run's pool proxy
    layout = sync_layout_from_args(args, DP, POOL)
    proxy = pool_proxy_from_args(args, POOL) if priced_lanes_apply(layout) else None
    reference = LibraGlobalBatchSampler(trace_gpt_dataset, len(trace_gpt_dataset), 0, 1, GBS, RANK, DP, POOL,
                                        sync_layout=layout, pool_proxy=proxy)
    num_windows = 2
    for step in range(num_windows * NUM_GA):
        window, ga = divmod(step, NUM_GA)
        key = reference.keys_for_window(reference.plan_window(window))[ga]
        packed = hooks.get_batch(iterator)[-1]
        planned_key, submitted_before_get = recorder.gets[step]
        window_keys = [pool_key(k.pool_segments)
                       for k in reference.keys_for_window(reference.plan_window(window))]
        assert planned_key == pool_key(key.pool_segments)
        assert set(window_keys) <= set(submitted_before_get)  # the whole window, before its first get
        inner = recorder.inner
        sync = plan_pool([list(s) for s in key.pool_segments], CONFIG, inner.layout, inner.heads)
        expected = sync.exchange.for_rank(key.pool_position)  # CP = 1: worker p
        assert packed.libra_plan.fingerprint == expected.fingerprint == sync.fingerprint
        assert packed.libra_plan.rank == expected.rank
        np.testing.assert_array_equal(packed.libra_plan.cu_seqlens_q, expected.cu_seqlens_q)
        planned = inner.get_pool(key.pool_segments)  # the knobs the module will run with travel on the carrier
        assert packed.libra_kernel_backend == CONFIG.kernel_backend.value
        assert packed.libra_save_mode == planned.save_mode.value
    assert len(recorder.submitted) == num_windows * NUM_GA  # one submission per GA index, nothing more
    assert len(recorder.inner.latencies()) == len(set(recorder.submitted))  # no pool planned twice


def test_a_plan_failing_in_the_planner_thread_surfaces_at_get_batch(wired_hooks, trace_gpt_dataset):
    def broken_plan(*args, **kwargs):
        raise ValueError("synthetic planner bug")

    base = build_planner_from_args(CONFIG, _megatron_args())
    base.close()
    planner = BackgroundPlanner(CONFIG, base.layout, base.heads, plan_fn=broken_plan, timeout_s=30, mode="thread")
    hooks, _ = wired_hooks(planner)
    iterator = iter(hooks.build_data_loader(trace_gpt_dataset, 0))
    start = time.perf_counter()
    with pytest.raises(PlannerError, match="background planner failed .*synthetic planner bug") as info:
        hooks.get_batch(iterator)
    assert isinstance(info.value.__cause__, ValueError)
    assert time.perf_counter() - start < 10


def test_a_dead_planner_thread_fails_get_at_once_instead_of_waiting_for_the_timeout():
    planner = BackgroundPlanner(CONFIG, TokenLayout("zigzag", 64, 1), HeadLayout(4, 2, 16, 1, 2),
                                timeout_s=120, mode="thread")
    planner._queue.put(None)  # the thread exits as if it crashed, with the planner still open
    planner._thread.join(10)
    start = time.perf_counter()
    with pytest.raises(PlannerError, match="dead"):
        planner.get_pool([[64], [64]])
    assert time.perf_counter() - start < 5


# ---------------------------------------------------------------------------------------------- memory
class _StubPlan:
    """Stands in for a PoolPlan (the cache tests need no real planning)."""

    def __init__(self, segments):
        self.segments = segments


def test_the_cache_stays_bounded_over_many_windows_without_replanning():
    capacity = 2 * NUM_GA
    dataset = [np.array([i + 1, 2048 - i - 1]) for i in range(60 * GBS)]  # every pool distinct
    with BackgroundPlanner(CONFIG, TokenLayout("zigzag", 64, 1), HeadLayout(4, 2, 16, 1, 2),
                           plan_fn=lambda segments, *a, **k: _StubPlan(segments), capacity=capacity,
                           mode="thread") as planner:
        sampler = _toy_sampler(dataset, listener=lambda v, keys: planner.submit_many(
            [k.pool_segments for k in keys]))
        sizes, pools = [], set()
        for batch in sampler:
            key = batch[0]
            pools.add(pool_key(key.pool_segments))
            assert planner.get_pool(key.pool_segments).pool_plan.segments == [list(s) for s in key.pool_segments]
            sizes.append(planner.num_cached())
        assert len(pools) > 10 * capacity  # eviction was exercised
        assert max(sizes) <= capacity + NUM_GA  # finished <= capacity, plus at most a window queued
        assert len(planner.latencies()) == len(pools)  # nothing submitted ahead was evicted before its get


def test_plans_submitted_ahead_outlive_recently_consumed_ones():
    calls = []

    def plan_fn(segments, *args, **kwargs):
        calls.append(pool_key(segments))
        return _StubPlan(segments)

    a, b, c = [[64], [64]], [[32, 32], [64]], [[16, 48], [64]]
    with BackgroundPlanner(CONFIG, TokenLayout("zigzag", 64, 1), HeadLayout(4, 2, 16, 1, 2),
                           plan_fn=plan_fn, capacity=1, mode="thread") as planner:
        planner.get_pool(a)  # consumed
        planner.submit(b)  # owed one get
        deadline = time.perf_counter() + 10
        while len(planner.latencies()) < 2 and time.perf_counter() < deadline:
            time.sleep(0.005)
        planner.get_pool(a)  # a is the most recently used, but consumed: evicted before b
        planner.submit(c)
        planner.get_pool(b)
    assert calls.count(pool_key(b)) == 1  # b was not evicted and planned again


# ---------------------------------------------------------------------------------------------- lazy RankPlans
def test_lazy_rank_plans_are_built_once_when_threads_race_and_stay_picklable(monkeypatch):
    from libra_megatron.plan.exchange import tables

    layout, heads = TokenLayout("zigzag", 64, 2), HeadLayout(4, 2, 16, 1, 2)
    plan = plan_pool([[40, 3, 21], [64]], CONFIG, layout, heads)
    ranks = tables.LazyRankPlans(plan.exchange.ranks._tables)  # nothing built yet
    build, built = tables.PlanTables.rank_plan, []

    def slow_build(tables, rank):
        built.append(rank)
        time.sleep(0.05)  # widen the check-then-build window
        return build(tables, rank)

    monkeypatch.setattr(tables.PlanTables, "rank_plan", slow_build)
    barrier, results = threading.Barrier(8), []

    def worker():
        barrier.wait()
        results.append(ranks[3])

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert built == [3]
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert results[0].fingerprint == plan.exchange.for_rank(3).fingerprint
    copy = pickle.loads(pickle.dumps(ranks))
    assert copy[3].fingerprint == plan.fingerprint and copy[0].rank == 0 and built == [3, 0]
    assert pickle.loads(pickle.dumps(plan)).exchange.for_rank(1).rank == 1


def test_the_planner_plans_the_heads_of_one_tensor_parallel_rank(monkeypatch):
    """TP=2 over 4 query heads and 2 K/V groups: each rank's operator runs 2 and 1 (``args.attention_heads_of_rank``,
    the rule the run's config validation uses); groups TP does not divide are refused, not rounded up to one."""
    monkeypatch.setenv("LIBRA_PLANNER_MODE", "thread")
    args = argparse.Namespace(**{**vars(_megatron_args()), "tensor_model_parallel_size": 2})
    planner = build_planner_from_args(CONFIG, args)
    try:
        heads = planner.heads
        assert (heads.num_q_heads, heads.num_kv_heads, heads.head_dim) == (2, 1, 16)
    finally:
        planner.close()
    args.tensor_model_parallel_size = 4
    with pytest.raises(ValueError, match=r"--num-query-groups 2 must be divisible by --tensor-model-parallel-size 4"):
        build_planner_from_args(CONFIG, args)
