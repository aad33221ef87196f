"""plan.model.events: the whole-layer event model on hand-computed timelines, and on real plans' op lists."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from libra_megatron.plan.exchange import build_exchange_plan, layer_ops, plan_layer_timing
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.model import BACKWARD_FLOPS_FACTOR, Copy, Exchange, Kernel, StepTimeModel, Wait, price_ops
from libra_megatron.plan.tiles import build_tiles

US = 1e-6
# 1 GB/s intra, 0.5 GB/s inter, 1 pair-head = 4*d FLOPs at d = 1 and 4e-6 TFLOP/s: 1 pair = 1 us
RATES = dict(head_dim=1, attn_tflops=4e-6, intra_node_gbps=1.0, inter_node_gbps=0.5, gpus_per_node=2,
             collective_us=3.0, intra_message_us=1.0, inter_message_us=2.0, kernel_launch_us=0.0, copy_gbps=1.0,
             gather_gbps=1.0, place_gbps=1.0, add_gbps=1.0, copy_launch_us=0.0)


def _model(**over):
    return StepTimeModel(**{**RATES, **over})


def _x(nbytes, peers=1, alpha=1.0, gbps=1.0):
    """One rank's transfer time in seconds: bytes at ``gbps`` plus one alpha per peer (us)."""
    return nbytes / (gbps * 1e9) + peers * alpha * US


def test_one_exchange_both_ranks_ready_at_zero():
    B = 2000
    ops = [[Exchange("pool", 0, (0, B), (0, B)), Wait("pool", 0)], [Exchange("pool", 0, (B, 0), (B, 0)), Wait("pool", 0)]]
    t = price_ops(ops, _model())
    want = 3 * US + _x(B)
    assert np.allclose(t.seconds, want) and np.allclose(t.compute, 0) and np.allclose(t.exposed, want)


def test_a_receive_waits_for_its_late_sender():
    """Rank 0 computes 50 pairs (50 us) before it sends; rank 1 issued at 0 and only receives: it ends 50 us +
    the transfer later (a per-worker model that prices rank 1 alone says 3 us + x)."""
    B = 1000
    k = Kernel("fwd", 1, 10, 10, 50, 1)
    ops = [[k, Exchange("pool", 0, (0, B), (0, 0)), Wait("pool", 0)],
           [Exchange("pool", 0, (0, 0), (B, 0)), Wait("pool", 0)]]
    t = price_ops(ops, _model())
    x = _x(B)
    assert np.isclose(t.seconds[1], 3 * US + 50 * US + x)
    assert np.isclose(t.seconds[0], 3 * US + 50 * US + x) and np.isclose(t.compute[0], 50 * US)
    assert np.isclose(t.exposed[1], t.seconds[1])


def _swap(rank: int, nbytes: int):
    """(send, recv) bytes of a two-rank exchange where each rank sends ``nbytes`` to the other."""
    pair = (0, nbytes) if rank == 0 else (nbytes, 0)
    return pair, pair


def test_exchanges_on_one_communicator_run_in_issue_order():
    B = 1000
    ops = [[Exchange("pool", 0, *_swap(r, B)), Exchange("pool", 1, *_swap(r, B)), Wait("pool", 1), Wait("pool", 0)]
           for r in range(2)]
    t = price_ops(ops, _model())
    one = 3 * US + _x(B)
    assert np.allclose(t.seconds, 2 * one)


def test_the_relay_communicator_shares_the_link():
    """A relay exchange issued at 0 next to a pool exchange in the same link class starts when that link is free
    (not at 0), but it does not wait for the pool exchange's collective latency (another communicator)."""
    B = 1000
    ops = [[Exchange("pool", 0, *_swap(r, B)), Exchange("relay", 0, *_swap(r, B)), Wait("relay", 0),
            Wait("pool", 0)] for r in range(2)]
    t = price_ops(ops, _model())
    assert np.allclose(t.seconds, B / 1e9 + 3 * US + _x(B))  # the link is busy for the bytes, not the alpha


def test_a_relay_hop_inside_a_node_runs_beside_an_inter_node_dispatch():
    """Nodes {0, 1}, {2, 3}. A pool exchange between ranks 0 and 2 (inter-node) and a relay exchange between ranks
    0 and 1 (intra-node), both issued at 0: the relay's bytes go over NVLink while the dispatch's go over the NIC,
    so the relay ends after its own transfer, not after the dispatch's (one shared link would add B / 0.5 GB/s)."""
    B = 1000
    pool = [((0, 0, B, 0), (0, 0, B, 0)), ((0,) * 4, (0,) * 4), ((B, 0, 0, 0), (B, 0, 0, 0)), ((0,) * 4, (0,) * 4)]
    relay = [((0, B, 0, 0), (0, B, 0, 0)), ((B, 0, 0, 0), (B, 0, 0, 0)), ((0,) * 4, (0,) * 4), ((0,) * 4, (0,) * 4)]
    ops = [[Exchange("pool", 0, *pool[r]), Exchange("relay", 0, *relay[r]), Wait("relay", 0), Wait("pool", 0)]
           for r in range(4)]
    t = price_ops(ops, _model())
    inter = 3 * US + _x(B, alpha=2.0, gbps=0.5)
    assert np.isclose(t.seconds[1], 3 * US + _x(B))  # rank 1 only relays
    assert np.isclose(t.seconds[2], inter) and np.isclose(t.seconds[0], inter)
    assert np.allclose(t.link, [B / 0.5e9 + B / 1e9, B / 1e9, B / 0.5e9, 0.0])  # per exchange, its slower class


