"""The planner in its own process (issue 25): the same plans as in a thread, and start-up, a failing plan, a crash
of the process, a hang and shutdown each end in one ``PlannerError`` line naming the pool, never a hang."""
from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest

from libra_megatron.config import LibraConfig
from libra_megatron.megatron.planner import BackgroundPlanner, PlannerError
from libra_megatron.plan.errors import PlanError
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.pool import plan_pool

L, CP, P = 64, 2, 2
CONFIG = LibraConfig(pool_size=P, head_split=2, num_chunks=2, block_size=8, token_layout="zigzag")
LAYOUT = TokenLayout("zigzag", L, CP)
HEADS = HeadLayout(8, 2, 16, 2, 2, elem_bytes=2)
POOL_A = [[40, 3, 21], [64]]
POOL_B = [[10] * 6 + [4], [1, 63]]
CRASH = [[1] * 64, [64]]  # the pools the stand-in plan functions below treat specially
HANG = [[2] * 32, [64]]


def crash_or_hang_plan(segments, *args, **kwargs):
    """Module level so that it pickles into the spawned process."""
    if segments == [list(s) for s in CRASH]:
        os._exit(3)
    if segments == [list(s) for s in HANG]:
        time.sleep(120)
    return plan_pool(segments, *args, **kwargs)


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0]


def test_the_process_planner_serves_the_threads_plans_and_rank_plans():
    direct = {id(p): plan_pool(p, CONFIG, LAYOUT, HEADS).fingerprint for p in (POOL_A, POOL_B)}
    with BackgroundPlanner(CONFIG, LAYOUT, HEADS, mode="process", worker=3, timeout_s=120) as planner:
        assert planner.warm_up() > 0
        planner.submit_many([POOL_A, POOL_B])
        for pool in (POOL_B, POOL_A):
            planned = planner.get_pool(pool)
            assert planned.pool_plan.fingerprint == direct[id(pool)]
            assert planned.latency_s > 0 and planned.rank_ready_s is not None
        plan = planner.get(POOL_A, position=1, cp_rank=1)
        assert plan.rank == 3 and plan.local_tokens == L // CP
        assert planner.plans_made == 3 and len(planner.latencies()) == 3  # warm-up + two pools, each once
        assert planner.latest_metrics()["planner_latency_s"] > 0
    assert not planner._process.is_alive()


def _same(a, b) -> bool:
    """Field by field, arrays by value and dtype."""
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_the_process_builds_the_workers_row_tables_and_the_trainer_builds_none(monkeypatch):
    """The worker's ``rank_tables`` come from the planner process with the plan (the trainer's interpreter only
    unpickles them): equal to the tables the trainer would build, and never built in the trainer; tables of another
    rank are refused."""
    from libra_megatron.plan.exchange import runtime_tables

    build = runtime_tables.build_rank_tables
    with BackgroundPlanner(CONFIG, LAYOUT, HEADS, mode="process", worker=3, timeout_s=120) as planner:
        monkeypatch.setattr(runtime_tables, "build_rank_tables", lambda plan: pytest.fail("built in the trainer"))
        exchange = planner.get_pool(POOL_A).pool_plan.exchange
        seeded = runtime_tables.rank_tables(exchange.for_rank(3))
    built = build(exchange.for_rank(3))
    assert _same(seeded, built) and not _same(seeded, build(exchange.for_rank(2)))
    with pytest.raises(ValueError, match="is not the tables of rank 2"):
        runtime_tables.seed_rank_tables(exchange.for_rank(2), seeded)


def test_a_validated_plan_reaches_the_trainer_with_its_workers_rank_plan_only():
    """``validate=True`` builds every rank's RankPlan in the process; pickled with all of them a pool plan is
    hundreds of MB at 256K. The trainer gets the plan with its own worker's RankPlan alone."""
    with BackgroundPlanner(CONFIG, LAYOUT, HEADS, mode="process", worker=3, validate=True, timeout_s=120) as planner:
        exchange = planner.get_pool(POOL_A).pool_plan.exchange
    assert exchange.num_workers == 4 and sorted(exchange.ranks._cache) == [3]  # noqa: SLF001
    assert exchange.for_rank(1).rank == 1  # the others are still built on demand


