"""plan.traffic: bytes per link, worker and Pipeliner phase read off an ExchangePlan, against its routes."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from libra_megatron.plan.errors import PlanError
from libra_megatron.plan.exchange import build_exchange_plan
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.tiles import build_tiles
from libra_megatron.plan.traffic import plan_traffic
from libra_megatron.plan.validate import validate_plan


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


@pytest.mark.parametrize("heads, kv_chunks", [(HeadLayout(8, 2, 4, 2, 2), 1), (HeadLayout(32, 4, 4, 2, 4), 2),
                                              (HeadLayout(8, 8, 4, 1, 4), 4)])
def test_phase_bytes_follow_the_runtime_issue_order(heads, kv_chunks):
    """Q and O split evenly over the M chunks; K/V only in the chunks that fetch a new kv piece."""
    assert int(heads.kv_send_chunks().sum()) == kv_chunks
    _, plan = _plan(heads)
    traffic = plan_traffic(plan)
    phases = traffic.phase_bytes()
    q, kv, o = traffic.moved_bytes()
    M = heads.num_chunks
    assert np.allclose(phases.sum(axis=(1, 2)), q + kv + o)
    assert np.allclose(phases[:, 1, :], o[:, None] / M)
    first_kv = kv / kv_chunks
    assert np.allclose(phases[:, 0, 0], q / M + first_kv)
    u = traffic.unhidable_share()
    moved = (q + kv + o) > 0
    assert np.allclose(u[moved], ((q / M + first_kv + o / M) / (q + kv + o))[moved])
    assert np.allclose(u[~moved], 1 / M)


def test_corrupt_peer_units_are_caught_naming_the_rank():
    tiles, plan = _plan(HeadLayout(8, 2, 4, 2, 2))
    validate_plan(plan, tiles)
    units = np.array(plan.peer_units)
    units[1, 3, (3 + 1) % 6] += 1
    with pytest.raises(PlanError, match="rank 3: peer_units of kv_route"):
        validate_plan(dataclasses.replace(plan, peer_units=units), tiles)