def test_exchanges_are_played_in_the_order_they_begin():
    """Two pool exchanges issued at 0 (the second begins when the first ends, at 5 us) and a relay exchange
    issued at 1 us: the relay begins first, so it runs at 1-6 us, and the second pool exchange after it does not
    delay it (played in issue order, the queued pool exchange would hold the link until 6 us and the relay end
    at 11 us)."""
    B = 1000  # 1 us at 1 GB/s, + 1 us alpha, + 3 us per call: 5 us an exchange
    ops = [[Exchange("pool", 0, *_swap(r, B)), Exchange("pool", 1, *_swap(r, B)), Kernel("fwd", 1, 1, 1, 1, 1),
            Exchange("relay", 0, *_swap(r, B)), Wait("relay", 0), Kernel("fwd", 1, 10, 10, 10, 1), Wait("pool", 1),
            Wait("pool", 0)] for r in range(2)]
    t = price_ops(ops, _model())
    assert np.allclose(t.seconds, 16 * US)  # relay ends at 6 us, then 10 us of compute; pool 1 ends at 10 us
    assert np.allclose(t.compute, 11 * US)


def test_inter_node_bytes_and_alpha_and_self_copy():
    B, S = 1000, 500
    nodes = np.array([0, 1])
    ops = [[Exchange("pool", 0, (S, B), (S, B)), Wait("pool", 0)], [Exchange("pool", 0, (B, S), (B, S)), Wait("pool", 0)]]
    t = price_ops(ops, _model(), nodes)
    assert np.allclose(t.seconds, 3 * US + _x(B, alpha=2.0, gbps=0.5))  # the self copy (1 us) runs beside
    big_self = [[Exchange("pool", 0, (100 * S, B), (100 * S, B)), Wait("pool", 0)],
                [Exchange("pool", 0, (B, 0), (B, 0)), Wait("pool", 0)]]
    t = price_ops(big_self, _model(), nodes)
    assert np.isclose(t.seconds[0], 3 * US + 2 * 100 * S / 1e9)
    assert np.isclose(t.seconds[1], 3 * US + _x(B, alpha=2.0, gbps=0.5))


def test_messages_of_one_exchange_share_the_links_fairly():
    """Rank 0 sends a large and a small message: the small one is done after twice its own bytes (it shares
    the egress with the large one until it ends), the large one after both messages' bytes."""
    big, small = 10_000, 1_000
    ops = [[Exchange("pool", 0, (0, big, small), (0, 0, 0)), Wait("pool", 0)],
           [Exchange("pool", 0, (0, 0, 0), (big, 0, 0)), Wait("pool", 0)],
           [Exchange("pool", 0, (0, 0, 0), (small, 0, 0)), Wait("pool", 0)]]
    t = price_ops(ops, _model(gpus_per_node=4))
    assert np.isclose(t.seconds[2], 3 * US + 2 * small / 1e9 + 1 * US)
    assert np.isclose(t.seconds[1], 3 * US + (big + small) / 1e9 + 1 * US)
    assert np.isclose(t.seconds[0], t.seconds[1])
    bad = [ops[0], [Exchange("pool", 0, (0, 0, 0), (big + 1, 0, 0)), Wait("pool", 0)], ops[2]]
    with pytest.raises(ValueError, match="sends 10000 bytes to rank 1, which expects 10001"):
        price_ops(bad, _model(gpus_per_node=4))


def test_kernel_and_copy_costs_and_the_backward_factor():
    m = _model(kernel_launch_us=5.0, kernel_entry_us=0.5, copy_launch_us=2.0)
    ops = [[Kernel("fwd", 4, 10, 10, 100, 1), Kernel("bwd", 4, 10, 10, 100, 1), Copy("gather", 1000),
            Copy("place", 0), Kernel("fwd", 0, 0, 0, 0, 1)]]
    t = price_ops(ops, m)
    fwd = 100 * US + 5 * US + 4 * 0.5 * US
    bwd = 100 * US * BACKWARD_FLOPS_FACTOR + 5 * US + 4 * 0.5 * US
    copy = 2 * US + 2 * 1000 / 1e9
    assert np.isclose(t.seconds[0], fwd + bwd + copy) and np.isclose(t.compute[0], t.seconds[0])


