"""Issue 25, the planner's speed-ups: every fast path gives exactly what the code before it gave.

References: ``_alg2_reference`` (Algorithm 2's greedy loop before), ``_timeline_reference`` below (the timeline
priced one lead per call, as ``best_lead`` did) and ``chunk_phase_bytes`` one link class per call (as the search
called it); ``test_timeaware`` compares the search itself with its per-move reference. (The 'dense' placement's
plans changed after these speed-ups: issue 24 keeps its candidates by the whole layer, ``test_node_export``.)"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_megatron.plan.exchange import chunk_phase_bytes
from libra_megatron.plan.layout import HeadLayout
from libra_megatron.plan.model import RelayTiming, best_lead, pipeline_seconds
from libra_megatron.plan.tiles.alg2 import place_alg2

from . import _alg2_reference
from .test_placement import pools
from .test_timeaware import _shipped_pools


def _timeline_reference(local, remote, dispatch, ret, lead, relay=None):
    """``plan.model.timing._timeline`` before issue 25: one lead per worker, [W] only."""
    M = dispatch.shape[1]
    unsplit = lead > M
    local, remote, lead = np.where(unsplit, 0.0, local), np.where(unsplit, local + remote, remote), np.minimum(lead, M)
    arrived = np.cumsum(dispatch, axis=1)
    link = arrived[:, -1]
    relay_free = np.zeros_like(link)
    t = local * lead / M
    for m in range(M):
        t = np.maximum(t, arrived[:, m])
        if relay is not None and (relay.seconds[:, m].any() or relay.receives[:, m].any()):
            peers = np.where(relay.partners, t[None, :], 0.0).max(axis=1, initial=0.0)
            relay_free = np.maximum(np.maximum(t, peers), relay_free) + relay.seconds[:, m]
            t = np.where(relay.receives[:, m], np.maximum(t, relay_free), t)
        t = t + remote / M
        link = np.maximum(t, link) + ret[:, m]
    t = t + local * (M - lead) / M
    return np.maximum(np.maximum(t, link), relay_free)


def _best_lead_reference(local, remote, dispatch, ret, relay=None):
    M = dispatch.shape[1]
    times = np.stack([_timeline_reference(local, remote, dispatch, ret, np.full(local.shape, k, dtype=np.int64), relay)
                      for k in range(M + 2)])
    near = times <= times.min(axis=0) * (1.0 + 1e-12) + 1e-300
    return (M + 1 - np.argmax(near[::-1], axis=0)).astype(np.int64)


@st.composite
def _timeline_cases(draw):
    seed, W, M = draw(st.integers(0, 2**31 - 1)), draw(st.integers(1, 12)), draw(st.integers(1, 6))
    rng = np.random.default_rng(seed)
    local = rng.random(W) * (rng.random(W) < 0.7)
    remote, dispatch, ret = rng.random(W), rng.random((W, M)) * (rng.random((W, M)) < 0.8), rng.random((W, M))
    relay = None
    if draw(st.booleans()):
        moves = rng.random((W, W)) < 0.3
        np.fill_diagonal(moves, False)
        sends = rng.random(M) < 0.6
        relay = RelayTiming(seconds=rng.random((W, M)) * sends, partners=moves | moves.T,
                            receives=moves.any(axis=0)[:, None] & sends[None, :])
    return local, remote, dispatch, ret, relay


@settings(max_examples=200, deadline=None)
@given(_timeline_cases())
def test_best_lead_prices_all_leads_at_once_bit_identically(case):
    local, remote, dispatch, ret, relay = case
    expected = _best_lead_reference(local, remote, dispatch, ret, relay)
    np.testing.assert_array_equal(best_lead(local, remote, dispatch, ret, relay), expected)
    seconds = pipeline_seconds(local, remote, dispatch, ret, relay=relay)[0]
    np.testing.assert_array_equal(seconds, _timeline_reference(local, remote, dispatch, ret, expected, relay))


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([(32, 4, 4, 4), (32, 4, 2, 4), (128, 16, 1, 8), (32, 8, 4, 2)]))
def test_chunk_phase_bytes_of_both_link_classes_equals_one_class_per_call(seed, shape):
    hq, hkv, H, M = shape
    heads = HeadLayout(hq, hkv, 128, H, M, elem_bytes=2)
    totals = [np.random.default_rng(seed + k).integers(0, 10**9, (7, 2)).astype(np.float64) for k in range(4)]
    both = chunk_phase_bytes(*totals, heads)
    for c in range(2):
        np.testing.assert_array_equal(both[:, c], chunk_phase_bytes(*(x[:, c] for x in totals), heads))


@settings(max_examples=150, deadline=None)
@given(pools())
def test_alg2_loop_equals_the_loop_before_on_small_pools(case):
    tiles, tau = case
    got, expected = place_alg2(tiles, tau), _alg2_reference.place_alg2(tiles, tau)
    np.testing.assert_array_equal(got[0], expected[0])
    assert got[1:] == expected[1:]
    cost = np.random.default_rng(tiles.num_tiles).random(tiles.num_tiles)  # float loads: tile by tile
    got, expected = place_alg2(tiles, tau, cost), _alg2_reference.place_alg2(tiles, tau, cost)
    np.testing.assert_array_equal(got[0], expected[0])
    assert got[1:] == expected[1:]


@pytest.fixture(scope="module")
def shipped_pools():
    return _shipped_pools()


def test_alg2_loop_equals_the_loop_before_on_real_pools(shipped_pools):
    for tiles in shipped_pools:
        got, expected = place_alg2(tiles, 0.03), _alg2_reference.place_alg2(tiles, 0.03)
        np.testing.assert_array_equal(got[0], expected[0])
        assert got[1:] == expected[1:]


# ---- the timeline prices each distinct exchange once; pricing pauses the cyclic collector ----------------------

def _uncached_timeline(monkeypatch):
    """``plan.model.events`` as before the per-timeline caches: every exchange's links priced, every row converted."""
    from libra_megatron.plan.model import events

    def link_seconds(self, send):
        return (events.message_done_seconds(send, self.nodes, self.model),
                events.exchange_class_seconds(send, self.nodes, self.model))

    monkeypatch.setattr(events._Timeline, "link_seconds", link_seconds)
    monkeypatch.setattr(events._Collective, "row", lambda self, sizes: sizes)