def test_a_failing_plan_in_the_process_raises_its_error_at_get_and_the_process_keeps_serving():
    bad_pool = [[30, 30], [64]]  # sums to 60, not L = 64
    with BackgroundPlanner(CONFIG, LAYOUT, HEADS, mode="process", timeout_s=120) as planner:
        with pytest.raises(PlannerError) as info:
            planner.get_pool(bad_pool)
        assert isinstance(info.value.__cause__, (PlanError, ValueError))
        assert "background planner failed for pool" in _first_line(info.value)
        assert planner.get_pool(POOL_A).pool_plan.fingerprint


def test_a_crashed_planner_process_fails_every_pending_pool_with_its_exit_code():
    with BackgroundPlanner(CONFIG, LAYOUT, HEADS, mode="process", plan_fn=crash_or_hang_plan,
                           timeout_s=120) as planner:
        planner.get_pool(POOL_A)  # started and serving
        planner.submit_many([CRASH, POOL_B])
        start = time.perf_counter()
        for pool in (CRASH, POOL_B):
            with pytest.raises(PlannerError) as info:
                planner.get_pool(pool)
            line = _first_line(info.value)
            assert "failed for pool" in line and "exit code 3" in line, line
        assert time.perf_counter() - start < 30
        with pytest.raises(PlannerError, match="exit code 3"):  # a pool submitted after the crash, too
            planner.get_pool([[64], [64]], timeout=30)


def test_a_hung_planner_process_times_out_and_close_stops_it():
    planner = BackgroundPlanner(CONFIG, LAYOUT, HEADS, mode="process", plan_fn=crash_or_hang_plan, timeout_s=120)
    planner.get_pool(POOL_A)
    with pytest.raises(PlannerError, match=r"did not finish pool \w+ within 1.0s \(process alive\)"):
        planner.get_pool(HANG, timeout=1.0)
    start = time.perf_counter()
    planner.close()
    assert time.perf_counter() - start < 20 and not planner._process.is_alive()
    with pytest.raises(PlannerError, match="closed"):
        planner.submit(POOL_B)


def test_mode_is_checked():
    with pytest.raises(ValueError, match="mode must be 'thread' or 'process'"):
        BackgroundPlanner(CONFIG, LAYOUT, HEADS, mode="fork")


def test_the_default_is_the_process_and_a_plan_fn_that_cannot_go_there_is_one_error():
    """A megatron-core user's ``BackgroundPlanner(config, layout, heads)`` plans off the training interpreter; a
    lambda ``plan_fn`` is refused at construction, naming both ways out, not a pickling traceback at spawn."""
    with BackgroundPlanner(CONFIG, LAYOUT, HEADS, timeout_s=120) as planner:
        assert planner.mode == "process" and planner._process.is_alive()  # noqa: SLF001
        assert planner.get_pool(POOL_A).pool_plan.fingerprint
    with pytest.raises(ValueError, match="does not pickle .* module-level function, or mode='thread'"):
        BackgroundPlanner(CONFIG, LAYOUT, HEADS, plan_fn=lambda *a, **k: None)


