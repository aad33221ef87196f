"""The time model's op lists are the runtime's (issue 23): ``plan.exchange.schedule.rank_layer_ops`` against the
calls ``runtime.libra_attn`` really makes, recorded on gloo by ``testing.op_recorder``.

Per rank, in issue order: every ``all_to_all_single`` (communicator, issue number, bytes to and from every
peer), every wait, every kernel call (entries, rows, causal pairs x heads) and every gather / place / add
copy (bytes). Forward and backward, save modes arranged and refetch, relay on (on its twin group and on the
pool group) and off, local-first split on and off at several leads, M = 1, 2, 4, H = 1, 2, 4, GQA with kv pieces
shared by chunks (dK|dV home in fp32), fp16 / fp32 / fp64, on hypothesis-drawn pools and on real-trace pools,
at world 2 and 4. One spawned world per size runs every case (spawning dominates the cost).

The comparison can fail: ``test_a_reordered_backward_fails_the_comparison`` runs the runtime once with one call of
``_bwd`` moved (the next chunk's inputs issued after the current chunk's compute instead of before it) and
asserts the recorded list is no longer the generated one.
"""
from __future__ import annotations

import dataclasses
import inspect
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libra_megatron.plan.model import Copy, Exchange, op_keys
from libra_megatron.testing.dist import run_distributed

DTYPES = {2: "float16", 4: "float32", 8: "float64"}
RELAY_MODEL = dict(attn_tflops=1e-6, inter_node_gbps=1e-7, intra_node_gbps=1e-3)  # relays pay off (tests only)
POOL_SHAPES = {2: [(1, 2), (2, 1)], 4: [(2, 2), (4, 1), (1, 4)]}  # world -> (P, CP)
# (hq, hkv, H, M): M 1/2/4, H 1/2/4, GQA 1/4/8, kv pieces shared by chunks (8, 1, *, 4), (8, 2, 1, 4)
HEADS = [(8, 1, 1, 4), (8, 2, 2, 2), (4, 4, 1, 1), (8, 1, 2, 4), (16, 4, 2, 2), (8, 2, 1, 4), (8, 8, 4, 2)]


# ====================================================================================== plans (parent)
def _plan(spec):
    """The ExchangePlan of a case spec (plain dict)."""
    from libra_megatron.config import TilePlacement
    from libra_megatron.plan.exchange.builder import _build_exchange_plan
    from libra_megatron.plan.layout import HeadLayout, TokenLayout
    from libra_megatron.plan.model import StepTimeModel
    from libra_megatron.plan.tiles import build_tiles, place_tiles

    layout = TokenLayout(spec["layout"], spec["L"], spec["cp"])
    heads = HeadLayout(spec["hq"], spec["hkv"], spec["d"], spec["H"], spec["M"], elem_bytes=spec["elem"])
    tiles = build_tiles(spec["segs"], layout, heads, spec["block"], tiling=spec["tiling"], tau=0.03,
                        kv_fetch=spec["kv_fetch"], min_block_size=1)
    if spec["assign"] == "home":
        assign = tiles.tile_home()
    elif spec["assign"] == "random":
        assign = np.random.default_rng(spec["seed"]).integers(0, tiles.num_workers, tiles.num_tiles)
    else:
        assign = place_tiles(tiles, 0.03, TilePlacement.ALG2).assignment
    timing = None
    if spec.get("nodes"):
        timing = StepTimeModel(spec["d"], worker_nodes=spec["nodes"], kv_relay=True, **RELAY_MODEL)
    # ``hosted``: entries in hosted order, so entry sets interleave (gathered and scattered, not sliced)
    return _build_exchange_plan(tiles, assign, timing, relay_stripe=spec.get("stripe"),
                                group_by_kind=not spec.get("hosted"))


def _runs(spec):
    """The runtime calls of one case: every save mode, the relay on its twin group and on the pool group."""
    plan = _plan(spec)
    lead = spec.get("lead")
    ranks = [plan.for_rank(r) if lead is None else dataclasses.replace(plan.for_rank(r), local_lead=lead)
             for r in range(plan.num_workers)]
    relayed = any(rp.relay_route is not None for rp in ranks)
    comms = ("relay", "pool") if relayed else ("relay",)
    return [dict(spec=spec, plans=ranks, save_mode=mode, relay_comm=comm, dtype=DTYPES[spec["elem"]])
            for mode in ("arranged", "refetch") for comm in comms]


