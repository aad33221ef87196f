"""plan.timing: the Pipeliner's event timeline, against hand-computed timelines and an interpreter of the
runtime's schedule listing (one FIFO link, one compute stream)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_megatron.plan.timing import StepTimeModel, pipeline_seconds


def _listing(M: int):
    """The local-first forward of ``runtime.libra_attn._fwd`` as written in the issue, one op per line."""
    ops = [("issue", "D", 0)]
    for m in range(M):
        if m + 1 < M:
            ops.append(("issue", "D", m + 1))
        if m < M - 1:
            ops.append(("compute", "L", m))
        ops += [("wait", "D", m), ("compute", "X", m), ("issue", "R", m)]
        if m == M - 1:
            ops.append(("compute", "L", m))
        if m > 0:
            ops.append(("wait", "R", m - 1))
    return ops + [("wait", "R", M - 1)]


def _interpret(local, remote, dispatch, ret):
    """Scalar reference: walk the listing with a compute clock and a FIFO link (a transfer starts when it is
    issued and the link is free; a wait moves the compute clock to the transfer's end)."""
    M = len(dispatch)
    seconds = {"D": dispatch, "R": ret, "L": [local / M] * M, "X": [remote / M] * M}
    clock = link = 0.0
    ends = {}
    for op, kind, m in _listing(M):
        if op == "issue":
            link = max(clock, link) + seconds[kind][m]
            ends[kind, m] = link
        elif op == "compute":
            clock += seconds[kind][m]
        else:
            clock = max(clock, ends[kind, m])
    return clock


def _one(local, remote, dispatch, ret, local_first=True):
    s, c = pipeline_seconds([local], [remote], [dispatch], [ret], local_first)
    return float(s[0]), float(c[0])


def test_hand_computed_timelines():
    # M=1, L=3, X=5, D=[2], R=[4]: D0 [0,2]; wait D0 -> 2; X -> 7; R0 [7,11]; L -> 10; wait R0 -> 11
    assert _one(3.0, 5.0, [2.0], [4.0]) == (11.0, 8.0)
    # previous schedule (L=0): 2 + 8 = 10, R0 [10,14]
    assert _one(3.0, 5.0, [2.0], [4.0], local_first=False) == (14.0, 8.0)
    # M=2, L_m=1, X_m=2, D=R=[1,1]: D0 [0,1], D1 [1,2]; L0 -> 1; wait D0; X0 -> 3; R0 [3,4]; wait D1;
    # X1 -> 5; R1 [5,6]; L1 -> 6; wait R0 -> 6; wait R1 -> 6: the exchange is hidden
    assert _one(2.0, 4.0, [1.0, 1.0], [1.0, 1.0]) == (6.0, 6.0)
    # previous: X_m=3; D0 [0,1] -> X0 -> 4; R0 [4,5]; X1 -> 7; R1 [7,8]: exposed = D0 + R1
    assert _one(2.0, 4.0, [1.0, 1.0], [1.0, 1.0], local_first=False) == (8.0, 6.0)
    # M=2, comm-bound: L_m=1, X_m=1, D=[3,2], R=[1,2]: D0 [0,3], D1 [3,5]; L0 -> 1; wait D0 -> 3; X0 -> 4;
    # R0 issued 4, link free at 5: [5,6]; wait D1 -> 5; X1 -> 6; R1 [6,8]; L1 -> 7; wait R0 -> 7; wait R1 -> 8
    assert _one(2.0, 2.0, [3.0, 2.0], [1.0, 2.0]) == (8.0, 4.0)
    # M=4, L_m=1, X_m=2, D=[2,1,1,1], R=[1,1,1,3]: link D0 [0,2] D1 [2,3] R0 [4,5] D2 [5,6] R1 [7,8] D3 [8,9]
    # R2 [10,11] R3 [12,15]; clock: 1, 2, 4 | 5, 5, 7, 7 | 8, 8, 10, 10 | 10, 12, L -> 13, wait R2 -> 13; R3 -> 15
    assert _one(4.0, 8.0, [2.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 3.0]) == (15.0, 12.0)
    # previous, X_m=3: D0 [0,2] D1 [2,3]; X0 -> 5; R0 [5,6]; D2 [6,7]; X1 -> 8; R1 [8,9]; D3 [9,10]; X2 -> 11;
    # R2 [11,12]; wait D3 -> 11; X3 -> 14; R3 [14,17]
    assert _one(4.0, 8.0, [2.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 3.0], local_first=False) == (17.0, 12.0)


@st.composite
def _timelines(draw):
    M = draw(st.sampled_from([1, 2, 3, 4, 8]))
    row = st.lists(st.floats(0, 10, allow_nan=False), min_size=M, max_size=M)
    W = draw(st.integers(1, 4))
    local = draw(st.lists(st.floats(0, 40, allow_nan=False), min_size=W, max_size=W))
    remote = draw(st.lists(st.floats(0, 40, allow_nan=False), min_size=W, max_size=W))
    dispatch = [draw(row) for _ in range(W)]
    ret = [draw(row) for _ in range(W)]
    return np.array(local), np.array(remote), np.array(dispatch), np.array(ret)


@given(_timelines())
@settings(deadline=None, max_examples=200)
def test_vectorised_timeline_equals_the_schedule_listing(case):
    local, remote, dispatch, ret = case
    seconds, compute = pipeline_seconds(local, remote, dispatch, ret)
    expected = [_interpret(*(x[w] for x in case)) for w in range(local.size)]
    assert np.allclose(seconds, expected, rtol=1e-12, atol=1e-12)
    assert np.allclose(compute, local + remote)
    # local_first=False is the listing with every entry remote (the previous runtime)
    old, _ = pipeline_seconds(local, remote, dispatch, ret, local_first=False)
    assert np.allclose(old, [_interpret(0.0, local[w] + remote[w], dispatch[w], ret[w]) for w in range(local.size)])
    assert np.allclose(old, pipeline_seconds(np.zeros_like(local), local + remote, dispatch, ret)[0])


@given(_timelines())
@settings(deadline=None, max_examples=200)
def test_limits_and_bounds(case):
    local, remote, dispatch, ret = case
    seconds, compute = pipeline_seconds(local, remote, dispatch, ret)
    link = dispatch.sum(axis=1) + ret.sum(axis=1)
    assert (seconds >= compute - 1e-9).all() and (seconds >= link - 1e-9).all()
    assert (seconds <= compute + link + 1e-9).all()  # nothing overlaps at worst
    # no traffic: nothing exposed
    assert np.allclose(pipeline_seconds(local, remote, 0 * dispatch, 0 * ret)[0], compute)
    # no compute: the FIFO link back to back
    assert np.allclose(pipeline_seconds(0 * local, 0 * remote, dispatch, ret)[0], link)
    # local first is never slower than the previous schedule
    assert (seconds <= pipeline_seconds(local, remote, dispatch, ret, local_first=False)[0] + 1e-9).all()


@given(_timelines(), st.integers(0, 3), st.floats(0.01, 5))
@settings(deadline=None, max_examples=200)
def test_more_work_or_traffic_is_never_faster(case, which, extra):
    local, remote, dispatch, ret = (x.copy() for x in case)
    before = pipeline_seconds(local, remote, dispatch, ret)[0]
    grown = [local, remote, dispatch, ret][which]
    grown[(0,) * grown.ndim] += extra
    after = pipeline_seconds(local, remote, dispatch, ret)[0]
    assert (after >= before - 1e-9).all()


def test_local_first_hides_the_first_dispatch_behind_local_work():
    # M=4, only local work (L_m=2), every transfer 1: D_m and R_{m-1} hide behind L_m, R3 behind L3
    seconds, compute = pipeline_seconds([8.0], [0.0], [[1.0] * 4], [[1.0] * 4])
    assert seconds[0] == pytest.approx(compute[0])
    old, _ = pipeline_seconds([8.0], [0.0], [[1.0] * 4], [[1.0] * 4], local_first=False)
    assert old[0] == pytest.approx(8.0 + 2.0)  # D0 + R3


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"local, remote \[W\] and dispatch, return \[W, M >= 1\]"):
        pipeline_seconds([1.0], [1.0], [[1.0, 1.0]], [[1.0]])
    with pytest.raises(ValueError, match="pipeline_seconds"):
        pipeline_seconds([1.0, 2.0], [1.0, 2.0], [[1.0]], [[1.0]])


def test_step_time_model_prices_by_the_timeline():
    model = StepTimeModel(8, intra_node_gbps=2.0, inter_node_gbps=1.0)
    assert model.comm_seconds([4e9], [3e9]).tolist() == [3.0]  # max(4/2, 3/1)
    args = ([3.0], [5.0], [[2.0]], [[4.0]])
    assert model.worker_seconds(*args).tolist() == [11.0]
    assert StepTimeModel(8, local_first=False).worker_seconds(*args).tolist() == [14.0]
