"""Algorithm 2 (§4.3.2) and Eq. 8: the fast placer equals a direct implementation over all workers."""
import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from libra_megatron.config import KvFetch, TilePlacement, TilingPolicy, TokenLayoutKind
from libra_megatron.plan.tiles import alg2, assignment_comm_bytes, build_tiles, place_tiles
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.model import worker_lower_bound

HEADS = {  # (hq, hkv, d): Qwen3-8B, Qwen3-30B-A3B, Qwen3-235B-A22B, paper microbench 256K / 1M
    "qwen3-8b": (32, 8, 128),
    "qwen3-30b": (32, 4, 128),
    "qwen3-235b": (64, 4, 128),
    "micro-256k": (128, 16, 256),
    "micro-1m": (128, 4, 256),
    "kv2": (16, 2, 32),  # H=4 > hkv: two shards share each kv head (one KV class), Eq. 8 counts it once
    "kv1": (8, 1, 16),
}


def _position_holders(tiles):
    """Per packed sequence: the worker holding each global position, from the layout alone."""
    rank, _ = tiles.layout.global_to_local()
    return [p * tiles.layout.cp + rank for p in range(tiles.pool_size)]


def reference_alg2(tiles, tau, tile_cost=None):
    """Algorithm 2 line by line over all W workers, Eq. 8 with prefixes counted position by position.

    A tile needs rows [0, e) of each group it references (``tile_kv_refs``; e = the document length under
    KvFetch.GROUP, which makes this the paper's V_g(r)); C_r keeps the largest prefix selected per group.
    f_t = Eq. 6 tile_flops, or ``tile_cost`` [num_tiles] floats (C then from the exact float sum)."""
    if tile_cost is None:
        f = [int(x) for x in tiles.tile_flops()]
        total = sum(f)
    else:
        f = [float(x) for x in tile_cost]
        total = math.fsum(f)
    W, H = tiles.num_workers, tiles.head_split
    cap = (1.0 + tau) * total / W
    order = sorted(range(len(f)), key=lambda t: (-f[t], t))
    loads, selected = [0] * W, [dict() for _ in range(W)]
    homes, tokens = tiles.tile_home(), tiles.tile_tokens()
    qo, kvb = 2 * tiles.heads.q_bytes_per_token(), tiles.heads.kv_bytes_per_token()
    holder = _position_holders(tiles)
    assignment, comm, fallbacks = [0] * len(f), 0, 0

    G = min(H, tiles.heads.num_kv_heads)  # KV classes: a group is (doc, class), doc = group // G

    def remote_rows(group, r, lo, hi):
        doc = int(group) // G
        seq, start = int(tiles.doc_seq[doc]), int(tiles.doc_start[doc])
        return int((holder[seq][start + lo : start + hi] != r).sum()) if hi > lo else 0

    def dcomm(t, r):
        groups, ends = tiles.tile_kv_refs(t)
        kv = sum(remote_rows(g, r, selected[r].get(int(g), 0), int(e)) for g, e in zip(groups, ends)) * kvb
        return kv + (int(tokens[t]) * qo if r != homes[t] else 0)

    for t in order:
        scores = [dcomm(t, r) for r in range(W)]
        feasible = [r for r in range(W) if loads[r] + f[t] <= cap]
        if feasible:
            best = min(feasible, key=lambda r: (scores[r], loads[r], r))
        else:
            fallbacks += 1
            best = min(range(W), key=lambda r: (loads[r], scores[r], r))
        assignment[t] = best
        loads[best] += f[t]
        comm += scores[best]
        for g, e in zip(*tiles.tile_kv_refs(t)):
            selected[best][int(g)] = max(selected[best].get(int(g), 0), int(e))
    return np.array(assignment), comm, fallbacks


def random_segments(rng, num_seqs, seq_len):
    out = []
    for _ in range(num_seqs):
        cuts = np.sort(rng.choice(np.arange(1, seq_len), size=min(seq_len - 1, rng.integers(0, 24)), replace=False))
        seg = np.diff(np.concatenate([[0], cuts, [seq_len]]))
        if rng.random() < 0.3:  # one long outlier doc
            seg = np.array([seq_len])
        out.append(seg)
    return out