def test_microbatch_metrics_read_the_planners_placements_and_place_nothing_again(monkeypatch):
    """Issue 25: the window's after-TAP loads come from the planner's plans (its own pools are cache hits, the
    others are planned by it, behind training's pools); ``metrics`` places no pool itself."""
    from libra_megatron.megatron import metrics

    window = [[16], [8, 8], [4] * 4, [16], [2] * 8, [12, 4], [1] * 16, [8, 4, 4]]
    order = [3, 4, 0, 6, 1, 2, 5, 7]
    config = LibraConfig(pool_size=2, head_split=1, num_chunks=1, block_size=4, token_layout="contiguous",
                         tiling="uniform")
    layout, heads = TokenLayout("contiguous", 16, 1), HeadLayout(2, 2, 8, 1, 1)
    expected = metrics.microbatch_metrics(window, order, 4, config, layout, heads)
    placed = []
    real = metrics._worst_worker_load
    monkeypatch.setattr(metrics, "_worst_worker_load",
                        lambda pool, cfg, *a: placed.append(cfg.tile_placement.value) or real(pool, cfg, *a))
    with BackgroundPlanner(config, layout, heads, mode="process", timeout_s=120) as planner:
        own = [window[i] for i in order[:2]]
        planner.submit(own)
        planner.get_pool(own)  # this rank's pool: planned once, read again by the metrics
        got = metrics.microbatch_metrics(window, order, 4, config, layout, heads, plans=planner.get_for_metrics)
        assert planner.plans_made == 4  # the window's 4 pools, each once
        values = planner.latest_metrics()
    assert got == pytest.approx(expected)
    assert set(placed) == {"home"}  # only the sampler-order pools at their Q-homes (no placement search)
    assert values["planner_wait_ms"] > 0 and values["planner_lead_windows"] == 0.0  # waited; nothing ready ahead


def _plan_in_a_daemonic_child(queue):
    """A daemonic multiprocessing child (as the CPU harness's ranks are) starts a process planner and plans."""
    try:
        from libra_megatron.config import LibraConfig
        from libra_megatron.megatron.planner import BackgroundPlanner
        from libra_megatron.plan.layout import HeadLayout, TokenLayout

        config = LibraConfig(pool_size=2, head_split=1, block_size=8, num_chunks=1)
        with BackgroundPlanner(config, TokenLayout("zigzag", 32, 2), HeadLayout(4, 2, 8, 1, 1), mode="process",
                               timeout_s=120) as planner:
            planned = planner.get_pool([[20, 12], [32]])
        queue.put(("ok", planned.pool_plan.exchange.num_workers))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def test_a_daemonic_trainer_can_start_its_planner_process():
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_plan_in_a_daemonic_child, args=(queue,), daemon=True)
    child.start()
    status, value = queue.get(timeout=240)
    child.join(timeout=60)
    assert (status, value) == ("ok", 4)


# ---------------------------------------------------------------------- shared plan directory (each pool once)
def _planners(tmp_path, n, **kwargs):
    return [BackgroundPlanner(CONFIG, LAYOUT, HEADS, mode="process", worker=w, timeout_s=120,
                              share_dir=str(tmp_path / "plans"), **kwargs) for w in range(n)]


def test_ranks_sharing_a_plan_directory_plan_each_pool_once_and_get_the_same_plans(tmp_path, monkeypatch):
    """Three ranks of one pool ask for the same two pools: the planning calls (counted by the planners and by the
    ledger the planner processes append to) are one per pool, and every rank gets the plan ``plan_pool`` makes
    with its own RankPlan."""
    ledger = tmp_path / "ledger.txt"
    monkeypatch.setenv("LIBRA_PLANNER_LEDGER", str(ledger))
    direct = {id(p): plan_pool(p, CONFIG, LAYOUT, HEADS).fingerprint for p in (POOL_A, POOL_B)}
    planners = _planners(tmp_path, 3)
    try:
        for planner in planners:
            planner.submit_many([POOL_A, POOL_B])
        for w, planner in enumerate(planners):
            for pool in (POOL_A, POOL_B):
                planned = planner.get_pool(pool)
                assert planned.pool_plan.fingerprint == direct[id(pool)]
                assert planned.pool_plan.exchange.for_rank(w).rank == w
        assert sum(p.plans_made for p in planners) == 2
        assert sum(p.plans_shared for p in planners) == 4
        keys = [line.split()[0] for line in ledger.read_text().splitlines()]
        assert len(keys) == 2 and len(set(keys)) == 2
    finally:
        for planner in planners:
            planner.close()
    assert not (tmp_path / "plans").exists()  # each process removed what it published, the last the directory
    ledger.unlink()
    alone = [BackgroundPlanner(CONFIG, LAYOUT, HEADS, mode="process", timeout_s=120) for _ in range(2)]
    try:  # the control: without a shared directory each rank plans both pools, and the ledger shows it
        for planner in alone:
            assert planner.get_pool(POOL_A).pool_plan.fingerprint == direct[id(POOL_A)]
            planner.get_pool(POOL_B)
        keys = [line.split()[0] for line in ledger.read_text().splitlines()]
        assert len(keys) == 4 and len(set(keys)) == 2 and sum(p.plans_made for p in alone) == 4
    finally:
        for planner in alone:
            planner.close()


