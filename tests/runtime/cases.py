"""Randomised operator cases and the per-rank worker run by ``run_distributed`` (module level, picklable).

A case is a plain dict, generated identically on every rank from a seed, so one spawned run executes many
cases. Every rank compares its own shard against ``testing.reference`` (dense fp64 block-causal attention
over its whole packed sequence) and returns errors and byte counts; the tests assert in the parent.
"""
from __future__ import annotations

import contextlib
import dataclasses
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
            deterministic=i == 1,  # --deterministic-mode reaches every backward kernel call
            lead=i % (M + 3) - 1,  # the Pipeliner lead per rank: -1 (default), 0..M, M + 1 (no local split)
            # K/V relay between nodes of two ranks (placed cases at world >= 4), on a twin group or the pool group
            nodes=tuple(w // 2 for w in range(world_size)) if world_size >= 4 and i % 3 else None,
            twin=world_size >= 4 and i % 3 > 0 and i % 2 == 1,  # (a twin is made by every rank of the world at once)
            stripe=1 if i % 4 >= 2 else None,  # relaying cases: the striped relay (>= 1 unit a stripe), else single
            hosted=i % 5 == 2,  # entries in hosted order: entry sets interleave (gathered, scattered), else sliced
        ))
    return cases


RELAY_MODEL = dict(attn_tflops=1e-6, inter_node_gbps=1e-7, intra_node_gbps=1e-3)  # relays pay off (tests only)


# ====================================================================================== per-rank
def build_plan(case):
    """(tiles, ExchangePlan) of a case, as every rank builds it."""
    return _build(case, with_tiles=True)


def _build(case, rank_override_assign=None, with_tiles=False):
    from libra_megatron.config import TilePlacement
    from libra_megatron.plan.exchange import validate_plan
    from libra_megatron.plan.exchange.builder import _build_exchange_plan
    from libra_megatron.plan.layout import HeadLayout, TokenLayout
    from libra_megatron.plan.tiles import place_tiles
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
    timing = None
    if case.get("nodes"):
        from libra_megatron.plan.model import StepTimeModel

        timing = StepTimeModel(case["d"], worker_nodes=case["nodes"], kv_relay=True, **RELAY_MODEL)
    plan = _build_exchange_plan(tiles, assign, timing, relay_stripe=case.get("stripe"),
                                group_by_kind=not case.get("hosted"))
    validate_plan(plan, tiles)  # every structural invariant, before any rank runs it
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
    rp = dataclasses.replace(plan.for_rank(rank), local_lead=case.get("lead", -1))
    p, c = divmod(rank, case["cp"])
    qg, kg, vg, dog = _inputs(case, p, layout)
    ref = reference_forward_backward(qg, kg, vg, dog, case["segs"][p])
    dtype = getattr(torch, case["dtype"])
    q, k, v = (shard_tokens(x, layout, c).to(dtype).requires_grad_(True) for x in (qg, kg, vg))
    do = shard_tokens(dog, layout, c).to(dtype)
    stats = ExchangeStats()
    args = (q, k, v) if case["fmt"] == "thd" else tuple(x.unsqueeze(1) for x in (q, k, v))
    deterministic = bool(case.get("deterministic", False))
    relay_group = _twin_group(group) if case.get("twin") else None
    with _recorded_backward_flags() as seen:
        out = libra_attn_func(*args, rp, group or dist.group.WORLD, qkv_format=case["fmt"],
                              save_mode=case["save_mode"], stats=stats, backend="torch", deterministic=deterministic,
                              relay_group=relay_group)
        out.backward(do if case["fmt"] == "thd" else do.unsqueeze(1))
    got = (out.detach().reshape(q.shape), q.grad, k.grad, v.grad)
    errs = [_rel_err(a, shard_tokens(b, layout, c)) for a, b in zip(got, ref)]
    kv_recv_remote = int(rp.kv_route.recv_splits.sum() - rp.kv_route.recv_splits[rank])
    relay_recv = 0 if rp.relay_route is None else int(rp.relay_route.recv_splits.sum())
    kv_recv_remote += relay_recv  # dK|dV of relayed rows go back to the relay (the input dtype = fp32 sums here)
    from libra_megatron.plan.model import deferred_relay_bytes, saved_bytes_per_rank
    from libra_megatron.testing.unit_tables import entry_kinds_by_units

    predicted = int(saved_bytes_per_rank(plan, rp.heads, layout.local_len, case["save_mode"])[rank])
    return dict(errs=errs, bytes=dict(stats.bytes_sent), plan_bytes=list(rp.bytes_sent),
                saved_predicted=predicted, deferred_bytes=stats.deferred_bytes,
                deferred_predicted=int(deferred_relay_bytes(plan, rp.heads)[rank]),
                kv_recv_bytes=kv_recv_remote * rp.heads.kv_bytes_per_token(), saved_bytes=stats.saved_bytes,
                shape_ok=tuple(out.shape) == tuple(args[0].shape) and out.dtype == dtype,
                kernel_calls=stats.kernel_calls, deterministic_seen=sorted(set(seen)),
                entry_kinds=np.bincount(entry_kinds_by_units(rp)[0], minlength=3).tolist(),  # remote, local, split
                waited=sorted(stats.wait_seconds), relay_recv=relay_recv,
                relayed=rp.relay_route is not None)


