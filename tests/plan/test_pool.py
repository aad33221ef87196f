"""plan_pool: tiles -> placement -> exchange -> validation, deterministic, bytes agree with Eq. 8."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_megatron.config import LibraConfig, TilePlacement
from libra_megatron.testing.execute import attention_numpy, gather_from_workers, scatter_to_workers
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.pool import plan_pool

from .test_exchange import reference_attention, trace_segments


def setup(P=2, cp=2, H=2, M=2, B=6, method="alg2", seed=0, L=48):
    config = LibraConfig(pool_size=P, head_split=H, block_size=B, num_chunks=M, tau=0.03,
                         tile_placement=method, token_layout="zigzag")
    layout, heads = TokenLayout("zigzag", L, cp), HeadLayout(4 * H * M, H * M, 4, H, M)
    segs = trace_segments(P, L, np.random.default_rng(seed), scale=200)
    return segs, config, layout, heads


@given(st.integers(0, 500), st.sampled_from(list(TilePlacement)), st.sampled_from([1, 2, 4]))
@settings(deadline=None, max_examples=12)
def test_plan_bytes_equal_placement_comm_bytes(seed, method, H):
    segs, config, layout, heads = setup(H=H, method=method.value, seed=seed)
    pp = plan_pool(segs, config, layout, heads)  # validate=True also checks Eq. 8 independently
    assert (pp.exchange.bytes_q, pp.exchange.bytes_kv, pp.exchange.bytes_o) == tuple(pp.placement.comm_bytes)
    np.testing.assert_array_equal(pp.exchange.assignment, pp.placement.assignment)


def test_same_inputs_same_fingerprint_different_inputs_different():
    segs, config, layout, heads = setup(seed=3)
    a = plan_pool(segs, config, layout, heads)
    b = plan_pool([list(s) for s in segs], config, layout, heads)
    assert a.fingerprint == b.fingerprint and a.seconds > 0
    L = layout.seq_len
    other = [[L] if list(segs[0]) != [L] else [1, L - 1], *segs[1:]]
    assert plan_pool(other, config, layout, heads).fingerprint != a.fingerprint
    home = plan_pool(segs, dataclasses.replace(config, tile_placement=TilePlacement.HOME), layout, heads)
    same_assignment = np.array_equal(home.exchange.assignment, a.exchange.assignment)
    assert (home.fingerprint == a.fingerprint) == same_assignment


def test_pool_plan_executes_attention_like_the_dense_reference():
    segs, config, layout, heads = setup(P=2, cp=2, H=2, M=2, seed=11)
    pp = plan_pool(segs, config, layout, heads)
    rng = np.random.default_rng(0)
    L = layout.seq_len
    q = [rng.standard_normal((L, heads.num_q_heads, 4)) for _ in segs]
    k = [rng.standard_normal((L, heads.num_kv_heads, 4)) for _ in segs]
    v = [rng.standard_normal((L, heads.num_kv_heads, 4)) for _ in segs]
    sc = lambda xs: scatter_to_workers(layout, xs)  # noqa: E731
    out = gather_from_workers(layout, attention_numpy(pp.exchange, sc(q), sc(k), sc(v)))
    for p, seg in enumerate(segs):
        np.testing.assert_allclose(out[p], reference_attention(q[p], k[p], v[p], seg, 0.5), atol=1e-12)


@pytest.mark.parametrize("field,value,flag", [
    ("pool_size", 3, "--libra-pool-size=3"),
    ("head_split", 4, "--libra-head-split=4"),
    ("num_chunks", 1, "--libra-num-chunks=1"),
    ("token_layout", "contiguous", "--libra-token-layout=contiguous"),
])
def test_config_that_disagrees_with_the_layouts_names_the_flag(field, value, flag):
    segs, config, layout, heads = setup()
    bad = dataclasses.replace(config, **{field: value})
    with pytest.raises(ValueError, match=flag):
        plan_pool(segs, bad, layout, heads)


def test_num_chunks_auto_is_checked_as_it_resolves_for_the_heads():
    """A YAML's ``num_chunks: auto`` plans the pool its heads resolve it to (``LibraConfig.chunks_for``: the K/V heads
    of one head shard), the same plan as the explicit M; heads with another M are an error naming the flag and the
    arithmetic."""
    segs, config, layout, heads = setup(P=2, cp=2, H=2, M=2, seed=3)  # 16 query / 4 K/V heads: auto = 4 / 2 = 2
    auto = dataclasses.replace(config, num_chunks="auto")
    assert plan_pool(segs, auto, layout, heads).fingerprint == plan_pool(segs, config, layout, heads).fingerprint
    other = HeadLayout(heads.num_q_heads, heads.num_kv_heads, heads.head_dim, 2, 1)
    with pytest.raises(ValueError, match=r"--libra-num-chunks=auto \(= 2 for 16 query / 4 K/V heads at head_split 2\) "
                                         r"but HeadLayout.num_chunks is 1"):
        plan_pool(segs, auto, layout, other)


@pytest.mark.parametrize("tiling,kv_fetch", [("uniform", "group"), ("adaptive", "prefix"), ("uniform", "prefix"),
                                             ("adaptive", "group")])
def test_tiling_and_kv_fetch_from_the_config_reach_the_plan(tiling, kv_fetch):
    segs, config, layout, heads = setup(P=2, cp=2, H=1, M=2, B=12, seed=5)
    segs = [[layout.seq_len], *segs[1:]]  # one document spanning a whole sequence: heavy late blocks
    config = dataclasses.replace(config, tiling=tiling, kv_fetch=kv_fetch)
    pp = plan_pool(segs, config, layout, heads)
    assert (pp.tiles.tiling.value, pp.tiles.kv_fetch.value) == (tiling, kv_fetch)
    uniform = plan_pool(segs, dataclasses.replace(config, tiling="uniform", kv_fetch="group"), layout, heads)
    assert (pp.tiles.num_tiles > uniform.tiles.num_tiles) == (tiling == "adaptive")
    group_kv = dataclasses.replace(config, kv_fetch="group")
    whole = plan_pool(segs, group_kv, layout, heads).exchange
    fetched = sum(rp.kv_route.target_len for rp in pp.exchange.ranks)
    assert (fetched < sum(rp.kv_route.target_len for rp in whole.ranks)) == (kv_fetch == "prefix")
