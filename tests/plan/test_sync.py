"""Synchronisation model (plan/sequences/sync.py): pipeline schedules against hand-computed cases and the textbook bubble,
pools / lanes / EP ties against hand-computed steps, Megatron's rank order for EP groups."""
import itertools

import numpy as np
import pytest

from libra_megatron.plan.sequences import SyncLayout, pipeline_schedule, pool_step_timing, step_timing


def _run(pp, vpp, fwd_per_microbatch, ratio=2.0):
    """Uniform stages: microbatch g takes fwd_per_microbatch[g] / vpp on every virtual stage."""
    fwd = np.repeat(np.asarray(fwd_per_microbatch, float)[:, None] / vpp, pp * vpp, axis=1)
    return pipeline_schedule(pp, vpp, len(fwd_per_microbatch)).run(fwd, ratio * fwd)


def test_1f1b_two_stages_two_microbatches_matches_hand_timeline():
    # stage 0: F0 [0,1] F1 [1,4] B0 [4,6] B1 [13,19];  stage 1: F0 [1,2] B0 [2,4] F1 [4,7] B1 [7,13]
    run = _run(2, 1, [1.0, 3.0])
    assert run.makespan == pytest.approx(19.0)
    assert run.busy.tolist() == [12.0, 12.0]
    assert run.bubble_fraction == pytest.approx(1 - 12 / 19)


def test_1f1b_three_stages_heavy_last_microbatch_matches_hand_timeline():
    # F: 1,1,4 per stage, B = 2F. Stage 2 runs F0 B0 F1 B1 F2 B2; stage 1 F0 F1 B0 F2 B1 B2; stage 0 F0 F1 F2 B0 B1 B2.
    # s0: F0 0-1 F1 1-2 F2 2-6; s1: F0 1-2 F1 2-3; s2: F0 2-3 B0 3-5 F1 5-6 B1 6-8; s1: B0 5-7 F2 7-11;
    # s0: B0 7-9; s1: B1 11-13; s2: F2 11-15 B2 15-23; s0: B1 13-15; s1: B2 23-31; s0: B2 31-39
    run = _run(3, 1, [1.0, 1.0, 4.0])
    assert run.makespan == pytest.approx(39.0)
    assert run.busy.tolist() == [18.0, 18.0, 18.0]


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 4), (4, 4), (4, 8), (4, 32), (8, 16), (3, 7)])
def test_1f1b_bubble_with_equal_times_is_p_minus_1_over_m_plus_p_minus_1(pp, m):
    run = _run(pp, 1, [1.0] * m)
    assert run.makespan == pytest.approx((m + pp - 1) * 3.0)
    assert run.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 2), (2, 2, 4), (4, 2, 8), (4, 4, 16), (4, 2, 4)])
def test_interleaved_bubble_with_equal_times_is_divided_by_vpp(pp, vpp, m):
    run = _run(pp, vpp, [1.0] * m)
    assert run.bubble_fraction == pytest.approx((pp - 1) / (vpp * m + pp - 1))


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 5), (4, 1, 6), (2, 2, 4), (4, 2, 8)])
def test_schedule_respects_every_dependency_and_is_bounded(pp, vpp, m):
    rng = np.random.default_rng(pp * 100 + vpp * 10 + m)
    times = rng.exponential(1.0, size=m)
    run = _run(pp, vpp, times)
    total = 3.0 * times.sum()
    assert run.busy == pytest.approx(np.full(pp, total))
    # no faster than any stage's work, nor than one microbatch through every stage and back
    assert run.makespan >= total - 1e-9
    assert run.makespan >= 3.0 * pp * times.max() - 1e-9
    assert run.makespan <= pp * total + 1e-9  # no slower than running everything one op at a time
    sched = pipeline_schedule(pp, vpp, m)
    assert sched.stage.size == 2 * m * pp * vpp
    assert np.all(sched.after_stage < np.arange(sched.stage.size))  # dependency order
    assert np.all(sched.after_data < np.arange(sched.stage.size))