def test_a_different_config_does_not_reuse_a_shared_plan(tmp_path):
    other = LibraConfig(pool_size=P, head_split=2, num_chunks=2, block_size=16, token_layout="zigzag")
    a = BackgroundPlanner(CONFIG, LAYOUT, HEADS, mode="process", timeout_s=120, share_dir=str(tmp_path))
    b = BackgroundPlanner(other, LAYOUT, HEADS, mode="process", timeout_s=120, share_dir=str(tmp_path))
    try:
        assert a.get_pool(POOL_A).pool_plan.fingerprint == plan_pool(POOL_A, CONFIG, LAYOUT, HEADS).fingerprint
        assert b.get_pool(POOL_A).pool_plan.fingerprint == plan_pool(POOL_A, other, LAYOUT, HEADS).fingerprint
        assert a.plans_made == b.plans_made == 1
    finally:
        a.close()
        b.close()


def test_a_shared_failing_plan_raises_on_every_rank_from_one_planning_call(tmp_path):
    bad_pool = [[30, 30], [64]]
    planners = _planners(tmp_path, 2)
    try:
        for planner in planners:
            planner.submit(bad_pool)
        for planner in planners:
            with pytest.raises(PlannerError) as info:
                planner.get_pool(bad_pool)
            assert "background planner failed for pool" in _first_line(info.value)
            assert isinstance(info.value.__cause__, (PlanError, ValueError))
        assert sum(p.plans_made for p in planners) == 2  # one planned (and failed), one read the failure
    finally:
        for planner in planners:
            planner.close()


def test_a_claimant_that_dies_fails_the_pool_on_the_other_ranks_at_once(tmp_path):
    """The rank whose planner process claims CRASH dies (exit code 3); the other rank's process sees the claim's
    owner gone and fails the pool with one line, long before the timeout, and keeps serving other pools."""
    dying = BackgroundPlanner(CONFIG, LAYOUT, HEADS, mode="process", plan_fn=crash_or_hang_plan, timeout_s=120,
                              share_dir=str(tmp_path))
    other = BackgroundPlanner(CONFIG, LAYOUT, HEADS, mode="process", plan_fn=crash_or_hang_plan, timeout_s=120,
                              share_dir=str(tmp_path))
    try:
        with pytest.raises(PlannerError, match="exit code 3"):
            dying.get_pool(CRASH)
        start = time.perf_counter()
        with pytest.raises(PlannerError) as info:
            other.get_pool(CRASH)
        line = _first_line(info.value)
        assert "failed for pool" in line and "exited without a plan" in line, line
        assert time.perf_counter() - start < 30
        assert other.get_pool(POOL_A).pool_plan.fingerprint == plan_pool(POOL_A, CONFIG, LAYOUT, HEADS).fingerprint
    finally:
        dying.close()
        other.close()


def test_share_dir_needs_the_process_mode():
    with pytest.raises(ValueError, match="share_dir needs mode='process'"):
        BackgroundPlanner(CONFIG, LAYOUT, HEADS, mode="thread", share_dir="/tmp/x")
