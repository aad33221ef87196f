"""plan.exchange.traffic: bytes per link, worker and Pipeliner phase read off an ExchangePlan, against its routes."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from libra_megatron.plan.errors import PlanError
from libra_megatron.plan.exchange import build_exchange_plan, plan_traffic, validate_plan
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.tiles import build_tiles
from libra_megatron.plan.model import StepTimeModel


def _plan(heads, seed=0):
    tiles = build_tiles([[5, 20, 7], [32], [10, 22]], TokenLayout("zigzag", 32, 2), heads, 6)
    assign = np.random.default_rng(seed).integers(0, tiles.num_workers, tiles.num_tiles)
    return tiles, build_exchange_plan(tiles, assign)


@pytest.mark.parametrize("heads", [HeadLayout(8, 2, 4, 2, 2), HeadLayout(32, 4, 4, 2, 4), HeadLayout(8, 8, 4, 1, 4)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_traffic_equals_every_ranks_route_splits_and_bytes_sent(heads, seed):
    tiles, plan = _plan(heads, seed)
    traffic = plan_traffic(plan)
    W = tiles.num_workers
    qb, kvb = heads.q_bytes_per_token(), heads.kv_bytes_per_token()
    for rp in plan.ranks:
        r = rp.rank
        others = np.arange(W) != r
        assert np.array_equal(traffic.q[r][others], rp.q_route.send_splits[others] * qb)
        assert np.array_equal(traffic.kv[r][others], rp.kv_route.send_splits[others] * kvb)
        # O goes back to every Q unit's home: what r received on its Q route
        assert np.array_equal(traffic.o[r][others], rp.q_route.recv_splits[others] * qb)
        assert tuple(int(x) for x in traffic.bytes_sent()[r]) == tuple(rp.bytes_sent)
    assert np.isclose(traffic.q.sum(), plan.bytes_q) and np.isclose(traffic.kv.sum(), plan.bytes_kv)


def test_link_bytes_split_by_node_by_hand():
    _, plan = _plan(HeadLayout(8, 2, 4, 2, 2))
    traffic = plan_traffic(plan)
    node = np.array([0, 0, 1, 1, 1, 1])
    intra, inter = traffic.link_bytes(node)
    total = traffic.q + traffic.kv + traffic.o
    for w in range(6):
        same = node == node[w]
        assert intra[w] == max(total[w, same].sum(), total[same, w].sum())
        assert inter[w] == max(total[w, ~same].sum(), total[~same, w].sum())


def _route_class_bytes(plan, rank, heads, same):
    """(Q sent, Q received, K/V sent, K/V received) bytes of one rank with the peers in ``same``, read off its
    routes' per-peer splits (self excluded)."""
    rp = plan.for_rank(rank)
    qb, kvb = heads.q_bytes_per_token(), heads.kv_bytes_per_token()
    peers = same & (np.arange(same.size) != rank)
    return (rp.q_route.send_splits[peers].sum() * qb, rp.q_route.recv_splits[peers].sum() * qb,
            rp.kv_route.send_splits[peers].sum() * kvb, rp.kv_route.recv_splits[peers].sum() * kvb)


@pytest.mark.parametrize("heads, kv_sends", [(HeadLayout(8, 2, 4, 2, 2), [1, 0]), (HeadLayout(32, 4, 4, 2, 4), [1, 0, 1, 0]),
                                             (HeadLayout(8, 8, 4, 1, 4), [1, 1, 1, 1])])
def test_phase_bytes_and_seconds_follow_the_runtime_issue_order(heads, kv_sends):
    """Per chunk and link class: dispatch = Q/M + K/V/F on the chunks that send K/V, return = O/M (O mirrors
    the Q received), each max(sent, received); seconds = the link rate of each phase."""
    assert heads.kv_send_chunks().astype(int).tolist() == kv_sends
    _, plan = _plan(heads)
    traffic = plan_traffic(plan)
    node = np.array([0, 0, 1, 1, 1, 1])
    intra, inter = traffic.phase_link_bytes(node)
    M, F = heads.num_chunks, sum(kv_sends)
    for w in range(6):
        for got, same in ((intra[w], node == node[w]), (inter[w], node != node[w])):
            qs, qr, ks, kr = _route_class_bytes(plan, w, heads, same)
            for m in range(M):
                share = kv_sends[m] / F
                assert got[0, m] == pytest.approx(max(qs / M + ks * share, qr / M + kr * share), rel=1e-12)
                assert got[1, m] == pytest.approx(max(qr, qs) / M, rel=1e-12)
    model = StepTimeModel(4, intra_node_gbps=2e-6, inter_node_gbps=1e-6)
    dispatch, ret = traffic.phase_seconds(node, model)
    assert np.allclose(dispatch, np.maximum(intra[:, 0] / 2e3, inter[:, 0] / 1e3))
    assert np.allclose(ret, np.maximum(intra[:, 1] / 2e3, inter[:, 1] / 1e3))
    # with every peer on one node, all bytes are intra-node and the dispatches sum to what crosses the link
    one, none = traffic.phase_link_bytes(np.zeros(6, dtype=int))
    assert not none.any()
    sent = traffic.bytes_sent()
    assert np.all(one[:, 0].sum(axis=1) >= sent[:, 0] + sent[:, 1] - 1e-6)


def test_corrupt_peer_units_are_caught_naming_the_rank():
    tiles, plan = _plan(HeadLayout(8, 2, 4, 2, 2))
    validate_plan(plan, tiles)
    units = np.array(plan.peer_units)
    units[1, 3, (3 + 1) % 6] += 1
    with pytest.raises(PlanError, match="rank 3: peer_units of kv_route"):
        validate_plan(dataclasses.replace(plan, peer_units=units), tiles)