def test_slower_microbatch_never_shortens_the_step():
    base = np.array([1.0, 2.0, 0.5, 1.5])
    for g in range(4):
        slower = base.copy()
        slower[g] += 1.0
        assert _run(2, 1, slower).makespan >= _run(2, 1, base).makespan


def test_pp1_step_is_the_heaviest_lane_total_pools_wait_for_their_slowest_worker():
    layout = SyncLayout(4, 2, 2)  # DP=4, P=2: lanes {0,1}, {2,3}; GA=2; CP=1
    workers = np.array([[1.0, 2.0, 3.0, 1.0], [5.0, 1.0, 1.0, 1.0]])
    timing = step_timing(workers, layout)
    # lane 0: max(1,2) + max(5,1) = 7; lane 1: 3 + 1 = 4; forward + 2x backward
    assert timing.lane_seconds.tolist() == [21.0, 12.0]
    assert timing.seconds == 21.0
    assert timing.microbatch_seconds.tolist() == [[2.0, 3.0], [5.0, 1.0]]
    assert timing.bubble_fraction.tolist() == [0.0, 0.0]


def test_pp1_step_takes_the_given_backward_seconds_not_the_ratio():
    layout = SyncLayout(4, 2, 2)  # lanes {0,1}, {2,3}; GA=2; CP=1
    fwd = np.array([[1.0, 2.0, 3.0, 1.0], [5.0, 1.0, 1.0, 1.0]])
    bwd = np.array([[4.0, 1.0, 1.0, 2.0], [1.0, 1.0, 9.0, 1.0]])
    timing = step_timing(fwd, layout, bwd)
    # lane 0: forward max(1,2) + max(5,1) = 7, backward max(4,1) + max(1,1) = 5; lane 1: 3 + 1, max(1,2) + max(9,1)
    assert timing.lane_seconds.tolist() == [12.0, 15.0]
    assert timing.seconds == 15.0  # the ratio fallback would give 3 * 7 = 21
    assert timing.microbatch_backward_seconds.tolist() == [[4.0, 2.0], [1.0, 9.0]]
    assert step_timing(fwd, layout).seconds == 21.0


def test_1f1b_two_stages_takes_the_given_backward_seconds():
    # F = 1, 3 and B = 5, 1 per stage. stage 0: F0 F1 B0 B1, stage 1: F0 B0 F1 B1.
    # s0 F0 0-1, s1 F0 1-2, s1 B0 2-7, s0 F1 1-4, s1 F1 7-10, s0 B0 7-12, s1 B1 10-11, s0 B1 12-13
    layout = SyncLayout(1, 1, 2, pipeline_parallel_size=2)
    timing = pool_step_timing(np.array([[1.0], [3.0]]), layout, np.array([[5.0], [1.0]]))
    assert timing.lane_seconds.tolist() == [13.0]  # with B = 2F: 19 (test above)
    assert timing.bubble_fraction == pytest.approx([1 - 10 / 13])


def test_interleaved_two_stages_two_chunks_takes_the_given_backward_seconds():
    # PP=2, VPP=2, m=2; per virtual stage F = 2/2 = 1 for both microbatches, B = 4/2 = 2 (g0) and 8/2 = 4 (g1).
    # v = c*PP + s. stage 0: F00 F10 F01 F11 B01 B11 B00 B10; stage 1: F00 F10 F01 B01 F11 B11 B00 B10 (Fgc, Bgc).
    # s0 F00 0-1 F10 1-2 | s1 F00 1-2 F10 2-3 | s0 F01 2-3 F11 3-4 | s1 F01 3-4 B01 4-6 F11 6-7 B11 7-11 |
    # s0 B01 6-8 B11 11-15 | s1 B00 11-13 B10 15-19 | s0 B00 15-17 B10 19-23
    layout = SyncLayout(1, 1, 2, pipeline_parallel_size=2, virtual_pipeline_size=2)
    timing = pool_step_timing(np.array([[2.0], [2.0]]), layout, np.array([[4.0], [8.0]]))
    assert timing.lane_seconds.tolist() == [23.0]
    assert timing.bubble_fraction == pytest.approx([1 - 16 / 23])  # each stage busy 4 x 1 + 2 + 4 + 2 + 4


