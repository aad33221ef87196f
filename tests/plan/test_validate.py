"""validate_plan accepts built plans and names the rank (and tile) of every corruption."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libra_megatron.plan.errors import PlanError
from libra_megatron.plan.exchange import IndexRuns, build_exchange_plan, validate_plan
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.tiles import build_tiles

from .test_exchange import pools


def small_plan(seed=0, kind="zigzag"):
    layout, heads = TokenLayout(kind, 32, 2), HeadLayout(8, 2, 4, 2, 2)
    tiles = build_tiles([[5, 20, 7], [32]], layout, heads, 6)
    assign = np.random.default_rng(seed).integers(0, tiles.num_workers, tiles.num_tiles)
    return tiles, build_exchange_plan(tiles, assign)


def with_rank(plan, rank, route=None, **changes):
    """A copy of ``plan`` whose RankPlan ``rank`` (or its ``route``) has ``changes`` applied; a changed
    ``send_index`` / ``recv_index`` becomes runs of one unit each (routes store runs)."""
    ranks = list(plan.ranks)
    rp = ranks[rank]
    if route is None:
        ranks[rank] = dataclasses.replace(rp, **changes)
    else:
        for side in ("send", "recv"):
            if f"{side}_index" in changes:
                changes[f"{side}_runs"] = IndexRuns.of_index(changes.pop(f"{side}_index"))
        ranks[rank] = dataclasses.replace(rp, **{route: dataclasses.replace(getattr(rp, route), **changes)})
    return dataclasses.replace(plan, ranks=tuple(ranks))


def busiest_sender(plan, route):
    """A rank that sends units to another rank on ``route``, and that destination."""
    for rp in plan.ranks:
        splits = getattr(rp, route).send_splits.copy()
        splits[rp.rank] = 0
        if splits.any():
            return rp.rank, int(np.flatnonzero(splits)[0])
    raise AssertionError("plan has no remote traffic")


@given(st.integers(0, 1000), st.sampled_from(["zigzag", "contiguous"]))
@settings(deadline=None, max_examples=15, suppress_health_check=[HealthCheck.too_slow])
def test_built_plans_validate(seed, kind):
    tiles, plan = small_plan(seed, kind)
    validate_plan(plan, tiles)


@given(pools())
@settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow])
def test_built_plans_validate_across_layouts_heads_and_assignments(pool):
    _, _, _, tiles, assign, _ = pool
    validate_plan(build_exchange_plan(tiles, assign), tiles)


def test_home_placement_validates_with_no_q_traffic():
    tiles, _ = small_plan()
    plan = build_exchange_plan(tiles, tiles.tile_home())
    validate_plan(plan, tiles)
    assert plan.bytes_q == plan.bytes_o == 0


def test_dropped_q_unit_names_the_rank():
    tiles, plan = small_plan()
    r, d = busiest_sender(plan, "q_route")
    rt = plan.ranks[r].q_route
    splits = rt.send_splits.copy()
    splits[d] -= 1
    cut = int(rt.send_splits[:d + 1].sum()) - 1
    bad = with_rank(plan, r, "q_route", send_index=np.delete(rt.send_index, cut), send_splits=splits)
    with pytest.raises(PlanError, match=rf"rank {r}: q_route sends {int(splits[d])} units to rank {d}"):
        validate_plan(bad, tiles)


def test_duplicated_q_unit_names_rank_and_tile():
    tiles, plan = small_plan()
    r = 1
    rt = plan.ranks[r].q_route
    idx = rt.send_index.copy()
    idx[1] = idx[0]  # unit idx[0] sent twice, unit idx[1] never
    with pytest.raises(PlanError, match=rf"rank {r}: Q unit \d+ \(tile \d+\) is sent"):
        validate_plan(with_rank(plan, r, "q_route", send_index=idx), tiles)


def test_tile_placed_twice_in_the_assignment_record_is_caught():
    tiles, plan = small_plan()
    a = plan.assignment.copy()
    t = 3
    a[t] = (a[t] + 1) % tiles.num_workers  # routes still send tile t to its old destination
    with pytest.raises(PlanError, match=rf"rank {int(tiles.tile_home()[t])}: tile {t} Q sent to rank"):
        validate_plan(dataclasses.replace(plan, assignment=a), tiles)


def test_kv_unit_from_wrong_source_names_the_destination_rank():
    tiles, plan = small_plan()
    r, d = busiest_sender(plan, "kv_route")
    rt = plan.ranks[r].kv_route
    idx = rt.send_index.copy()
    pos = int(rt.send_splits[:d].sum())
    idx[pos] = (idx[pos] + 1) % rt.source_len  # neighbouring unit: other head shard or token
    with pytest.raises(PlanError, match=rf"rank {d}: "):
        validate_plan(with_rank(plan, r, "kv_route", send_index=idx), tiles)


def test_wrong_split_names_the_rank():
    tiles, plan = small_plan()
    r, d = busiest_sender(plan, "kv_route")
    rt = plan.ranks[r].kv_route
    splits = rt.send_splits.copy()
    splits[d] -= 1
    splits[r] += 1
    with pytest.raises(PlanError, match=rf"rank {r}: kv_route sends"):
        validate_plan(with_rank(plan, r, "kv_route", send_splits=splits), tiles)


def test_recv_index_that_is_not_a_permutation_is_caught():
    tiles, plan = small_plan()
    rt = plan.ranks[2].kv_route
    idx = rt.recv_index.copy()
    idx[0] = idx[1]
    with pytest.raises(PlanError, match=r"rank 2: kv_route: recv_index is not a permutation"):
        validate_plan(with_rank(plan, 2, "kv_route", recv_index=idx), tiles)


@pytest.mark.parametrize("field", ["seq_k_len", "seq_kv_offset", "cu_seqlens_q"])
def test_corrupt_varlen_metadata_names_the_rank(field):
    tiles, plan = small_plan()
    r = max(range(plan.num_workers), key=lambda w: plan.ranks[w].num_seqs)
    arr = getattr(plan.ranks[r], field).copy()
    i = 1 if field == "cu_seqlens_q" else 0
    arr[i] += 1
    with pytest.raises(PlanError, match=rf"rank {r}: "):
        validate_plan(with_rank(plan, r, **{field: arr}), tiles)


def test_kv_fetched_twice_at_one_destination_is_caught():
    """Sending one KV unit twice to a destination (no dedup) shows up as a repeated unit there."""
    tiles, plan = small_plan()
    r, d = next((rp.rank, d) for rp in plan.ranks for d in range(plan.num_workers)
                if d != rp.rank and rp.kv_route.send_splits[d] >= 2)
    src = plan.ranks[r].kv_route
    pos = int(src.send_splits[:d].sum())
    idx = src.send_index.copy()
    idx[pos + 1] = idx[pos]
    with pytest.raises(PlanError, match=rf"rank {d}: KV unit id \d+ arrives 2 times"):
        validate_plan(with_rank(plan, r, "kv_route", send_index=idx), tiles)


def test_byte_totals_that_disagree_with_eq8_are_caught():
    tiles, plan = small_plan()
    with pytest.raises(PlanError, match="Eq. 8"):
        validate_plan(dataclasses.replace(plan, bytes_kv=plan.bytes_kv + 1), tiles)
    bs = plan.ranks[3].bytes_sent
    with pytest.raises(PlanError, match="rank 3: bytes_sent"):
        validate_plan(with_rank(plan, 3, bytes_sent=(bs[0], bs[1] + 1, bs[2])), tiles)


def test_fingerprint_mismatch_names_the_rank():
    tiles, plan = small_plan()
    with pytest.raises(PlanError, match="rank 2: "):
        validate_plan(with_rank(plan, 2, fingerprint="0" * 32), tiles)


def test_plan_for_another_pool_is_rejected():
    tiles, plan = small_plan()
    other = build_tiles([[32], [32]], tiles.layout, tiles.heads, 8)
    with pytest.raises(PlanError, match="plan has 4 ranks|assignment has shape"):
        validate_plan(plan, other)


def test_kv_sent_by_every_chunk_that_shares_a_piece_is_caught(monkeypatch):
    # HeadLayout(8, 2, 4, 2, 2): q piece 2 < GQA group 4, so both chunks of a shard read one kv head
    tiles, plan = small_plan()
    assert plan.ranks[0].heads.kv_send_chunks().tolist() == [True, False]
    monkeypatch.setattr(HeadLayout, "kv_send_chunks", lambda self: np.ones(self.num_chunks, dtype=bool))
    with pytest.raises(PlanError, match="kv piece 0 is read by chunks \\[0, 1\\].*arrive twice"):
        validate_plan(plan, tiles)


def test_prefix_shorter_than_a_tile_needs_is_caught():
    layout, heads = TokenLayout("contiguous", 16, 2), HeadLayout(2, 1, 4, 1, 1)
    tiles = build_tiles([[16]], layout, heads, 4, tiling="uniform", kv_fetch="prefix")
    plan = build_exchange_plan(tiles, np.zeros(tiles.num_tiles, dtype=np.int64))  # all on worker 0
    rp = plan.ranks[0]
    longer = rp.seq_k_len.copy()
    longer[-1] += 1  # the last entry reads one key row past the fetched prefix
    with pytest.raises(PlanError, match="rank 0"):
        validate_plan(with_rank(plan, 0, seq_k_len=longer), tiles)