_TWINS = {}


def _twin_group(group):
    """A second process group over the ranks of ``group`` (the world when None), made once per process (every
    rank runs the same cases in the same order, so every rank makes it at the same point)."""
    import torch.distributed as dist

    ranks = tuple(range(dist.get_world_size())) if group is None else tuple(dist.get_process_group_ranks(group))
    if ranks not in _TWINS:
        _TWINS[ranks] = dist.new_group(list(ranks))
    return _TWINS[ranks]


@contextlib.contextmanager
def _recorded_backward_flags():
    """The ``deterministic`` value every backward kernel call of the torch backend receives (a list)."""
    import dataclasses

    from libra_megatron.config import KernelBackendName
    from libra_megatron.runtime import kernels

    seen, original = [], kernels._BACKENDS[KernelBackendName.TORCH]

    def recording(*args, deterministic=False):
        seen.append(deterministic)
        return original.raw_bwd(*args, deterministic=deterministic)

    kernels._BACKENDS[KernelBackendName.TORCH] = dataclasses.replace(original, raw_bwd=recording)
    try:
        yield seen
    finally:
        kernels._BACKENDS[KernelBackendName.TORCH] = original


@contextlib.contextmanager
def _nan_sentinel_buffers():
    """O and dQ buffers of libra_attn start as NaN instead of uninitialised memory: a row the inverse Q route
    does not write stays NaN and fails the reference comparison. Counts the buffers made."""
    import torch

    from libra_megatron.runtime import libra_attn

    made, original = [], libra_attn._uninitialized_like

    def nan_filled(x):
        made.append(x.shape)
        return torch.full_like(x, float("nan"))

    libra_attn._uninitialized_like = nan_filled
    try:
        yield made
    finally:
        libra_attn._uninitialized_like = original


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


def run_suite(rank: int, world_size: int, libra_cases, stale_cases, ulysses_cases, subpool_cases=(),
              precision_cases=(), collective_case=None) -> dict:
    """Everything one spawned run executes, in the same order on every rank; O and dQ buffers start as NaN."""
    with _nan_sentinel_buffers() as sentinels:
        return dict(
            subpool=run_subpool_cases(rank, world_size, subpool_cases) if subpool_cases else [],
            libra=[run_libra_case(rank, c) for c in libra_cases],
            stale=[run_stale_case(rank, c) for c in stale_cases],
            ulysses=[run_ulysses_case(rank, c) for c in ulysses_cases],
            precision=run_precision_cases(rank, precision_cases, world_size == 4) if precision_cases else None,
            collectives=run_collective_counts(rank, collective_case) if collective_case else None,
            nan_sentinel_buffers=len(sentinels),
        )