@st.composite
def pools(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from([TokenLayoutKind.ZIGZAG, TokenLayoutKind.CONTIGUOUS]))
    cp = draw(st.sampled_from([1, 2, 4]))
    pool = draw(st.integers(1, 4))
    H = draw(st.sampled_from([1, 2, 4]))
    hq, hkv, d = HEADS[draw(st.sampled_from(sorted(HEADS)))]
    chunks = 2 * cp if kind is TokenLayoutKind.ZIGZAG and cp > 1 else cp
    seq_len = chunks * draw(st.integers(4, 32))
    block = draw(st.integers(3, 40))
    tau = draw(st.sampled_from([0.0, 0.03, 0.2]))
    layout = TokenLayout(kind, seq_len, cp)
    heads = HeadLayout(hq, hkv, d, H, 2, elem_bytes=2)
    tiling = draw(st.sampled_from(list(TilingPolicy)))
    kv_fetch = draw(st.sampled_from(list(KvFetch)))
    tiles = build_tiles(random_segments(rng, pool, seq_len), layout, heads, block, tiling=tiling, tau=tau,
                        kv_fetch=kv_fetch, min_block_size=draw(st.sampled_from([1, 2, None])))
    return tiles, tau


@settings(max_examples=150, deadline=None)
@given(pools())
def test_alg2_equals_direct_reference_with_gqa_and_both_layouts(case):
    tiles, tau = case
    expected, comm, fallbacks = reference_alg2(tiles, tau)
    got = place_tiles(tiles, tau=tau, method=TilePlacement.ALG2)
    np.testing.assert_array_equal(got.assignment, expected)
    assert sum(got.comm_bytes) == comm
    assert got.num_fallback == fallbacks
    np.testing.assert_array_equal(got.loads, np.bincount(expected, tiles.tile_flops(), tiles.num_workers))


@settings(max_examples=40, deadline=None)
@given(pools())
def test_refined_never_worse_than_alg2_and_home_has_no_q_traffic(case):
    tiles, tau = case
    alg2 = place_tiles(tiles, tau=tau, method=TilePlacement.ALG2)
    refined = place_tiles(tiles, tau=tau, method=TilePlacement.REFINED)
    home = place_tiles(tiles, tau=tau, method=TilePlacement.HOME)
    assert refined.loads.max() <= alg2.loads.max()
    assert refined.loads.max() >= worker_lower_bound(tiles.tile_flops(), tiles.num_workers) - 1e-6
    np.testing.assert_array_equal(home.assignment, tiles.tile_home())
    assert home.comm_bytes[0] == 0 and home.comm_bytes[2] == 0
    for result in (alg2, refined, home):
        assert result.loads.sum() == tiles.tile_flops().sum()
        assert result.comm_bytes == assignment_comm_bytes(tiles, result.assignment)


def _two_sequence_pool():
    # P=2, CP=1, L=8, B=4: seq 0 = one doc of 8 (blocks f=10, 26), seq 1 = eight docs of 1 (f=4, 4)
    layout = TokenLayout(TokenLayoutKind.CONTIGUOUS, 8, 1)
    heads = HeadLayout(1, 1, 1, 1, 1, elem_bytes=1)
    return build_tiles([[8], [1] * 8], layout, heads, 4, tiling="uniform", kv_fetch="group")


def test_alg2_hand_computed_case_with_fallback_and_kv_reuse():
    tiles = _two_sequence_pool()
    np.testing.assert_array_equal(tiles.tile_flops(), [10, 26, 4, 4])
    # C = 1.0 * 44 / 2 = 22. Order: t1 (26), t0 (10), t2 (4), t3 (4; tie -> lower id first).
    # t1: nobody fits (26 > 22) -> fallback argmin (L, dcomm, r): L ties at 0, dcomm(home 0)=0 -> worker 0.
    # t0: feasible {1}: worker 0 has 26. Goes to 1: KV of doc 0 (8 tokens * 2 bytes) + Q/O 2*4*1.
    # t2, t3: feasible {1}; stay... worker 1 is their home with dcomm 0.
    res = place_tiles(tiles, tau=0.0, method=TilePlacement.ALG2)
    np.testing.assert_array_equal(res.assignment, [1, 0, 1, 1])
    assert res.num_fallback == 1
    assert res.comm_bytes == (4, 16, 4)
    assert res.capacity == 22.0


