"""plan.model.timing: the Pipeliner's event timeline, against hand-computed timelines and an interpreter of the
runtime's schedule listing (one FIFO link, one compute stream)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_megatron.plan.model import StepTimeModel, best_lead, pipeline_seconds


def _listing(M: int, lead: int):
    """The forward of ``runtime.libra_attn._fwd`` as listed in ``plan.model.timing``, one op per line."""
    ops = [("issue", "D", m) for m in range(M)] + [("compute", "L", m) for m in range(lead)]
    for m in range(M):
        ops += [("wait", "D", m), ("compute", "X", m), ("issue", "R", m)]
    ops += [("compute", "L", m) for m in range(lead, M)]
    return ops + [("wait", "R", m) for m in range(M)]


def _interpret(local, remote, dispatch, ret, lead):
    """Scalar reference: walk the listing with a compute clock and a FIFO link (a transfer starts when it is
    issued and the link is free; a wait moves the compute clock to the transfer's end)."""
    M = len(dispatch)
    seconds = {"D": dispatch, "R": ret, "L": [local / M] * M, "X": [remote / M] * M}
    clock = link = 0.0
    ends = {}
    for op, kind, m in _listing(M, lead):
        if op == "issue":
            link = max(clock, link) + seconds[kind][m]
            ends[kind, m] = link
        elif op == "compute":
            clock += seconds[kind][m]
        else:
            clock = max(clock, ends[kind, m])
    return clock


def _best(local, remote, dispatch, ret):
    """(seconds, lead) minimising the listing over every lead, ties to the largest."""
    M = len(dispatch)
    times = [_interpret(local, remote, dispatch, ret, k) for k in range(M + 1)]
    times.append(_interpret(0.0, local + remote, dispatch, ret, 0))  # lead M + 1: no local split
    best = min(times)
    return best, max(k for k, t in enumerate(times) if t <= best * (1 + 1e-9) + 1e-300)


def _one(local, remote, dispatch, ret, local_first=True):
    s, c = pipeline_seconds([local], [remote], [dispatch], [ret], local_first)
    return float(s[0]), float(c[0])


def _lead(local, remote, dispatch, ret):
    return int(best_lead([local], [remote], [dispatch], [ret])[0])


def test_hand_computed_timelines():
    # M=1, L=3, X=5, D=[2], R=[4]. lead 0: wait D0 -> 2; X -> 7; R0 [7,11]; L -> 10; wait R0 -> 11.
    # lead 1: L [0,3]; X [3,8]; R0 [8,12] -> 12. Best: lead 0.
    assert _one(3.0, 5.0, [2.0], [4.0]) == (11.0, 8.0) and _lead(3.0, 5.0, [2.0], [4.0]) == 0
    # without the local split (L=0): X = 8 after D0: [2,10], R0 [10,14]
    assert _one(3.0, 5.0, [2.0], [4.0], local_first=False) == (14.0, 8.0)
    # M=2, L_m=1, X_m=2, D=R=[1,1]: D0 [0,1], D1 [1,2]. lead 1: L0 -> 1; X0 [1,3]; R0 [3,4]; X1 [3,5];
    # R1 [5,6]; L1 -> 6: hidden. (lead 0: L0 L1 after X1 -> 7; lead 2: X0 [2,4] ... R1 [6,7] -> 7.)
    assert _one(2.0, 4.0, [1.0, 1.0], [1.0, 1.0]) == (6.0, 6.0) and _lead(2.0, 4.0, [1.0, 1.0], [1.0, 1.0]) == 1
    # L=0: X_m=3: X0 [1,4]; R0 [4,5]; X1 [4,7]; R1 [7,8]: exposed = D0 + R1
    assert _one(2.0, 4.0, [1.0, 1.0], [1.0, 1.0], local_first=False) == (8.0, 6.0)
    # M=2, comm-bound: L_m=1, X_m=1, D=[3,2], R=[1,2]: D0 [0,3], D1 [3,5]; X0 [3,4]; R0 waits for the link:
    # [5,6]; X1 [5,6]; R1 [6,8]: 8 whatever the lead (ties: the largest, 2)
    assert _one(2.0, 2.0, [3.0, 2.0], [1.0, 2.0]) == (8.0, 4.0) and _lead(2.0, 2.0, [3.0, 2.0], [1.0, 2.0]) == 2
    # M=4, L_m=1, X_m=2, D=[2,1,1,1] (D's end 2, 3, 4, 5), R=[1,1,1,3]. lead 2: L0 L1 -> 2; X0 [2,4];
    # R0 [5,6]; X1 [4,6]; R1 [6,7]; X2 [6,8]; R2 [8,9]; X3 [8,10]; R3 [10,13]; L2 L3 -> 12: 13
    # (lead 1 also 13; 0, 3, 4: 14, 14, 15)
    args = (4.0, 8.0, [2.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 3.0])
    assert _one(*args) == (13.0, 12.0) and _lead(*args) == 2
    # L=0, X_m=3: X0 [2,5]; R0 [5,6]; X1 [5,8]; R1 [8,9]; X2 [8,11]; R2 [11,12]; X3 [11,14]; R3 [14,17]
    assert _one(*args, local_first=False) == (17.0, 12.0)


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
    M = dispatch.shape[1]
    seconds, compute = pipeline_seconds(local, remote, dispatch, ret)
    best = [_best(*(x[w] for x in case)) for w in range(local.size)]
    assert np.allclose(seconds, [b[0] for b in best], rtol=1e-12, atol=1e-12)
    leads = best_lead(local, remote, dispatch, ret)
    chosen = [_interpret(*(x[w] for x in case), int(leads[w])) if leads[w] <= M else
              _interpret(0.0, local[w] + remote[w], dispatch[w], ret[w], 0) for w in range(local.size)]
    assert np.allclose(chosen, [b[0] for b in best], rtol=1e-12, atol=1e-12)  # the lead it picks is a best one
    assert np.allclose(compute, local + remote)
    for k in range(M + 1):  # every explicit lead is the listing with that lead
        got = pipeline_seconds(local, remote, dispatch, ret, lead=np.full(local.size, k))[0]
        assert np.allclose(got, [_interpret(*(x[w] for x in case), k) for w in range(local.size)], rtol=1e-12, atol=1e-12)
    # local_first=False is the listing with every entry remote
    old, _ = pipeline_seconds(local, remote, dispatch, ret, local_first=False)
    assert np.allclose(old, [_best(0.0, local[w] + remote[w], dispatch[w], ret[w])[0] for w in range(local.size)])


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
    # never slower than running every entry after its dispatch (that is lead M + 1)
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
    # M=4, only local work (L_m=2), every transfer 1: lead 2: L0 L1 [0,4] while D0..D3 [0,4]; R0..R3 [4,8]
    # while L2 L3 [4,8]
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


# ------------------------------------------------------------------ relay (plan.exchange "Relay")
def _interpret_relay(local, remote, dispatch, ret, lead, relay):
    """Reference for ``RelayTiming``: every worker walks the listing with its own compute clock, FIFO link and
    relay link; at chunk m each rank issues F_m right after waiting D_m, the pair's rows move once both sides
    issued it, and a receiving rank waits F_m before X_m. Workers advance chunk by chunk in lockstep."""
    W, M = dispatch.shape
    L = np.where(lead > M, 0.0, local)
    X = np.where(lead > M, local + remote, remote)
    k = np.minimum(lead, M)
    clock = [L[w] * k[w] / M for w in range(W)]
    arrived = [np.cumsum(dispatch[w]) for w in range(W)]
    link = [arrived[w][-1] for w in range(W)]
    free = [0.0] * W
    for m in range(M):
        issue = [max(clock[w], arrived[w][m]) for w in range(W)]
        for w in range(W):
            clock[w] = issue[w]
            if relay.seconds[:, m].any() or relay.receives[:, m].any():
                start = max([issue[w], free[w]] + [issue[v] for v in range(W) if relay.partners[w, v]])
                free[w] = start + relay.seconds[w, m]
                if relay.receives[w, m]:
                    clock[w] = max(clock[w], free[w])
            clock[w] += X[w] / M
            link[w] = max(clock[w], link[w]) + ret[w, m]
    return np.array([max(clock[w] + L[w] * (M - k[w]) / M, link[w], free[w]) for w in range(W)])


def test_hand_computed_relay_timeline():
    """M=1: worker 0 relays to worker 1. D = [3], [1]; X = 4, 2; R = 1; F_0 = 2 s on both. Worker 0: D0 [0,3],
    issues F0 at 3 (worker 1 issued at 1) -> F0 [3,5]; it only sends, so X0 [3,7], R0 [7,8]: 8. Worker 1:
    D0 [0,1]; F0 needs worker 0's issue -> [3,5]; it waits F0: X0 [5,7], R0 [7,8]: 8. Without the relay
    wait worker 1 would end at 1 + 2 + 1 = 4."""
    from libra_megatron.plan.model import RelayTiming

    relay = RelayTiming(seconds=np.array([[2.0], [2.0]]), partners=np.array([[False, True], [True, False]]),
                        receives=np.array([[False], [True]]))
    args = (np.zeros(2), np.array([4.0, 2.0]), np.array([[3.0], [1.0]]), np.array([[1.0], [1.0]]))
    seconds, _ = pipeline_seconds(*args, lead=[2, 2], relay=relay)
    assert seconds.tolist() == [8.0, 8.0]
    assert pipeline_seconds(*args, lead=[2, 2])[0].tolist() == [8.0, 4.0]


@st.composite
def _relay_timelines(draw):
    local, remote, dispatch, ret = draw(_timelines())
    W, M = dispatch.shape
    from libra_megatron.plan.model import RelayTiming

    moves = np.array(draw(st.lists(st.booleans(), min_size=W * W, max_size=W * W))).reshape(W, W)
    np.fill_diagonal(moves, False)
    kv_chunks = np.array(draw(st.lists(st.booleans(), min_size=M, max_size=M)))
    seconds = np.array([draw(st.lists(st.floats(0, 10, allow_nan=False), min_size=M, max_size=M)) for _ in range(W)])
    seconds = np.where(kv_chunks[None, :] & moves.any(axis=1)[:, None] | moves.any(axis=0)[:, None], seconds, 0.0)
    relay = RelayTiming(seconds=seconds * kv_chunks[None, :], partners=moves | moves.T,
                        receives=moves.any(axis=0)[:, None] & kv_chunks[None, :])
    lead = np.array(draw(st.lists(st.integers(0, M + 1), min_size=W, max_size=W)))
    return local, remote, dispatch, ret, lead, relay


@given(_relay_timelines())
@settings(deadline=None, max_examples=200)
def test_vectorised_relay_timeline_equals_the_lockstep_listing(case):
    local, remote, dispatch, ret, lead, relay = case
    seconds, _ = pipeline_seconds(local, remote, dispatch, ret, lead=lead, relay=relay)
    np.testing.assert_allclose(seconds, _interpret_relay(*case), rtol=1e-12, atol=1e-12)
    without, _ = pipeline_seconds(local, remote, dispatch, ret, lead=lead)
    assert (seconds >= without * (1 - 1e-12) - 1e-12).all()  # a relay hop never makes a worker faster
