"""plan.model.rates: the per-kind copy rates are what one H200 measured for the runtime's own copies.

The shipped profile (``docs/gpu/h200-2026-12-04/overhead_profile_after.txt``: torch.profiler device time per kernel
name of ``libra_attn_func`` forward + backward at P=1, 32K tokens of 4 documents, 32 query / 4 K/V heads, d=128,
bf16, H=1 M=1 and H=2 M=2) is read again; the bytes come from ``plan.exchange.schedule``'s op lists of the same
plans. Each rate = 2 x bytes / (device time - one launch per call): the defaults may not drift from it."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from libra_megatron.plan.exchange import build_exchange_plan
from libra_megatron.plan.exchange.schedule import rank_layer_ops
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.model import (DEFAULT_ADD_GBPS, DEFAULT_COPY_LAUNCH_US, DEFAULT_ELEMENTWISE_GBPS,
                                       DEFAULT_GATHER_GBPS, DEFAULT_PLACE_GBPS, DEFAULT_WIDEN_GBPS, Copy)
from libra_megatron.plan.tiles import build_tiles

PROFILE = Path(__file__).resolve().parents[2] / "docs" / "gpu" / "h200-2026-12-04" / "overhead_profile_after.txt"
SEGS = (4096, 8192, 4096, 16384)  # benchmarks/gpu/device_check.py GPU["overhead_segs"], block 4096
# the kernel names torch 2.11+cu130 gives each copy kind (every listed part of a name must match); the int64
# ``direct_copy`` in the profile is index_put_'s own index conversion (one per index_put_), not a runtime call
KERNELS = {"gather": [("vectorized_gather_kernel",)], "place": [("index_put_kernel_impl",)],
           "add": [("indexFuncLargeIndex<float",)],
           "widen": [("direct_copy_kernel_cuda", "{lambda(float)#1}")],  # bf16 -> fp32, unvectorised
           "elementwise": [("CatArrayBatchedCopy",), ("FillFunctor<float>",), ("bfloat16_copy_kernel_cuda",)]}
SHIPPED = {"gather": DEFAULT_GATHER_GBPS, "place": DEFAULT_PLACE_GBPS, "add": DEFAULT_ADD_GBPS,
           "widen": DEFAULT_WIDEN_GBPS, "elementwise": DEFAULT_ELEMENTWISE_GBPS}


def _profile_us(case: str) -> dict:
    """{kind: (device us, calls)} of one ``== case`` table of the profile."""
    text = PROFILE.read_text(encoding="utf-8").split(f"== {case}\n", 1)[1].split("\n== ", 1)[0]
    out = {k: [0.0, 0] for k in KERNELS}
    for line in text.splitlines():
        hit = re.match(r"\s*([\d.]+) us\s+x(\d+)\s+(.*)", line)
        for kind, names in KERNELS.items():
            if hit and any(all(part in hit.group(3) for part in name) for name in names):
                out[kind][0] += float(hit.group(1))
                out[kind][1] += int(hit.group(2))
    return out


def _op_bytes(H: int, M: int) -> dict:
    """{kind: (bytes, calls with bytes)} of the P=1 plan's forward + backward op lists, as the profiled runtime
    issued them: it cast the fp32 dK|dV sums back in one call, the runtime now casts K and V apart (ecaca51: the
    same bytes, one more call; contiguous dk, dv), so the last two casts count as the one profiled call; and it
    placed the O and dQ returns (``_as_profiled``)."""
    heads = HeadLayout(32, 4, 128, H, M, elem_bytes=2)
    tiles = build_tiles([list(SEGS)], TokenLayout("contiguous", sum(SEGS), 1), heads, 4096)
    fwd, bwd = rank_layer_ops(build_exchange_plan(tiles, tiles.tile_home()).for_rank(0), "arranged", "pool")
    final = [op for op in bwd[-2:] if isinstance(op, Copy) and op.op == "elementwise" and op.chunk == -1]
    assert len(final) == 2 and final[0] == final[1], bwd[-2:]  # the two half casts of the sums, last in the list
    out = {k: [0, 0] for k in KERNELS}
    for op in _as_profiled(fwd) + _as_profiled(bwd):
        if isinstance(op, Copy) and op.nbytes:
            out[op.op][0] += op.nbytes
            out[op.op][1] += 1
    out["elementwise"][1] -= 1
    return out


def _dkv_rows_block(ops, i: int):
    """Bytes of the first gather when ``ops[i:i + 4]`` gather and widen one row set of packed dK, then of dV
    (``runtime.libra_attn._widened`` with rows), else None."""
    four = ops[i:i + 4]
    if len(four) == 4 and all(isinstance(o, Copy) and o.tag == "dkv" for o in four) and \
            [o.op for o in four] == ["gather", "widen", "gather", "widen"]:
        return four[0].nbytes
    return None


def _as_widened_first(ops) -> list:
    """The runtime now gathers a kv piece's first packed rows (and the others) at the kernel's dtype and widens
    only those; before, it widened every packed row into fp32 and gathered the sums' rows there: each such block
    -> the two widening casts of every packed row (3/2 of the bf16 bytes each), a gather of the first rows in
    fp32 (4x their bf16 half), and of the others with their add (``_as_profiled_sums`` takes it from there)."""
    out, i = [], 0
    while i < len(ops):
        first = _dkv_rows_block(ops, i)
        if first is None:
            out.append(ops[i])
            i += 1
            continue
        chunk, i = ops[i].chunk, i + 4
        repeat = _dkv_rows_block(ops, i)
        others = [] if repeat is None else [Copy("gather", 4 * repeat, "dkv", chunk), ops[i + 4]]
        i += 0 if repeat is None else 5
        rows = first + (repeat or 0)
        out += [Copy("widen", 3 * rows // 2, "dkv", chunk)] * 2 + [Copy("gather", 4 * first, "dkv", chunk)] + others
    return out


def _as_gathered_first(ops) -> list:
    """The runtime now casts the fp32 dK|dV sums to the bf16 wire before gathering them when every row goes home;
    the profiled runtime gathered the fp32 rows first: each cast + gather pair -> the gather of the fp32 rows (twice
    the bytes), then the same cast."""
    out, i = [], 0
    while i < len(ops):
        op, nxt = ops[i], ops[i + 1] if i + 1 < len(ops) else None
        if isinstance(op, Copy) and isinstance(nxt, Copy) and (op.op, op.tag, nxt.op, nxt.tag) == \
                ("elementwise", "dkv", "gather", "dkv") and op.chunk == nxt.chunk and 2 * op.nbytes == 3 * nxt.nbytes:
            out += [Copy("gather", 2 * nxt.nbytes, "dkv", op.chunk), op]
            i += 2
            continue
        out.append(op)
        i += 1
    return out


def _as_profiled_sums(ops) -> list:
    """After the widening cast of packed dK|dV: a gather of the first rows (and a gather + add of the others) ->
    the profiled fill of the sums and one add of every packed row."""
    out, i = [], 0
    while i < len(ops):
        op = ops[i]
        out.append(op)
        i += 1
        prev = ops[i - 1]
        first = ops[i] if i < len(ops) else None
        if not (isinstance(prev, Copy) and (prev.op, prev.tag) == ("widen", "dkv") and isinstance(first, Copy)
                and (first.op, first.tag, first.chunk) == ("gather", "dkv", prev.chunk)):
            continue
        added, i = first.nbytes, i + 1
        rest = ops[i:i + 2]
        if len(rest) == 2 and all(isinstance(o, Copy) and o.tag == "dkv" for o in rest) and \
                [o.op for o in rest] == ["gather", "add"]:
            added, i = added + rest[1].nbytes, i + 2
        out += [Copy("elementwise", first.nbytes // 2, "dkv", first.chunk), Copy("add", added, "dkv", first.chunk)]
    return out


def _as_profiled_cats(ops) -> list:
    """The profiled runtime concatenated K and V: the K|V dispatch gathered K and V rows, then ``torch.cat`` wrote
    the send buffer, and the backward cast ``torch.cat([dk, dv])`` to fp32 in one call. The runtime now gathers K and
    V straight into the send buffer's halves and widens dK and dV straight into the fp32 halves: each such pair of
    gathers gets its profiled cat (the bytes of both) back, each pair of widening copies becomes the profiled cat
    of the bf16 rows and one widening cast of them."""
    out, i, dispatched = [], 0, set()
    while i < len(ops):
        op, nxt = ops[i], ops[i + 1] if i + 1 < len(ops) else None
        pair = isinstance(op, Copy) and isinstance(nxt, Copy) and (op.op, op.tag, op.chunk, op.nbytes) == \
            (nxt.op, nxt.tag, nxt.chunk, nxt.nbytes)
        # a chunk's K|V dispatch is its first K|V op (placing and packing come after it)
        if pair and op.op == "gather" and op.tag in ("kv", "kv_bwd") and (op.tag, op.chunk) not in dispatched:
            dispatched.add((op.tag, op.chunk))
            out += [op, nxt, Copy("elementwise", 2 * op.nbytes, op.tag, op.chunk)]
            i += 2
            continue
        if pair and (op.op, op.tag) == ("widen", "dkv"):  # bf16 -> fp32: each cast moves (2 + 4) / 2 bytes per element
            out += [Copy("elementwise", 2 * op.nbytes * 2 // 3, "dkv", op.chunk), Copy("widen", 2 * op.nbytes, "dkv", op.chunk)]
            i += 2
            continue
        out.append(op)
        i += 1
    return out


def _as_profiled(ops) -> list:
    """The profiled runtime placed the O and dQ returns by one ``index_put_`` each; the runtime now gathers them
    into unit order and copies them into the chunk's strided view (the same bytes in two calls): each such
    gather + copy pair counts as the one profiled place. And it started a kv piece's dK|dV sums from zeros (a
    fill of half their bytes) and added every packed row; the runtime now gathers each row's first packed row
    and adds the others (``_as_profiled_sums``), widening only the rows it gathers (``_as_widened_first``); it
    gathered the dK|dV sums before their cast to the wire (``_as_gathered_first``); and it concatenated K and V
    (``_as_profiled_cats``)."""
    ops = _as_profiled_sums(_as_profiled_cats(_as_widened_first(_as_gathered_first(ops))))
    out, i = [], 0
    while i < len(ops):
        op, nxt = ops[i], ops[i + 1] if i + 1 < len(ops) else None
        if isinstance(op, Copy) and op.op == "gather" and op.tag in ("o", "dq") and isinstance(nxt, Copy) and \
                (nxt.op, nxt.nbytes, nxt.tag, nxt.chunk) == ("elementwise", op.nbytes, op.tag, op.chunk):
            out.append(Copy("place", op.nbytes, op.tag, op.chunk))
            i += 2
            continue
        out.append(op)
        i += 1
    return out


def test_the_copy_rates_are_the_h200_profile_of_the_runtimes_own_copies():
    if not PROFILE.exists():
        pytest.fail(f"{PROFILE} is missing: the copy rates' source is part of the repository")
    nbytes = {k: 0 for k in KERNELS}
    seconds = {k: 0.0 for k in KERNELS}
    for case, (H, M) in (("H=1 M=1", (1, 1)), ("H=2 M=2", (2, 2))):
        measured, listed = _profile_us(case), _op_bytes(H, M)
        for kind in KERNELS:
            us, calls = measured[kind]
            assert calls == listed[kind][1], (case, kind, calls, listed[kind])  # the profile ran these op lists
            nbytes[kind] += listed[kind][0]
            seconds[kind] += (us - calls * DEFAULT_COPY_LAUNCH_US) * 1e-6
    derived = {k: 2.0 * nbytes[k] / seconds[k] / 1e9 for k in KERNELS}
    for kind in KERNELS:
        assert np.isclose(SHIPPED[kind], derived[kind], rtol=0.02), (kind, SHIPPED[kind], derived[kind])
    assert derived["place"] < derived["add"] < derived["widen"] < derived["gather"] < derived["elementwise"]


def test_every_copy_kernel_of_the_profile_is_priced():
    """Every kernel of the profiled Libra runs that is not attention, not the harness's own (in the single-device
    "bare" run too, or the bf16 adds that accumulate the harness's leaf q/k/v gradients over its iterations: the
    operator's dK/dV are strided views, so their adds take the unvectorised kernel) and not index_put_'s index
    conversion is one of the priced kinds: nothing the runtime launches goes unpriced."""
    for case in ("H=1 M=1", "H=2 M=2"):
        text = PROFILE.read_text(encoding="utf-8").split(f"== {case}\n", 1)[1].split("\n== ", 1)[0]
        bare = PROFILE.read_text(encoding="utf-8").split("== bare\n", 1)[1].split("\n== ", 1)[0]
        harness = {re.match(r"\s*[\d.]+ us\s+x\d+\s+(.*)", line).group(1) for line in bare.splitlines() if line.strip()}
        for line in text.splitlines():
            hit = re.match(r"\s*([\d.]+) us\s+x(\d+)\s+(.*)", line)
            if not hit:
                continue
            name = hit.group(3)
            harness_add = "CUDAFunctor_add<c10::BFloat16>" in name
            known = name in harness or harness_add or "pytorch_flash::" in name or "{lambda(long)#1}" in name or any(
                all(part in name for part in parts) for names in KERNELS.values() for parts in names)
            assert known, (case, name[:120])