def test_alg2_prefers_resident_kv_group_over_lower_load():
    # One doc of 12 tokens, CP=1, P=2, B=4: tiles f = 10, 26, 42 (ids 0,1,2), home 0; worker 1 empty.
    # tau large => everything feasible; dcomm picks the home (0 bytes) every time.
    layout = TokenLayout(TokenLayoutKind.CONTIGUOUS, 12, 1)
    heads = HeadLayout(1, 1, 1, 1, 1, elem_bytes=1)
    tiles = build_tiles([[12], [12]], layout, heads, 4, tiling="uniform", kv_fetch="group")
    res = place_tiles(tiles, tau=10.0, method=TilePlacement.ALG2)
    np.testing.assert_array_equal(res.assignment, tiles.tile_home())
    assert res.comm_bytes == (0, 0, 0)
    # tau = 0: C = 156/2 = 78 per worker; t5 (42, home 1) -> 1, t2 (42, home 0) -> 0, t4 (26) -> 1,
    # t1 (26) -> 0, t3 (10): worker 1 has 68, 0 has 68: both feasible, home 1 wins (dcomm 0). t0 -> 0.
    res = place_tiles(tiles, tau=0.0, method=TilePlacement.ALG2)
    np.testing.assert_array_equal(res.assignment, tiles.tile_home())


def test_place_tiles_rejects_negative_tau():
    with pytest.raises(ValueError, match="tau"):
        place_tiles(_two_sequence_pool(), tau=-0.1)


@settings(max_examples=100, deadline=None)
@given(pools())
def test_alg2_load_ordered_scan_path_equals_direct_reference(case):
    # force the path used when a shared KV group is resident on many workers (> _FEW_RESIDENTS)
    tiles, tau = case
    expected, comm, _ = reference_alg2(tiles, tau)
    with mock.patch.object(alg2, "_FEW_RESIDENTS", 0):
        got = place_tiles(tiles, tau=tau, method=TilePlacement.ALG2)
    np.testing.assert_array_equal(got.assignment, expected)
    assert sum(got.comm_bytes) == comm


@pytest.mark.parametrize("head_split,tau,tiling,kv_fetch", [(1, 0.0, "uniform", "group"), (4, 0.03, "uniform", "group"),
                                                           (1, 0.0, "adaptive", "prefix"), (4, 0.03, "adaptive", "prefix")])
def test_alg2_equals_reference_on_a_32_worker_pool_with_long_docs(head_split, tau, tiling, kv_fetch):
    # synthetic: P=4, CP=8 zigzag, L=512, B=16; each sequence mixes one long doc with short ones
    rng = np.random.default_rng(7)
    segs = []
    for _ in range(4):
        long_len = int(rng.integers(200, 512))
        rest = np.diff(np.concatenate([[0], np.sort(rng.choice(np.arange(1, 512 - long_len), 6, replace=False)), [512 - long_len]]))
        segs.append(np.concatenate([rest[:3], [long_len], rest[3:]]))
    tiles = build_tiles(segs, TokenLayout(TokenLayoutKind.ZIGZAG, 512, 8), HeadLayout(32, 4, 128, head_split, 2), 16,
                        tiling=tiling, tau=tau, kv_fetch=kv_fetch, min_block_size=4)
    expected, comm, fallbacks = reference_alg2(tiles, tau)
    got = place_tiles(tiles, tau=tau)
    np.testing.assert_array_equal(got.assignment, expected)
    assert (sum(got.comm_bytes), got.num_fallback) == (comm, fallbacks)
    assert (got.assignment != tiles.tile_home()).any()


@settings(max_examples=80, deadline=None)
@given(pools(), st.sampled_from(["uniform", "ties", "per_block"]), st.integers(0, 2**31 - 1))
def test_alg2_with_tile_cost_vector_equals_direct_reference(case, kind, seed):
    # f_t from a random positive cost vector (head shards of a block may differ; "ties" forces Eq. 8 ties)
    tiles, tau = case
    rng = np.random.default_rng(seed)
    n, H = tiles.num_tiles, tiles.head_split
    cost = {"uniform": lambda: rng.random(n) + 1e-3,
            "ties": lambda: rng.integers(1, 4, n).astype(np.float64),
            "per_block": lambda: np.repeat(rng.random(n // H) * 7.0 + 0.5, H)}[kind]()
    expected, comm, fallbacks = reference_alg2(tiles, tau, cost)
    got = place_tiles(tiles, tau=tau, method=TilePlacement.ALG2, tile_cost=cost)
    np.testing.assert_array_equal(got.assignment, expected)
    assert (sum(got.comm_bytes), got.num_fallback) == (comm, fallbacks)
    np.testing.assert_array_equal(got.loads, np.bincount(expected, cost, tiles.num_workers))
    assert got.capacity == (1.0 + tau) * math.fsum(cost.tolist()) / tiles.num_workers