def test_backward_seconds_must_have_the_forward_shape():
    with pytest.raises(ValueError, match=r"backward_seconds must have the forward seconds' shape \[2, 4\]"):
        step_timing(np.zeros((2, 4)), SyncLayout(4, 2, 2), np.zeros((2, 3)))


def test_an_ep_group_across_lanes_ties_them_every_microbatch():
    # TP=CP=1, EP=4: one EP group over all four replicas, so both lanes wait for each other every layer
    layout = SyncLayout(4, 2, 2, expert_parallel_size=4)
    assert layout.lane_ties().tolist() == [0, 0] and layout.ep_ties_lanes
    workers = np.array([[1.0, 2.0, 3.0, 1.0], [5.0, 1.0, 1.0, 1.0]])
    assert step_timing(workers, layout).seconds == 3.0 * (3.0 + 5.0)  # per-instance maxima, summed
    back = np.array([[1.0, 1.0, 1.0, 7.0], [2.0, 1.0, 1.0, 1.0]])
    assert step_timing(workers, layout, back).seconds == (3.0 + 5.0) + (7.0 + 2.0)  # backward tied the same way


def test_cp_workers_of_a_replica_belong_to_its_pool():
    layout = SyncLayout(2, 1, 1, context_parallel_size=2)  # two lanes of one replica with two CP ranks
    timing = step_timing(np.array([[1.0, 4.0, 2.0, 2.0]]), layout)
    assert timing.lane_seconds.tolist() == [12.0, 6.0]


@pytest.mark.parametrize("tp,cp,dp,pool,ep,etp,ties", [
    (1, 8, 4, 1, 8, 1, [0, 1, 2, 3]),  # qwen3-30b-a3b 256k: EP = the CP group of one replica
    (4, 8, 4, 1, 32, 1, [0, 1, 2, 3]),  # qwen3-235b-a22b: EP = TP x CP of one replica
    (1, 8, 4, 1, 16, 1, [0, 0, 1, 1]),  # EP over two replicas, pools of one: lanes tied in pairs
    (1, 8, 4, 2, 16, 1, [0, 1]),  # ... the same EP inside pools of two: nothing tied
    (2, 1, 4, 1, 2, 2, [0, 0, 1, 1]),  # ETP=2: members r = etp + 2*ep -> replicas (r // TP) 0 and 1
    (2, 1, 4, 1, 2, 1, [0, 1, 2, 3]),  # ETP=1: members 0, 1 = both TP ranks of replica 0
])
def test_lane_ties_follow_megatron_rank_order(tp, cp, dp, pool, ep, etp, ties):
    layout = SyncLayout(dp, pool, 1, tensor_parallel_size=tp, context_parallel_size=cp, expert_parallel_size=ep,
                        expert_tensor_parallel_size=etp)
    assert layout.lane_ties().tolist() == ties


def test_lane_ties_match_brute_force_rank_grid():
    """Build both rank grids of one PP stage explicitly and union the lanes of every EP group."""
    for tp, cp, dp, pool, ep, etp in itertools.product((1, 2), (1, 2), (2, 4), (1, 2), (1, 2, 4), (1, 2)):
        if dp % pool or (tp * cp * dp) % (ep * etp):
            continue
        ranks = np.arange(tp * cp * dp)
        lane_of_rank = ranks // (tp * cp) // pool
        expert_grid = ranks.reshape(-1, ep, etp)  # [edp, ep, etp]: etp fastest, then ep
        groups = [set(lane_of_rank[expert_grid[e, :, t]].tolist()) for e in range(expert_grid.shape[0])
                  for t in range(etp)]
        merged = []
        for g in groups:
            touching = [m for m in merged if m & g]
            for m in touching:
                merged.remove(m)
                g |= m
            merged.append(g)
        layout = SyncLayout(dp, pool, 1, tensor_parallel_size=tp, context_parallel_size=cp, expert_parallel_size=ep,
                            expert_tensor_parallel_size=etp)
        ties = layout.lane_ties()
        for m in merged:
            assert len({ties[lane] for lane in m}) == 1
        assert len(set(ties.tolist())) == len(merged)


