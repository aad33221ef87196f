"""``plan.sequences.critical_path_seconds``: one microbatch's pipeline is exactly its critical path, no pipeline beats
the critical path of any of its microbatches, and no grouping of a small window into pools, in any microbatch order,
beats the path of the heaviest pool every grouping must hold (brute force over every grouping and order, pools
priced as perfectly spread work); the balanced schedule the simulator divides by is beaten by unequal microbatches,
as the docstring says."""
import itertools

import numpy as np
import pytest

from libra_megatron.plan.model import pool_lower_bound_counting
from libra_megatron.plan.sequences import SyncLayout, critical_path_seconds, run_lane_pipelines

LAYOUTS = [dict(pp=1, vpp=1, ga=1), dict(pp=2, vpp=1, ga=1), dict(pp=4, vpp=1, ga=1), dict(pp=2, vpp=2, ga=2),
           dict(pp=4, vpp=2, ga=4)]


def _layout(pp, vpp, ga, other=0.0):
    return SyncLayout(1, 1, ga, pipeline_parallel_size=pp, virtual_pipeline_size=vpp, other_seconds=other)


@pytest.mark.parametrize("case", LAYOUTS)
def test_one_microbatch_runs_exactly_its_critical_path(case):
    layout = _layout(case["pp"], case["vpp"], case["ga"], other=0.25)
    ga = case["ga"]
    fwd, bwd = np.zeros((ga, 1)), np.zeros((ga, 1))
    fwd[ga - 1, 0], bwd[ga - 1, 0] = 1.5, 3.25  # the others carry only other_seconds
    span = float(run_lane_pipelines(fwd, layout, bwd).makespan[0])
    path = critical_path_seconds(1.5, 3.25, layout)
    assert path == pytest.approx(case["pp"] * (1.5 + 3.25 + 3 * 0.25), rel=1e-15)  # PP x (f + b + (1 + 2) x other)
    if ga == 1:  # alone, its forward and backward through every virtual stage are the whole run
        assert span == pytest.approx(path, rel=1e-12)
    assert span >= path * (1 - 1e-12)


@pytest.mark.parametrize("case", LAYOUTS[1:])
def test_no_pipeline_beats_the_critical_path_of_its_heaviest_microbatch(case):
    rng = np.random.default_rng(7)
    ga = max(case["ga"], case["pp"]) * 2
    layout = _layout(case["pp"], case["vpp"], ga, other=0.1)
    fwd = rng.pareto(1.0, size=(ga, 200)) + 0.01  # heavy tails: in some lanes one microbatch dominates
    bwd = fwd * rng.uniform(1.5, 3.0, size=fwd.shape)
    span = run_lane_pipelines(fwd, layout, bwd).makespan
    path = np.array([max(critical_path_seconds(f, b, layout) for f, b in zip(fwd[:, j], bwd[:, j]))
                     for j in range(fwd.shape[1])])
    assert (span >= path * (1 - 1e-12)).all()
    assert ((span - path) / span).min() < 0.35  # where one microbatch dominates, its path is most of the run


def test_bad_seconds_are_a_value_error():
    for f, b in ((-1.0, 1.0), (float("nan"), 1.0), (1.0, float("inf"))):
        with pytest.raises(ValueError, match="critical_path_seconds needs finite seconds"):
            critical_path_seconds(f, b, _layout(2, 1, 2))


def _pairings(items):
    if not items:
        yield []
        return
    for k in range(1, len(items)):
        for tail in _pairings(items[1:k] + items[k + 1:]):
            yield [(items[0], items[k])] + tail


def _best_step(work, layout):
    """The shortest lane over every grouping of 8 sequences into 4 pools of 2 and every order of the 4 pools; a
    pool's forward is its work, its backward 2.5 x (work spread perfectly, the bound's own premise)."""
    columns = []
    for pairs in _pairings(list(range(8))):
        loads = [work[a] + work[b] for a, b in pairs]
        columns += [[loads[k] for k in order] for order in itertools.permutations(range(4))]
    fwd = np.array(columns).T
    return float(run_lane_pipelines(fwd, layout, 2.5 * fwd).makespan.min())


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("work", [[900.0, 40, 35, 30, 20, 12, 8, 5], [300.0, 250, 40, 35, 30, 20, 12, 8],
                                  [50.0, 48, 45, 44, 40, 39, 35, 30]])
def test_no_grouping_and_order_beats_the_heaviest_pools_path(pp, work):
    layout = _layout(pp, 1, 4)
    heavy = pool_lower_bound_counting(np.asarray(work), 2)  # every grouping into pairs holds a pool this heavy
    path = critical_path_seconds(heavy, 2.5 * heavy, layout)
    best = _best_step(work, layout)
    assert best >= path * (1 - 1e-12)
    if work[0] == 900.0 and pp > 1:  # the whale's pool sets the step: the path is within 20% of the best
        assert best <= path * 1.2


def test_unequal_microbatches_beat_the_balanced_schedule():
    """The simulator's lower bound at PP > 1 is the schedule of GA equal microbatches (its own bubble); a window
    whose pools can be uneven, light at the ends, runs shorter than that (why ``critical_path_seconds`` says the
    heaviest pool binds only where its path is longer)."""
    work = [50.0, 48, 45, 44, 40, 39, 35, 30]
    layout = _layout(2, 1, 4)
    mean = sum(work) / 4
    balanced = float(run_lane_pipelines(np.full((4, 1), mean), layout, np.full((4, 1), 2.5 * mean)).makespan[0])
    assert _best_step(work, layout) < balanced * 0.98
