"""Codec: RankPlan / ExchangePlan <-> 1-D int64 buffers round-trip exactly; damage raises PlanError."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_megatron.plan.codec import (
    decode_exchange_plan, decode_rank_plan, encode_exchange_plan, encode_rank_plan,
)
from libra_megatron.plan.errors import PlanError
from libra_megatron.plan.exchange import build_exchange_plan
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.tiles import build_tiles
from libra_megatron.plan.validate import validate_plan

ROUTE_FIELDS = ("send_index", "send_splits", "recv_splits", "recv_index", "source_len", "target_len", "accumulate")
RANK_FIELDS = ("rank", "num_workers", "local_tokens", "heads", "fingerprint", "bytes_sent")
RANK_ARRAYS = ("cu_seqlens_q", "seq_kv_offset", "seq_k_len")


def make_plan(seed: int):
    rng = np.random.default_rng(seed)
    cp, H = int(rng.choice([1, 2, 4])), int(rng.choice([1, 2]))
    layout, heads = TokenLayout("zigzag", 16 * cp, cp), HeadLayout(8, 2, 4, H, 2, elem_bytes=int(rng.choice([2, 4])))
    segs = [np.diff([0, *sorted(rng.choice(np.arange(1, 16 * cp), 3, replace=False)), 16 * cp]) for _ in range(2)]
    tiles = build_tiles(segs, layout, heads, int(rng.integers(1, 9)))
    return tiles, build_exchange_plan(tiles, rng.integers(0, tiles.num_workers, tiles.num_tiles))


def assert_same_rank_plan(a, b):
    for f in RANK_FIELDS:
        assert getattr(a, f) == getattr(b, f), f
    for f in RANK_ARRAYS:
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
        assert getattr(b, f).dtype == np.int64
    for route in ("q_route", "kv_route"):
        for f in ROUTE_FIELDS:
            np.testing.assert_array_equal(getattr(getattr(a, route), f), getattr(getattr(b, route), f))


@given(st.integers(0, 10_000))
@settings(deadline=None, max_examples=20)
def test_rank_plan_round_trips_exactly(seed):
    _, plan = make_plan(seed)
    for rp in plan.ranks:
        buf = encode_rank_plan(rp)
        assert buf.dtype == np.int64 and buf.ndim == 1
        assert_same_rank_plan(rp, decode_rank_plan(buf))


def test_inverse_route_flag_round_trips():
    _, plan = make_plan(1)
    rp = plan.ranks[0]
    inv = dataclasses.replace(rp, q_route=rp.q_route.inverse())
    assert decode_rank_plan(encode_rank_plan(inv)).q_route.accumulate is True


def test_exchange_plan_round_trips_and_still_validates():
    tiles, plan = make_plan(7)
    back = decode_exchange_plan(encode_exchange_plan(plan))
    assert (back.fingerprint, back.bytes_q, back.bytes_kv, back.bytes_o) == (
        plan.fingerprint, plan.bytes_q, plan.bytes_kv, plan.bytes_o)
    np.testing.assert_array_equal(back.assignment, plan.assignment)
    for a, b in zip(plan.ranks, back.ranks):
        assert_same_rank_plan(a, b)
    validate_plan(back, tiles)


def test_every_single_word_corruption_is_detected():
    _, plan = make_plan(3)
    buf = encode_rank_plan(plan.ranks[1])
    for i in range(buf.size):
        bad = buf.copy()
        bad[i] ^= 1 << (i % 63)
        with pytest.raises(PlanError):
            decode_rank_plan(bad)


def test_every_truncation_is_detected():
    _, plan = make_plan(4)
    for buf, decode in ((encode_rank_plan(plan.ranks[0]), decode_rank_plan),
                        (encode_exchange_plan(plan), decode_exchange_plan)):
        for n in range(buf.size):
            with pytest.raises(PlanError):
                decode(buf[:n])


def test_wrong_dtype_or_kind_of_buffer_is_rejected():
    _, plan = make_plan(5)
    buf = encode_rank_plan(plan.ranks[0])
    with pytest.raises(PlanError, match="int64"):
        decode_rank_plan(buf.astype(np.int32))
    with pytest.raises(PlanError, match="magic"):
        decode_exchange_plan(buf)
