"""Randomised operator cases and the per-rank worker run by ``run_distributed`` (module level, picklable).

A case is a plain dict, generated identically on every rank from a seed, so one spawned run executes many
cases. Every rank compares its own shard against ``testing.reference`` (dense fp64 block-causal attention
over its whole packed sequence) and returns errors and byte counts; the tests assert in the parent.
"""
from __future__ import annotations

from typing import List

import numpy as np
from libra_megatron.testing.traces import trace_lengths

# (hq, hkv, H, M): GQA ratios 1, 4, 8; H in {1,2,4} (H <= hkv and H > hkv); M in {1,2,4}; shared kv pieces.
HEAD_CONFIGS = [(8, 8, 2, 2), (8, 2, 1, 4), (8, 1, 4, 2), (8, 2, 4, 1), (16, 2, 2, 1), (4, 4, 4, 1),
                (8, 8, 1, 4), (16, 4, 2, 2), (8, 1, 1, 1)]
POOL_SHAPES = {2: [(1, 2), (2, 1)], 4: [(2, 2), (4, 1)], 8: [(4, 2)]}  # world size -> [(P, CP)]
# (tiling, KV fetch) of case i: TILINGS[i % 4]; case 2 (adaptive + prefix) holds one document cut adaptively
TILINGS = [("uniform", "group"), ("uniform", "prefix"), ("adaptive", "prefix"), ("adaptive", "group")]


def trace_segments(rng: np.random.Generator, num_seqs: int, seq_len: int) -> List[List[int]]:
    """Megatron-style packing of real Linux-trace documents scaled by seq_len/3000 (so a median document
    is ~0.4 L and the tail spans whole sequences): shuffle, concatenate, cut every L tokens."""
    lens = trace_lengths()
    picked = rng.choice(lens, size=8 * num_seqs)
    scaled = np.maximum(1, np.round(picked * seq_len / 3000.0)).astype(np.int64)
    stream, out, current, room = list(scaled), [], [], seq_len
    while len(out) < num_seqs:
        doc = stream.pop(0) if stream else seq_len
        while doc > 0 and len(out) < num_seqs:
            take = min(doc, room)
            current.append(int(take))
            doc, room = doc - take, room - take
            if room == 0:
                out.append(current)
                current, room = [], seq_len
    return out