# ====================================================================================== low precision
PRECISION_SHAPES = {  # world size -> (P, CP, L): one long sample per sequence, small blocks, random placement
    2: [(2, 1, 64)], 4: [(2, 2, 64), (4, 1, 64)], 8: [(4, 2, 96), (8, 1, 96)],
}


def make_precision_cases(world_size: int, seed: int) -> List[dict]:
    """bf16 and fp16 cases whose K/V rows receive many dK|dV fragments (several destinations x chunks that
    share a kv head: hq=8, hkv=1, M=4 -> every chunk reads kv head 0; dK|dV summed over the chunks in fp32 and
    returned after the last), and a bf16 case of the shipped head split (hq=8, hkv=4, H=2, M=2: every chunk owns
    its kv head, so each chunk's dK|dV goes home in bf16 right after its compute and is summed at home in fp32)."""
    rng = np.random.default_rng(seed)
    cases = []
    for i, (P, cp, L) in enumerate(PRECISION_SHAPES[world_size]):
        for j, (dtype, hkv, H, M) in enumerate((("bfloat16", 1, 1, 4), ("float16", 1, 1, 4), ("bfloat16", 4, 2, 2))):
            segs = [[L]] + trace_segments(rng, P - 1, L)
            cases.append(dict(P=P, cp=cp, L=L, segs=segs, hq=8, hkv=hkv, H=H, M=M, d=16, layout="zigzag", block=4,
                              assign="random", assign_seed=int(rng.integers(1 << 30)), dtype=dtype,
                              save_mode=["arranged", "refetch"][i % 2], fmt="thd", data_seed=int(rng.integers(1 << 30)),
                              nodes=tuple(w // 2 for w in range(world_size)) if world_size >= 4 else None,
                              min_fragments=8 if hkv == 1 else 1,
                              stripe=1 if (i + j) % 2 else None))  # relayed (world >= 4): striped or single
    return cases


def kv_fragments(rp) -> np.ndarray:
    """int [t*kvp]: dK|dV fragments every local K/V view row receives = (destination, chunk) pairs that
    fetched it, counted with the varlen entries that read it at that destination."""
    from libra_megatron.plan.exchange import kv_rows

    heads, kr = rp.heads, rp.kv_route
    rows = rp.local_tokens * heads.kv_pieces_per_token
    counts = np.zeros(rows, dtype=np.int64)
    for m in range(heads.num_chunks):
        np.add.at(counts, kv_rows(kr.send_index, heads, m), 1)
    return counts


def run_precision_case(rank: int, case: dict, group=None) -> dict:
    """FlashAttention's rule per tensor: max|libra - ref64| <= 2 * max|same-dtype single-device - ref64|.

    ref64: fp64 attention of the *rounded* inputs (input rounding is not the operator's error); the
    baseline is the dense per-sample reference run entirely in the low dtype on one device.
    """
    import torch
    import torch.distributed as dist

    from libra_megatron.runtime import libra_attn_func
    from libra_megatron.testing.reference import reference_forward_backward, shard_tokens

    layout, plan = _build(case)
    rp = dataclasses.replace(plan.for_rank(rank), local_lead=case.get("lead", -1))
    p, c = divmod(rank, case["cp"])
    dtype = getattr(torch, case["dtype"])
    full = [x.to(dtype) for x in _inputs(case, p, layout)]
    ref = reference_forward_backward(*full, case["segs"][p])  # fp64 of the rounded inputs
    base = reference_forward_backward(*full, case["segs"][p], dtype=dtype)
    q, k, v = (shard_tokens(x, layout, c).requires_grad_(True) for x in full[:3])
    layouts = []  # the operator's own dk, dv (before autograd accumulates them): contiguous
    for x in (k, v):
        x.register_hook(lambda g: layouts.append(g.is_contiguous()))
    out = libra_attn_func(q, k, v, rp, group or dist.group.WORLD, backend="torch", save_mode=case["save_mode"])
    out.backward(shard_tokens(full[3], layout, c))
    got = (out.detach(), q.grad, k.grad, v.grad)
    err = [float((g.double() - shard_tokens(r, layout, c)).abs().max()) for g, r in zip(got, ref)]
    base_err = [float((b.double() - r).abs().index_select(0, torch.as_tensor(layout.local_to_global(c))).max())
                for b, r in zip(base, ref)]
    return dict(err=err, base_err=base_err, max_fragments=int(kv_fragments(rp).max()),
                dtypes_ok=all(x.dtype == dtype for x in got), relayed=rp.relay_route is not None,
                dkv_contiguous=layouts == [True, True])


def run_precision_cases(rank: int, cases, with_injected_bug: bool) -> dict:
    """All precision cases; then (optionally) the first one again with dK|dV sums in the input dtype, the
    bug fp32 accumulation fixes -- the rule must catch it (the test can fail)."""
    out = dict(ok=[run_precision_case(rank, c) for c in cases], bug=None)
    if with_injected_bug:
        from libra_megatron.runtime import libra_attn

        saved = libra_attn._accumulation_dtype
        libra_attn._accumulation_dtype = lambda dtype: dtype
        try:
            out["bug"] = run_precision_case(rank, cases[0])
        finally:
            libra_attn._accumulation_dtype = saved
    return out


# ====================================================================================== collectives
_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "broadcast", "barrier",
                "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "send", "recv", "isend", "irecv",
                "all_to_all", "all_to_all_single", "batch_isend_irecv")
_HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "cpu", "numpy")


class CallCounter:
    """Counts torch.distributed collectives and Tensor host reads while active (patched in this process)."""

    def __init__(self):
        import torch
        import torch.distributed as dist

        self.counts = {}
        self._patched = []
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                self._wrap(dist, name, name)
        for name in _HOST_READS:
            self._wrap(torch.Tensor, name, "host:" + name)
        self.active = False

    def _wrap(self, owner, name, label):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if self.active:
                self.counts[label] = self.counts.get(label, 0) + 1
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)
        self._patched.append((owner, name, original))

    def measure(self, fn):
        self.counts, self.active = {}, True
        try:
            fn()
        finally:
            self.active = False
        return dict(self.counts)

    def restore(self):
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)


def run_collective_counts(rank: int, case: dict) -> dict:
    """Calls 1..3 with one plan, then a new plan object of the same content, then a new plan: what each
    call (forward + backward) issued. Then a cross-rank dtype mismatch and a save-mode mismatch."""
    import torch
    import torch.distributed as dist

    from libra_megatron.plan.errors import PlanError
    from libra_megatron.runtime import libra_attn_func

    layout, plan = _build(case)
    p, c = divmod(rank, case["cp"])
    qg, kg, vg, dog = (x.to(torch.float32) for x in _inputs(case, p, layout))
    from libra_megatron.testing.reference import shard_tokens

    def call(rp, dtype=torch.float32, save_mode="arranged"):
        q, k, v = (shard_tokens(x, layout, c).to(dtype).requires_grad_(True) for x in (qg, kg, vg))
        libra_attn_func(q, k, v, rp, dist.group.WORLD, backend="torch", save_mode=save_mode).backward(
            shard_tokens(dog, layout, c).to(dtype))

    counter = CallCounter()
    try:
        same = [counter.measure(lambda: call(plan.for_rank(rank))) for _ in range(3)]
        _, replanned = _build(case)  # same content, new objects: the call key is already verified
        same.append(counter.measure(lambda: call(replanned.for_rank(rank))))
        other = dict(case, assign="home" if case["assign"] != "home" else "random")
        _, new_plan = _build(other)
        fresh = counter.measure(lambda: call(new_plan.for_rank(rank)))
    finally:
        counter.restore()
    errors = {}
    for name, kwargs in (("dtype", dict(dtype=torch.float32 if rank == 0 else torch.float64)),
                         ("save_mode", dict(save_mode="refetch" if rank == 1 else "arranged"))):
        _, mismatch_plan = _build(dict(case, assign_seed=case["assign_seed"] + 1 + len(errors)))
        try:
            call(mismatch_plan.for_rank(rank), **kwargs)
            errors[name] = "no error"
        except PlanError as exc:
            errors[name] = f"PlanError: {exc}"
    return dict(same=same, fresh=fresh, errors=errors)