def test_pipeline_step_uses_the_lane_pipelines_and_reports_their_bubble():
    layout = SyncLayout(2, 1, 2, pipeline_parallel_size=2)  # two lanes, each a 2-stage pipeline of 2 microbatches
    timing = pool_step_timing(np.array([[1.0, 1.0], [3.0, 1.0]]), layout)
    assert timing.lane_seconds.tolist() == [19.0, (2 + 1) * 3.0]
    assert timing.bubble_fraction == pytest.approx([1 - 12 / 19, 1 / 3])


@pytest.mark.parametrize("kwargs,match", [
    (dict(data_parallel_size=6, pool_size=4, num_microbatches=1), r"--pool-size 4 must divide --dp 6"),
    (dict(data_parallel_size=4, pool_size=2, num_microbatches=1, expert_parallel_size=3), r"--ep 3 x --etp 1 = 3 must divide"),
    (dict(data_parallel_size=4, pool_size=2, num_microbatches=3, pipeline_parallel_size=2, virtual_pipeline_size=2),
     r"--vpp 2 .* 3 % 2 = 1"),
    (dict(data_parallel_size=4, pool_size=2, num_microbatches=2, virtual_pipeline_size=2), r"--vpp 2 .* needs --pp >= 2"),
    (dict(data_parallel_size=4, pool_size=2, num_microbatches=2, pipeline_parallel_size=0), r"--pp must be a positive"),
    (dict(data_parallel_size=4, pool_size=2, num_microbatches=2, backward_ratio=float("nan")), r"--backward-ratio must"),
])
def test_bad_layouts_name_the_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyncLayout(**kwargs)


def test_worker_seconds_shape_is_checked():
    with pytest.raises(ValueError, match=r"\[GA, DP\*CP\] = \[2, 4\*1\]"):
        step_timing(np.zeros((2, 3)), SyncLayout(4, 2, 2))


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 6), (4, 1, 4), (8, 1, 3), (2, 2, 4), (4, 2, 8)])
def test_many_pipelines_at_once_equal_each_pipeline_alone(pp, vpp, m):
    """``PipelineSchedule.run`` simulates up to a few columns in plain floats and more as numpy rows: 40 random
    pipelines run together (rows) give, column by column, the makespan and stage busy time each gives alone
    (plain floats, whose timelines the hand-drawn cases above check); a broadcast view runs like its copy."""
    rng = np.random.default_rng(pp * 100 + vpp * 10 + m)
    sched = pipeline_schedule(pp, vpp, m)
    fwd, bwd = rng.exponential(1.0, (m, pp * vpp, 40)), rng.exponential(2.0, (m, pp * vpp, 40))
    together = sched.run(fwd, bwd)
    for c in range(40):
        alone = sched.run(fwd[:, :, c], bwd[:, :, c])
        assert together.makespan[c] == alone.makespan
        assert together.busy[:, c] == pytest.approx(alone.busy, rel=1e-12)  # numpy sums a lone column pairwise
    stage_times = rng.exponential(1.0, (m, 1, 12))
    view = sched.run(np.broadcast_to(stage_times, (m, pp * vpp, 12)), np.broadcast_to(2 * stage_times, (m, pp * vpp, 12)))
    copy = sched.run(np.repeat(stage_times, pp * vpp, axis=1), np.repeat(2 * stage_times, pp * vpp, axis=1))
    assert view.makespan.tolist() == copy.makespan.tolist() and view.busy.tolist() == copy.busy.tolist()