def _generated(run):
    from libra_megatron.plan.exchange import rank_layer_ops

    return [rank_layer_ops(rp, run["save_mode"], run["relay_comm"]) for rp in run["plans"]]


# ====================================================================================== cases
@st.composite
def specs(draw, world):
    """A small pool of ``world`` workers: layout, heads (elem 2/4/8), documents, tiling, assignment, lead and
    (world 4) two nodes whose K/V may relay, single or striped."""
    P, cp = draw(st.sampled_from(POOL_SHAPES[world]))
    kind = draw(st.sampled_from(["contiguous", "zigzag"]))
    hq, hkv, H, M = draw(st.sampled_from(HEADS))
    n_chunks = 2 * cp if kind == "zigzag" and cp > 1 else cp
    L = n_chunks * draw(st.integers(2, 8))
    segs = [_partition(draw, L) for _ in range(P)]
    spec = dict(P=P, cp=cp, L=L, segs=segs, layout=kind, hq=hq, hkv=hkv, d=2, H=H, M=M,
                elem=draw(st.sampled_from([2, 4, 8])), block=draw(st.integers(2, L + 1)),
                tiling=draw(st.sampled_from(["uniform", "adaptive"])), kv_fetch=draw(st.sampled_from(["group", "prefix"])),
                assign=draw(st.sampled_from(["home", "random", "alg2"])), seed=draw(st.integers(0, 2**30)),
                lead=draw(st.sampled_from([None, -1, 0, 1, M, M + 1])),
                nodes=(0, 0, 1, 1) if world == 4 and draw(st.booleans()) else None)
    # a relay striped or single, entries grouped by kind or in hosted order (no draw: the same stream as before)
    return dict(spec, stripe=1 if spec["seed"] % 2 else None, hosted=spec["seed"] % 3 == 0)


def _partition(draw, L):
    cuts = sorted(draw(st.sets(st.integers(1, L - 1), max_size=min(4, L - 1))))
    return np.diff([0, *cuts, L]).tolist()


