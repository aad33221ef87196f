"""Time-aware tile placement (plan.tiles.timeaware): priced like the exchange plan, never slower than Algorithm 2."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from libra_megatron.config import LibraConfig, TilePlacement
from libra_megatron.plan.exchange import build_exchange_plan, plan_traffic
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.packing import pack_documents
from libra_megatron.plan.tiles import build_tiles, place_tiles, timeaware
from libra_megatron.plan.pool import plan_pool
from libra_megatron.plan.tiles.timeaware import _PoolTraffic, worker_times
from libra_megatron.plan.model import StepTimeModel
from libra_megatron.plan.traces import find_trace, load_trace

from .test_exchange import SETTINGS, pools

# slow links make communication matter at these tiny sizes (bytes ~ KB, pair-heads ~ 1e4)
SLOW = dict(attn_tflops=1e-6, intra_node_gbps=1e-3, inter_node_gbps=2e-4, gpus_per_node=2)


def _plan_seconds(tiles, assignment, model):
    """Independent pricing: the exchange plan's own traffic per phase and local/remote split, then the
    Pipeliner timeline (``plan.model.timing``)."""
    plan = build_exchange_plan(tiles, np.asarray(assignment))
    dispatch, ret = plan_traffic(plan).phase_seconds(model.nodes(tiles.num_workers), model)
    local, remote = (model.compute_seconds(x) for x in plan.hosted_pair_heads)
    return model.worker_seconds(local, remote, dispatch, ret)


@given(pools())
@settings(**SETTINGS)
def test_incremental_state_prices_the_exchange_plans_traffic_exactly(pool):
    """The search's per-worker state: link bytes per phase exactly the plan's; local compute an upper bound
    of the plan's (entries merge into remote ones), local + remote = the worker's load."""
    _, _, heads, tiles, assign, _ = pool
    model = StepTimeModel(heads.head_dim, **SLOW)
    plan = build_exchange_plan(tiles, np.asarray(assign))
    state = _PoolTraffic(tiles, assign, model).state.copy()
    local, remote = (model.compute_seconds(x) for x in plan.hosted_pair_heads)
    assert np.allclose(state[:, 8] + state[:, 9], local + remote, rtol=1e-12, atol=1e-15)
    assert (state[:, 8] >= local * (1 - 1e-12) - 1e-15).all()
    state[:, 8], state[:, 9] = local, remote
    pricer = _PoolTraffic(tiles, assign, model)
    assert np.allclose(pricer.seconds(state), _plan_seconds(tiles, assign, model), rtol=1e-9, atol=0)
    assert np.allclose(worker_times(tiles, assign, model), _plan_seconds(tiles, assign, model), rtol=1e-12, atol=0)


@given(pools())
@settings(**SETTINGS)
def test_whole_assignment_state_is_what_moving_tiles_one_at_a_time_sums_to(pool):
    """The search builds its state for a whole assignment at once; starting from a random other assignment and
    moving every tile to its place one ``move`` at a time (the search's incremental deltas) lands on the same
    per-worker state and the same prefix selections."""
    _, _, heads, tiles, assign, rng = pool
    model = StepTimeModel(heads.head_dim, **SLOW)
    moved = _PoolTraffic(tiles, rng.integers(0, tiles.num_workers, tiles.num_tiles), model)
    for t, w in enumerate(np.asarray(assign).tolist()):
        moved.move(t, w)
    whole = _PoolTraffic(tiles, assign, model)
    np.testing.assert_allclose(moved.state, whole.state, rtol=1e-9, atol=1e-9 * max(1.0, np.abs(whole.state).max()))
    assert {k: v for k, v in moved.ends.items() if v} == {k: v for k, v in whole.ends.items() if v}
    assert {g: w for g, w in moved.fetchers.items() if w} == {g: w for g, w in whole.fetchers.items() if w}


@given(pools())
@settings(**SETTINGS)
def test_time_placement_is_never_slower_than_alg2_under_the_model(pool):
    _, _, heads, tiles, _, _ = pool
    model = StepTimeModel(heads.head_dim, first_gpu=1, **SLOW)
    alg2 = place_tiles(tiles, 0.03, TilePlacement.ALG2)
    timed = place_tiles(tiles, 0.03, TilePlacement.TIME, timing=model)
    before = _plan_seconds(tiles, alg2.assignment, model).max()
    after = _plan_seconds(tiles, timed.assignment, model).max()
    assert after <= before * (1 + 1e-9)


@pytest.fixture(scope="module")
def wiki_pool():
    return wiki_tiles()


def wiki_tiles():
    """4 packed 8K sequences of the real Wikipedia trace, each with a 3.4K-5.2K-token document."""
    docs = load_trace(find_trace("wikipedia-flexsp.txt"))[:20000]
    seqs = pack_documents(docs, 8192, "megatron", 1234)
    pick = [i for i in range(len(seqs)) if 3000 < max(seqs[i]) < 8000][:4]
    return build_tiles([seqs[i] for i in pick], TokenLayout("zigzag", 8192, 4), HeadLayout(32, 4, 16, 2, 4),
                       512, tiling="adaptive", tau=0.03, kv_fetch="prefix")


def test_time_placement_trades_flops_balance_for_exposed_comm_on_a_real_trace(wiki_pool):
    # links scaled with the tiny head dim so the exchange dominates as on the wikipedia 256K runs
    model = StepTimeModel(16, attn_tflops=0.1, intra_node_gbps=0.3, inter_node_gbps=0.05, gpus_per_node=4)
    alg2 = place_tiles(wiki_pool, 0.03, TilePlacement.ALG2)
    timed = place_tiles(wiki_pool, 0.03, TilePlacement.TIME, timing=model)
    before = _plan_seconds(wiki_pool, alg2.assignment, model)
    after = _plan_seconds(wiki_pool, timed.assignment, model)
    assert after.max() < 0.9 * before.max()  # the slowest worker gets at least 10% faster ...
    assert timed.max_over_mean > alg2.max_over_mean + 0.05  # ... by giving up FLOPs balance


def test_refined_assignment_is_kept_only_when_the_exchange_plans_say_it_is_faster(wiki_pool, monkeypatch):
    """The search scores by an estimate; the final word is ``worker_times`` on the real plans of both results."""
    model = StepTimeModel(16, attn_tflops=0.1, intra_node_gbps=0.3, inter_node_gbps=0.05, gpus_per_node=4)
    alg2 = place_tiles(wiki_pool, 0.03, TilePlacement.ALG2).assignment
    refined = timeaware.refine_for_time(wiki_pool, alg2, model)
    assert not np.array_equal(refined, alg2)
    assert _plan_seconds(wiki_pool, refined, model).max() < _plan_seconds(wiki_pool, alg2, model).max()
    # the same search, but the plans price Alg. 2's assignment as the faster one: Alg. 2's is returned
    fake = lambda tiles, assignment, m: np.full(tiles.num_workers, 0.0 if np.array_equal(assignment, alg2) else 1.0)  # noqa: E731
    monkeypatch.setattr(timeaware, "worker_times", fake)
    assert np.array_equal(timeaware.refine_for_time(wiki_pool, alg2, model), alg2)


def test_timing_model_is_only_for_the_time_placement_and_checked(wiki_pool):
    with pytest.raises(ValueError, match="only read by tile placement 'time' or 'dense', not 'alg2'"):
        place_tiles(wiki_pool, 0.03, TilePlacement.ALG2, timing=StepTimeModel(16))
    with pytest.raises(ValueError, match=r"--inter-node-gbps must be a finite number > 0, got 0 \(StepTimeModel.inter_node_gbps\)"):
        StepTimeModel(16, inter_node_gbps=0)


def test_config_time_placement_reaches_plan_pool_and_its_plan_validates():
    config = LibraConfig(pool_size=2, block_size=512, head_split=2, tile_placement="time")
    assert config.tile_placement is TilePlacement.TIME
    docs = load_trace(find_trace("wikipedia-flexsp.txt"))[:3000]
    seqs = pack_documents(docs, 4096, "megatron", 3)[:2]
    layout, heads = TokenLayout("zigzag", 4096, 2), HeadLayout(32, 4, 16, 2, 4)
    planned = plan_pool(seqs, config, layout, heads, validate=True)
    tiles = planned.tiles
    expected = place_tiles(tiles, config.tau, TilePlacement.TIME)
    assert np.array_equal(planned.placement.assignment, expected.assignment)
    with pytest.raises(ValueError, match="tile_placement"):
        LibraConfig(tile_placement="tim")


def _shipped_pools():
    """Real-trace pools at the shipped 256K knobs (configs/libra/256k.yaml: B=2048, H=2, M=2, tau=0.01), Qwen3-30B-A3B
    heads, 8 sequences of the linux and wikipedia traces packed as ``benchmarks/bench_planner.py`` packs them."""
    out = []
    for trace in ("linux-6.12-files.qwen.txt", "wikipedia-flexsp.txt"):
        docs = load_trace(find_trace(trace))[:60000]
        seqs = pack_documents(docs, 256 * 1024, "megatron", 7)
        for k in range(2):
            out.append(build_tiles(seqs[8 * k:8 * k + 8], TokenLayout("zigzag", 256 * 1024, 8),
                                   HeadLayout(32, 4, 128, 2, 2, elem_bytes=2), 2048, tiling="adaptive", tau=0.01,
                                   kv_fetch="prefix"))
    return out


def test_vectorised_search_returns_the_per_move_searchs_assignment_on_real_pools():
    """Issue 25: the numpy search prices whole candidate sets at once; it must pick the moves the per-move Python
    search (``tests/plan/_timeaware_reference.py``, the code before) picks, at the dense placement's width and at
    the full width, from Alg. 2's assignment and from the node export's."""
    from libra_megatron.plan.tiles.alg2 import place_alg2, tile_loads
    from libra_megatron.plan.tiles.node_export import export_dense_first

    from . import _timeaware_reference as reference

    moved = 0
    for tiles in _shipped_pools():
        model = StepTimeModel(128)
        start = place_alg2(tiles, 0.01)[0]
        exported = export_dense_first(tiles, start, tile_loads(tiles, None), model.nodes(tiles.num_workers))
        dense = (exported, timeaware.DENSE_TIME_ROUNDS, timeaware.DENSE_WIDTH)
        for begin, rounds, width in (dense, (start, 24, (10, 10))):
            new = timeaware.time_moves(tiles, begin, model, rounds, width)
            assert np.array_equal(new, reference.time_moves(tiles, begin, model, rounds, width))
            moved += int((new != begin).sum())
    assert moved > 20  # the searches did move tiles