def test_each_copy_kind_at_its_own_rate():
    """gather / index_put_ / index_add_ are priced apart (their H200 rates differ 4x): 1000 bytes each at 1, 2 and
    4 GB/s, read + written, plus one launch each."""
    m = _model(gather_gbps=1.0, place_gbps=2.0, add_gbps=4.0, copy_launch_us=2.0)
    ops = [[Copy("gather", 1000), Copy("place", 1000), Copy("add", 1000)]]
    t = price_ops(ops, m)
    expect = 3 * 2 * US + 2 * 1000 / 1e9 * (1 / 1.0 + 1 / 2.0 + 1 / 4.0)
    assert np.isclose(t.seconds[0], expect) and np.isclose(t.compute[0], expect)
    with pytest.raises(ValueError, match="--place-gbps must be a finite number > 0"):
        _model(place_gbps=0.0)


def test_compute_overlaps_an_exchange_in_flight():
    B = 100_000  # 100 us on the link
    ops = [[Exchange("pool", 0, *_swap(r, B)), Kernel("fwd", 1, 1, 1, 60, 1), Wait("pool", 0)] for r in range(2)]
    t = price_ops(ops, _model())
    assert np.allclose(t.seconds, 3 * US + _x(B))
    assert np.allclose(t.exposed, t.seconds - 60 * US)


def test_disagreeing_op_lists_raise_instead_of_hanging():
    ops = [[Exchange("pool", 0, (0, 1), (0, 1)), Wait("pool", 0)], [Wait("pool", 0)]]
    with pytest.raises(ValueError, match="cannot run to the end"):
        price_ops(ops, _model())
    with pytest.raises(ValueError, match="names 3 ranks"):
        price_ops([[Exchange("pool", 0, (0, 1, 0), (0, 1, 0))], [Exchange("pool", 0, (0, 1), (0, 1))]], _model())


def _plan(heads, seed=0):
    tiles = build_tiles([[5, 20, 7], [32], [10, 22]], TokenLayout("zigzag", 32, 2), heads, 6)
    assign = np.random.default_rng(seed).integers(0, tiles.num_workers, tiles.num_tiles)
    return tiles, build_exchange_plan(tiles, assign)


@pytest.mark.parametrize("heads", [HeadLayout(8, 2, 4, 2, 2), HeadLayout(8, 8, 4, 1, 4), HeadLayout(4, 1, 4, 2, 2)])
@pytest.mark.parametrize("save_mode", ["arranged", "refetch"])
def test_the_op_lists_of_a_plan_compute_its_pairs_and_move_its_bytes(heads, save_mode):
    """Independent of the schedule's order: the kernels of every rank's forward compute exactly the pool's
    causal pairs x heads (Eq. 6 of the tiles), the backward the same pairs again, and the bytes the forward's
    exchanges send to other ranks are the plan's Q + K/V + O totals."""
    tiles, plan = _plan(heads)
    ops = layer_ops(plan, save_mode)
    want_pairs = int(tiles.tile_flops().sum())
    for phase in (ops.forward, ops.backward):  # a split entry's causal tail + unmasked head = its causal pairs
        assert sum(op.pairs for rank in phase for op in rank if isinstance(op, Kernel)) == want_pairs
    remote = sum(b for r, rank in enumerate(ops.forward) for op in rank if isinstance(op, Exchange)
                 for q, b in enumerate(op.send) if q != r)
    assert remote == plan.bytes_q + plan.bytes_kv + plan.bytes_o


def test_layer_timing_of_a_plan_is_never_below_its_compute_and_refetch_costs_more():
    heads = HeadLayout(8, 2, 4, 2, 2)
    _, plan = _plan(heads, 3)
    model = StepTimeModel(4, gpus_per_node=2)
    arranged, refetch = plan_layer_timing(plan, model, "arranged"), plan_layer_timing(plan, model, "refetch")
    for lt in (arranged, refetch):
        for phase in (lt.forward, lt.backward):
            assert (phase.seconds >= phase.compute - 1e-15).all() and (phase.exposed >= -1e-15).all()
    assert refetch.backward.seconds.max() > arranged.backward.seconds.max()
    assert np.allclose(refetch.forward.seconds, arranged.forward.seconds)
    slower = dataclasses.replace(model, inter_node_gbps=model.inter_node_gbps / 10)
    assert plan_layer_timing(plan, slower).seconds.max() > arranged.seconds.max()


def test_the_backward_kernel_can_run_at_its_own_rate_and_costs():
    m = _model(attn_bwd_tflops=2e-6, bwd_kernel_launch_us=7.0, bwd_kernel_entry_us=1.0, kernel_launch_us=5.0)
    t = price_ops([[Kernel("bwd", 3, 10, 10, 100, 1)], [Kernel("fwd", 3, 10, 10, 100, 1)]], m)
    assert np.isclose(t.seconds[0], 2 * 100 * US * BACKWARD_FLOPS_FACTOR + 7 * US + 3 * US)
    assert np.isclose(t.seconds[1], 100 * US + 5 * US)
    with pytest.raises(ValueError, match="attn_bwd_tflops"):
        _model(attn_bwd_tflops=0.0)
