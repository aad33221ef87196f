"""build_exchange_plan: routes move the right units, attention through the plan matches a dense reference."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libra_megatron.plan.exchange import build_exchange_plan
from libra_megatron.testing.execute import (
    attention_numpy, gather_from_workers, return_kv_grads_numpy, return_outputs_numpy, run_routes_numpy,
    scatter_to_workers,
)
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.tiles import build_tiles
from libra_megatron.testing.traces import packed_trace_segments

SETTINGS = dict(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------ pool generators
@st.composite
def pools(draw, max_chunk=6):
    """A random small pool: layout, heads, segments, block size and an assignment (random or home)."""
    cp = draw(st.sampled_from([1, 2, 4]))
    P = draw(st.sampled_from([1, 2, 4]))
    kind = draw(st.sampled_from(["contiguous", "zigzag"]))
    H, M = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    hq = H * M * draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([g for g in (1, 4, 8) if hq % g == 0]))
    n_chunks = 2 * cp if kind == "zigzag" and cp > 1 else cp
    L = n_chunks * draw(st.integers(1, max_chunk))
    layout = TokenLayout(kind, L, cp)
    heads = HeadLayout(hq, hq // group, 4, H, M, elem_bytes=2)
    segs = [_partition(draw, L) for _ in range(P)]
    B = draw(st.integers(1, L + 2))
    tiles = build_tiles(segs, layout, heads, B, tiling=draw(st.sampled_from(["uniform", "adaptive"])),
                        kv_fetch=draw(st.sampled_from(["group", "prefix"])), min_block_size=draw(st.sampled_from([1, 2])))
    home = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    assign = tiles.tile_home() if home else rng.integers(0, tiles.num_workers, tiles.num_tiles)
    return segs, layout, heads, tiles, assign, rng


def _partition(draw, L):
    cuts = sorted(draw(st.sets(st.integers(1, L - 1), max_size=min(5, L - 1)))) if L > 1 else []
    return np.diff([0, *cuts, L]).tolist()


def trace_segments(P, L, rng, scale=400):
    """Megatron-style packing of real linux-6.12 document lengths, scaled down by ``scale``, cut at L."""
    return packed_trace_segments(rng, P, L, scale=1.0 / scale)


# ------------------------------------------------------------------ independent references
def reference_attention(q, k, v, segs, scale):
    """Dense per-doc causal attention over one packed sequence, float64. q (L,hq,d), k/v (L,hkv,d)."""
    L, hq, _ = q.shape
    group = hq // k.shape[1]
    pos = np.arange(L)
    doc = np.repeat(np.arange(len(segs)), segs)
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    out = np.zeros_like(q)
    for i in range(hq):
        s = np.where(mask, q[:, i] @ k[:, i // group].T * scale, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, i] = (p / p.sum(axis=1, keepdims=True)) @ v[:, i // group]
    return out


def token_ids(layout, P, H):
    """Per worker, the id (seq*L + global pos)*H + h of every local unit (token*H + h; H = G for KV units)."""
    seqs = [(p * layout.seq_len + np.arange(layout.seq_len))[:, None] * H + np.arange(H) for p in range(P)]
    return [x.reshape(-1) for x in scatter_to_workers(layout, seqs)]


def brute_force_expectation(segs, layout, tiles, assign):
    """Per destination: set of Q ids of its tiles, and the referenced groups as {(p, doc start, rows, class)},
    rows = the whole doc (group fetch) or the longest causal prefix its tiles there need (prefix fetch);
    shards reading the same kv head (H > hkv) share one group."""
    H, L, W = tiles.head_split, layout.seq_len, tiles.num_workers
    hq, hkv = tiles.heads.num_q_heads, tiles.heads.num_kv_heads
    want_q = [set() for _ in range(W)]
    prefix = [dict() for _ in range(W)]
    for t, d in enumerate(assign):
        b, h = divmod(t, H)
        p, lo, hi = int(tiles.block_seq[b]), int(tiles.block_start[b]), int(tiles.block_end[b])
        want_q[d].update(((p * L + np.arange(lo, hi)) * H + h).tolist())
        # the KV class: the shard's kv heads (H <= hkv) or the one kv head it lies in (H > hkv)
        klass = h if H <= hkv else (h * (hq // H)) // (hq // hkv)
        starts = np.concatenate([[0], np.cumsum(segs[p])])
        for s0, s1 in zip(starts[:-1], starts[1:]):
            if s0 < hi and lo < s1:
                rows = int(s1 - s0) if tiles.kv_fetch.value == "group" else int(min(hi, s1) - s0)
                key = (p, int(s0), klass)
                prefix[d][key] = max(prefix[d].get(key, 0), rows)
    want_groups = [{(p, s0, n, c) for (p, s0, c), n in pre.items()} for pre in prefix]
    return want_q, want_groups


# ------------------------------------------------------------------ tests
@given(pools())
@settings(**SETTINGS)
def test_numbered_units_reach_their_destination_and_outputs_return_home_once(pool):
    segs, layout, heads, tiles, assign, _ = pool
    H, L, P = heads.head_split, layout.seq_len, len(segs)
    plan = build_exchange_plan(tiles, assign)
    G = heads.num_kv_classes
    ids, kv_ids = token_ids(layout, P, H), token_ids(layout, P, G)
    arr_q, arr_kv = run_routes_numpy(plan, ids, kv_ids)
    want_q, want_groups = brute_force_expectation(segs, layout, tiles, assign)
    for d in range(tiles.num_workers):
        assert sorted(arr_q[d].tolist()) == sorted(want_q[d])
        assert len(arr_kv[d]) == sum(g[2] for g in want_groups[d])  # every group's prefix exactly once
        where = {int(x): i for i, x in enumerate(arr_kv[d])}
        for p, s0, n, c in want_groups[d]:
            rows = [where[(p * L + s0 + j) * G + c] for j in range(n)]
            assert rows == list(range(rows[0], rows[0] + n))  # the prefix, contiguous, in doc order
    back = return_outputs_numpy(plan, [a + 1 for a in arr_q])  # +1: a missing return would read 0
    for w in range(tiles.num_workers):
        np.testing.assert_array_equal(back[w], ids[w] + 1)


@given(pools())
@settings(**SETTINGS)
def test_attention_through_plan_matches_dense_per_sample_causal_reference(pool):
    segs, layout, heads, tiles, assign, rng = pool
    plan = build_exchange_plan(tiles, assign)
    _check_attention(plan, segs, layout, heads, rng)


def _check_attention(plan, segs, layout, heads, rng):
    P, L, d = len(segs), layout.seq_len, heads.head_dim
    q = [rng.standard_normal((L, heads.num_q_heads, d)) for _ in range(P)]
    k = [rng.standard_normal((L, heads.num_kv_heads, d)) for _ in range(P)]
    v = [rng.standard_normal((L, heads.num_kv_heads, d)) for _ in range(P)]
    sl = lambda xs: scatter_to_workers(layout, xs)  # noqa: E731
    out = gather_from_workers(layout, attention_numpy(plan, sl(q), sl(k), sl(v), softmax_scale=0.3))
    for p in range(P):
        np.testing.assert_allclose(out[p], reference_attention(q[p], k[p], v[p], segs[p], 0.3), atol=1e-12)


@pytest.mark.parametrize("kind,cp,P,H,M,group,B", [
    ("zigzag", 4, 2, 2, 2, 4, 7), ("contiguous", 2, 4, 4, 1, 8, 16), ("zigzag", 2, 2, 1, 4, 1, 5),
])
def test_attention_matches_reference_on_linux_trace_segments(kind, cp, P, H, M, group, B):
    rng = np.random.default_rng(cp * 100 + H)
    L = 2 * cp * 12
    layout = TokenLayout(kind, L, cp)
    hq = max(H * M, group) * 2
    heads = HeadLayout(hq, hq // group, 4, H, M)
    segs = trace_segments(P, L, rng)
    tiles = build_tiles(segs, layout, heads, B)
    for assign in (tiles.tile_home(), rng.integers(0, tiles.num_workers, tiles.num_tiles)):
        _check_attention(build_exchange_plan(tiles, assign), segs, layout, heads, rng)


def test_single_sample_longer_than_a_shard_with_blocks_crossing_shards():
    layout, heads = TokenLayout("zigzag", 48, 4), HeadLayout(8, 2, 4, 2, 2)
    segs = [[3, 40, 5], [48]]
    tiles = build_tiles(segs, layout, heads, 5)  # 5 does not divide the chunk size 6: short blocks
    rng = np.random.default_rng(1)
    _check_attention(build_exchange_plan(tiles, rng.integers(0, 8, tiles.num_tiles)), segs, layout, heads, rng)


@given(pools())
@settings(**SETTINGS)
def test_inverse_routes_are_the_adjoint_of_the_forward_gather(pool):
    """<A x, G> == <x, A^T G> with A^T executed by Route.inverse() (dK/dV sums over destinations)."""
    _, layout, heads, tiles, assign, rng = pool
    assert_inverse_is_adjoint(build_exchange_plan(tiles, assign), layout, heads, rng)


def assert_inverse_is_adjoint(plan, layout, heads, rng):
    """<A x, G> == <x, A^T G> for the Q and K/V routes of ``plan`` (A^T: their inverses, and the relay's)."""
    W = plan.num_workers
    n, nk = layout.local_len * heads.head_split, layout.local_len * heads.num_kv_classes
    x = [rng.standard_normal(n) for _ in range(W)]
    xk = [rng.standard_normal(nk) for _ in range(W)]
    arr_q, arr_kv = run_routes_numpy(plan, x, xk)
    g_kv = [rng.standard_normal(a.shape) for a in arr_kv]
    g_q = [rng.standard_normal(a.shape) for a in arr_q]
    back_kv, back_q = return_kv_grads_numpy(plan, g_kv), return_outputs_numpy(plan, g_q)
    dot = lambda a, b: sum(float(np.dot(u, v)) for u, v in zip(a, b))  # noqa: E731
    assert math.isclose(dot(arr_kv, g_kv), dot(xk, back_kv), rel_tol=1e-12, abs_tol=1e-9)
    assert math.isclose(dot(arr_q, g_q), dot(x, back_q), rel_tol=1e-12, abs_tol=1e-9)


@given(pools())
@settings(**SETTINGS)
def test_kv_gradients_accumulate_once_per_fetching_destination(pool):
    """Sending ones back: every local KV unit receives the number of destinations that fetched it."""
    segs, layout, heads, tiles, assign, _ = pool
    plan = build_exchange_plan(tiles, assign)
    G, L, P = heads.num_kv_classes, layout.seq_len, len(segs)
    _, want_groups = brute_force_expectation(segs, layout, tiles, assign)
    fetched = np.zeros(P * L * G)
    for groups in want_groups:
        for p, s0, n, c in groups:
            fetched[(p * L + s0 + np.arange(n)) * G + c] += 1
    back = return_kv_grads_numpy(plan, [np.ones(rp.kv_route.target_len) for rp in plan.ranks])
    ids = token_ids(layout, P, G)
    for w in range(tiles.num_workers):
        np.testing.assert_array_equal(back[w], fetched[ids[w]])


@given(pools())
@settings(**SETTINGS)
def test_plan_bytes_equal_eq8_accounting_from_the_assignment(pool):
    segs, layout, heads, tiles, assign, _ = pool
    plan = build_exchange_plan(tiles, assign)
    _, want_groups = brute_force_expectation(segs, layout, tiles, assign)
    holder_rank, _ = layout.global_to_local()
    kv = 0
    for d, groups in enumerate(want_groups):
        for p, s0, n, h in groups:
            held = int(((p * layout.cp + holder_rank[s0 : s0 + n]) == d).sum())
            kv += (n - held) * heads.kv_bytes_per_token()
    moved = sum(int(tiles.block_end[t // heads.head_split] - tiles.block_start[t // heads.head_split])
                for t, d in enumerate(assign) if d != tiles.block_home[t // heads.head_split])
    assert plan.bytes_kv == kv
    assert plan.bytes_q == moved * heads.q_bytes_per_token()
    assert plan.bytes_o == moved * heads.o_bytes_per_token()
    assert sum(rp.bytes_sent[1] for rp in plan.ranks) == kv


def test_adjacent_tiles_of_one_sample_merge_into_one_varlen_entry():
    """Home placement, CP=1: each worker's blocks of one long doc become one entry per head shard."""
    layout, heads = TokenLayout("contiguous", 40, 1), HeadLayout(4, 4, 4, 2, 1)
    tiles = build_tiles([[3, 30, 7]], layout, heads, 4)
    rp = build_exchange_plan(tiles, tiles.tile_home()).ranks[0]
    # per shard: docs 0,1,2 -> 3 entries (the 30-token doc spans 9 blocks), 2 shards -> 6
    assert rp.num_seqs == 6
    assert rp.seq_k_len.tolist() == [3, 30, 7, 3, 30, 7]
    assert np.diff(rp.cu_seqlens_q).tolist() == [3, 30, 7, 3, 30, 7]


def test_fingerprint_is_identical_on_every_rank_and_changes_with_the_assignment():
    layout, heads = TokenLayout("zigzag", 32, 2), HeadLayout(8, 2, 4, 2, 2)
    tiles = build_tiles([[10, 22], [32]], layout, heads, 4)
    a = np.random.default_rng(0).integers(0, 4, tiles.num_tiles)
    plan, again = build_exchange_plan(tiles, a), build_exchange_plan(tiles, a.copy())
    assert {rp.fingerprint for rp in plan.ranks} == {plan.fingerprint} and again.fingerprint == plan.fingerprint
    b = a.copy()
    b[0] = (b[0] + 1) % 4
    assert build_exchange_plan(tiles, b).fingerprint != plan.fingerprint


def test_bad_assignment_raises_plan_error_naming_the_tile():
    layout, heads = TokenLayout("contiguous", 8, 2), HeadLayout(2, 2, 4, 1, 1)
    tiles = build_tiles([[8]], layout, heads, 4, tiling="uniform")
    with pytest.raises(ValueError, match="tile 1: destination 5"):
        build_exchange_plan(tiles, np.array([0, 5]))
    with pytest.raises(ValueError, match="one per tile"):
        build_exchange_plan(tiles, np.array([0]))