def test_the_timeline_prices_each_distinct_exchange_once_and_the_same(monkeypatch):
    from libra_megatron.plan.exchange import layer_ops
    from libra_megatron.plan.model import Exchange, events, price_ops

    from .test_op_list_cache import _candidates

    model, plans = _candidates()
    lists = [getattr(layer_ops(plan), phase) for plan in plans for phase in ("forward", "backward")]
    calls, real = [], events.message_done_seconds
    monkeypatch.setattr(events, "message_done_seconds", lambda send, *a: calls.append(send.tobytes()) or real(send, *a))
    fast, priced, exchanges = [], 0, 0
    for ops in lists:
        calls.clear()
        fast.append(price_ops(ops, model))
        assert len(calls) == len(set(calls))  # a matrix priced once per phase
        priced += len(calls)
        exchanges += sum(isinstance(op, Exchange) for op in ops[0])
    assert 0 < priced < exchanges  # the Q route's exchanges (Q, O, dO, dQ) repeat one matrix
    monkeypatch.undo()
    _uncached_timeline(monkeypatch)
    for ops, got in zip(lists, fast):
        slow = price_ops(ops, model)
        for field in ("seconds", "compute", "link"):
            np.testing.assert_array_equal(getattr(got, field), getattr(slow, field))


def test_paused_gc_pauses_in_the_main_thread_only_and_keeps_a_collector_that_was_off():
    import gc
    import threading

    from libra_megatron.plan.gc_pause import paused_gc

    was = gc.isenabled()
    try:
        gc.enable()
        with paused_gc():
            assert not gc.isenabled()
            with paused_gc():  # nested: still off, and the inner exit does not turn it on
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()
        seen = []

        def other():  # a planner thread beside training: the interpreter's switch is not its to flip
            with paused_gc():
                seen.append(gc.isenabled())
                gc.disable()  # what Megatron's --manual-gc does meanwhile
            seen.append(gc.isenabled())

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(10)
        assert seen == [True, False]
        with paused_gc():  # off on entry (--manual-gc): a block must not turn it on
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_pricing_and_the_dense_placement_run_with_the_collector_paused(monkeypatch):
    import gc

    from libra_megatron.config import KvFetch, TilingPolicy, TokenLayoutKind
    from libra_megatron.plan.exchange import plan_layer_timing, traffic
    from libra_megatron.plan.layout import TokenLayout
    from libra_megatron.plan.model import StepTimeModel
    from libra_megatron.plan.tiles import build_tiles, placement
    from libra_megatron.testing.traces import packed_trace_segments

    heads = HeadLayout(16, 2, 64, head_split=2, num_chunks=2, elem_bytes=2)
    model = StepTimeModel(64, gpus_per_node=4)
    segs = packed_trace_segments(np.random.default_rng(5), 2, 16384, name="wikipedia-flexsp.txt")
    tiles = build_tiles(segs, TokenLayout(TokenLayoutKind.ZIGZAG, 16384, 2), heads, 1024,
                        tiling=TilingPolicy.ADAPTIVE, tau=0.03, kv_fetch=KvFetch.PREFIX)
    seen, real_ops, real_alg2 = [], traffic.price_ops, placement.place_alg2
    monkeypatch.setattr(traffic, "price_ops", lambda *a, **k: seen.append(gc.isenabled()) or real_ops(*a, **k))
    monkeypatch.setattr(placement, "place_alg2", lambda *a, **k: seen.append(gc.isenabled()) or real_alg2(*a, **k))
    was = gc.isenabled()
    gc.enable()
    try:
        result = placement.place_tiles(tiles, 0.03, "dense", timing=model)
        assert len(seen) >= 3 and not any(seen) and gc.isenabled()
        seen.clear()
        plan_layer_timing(result.exchange, model)
        assert seen == [False, False] and gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