def make_cases(world_size: int, seed: int, count: int) -> List[dict]:
    """``count`` randomised cases for a pool of ``world_size`` ranks (plus fixed edge cases)."""
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(count):
        P, cp = POOL_SHAPES[world_size][i % len(POOL_SHAPES[world_size])]
        hq, hkv, H, M = HEAD_CONFIGS[int(rng.integers(len(HEAD_CONFIGS)))]
        L = int(rng.choice([32, 48, 64])) if cp == 1 else int(rng.choice([32, 48, 64]))
        segs = trace_segments(rng, P, L)
        if i == 0:
            segs[0] = [L]  # one sample longer than a whole shard
        if i == 1:
            segs[-1] = [1, 2, 1] + [L - 4]  # tiny docs and a short-final-block doc
        split_one_doc = i == 2 and P * cp >= 4  # one whole-sequence doc, cut adaptively, spread by Alg. 2
        if split_one_doc:
            segs = [[L]] + [[4] * (L // 4) for _ in range(P - 1)]
        cases.append(dict(
            P=P, cp=cp, L=L, segs=segs, hq=hq, hkv=hkv, H=H, M=M, d=4,
            layout=["contiguous", "zigzag"][i % 2], block=16 if split_one_doc else int(rng.choice([5, 8, 12, 16])),
            tiling=TILINGS[i % 4][0], kv_fetch=TILINGS[i % 4][1],
            assign="alg2" if split_one_doc else ["home", "random", "alg2"][i % 3], assign_seed=int(rng.integers(1 << 30)),
            dtype="float64" if i % 4 else "float32", save_mode=["arranged", "refetch"][(i // 2) % 2],
            fmt="sbhd" if i % 5 == 3 else "thd", data_seed=int(rng.integers(1 << 30)),
        ))
    return cases


# ====================================================================================== per-rank
def build_plan(case):
    """(tiles, ExchangePlan) of a case, as every rank builds it."""
    return _build(case, with_tiles=True)


def _build(case, rank_override_assign=None, with_tiles=False):
    from libra_megatron.config import TilePlacement
    from libra_megatron.plan.exchange import build_exchange_plan
    from libra_megatron.plan.layout import HeadLayout, TokenLayout
    from libra_megatron.plan.placement import place_tiles
    from libra_megatron.plan.tiles import build_tiles

    elem = 8 if case["dtype"] == "float64" else 4
    layout = TokenLayout(case["layout"], case["L"], case["cp"])
    heads = HeadLayout(case["hq"], case["hkv"], case["d"], case["H"], case["M"], elem_bytes=elem)
    tiles = build_tiles(case["segs"], layout, heads, case["block"], tiling=case.get("tiling", "uniform"), tau=0.03,
                        kv_fetch=case.get("kv_fetch", "group"), min_block_size=1)
    kind = rank_override_assign or case["assign"]
    if kind == "home":
        assign = tiles.tile_home()
    elif kind == "random":
        assign = np.random.default_rng(case["assign_seed"]).integers(0, tiles.num_workers, tiles.num_tiles)
    else:
        assign = place_tiles(tiles, 0.03, TilePlacement.ALG2).assignment
    plan = build_exchange_plan(tiles, assign)
    return (tiles, plan) if with_tiles else (layout, plan)


def _inputs(case, p: int, layout):
    """Global fp64 q, k, v, dout of packed sequence p (identical on every rank holding it)."""
    import torch

    g = torch.Generator().manual_seed(case["data_seed"] + p)
    L, d = case["L"], case["d"]
    shapes = [(L, case["hq"], d), (L, case["hkv"], d), (L, case["hkv"], d), (L, case["hq"], d)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def _rel_err(got, want) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def run_libra_case(rank: int, case: dict, group=None) -> dict:
    """``rank`` is the rank inside ``group`` (the pool; default: the whole world)."""
    import torch
    import torch.distributed as dist

    from libra_megatron.runtime import ExchangeStats, libra_attn_func
    from libra_megatron.testing.reference import reference_forward_backward, shard_tokens

    layout, plan = _build(case)
    rp = plan.for_rank(rank)
    p, c = divmod(rank, case["cp"])
    qg, kg, vg, dog = _inputs(case, p, layout)
    ref = reference_forward_backward(qg, kg, vg, dog, case["segs"][p])
    dtype = getattr(torch, case["dtype"])
    q, k, v = (shard_tokens(x, layout, c).to(dtype).requires_grad_(True) for x in (qg, kg, vg))
    do = shard_tokens(dog, layout, c).to(dtype)
    stats = ExchangeStats()
    args = (q, k, v) if case["fmt"] == "thd" else tuple(x.unsqueeze(1) for x in (q, k, v))
    out = libra_attn_func(*args, rp, group or dist.group.WORLD, qkv_format=case["fmt"],
                          save_mode=case["save_mode"], stats=stats, backend="torch")
    out.backward(do if case["fmt"] == "thd" else do.unsqueeze(1))
    got = (out.detach().reshape(q.shape), q.grad, k.grad, v.grad)
    errs = [_rel_err(a, shard_tokens(b, layout, c)) for a, b in zip(got, ref)]
    kv_recv_remote = int(rp.kv_route.recv_splits.sum() - rp.kv_route.recv_splits[rank])
    return dict(errs=errs, bytes=dict(stats.bytes_sent), plan_bytes=list(rp.bytes_sent),
                kv_recv_bytes=kv_recv_remote * rp.heads.kv_bytes_per_token(), saved_bytes=stats.saved_bytes,
                shape_ok=tuple(out.shape) == tuple(args[0].shape) and out.dtype == dtype,
                kernel_calls=stats.kernel_calls)


def run_stale_case(rank: int, case: dict) -> str:
    """Feed one rank a bad plan or bad tensors; return 'PlanError: ...' or the unexpected outcome."""
    import torch
    import torch.distributed as dist

    from libra_megatron.plan.errors import PlanError
    from libra_megatron.runtime import libra_attn_func

    bad, fault = case["bad_rank"], case["fault"]
    stale = "random" if case["assign"] == "home" else "home"
    layout, plan = _build(case, stale if (fault == "fingerprint" and rank == bad) else None)
    rp = plan.for_rank(rank)
    t = layout.local_len - (1 if (fault == "tokens" and rank == bad) else 0)
    hq = case["hq"] // 2 if (fault == "heads" and rank == bad) else case["hq"]
    q = torch.randn(t, hq, case["d"], dtype=torch.float64)
    k = torch.randn(t, case["hkv"], case["d"], dtype=torch.float64)
    try:
        libra_attn_func(q, k, k.clone(), rp, dist.group.WORLD, backend="torch")
    except PlanError as exc:
        return f"PlanError: {exc}"
    return "no error"


def run_ulysses_case(rank: int, case: dict) -> List[float]:
    import torch.distributed as dist

    from libra_megatron.plan.layout import TokenLayout
    from libra_megatron.runtime import ulysses_attn_func
    from libra_megatron.testing.reference import reference_forward_backward, shard_tokens

    cp = dist.get_world_size()
    layout = TokenLayout(case["layout"], case["L"], cp)
    qg, kg, vg, dog = _inputs(case, 0, layout)
    ref = reference_forward_backward(qg, kg, vg, dog, case["segs"][0])
    q, k, v = (shard_tokens(x, layout, rank).requires_grad_(True) for x in (qg, kg, vg))
    cu = np.concatenate([[0], np.cumsum(case["segs"][0])])
    out = ulysses_attn_func(q, k, v, cu, dist.group.WORLD, token_layout=case["layout"], backend="torch")
    out.backward(shard_tokens(dog, layout, rank))
    return [_rel_err(a, shard_tokens(b, layout, rank)) for a, b in zip((out.detach(), q.grad, k.grad, v.grad), ref)]


def run_subpool_cases(rank: int, world_size: int, cases) -> list:
    """Two pools of world_size/2 ranks run different plans concurrently on their own subgroups."""
    import torch.distributed as dist

    half = world_size // 2
    groups = [dist.new_group(list(range(i * half, (i + 1) * half))) for i in range(2)]
    pool, local = divmod(rank, half)
    return [run_libra_case(local, pair[pool], groups[pool]) for pair in cases]


def run_suite(rank: int, world_size: int, libra_cases, stale_cases, ulysses_cases, subpool_cases=()) -> dict:
    """Everything one spawned run executes, in the same order on every rank."""
    return dict(
        subpool=run_subpool_cases(rank, world_size, subpool_cases) if subpool_cases else [],
        libra=[run_libra_case(rank, c) for c in libra_cases],
        stale=[run_stale_case(rank, c) for c in stale_cases],
        ulysses=[run_ulysses_case(rank, c) for c in ulysses_cases],
    )