def drawn_specs(world, count):
    """``count`` hypothesis-drawn specs, the same on every run (derandomized): one spawned world runs them all."""
    found = []

    @settings(max_examples=count, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(specs(world))
    def collect(spec):
        found.append(spec)

    collect()
    return found


def trace_specs(world):
    """Real Linux-trace and Wikipedia-trace documents packed into the pool's sequences."""
    from libra_megatron.testing.traces import packed_trace_segments

    rng = np.random.default_rng(23 + world)
    out = []
    for i, (trace, scale) in enumerate((("linux-6.12-files.qwen.txt", 1 / 200), ("wikipedia-flexsp.txt", 1 / 50))):
        for j, (P, cp) in enumerate(POOL_SHAPES[world][:2]):
            hq, hkv, H, M = HEADS[(2 * i + j) % len(HEADS)]
            L = 32 * cp
            out.append(dict(P=P, cp=cp, L=L, segs=packed_trace_segments(rng, P, L, scale=scale, name=trace),
                            layout=["zigzag", "contiguous"][j], hq=hq, hkv=hkv, d=2, H=H, M=M, elem=4,
                            block=8, tiling=["adaptive", "uniform"][i], kv_fetch=["prefix", "group"][j],
                            assign="alg2", seed=i, lead=[None, 1, -1, 0][2 * i + j],
                            nodes=(0, 0, 1, 1) if world == 4 else None))
    return out


def fixed_specs(world):
    """Cases a small draw may miss: every tile at home (local entries only), kv pieces shared by four chunks in
    fp16 (dK|dV home in fp32) under a random placement, and (world 4) relaying pools."""
    L = 16
    P, cp = POOL_SHAPES[world][-1]
    base = dict(P=P, cp=cp, L=L * cp, segs=[[3, L * cp - 3]] * P, layout="contiguous", hq=8, hkv=1, d=2, H=1, M=4,
                elem=2, block=4, tiling="uniform", kv_fetch="group", seed=5, lead=None, nodes=None)
    out = [dict(base, assign="home"), dict(base, assign="random"), dict(base, assign="alg2", lead=2, elem=4)]
    if world == 4:  # relays in fp16 with kv pieces shared by chunks, in fp64 with one chunk
        relay = dict(base, assign="random", nodes=(0, 0, 1, 1))
        out += [dict(relay, H=2, M=2, hkv=2, elem=2), dict(relay, H=2, M=2, hkv=2, elem=4, lead=1),
                dict(relay, H=1, M=1, hq=4, hkv=4, elem=8, seed=7), dict(relay, H=2, M=2, hkv=2, elem=2, stripe=1)]
    return out


# ====================================================================================== per rank (spawned)
def record_runs(rank: int, world: int, runs, mutant_runs=()) -> list:
    """Each run's recorded (forward ops, backward ops) on this rank; then the runs of ``mutant_runs`` again under
    the reordered ``_bwd``."""
    import torch.distributed as dist

    twin = dist.new_group(list(range(world)))  # the relay's communicator, made by every rank at once
    out = [_record(rank, run, dist.group.WORLD, twin) for run in runs]
    from libra_megatron.runtime import libra_attn

    original, libra_attn._bwd = libra_attn._bwd, reordered_bwd()
    try:
        out += [_record(rank, run, dist.group.WORLD, twin) for run in mutant_runs]
    finally:
        libra_attn._bwd = original
    return out


def _record(rank: int, run, pool, twin, verify="auto"):
    """(forward ops, backward ops) of one forward + backward of ``libra_attn_func`` on this rank."""
    import torch

    from libra_megatron.runtime import libra_attn_func
    from libra_megatron.testing.op_recorder import record_ops

    rp, dtype = run["plans"][rank], getattr(torch, run["dtype"])
    g = torch.Generator().manual_seed(rank)
    heads, t = rp.heads, rp.local_tokens
    q, k, v = (torch.randn(t, h, heads.head_dim, generator=g).to(dtype).requires_grad_(True)
               for h in (heads.num_q_heads, heads.num_kv_heads, heads.num_kv_heads))
    dout = torch.randn(t, heads.num_q_heads, heads.head_dim, generator=g).to(dtype)
    with record_ops({pool: "pool", twin: "relay"}) as rec:
        out = libra_attn_func(q, k, v, rp, pool, backend="torch", save_mode=run["save_mode"], verify=verify,
                              relay_group=twin if run["relay_comm"] == "relay" else None)
        forward = rec.take()
        out.backward(dout)
        backward = rec.take()
    return forward, backward


def reordered_bwd():
    """``runtime.libra_attn._bwd`` with one call moved: the next chunk's inputs are issued after the current
    chunk's kernel backward, not before it (the source is the runtime's own, so the mutant follows it)."""
    from libra_megatron.runtime import libra_attn

    src = textwrap.dedent(inspect.getsource(libra_attn._bwd))
    ahead = ("        if m + 1 < heads.num_chunks:\n"
             "            incoming = _bwd_inputs(cx, m + 1, dout_view, saved, local)\n")
    compute = "        dq_arr, kv_arr, dk_pk, dv_pk = _bwd_kernel(cx, current, saved[m], kv_arr)\n"
    assert ahead + compute in src, "runtime _bwd changed: update the mutation of test_op_list.reordered_bwd"
    namespace = dict(vars(libra_attn))
    exec(compile(src.replace(ahead + compute, compute + ahead), libra_attn.__file__, "exec"), namespace)
    return namespace["_bwd"]


# ====================================================================================== comparison
def first_mismatch(recorded, generated) -> str:
    """'' when the op keys are equal, else a readable account of the first difference (with the generated
    op's tag / chunk and a few ops of context)."""
    rk, gk = op_keys(recorded), op_keys(generated)
    if rk == gk:
        return ""
    i = next((j for j, (a, b) in enumerate(zip(rk, gk)) if a != b), min(len(rk), len(gk)))
    lines = [f"first difference at op {i} (recorded {len(rk)} ops, generated {len(gk)})"]
    for j in range(max(0, i - 3), i + 3):
        rec = recorded[j].key() if j < len(recorded) else "-"
        gen = generated[j] if j < len(generated) else "-"
        lines.append(f"{'>>' if j == i else '  '} {j:4d} recorded {rec}\n          generated {gen}")
    return "\n".join(lines)


def _check(runs, results, generated=None):
    """Per (run, rank, phase) whose recorded list is not the generated one, an account of the first difference."""
    failures = []
    generated = generated or [_generated(run) for run in runs]
    for i, run in enumerate(runs):
        for rank, ((fwd, bwd), (gen_f, gen_b)) in enumerate(zip((res[i] for res in results), generated[i])):
            for phase, rec, gen in (("forward", fwd, gen_f), ("backward", bwd, gen_b)):
                diff = first_mismatch(rec, gen)
                if diff:
                    failures.append(f"run {i} rank {rank} {phase} save_mode={run['save_mode']} relay_comm="
                                    f"{run['relay_comm']} spec={run['spec']}\n{diff}")
    return failures


_RESULTS = {}
HYPOTHESIS_EXAMPLES = {2: 6, 4: 6}


def _suite(world):
    if world not in _RESULTS:
        specs_ = drawn_specs(world, HYPOTHESIS_EXAMPLES[world]) + trace_specs(world) + fixed_specs(world)
        runs = [run for spec in specs_ for run in _runs(spec)]
        mutant = [r for r in runs if r["spec"]["M"] > 1][:1] if world == 2 else []
        results = run_distributed(record_runs, world, runs, mutant, timeout=240)
        _RESULTS[world] = (runs, [res[: len(runs)] for res in results], mutant,
                           [res[len(runs):] for res in results], [_generated(run) for run in runs])
    return _RESULTS[world]


@pytest.mark.parametrize("world", [2, 4])
def test_runtime_issues_exactly_the_generated_op_list(world):
    runs, results, _, _, generated = _suite(world)
    failures = _check(runs, results, generated)
    assert not failures, f"{len(failures)} lists differ; first:\n" + failures[0]


@pytest.mark.parametrize("world", [2, 4])
def test_cases_cover_save_modes_relay_split_chunks_and_heads(world):
    from libra_megatron.plan.exchange import rank_tables

    runs, _, _, _, generated = _suite(world)
    seen = dict(save_mode=set(), relay=set(), split=set(), M=set(), H=set(), shared_kv=set(), elem=set(), fp32_wire=set(),
                kv_rows_read=set(), striped=set(), sliced=set())
    for run in runs:
        spec, tables = run["spec"], [rank_tables(rp) for rp in run["plans"]]
        seen["save_mode"].add(run["save_mode"])
        seen["relay"].add(run["relay_comm"] if any(t.relay_send is not None for t in tables) else "off")
        seen["split"].add(any(t.local is not None for t in tables) and spec["lead"] != spec["M"] + 1)
        seen["M"].add(spec["M"])
        seen["H"].add(spec["H"])
        seen["shared_kv"].add(not run["plans"][0].heads.kv_send_chunks().all())
        seen["elem"].add(spec["elem"])
        seen["fp32_wire"].add(spec["elem"] == 2 and not run["plans"][0].heads.kv_return_chunks().all())
        seen["kv_rows_read"].update(t.kv_rows_read for t in tables)  # dK|dV sums from first rows, or from zeros
        # entry sets read as one slice of the arranged Q, or gathered (hosted order, sets interleaved)
        seen["sliced"].update(part.q_span is not None for t in tables for part in t.entry_sets() if part.num_entries)
        if spec.get("stripe") and any(t.relay_send is not None for t in tables):  # striped: not the single relay's plan
            seen["striped"].add(_plan(dict(spec, stripe=None)).fingerprint != run["plans"][0].fingerprint)
    assert seen["save_mode"] == {"arranged", "refetch"} and seen["split"] == {True, False}
    assert seen["M"] == seen["H"] == {1, 2, 4} and seen["shared_kv"] == {True, False}
    assert seen["elem"] == {2, 4, 8} and True in seen["fp32_wire"]  # fp16 dK|dV sums home in fp32
    assert seen["kv_rows_read"] == {True, False} and seen["sliced"] == {True, False}
    assert seen["relay"] == ({"off", "relay", "pool"} if world == 4 else {"off"}), seen["relay"]
    assert True in seen["striped"] if world == 4 else not seen["striped"]
    steps = {(phase, op.tag, type(op).__name__) for per_rank in generated for ops in per_rank
             for phase, phase_ops in zip(("f", "b"), ops) for op in phase_ops}
    want = {("f", "local", "Kernel"), ("f", "remote", "Kernel"), ("f", "heads", "Kernel"), ("f", "merge", "Copy"),
            ("f", "all", "Kernel"), ("f", "o_self", "Copy"), ("b", "kv_bwd", "Exchange"), ("b", "o_bwd", "Wait")}
    if world == 4:  # relayed rows placed by receivers, sends-only relays waited at the end, dK|dV back to the relay
        want |= {("f", "relay", "Exchange"), ("f", "relay", "Wait"), ("b", "relay_bwd", "Exchange"),
                 ("b", "relay_back", "Exchange")}
    assert want <= steps, want - steps
    kinds = {(phase, op.op, op.tag) for per_rank in generated for ops in per_rank
             for phase, phase_ops in zip(("f", "b"), ops) for op in phase_ops if isinstance(op, Copy)}
    # the dense kernels: bf16 dK|dV widened to fp32 and narrowed for the wire, fp32 sums zeroed, the merge
    assert {("b", "widen", "dkv"), ("b", "elementwise", "dkv"),
            ("f", "widen", "merge"), ("f", "elementwise", "merge")} <= kinds, kinds
    assert ("f", "elementwise", "kv") not in kinds  # K and V are gathered into the send buffer's halves: no cat
    relay_ops = [op for per_rank in generated for ops in per_rank for op in ops[0] if op.tag == "relay"]
    places = sum(isinstance(op, Copy) and op.op == "place" for op in relay_ops)
    exchanges = sum(isinstance(op, Exchange) for op in relay_ops)
    assert world == 2 or 0 < places < exchanges, (places, exchanges)  # receivers and sends-only ranks
    issued = {_after_gather(ops[0], i) for per_rank in generated for ops in per_rank for i, op in enumerate(ops[0])
              if isinstance(op, Exchange) and op.tag == "relay"}
    # ranks that send relayed rows issue after gathering them; the others issue early, with nothing gathered
    assert world == 2 or issued == {True, False}, issued


def _after_gather(ops, i: int) -> bool:
    """Whether op i of a list is issued right after a gather of its own rows (tag and chunk)."""
    before = ops[i - 1] if i else None
    return isinstance(before, Copy) and before.op == "gather" and (before.tag, before.chunk) == (ops[i].tag, ops[i].chunk)


def test_a_reordered_backward_fails_the_comparison():
    """The test above can fail: the same runtime with the next chunk's backward inputs issued after the current
    chunk's compute (one call of ``_bwd`` moved) records a backward list the generator does not emit."""
    _, _, mutant, results, _ = _suite(2)
    assert mutant, "no M > 1 case at world 2"
    failures = _check(mutant, results)
    assert failures and all(" backward " in f for f in failures), failures


def test_one_worker_pool_issues_no_exchange_and_the_generated_list():
    """P = CP = 1 (in this process, no group: the runtime skips every collective, and so does the model)."""
    spec = dict(P=1, cp=1, L=16, segs=[[5, 11]], layout="contiguous", hq=8, hkv=1, d=2, H=2, M=2, elem=4, block=4,
                tiling="uniform", kv_fetch="group", assign="home", seed=0, lead=None, nodes=None)
    for run in _runs(spec):
        recorded = _record(0, run, None, None, verify=False)
        for rec, gen in zip(recorded, _generated(run)[0]):
            assert not first_mismatch(rec, gen), first_mismatch(rec, gen)
            assert not any(isinstance(op, Exchange) for op in rec) and rec, rec
    import torch
    import torch.distributed as dist

    from libra_megatron.runtime import kernels, libra_attn, routes

    # nothing of the recorder is left on the runtime's path once the block is left
    assert routes.dist is dist and libra_attn.resolve_backend is kernels.resolve_backend
    assert not {"index_select", "index_put_", "index_add_"} & set(vars(torch.Tensor))
