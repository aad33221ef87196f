"""The dense placement's op-list cache (``plan.exchange.op_lists.rank_ops_key``): candidate placements of one
pool share most ranks' plans, and a rank's op lists are built once per distinct plan. The cache may only skip work:
equal keys must mean equal op lists, and a cached pricing must equal an uncached one."""
from __future__ import annotations

import numpy as np

from libra_megatron.config import KvFetch, TilePlacement, TilingPolicy, TokenLayoutKind
from libra_megatron.plan.exchange import build_exchange_plan, plan_layer_timing
from libra_megatron.plan.exchange.runtime_tables import rank_sizes
from libra_megatron.plan.exchange.op_lists import layer_ops, rank_ops_key
from libra_megatron.plan.exchange.schedule import rank_layer_ops
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.model import StepTimeModel
from libra_megatron.plan.tiles import build_tiles, place_tiles
from libra_megatron.testing.traces import packed_trace_segments


def _candidates():
    """A real wikipedia pool (2 packed 32K sequences x CP 4, two 4-GPU nodes, relay on): Algorithm 2's placement
    and the same with one tile moved to another worker, each with its exchange plan."""
    heads = HeadLayout(16, 2, 64, head_split=2, num_chunks=2, elem_bytes=2)
    model = StepTimeModel(64, gpus_per_node=4, kv_relay=True)
    segs = packed_trace_segments(np.random.default_rng(11), 2, 32768, name="wikipedia-flexsp.txt")
    tiles = build_tiles(segs, TokenLayout(TokenLayoutKind.ZIGZAG, 32768, 4), heads, 1024,
                        tiling=TilingPolicy.ADAPTIVE, tau=0.03, kv_fetch=KvFetch.PREFIX)
    start = np.asarray(place_tiles(tiles, 0.03, TilePlacement.ALG2).assignment)
    moved = start.copy()
    moved[0] = (moved[0] + 1) % tiles.num_workers
    return model, [build_exchange_plan(tiles, a, model) for a in (start, moved)]


def test_equal_keys_mean_equal_op_lists_and_the_cache_changes_no_price():
    model, plans = _candidates()
    W = plans[0].num_workers
    keyed = {}
    for plan in plans:
        for r in range(W):
            rank_plan = plan.for_rank(r)
            ops = rank_layer_ops(rank_plan)
            keyed.setdefault(_key(rank_plan), set()).add(ops)
    assert all(len(lists) == 1 for lists in keyed.values())  # a key never stands for two different op lists
    assert W < len(keyed) < 2 * W  # the moved tile changed some ranks' plans, not all of them
    cache = {}
    for plan in plans:
        cached, plain = layer_ops(plan, cache=cache), layer_ops(plan)
        assert cached == plain
        with_cache = plan_layer_timing(plan, model, cache={})
        without = plan_layer_timing(plan, model)
        for phase in ("forward", "backward"):
            assert np.array_equal(getattr(with_cache, phase).seconds, getattr(without, phase).seconds)
    assert len(cache) == 2 * len(keyed)  # every distinct rank plan's two phases built once over both candidates


def _key(rank_plan):
    return rank_ops_key(rank_sizes(rank_plan), rank_plan.heads, rank_plan.rank, rank_plan.num_workers,
                        rank_plan.local_tokens, rank_plan.local_lead)


def test_the_key_sees_each_field_the_op_lists_read():
    import dataclasses

    _, plans = _candidates()
    rank_plan = plans[0].for_rank(1)
    base = _key(rank_plan)
    for change in (dict(local_lead=rank_plan.local_lead + 1), dict(rank=0), dict(local_tokens=rank_plan.local_tokens + 1),
                   dict(seq_k_len=rank_plan.seq_k_len + 1), dict(kv_route=rank_plan.q_route),
                   dict(heads=dataclasses.replace(rank_plan.heads, elem_bytes=4))):
        assert _key(dataclasses.replace(rank_plan, **change)) != base, change
    assert _key(dataclasses.replace(rank_plan, fingerprint="another pool")) == base  # not read


def test_a_phase_is_built_and_priced_only_when_read():
    """``LayerPricing`` builds a phase's op lists on its first read: after the forward alone the cache holds no
    backward list, and the forward priced alone equals the forward of the whole layer."""
    from libra_megatron.plan.exchange import LayerPricing

    model, plans = _candidates()
    cache = {}
    pricing = LayerPricing(plans[0], model, cache=cache)
    forward = pricing.phase("forward")
    assert cache and {key[-1] for key in cache} == {"forward"}
    assert np.array_equal(forward.seconds, plan_layer_timing(plans[0], model).forward.seconds)
    pricing.layer()
    assert {key[-1] for key in cache} == {"forward", "backward"}


def test_byte_rows_shared_by_phases_and_plans_change_no_op():
    """``phase_ops(byte_rows=...)``: one dict of bytes-per-peer tuples shared by both phases of both candidates
    gives the op lists each phase builds alone, and it does share: a rank's forward Q dispatch and its backward dO
    dispatch (the same split sizes, the same row bytes) carry one tuple object."""
    from libra_megatron.plan.exchange.op_lists import phase_ops, rank_inputs
    from libra_megatron.plan.model import Exchange

    _, plans = _candidates()
    shared = {}
    for plan in plans:
        inputs = rank_inputs(plan)
        built = {phase: phase_ops(inputs, phase, byte_rows=shared) for phase in ("forward", "backward")}
        for phase, ops in built.items():
            assert ops == phase_ops(inputs, phase)
        for fwd, bwd in zip(built["forward"], built["backward"]):
            q = next(op for op in fwd if type(op) is Exchange and op.tag == "q")
            do = next(op for op in bwd if type(op) is Exchange and op.tag == "do")
            assert q.send == do.send and q.send is do.send
    exchanges = sum(type(op) is Exchange for plan in plans for phase in ("forward", "backward")
                    for ops in phase_ops(rank_inputs(plan), phase) for op in ops)
    assert 0 < len(shared) < exchanges  # each distinct (sizes, row bytes) built once, not once per exchange
