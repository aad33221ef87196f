"""Design study for issue 24: would a local-first backward pay, priced by the whole-layer model before it is built?

The shipped backward (``runtime.libra_attn._bwd``, op for op ``plan.exchange.schedule._backward``) runs every
varlen entry of chunk m in one kernel call once chunk m's dO has arrived. The forward instead computes its
*local* entries (``plan.exchange.local_entries``: every Q and key row self-sourced) while the dispatch travels.
The candidate priced here does the same in backward, for chunk 0 (later chunks' dO was issued one kernel earlier
and has arrived): place dO's self segment, run the backward of the local entries and of the split entries'
self-sourced key tails (with the saved O and lse, FlashAttention's backward of a key subset is exact), wait dO,
place the rest, run the remote entries and the split entries' heads (no mask) and add the split entries' two
dQ parts in fp32. Each part pays what the runtime would launch for it: gathers of its Q, O, dO rows and lse,
its packed K|V, its kernel, dQ rows placed, and its packed dK, dV rows copied into the chunk's (whose sums are
then the shipped ``schedule._dkv_sums``).

Side by side on the same pool plans (shipped knobs, save mode ARRANGED, peers coupled, ``plan_layer_timing``):
    shipped      the backward as the runtime runs it
    all          every rank with local entries runs the candidate
    best         per rank, the candidate kept only where it shortens the pool's layer (greedy over ranks)
The figure is the pool's layer (slowest forward + slowest backward), summed over the pools.

Run:  .venv/bin/python benchmarks/bench_backward_local_first.py [--trace wikipedia|linux] [--seq-len 256K|1M]
      [--pools 4] [--model qwen3-30b-a3b|qwen3-8b]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_balance import pack  # noqa: E402
from bench_planner import pools_of  # noqa: E402
from libra_megatron.config import LibraConfig, TokenLayoutKind  # noqa: E402
from libra_megatron.plan.exchange import schedule  # noqa: E402
from libra_megatron.plan.exchange.traffic import plan_layer_timing  # noqa: E402
from libra_megatron.plan.layout import HeadLayout, TokenLayout  # noqa: E402
from libra_megatron.plan.model import StepTimeModel  # noqa: E402
from libra_megatron.plan.pool import plan_pool  # noqa: E402
from libra_megatron.plan.traces import find_trace, load_trace  # noqa: E402

TRACES = {"wikipedia": "wikipedia-flexsp.txt", "linux": "linux-6.12-files.qwen.txt"}
MODELS = {"qwen3-30b-a3b": (32, 4), "qwen3-8b": (32, 8)}  # (query heads, kv heads), head dim 128
SEQ = {"256K": (262144, 8, "configs/libra/256k.yaml"), "1M": (1048576, 16, "configs/libra/1m.yaml")}


def _part_backward(rk, lens, m: int, tag: str, causal: bool = True) -> int:
    """One entry set's backward call with what it gathers; returns its query rows (its packed dK, dV rows join the
    chunk's, summed by the shipped ``schedule._dkv_sums``)."""
    sz, n, nk = rk.sz, sum(lens.q_lens), sum(lens.k_lens)
    for _ in "QOD":  # its Q, O and dO rows
        rk.copy("gather", n, sz.q, tag, m)
    rk.copy("gather", n, sz.qp * sz.lse, tag, m)
    rk.packed_kv(nk, tag, m)
    rk.kernel("bwd", lens.q_lens, lens.k_lens, tag, m, causal)
    for _ in "KV":  # its packed dK and dV rows copied into the chunk's packed buffers
        rk.copy("elementwise", nk, sz.k, "dkv", m)
    return n


def _local_first_kernel(shipped, ranks: set):
    """``schedule._bwd_kernel`` with chunk 0 local-first on ``ranks`` (module docstring)."""
    def kernel(rk, pending, m):
        t, sz = rk.t, rk.sz
        if m != 0 or rk.rank not in ranks or t.local is None or "q" in pending:
            return shipped(rk, pending, m)
        rk.self_placed(pending["do"], sz.q, "do", m)
        rk.copy("place", _part_backward(rk, t.local, m, "local"), sz.q, "local", m)
        rk.rest_placed(pending["do"], sz.q, "do", m)
        if len(t.remote.q_lens):
            rk.copy("place", _part_backward(rk, t.remote, m, "remote"), sz.q, "remote", m)
        if t.heads is not None:  # the split entries' second dQ part, added in fp32
            n = _part_backward(rk, t.heads, m, "heads", causal=False)
            rk.cast(n, sz.q, sz.q_acc, "merge", m)
            rk.cast(n, sz.q, sz.q_acc, "merge", m)
            rk.cast(n, sz.q_acc, sz.q, "merge", m)
            rk.copy("place", n, sz.q, "merge", m)
    return kernel


@contextlib.contextmanager
def local_first(ranks: set):
    shipped = schedule._bwd_kernel
    schedule._bwd_kernel = _local_first_kernel(shipped, ranks)
    try:
        yield
    finally:
        schedule._bwd_kernel = shipped


def layer_ms(plan, model, ranks=frozenset()) -> float:
    with local_first(set(ranks)):
        timing = plan_layer_timing(plan, model)
    return float(timing.forward.seconds.max() + timing.backward.seconds.max()) * 1e3


def study_pool(plan, model):
    """(shipped, all, best) layer ms of one pool plan and how many ranks the best keeps local-first."""
    shipped = layer_ms(plan, model)
    candidates = [r for r in range(plan.num_workers) if schedule.rank_sizes(plan.for_rank(r)).local is not None]
    every = layer_ms(plan, model, candidates)
    best, kept = (every, set(candidates)) if every < shipped else (shipped, set())
    for r in candidates:
        trial = kept ^ {r}
        ms = layer_ms(plan, model, trial)
        if ms < best - 1e-9:
            best, kept = ms, trial
    return shipped, every, best, len(candidates), len(kept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", choices=sorted(TRACES), default="wikipedia")
    ap.add_argument("--seq-len", choices=sorted(SEQ), default="256K")
    ap.add_argument("--pools", type=int, default=4)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    args = ap.parse_args()
    seq_len, cp, yaml = SEQ[args.seq_len]
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    cfg = LibraConfig.from_yaml(os.path.join(root, yaml))
    hq, hkv = MODELS[args.model]
    heads = HeadLayout(hq, hkv, 128, head_split=cfg.head_split, num_chunks=cfg.chunks_for(hq, hkv), elem_bytes=2)
    layout = TokenLayout(TokenLayoutKind.ZIGZAG, seq_len, cp)
    model = StepTimeModel(128)
    segs = pack(load_trace(find_trace(TRACES[args.trace])), seq_len)
    totals = np.zeros(3)
    print(f"{args.trace} {args.seq_len} {args.model}, P={cfg.pool_size} CP={cp} H={cfg.head_split} "
          f"M={cfg.chunks_for(hq, hkv)} B={cfg.block_size}: pool layer ms (slowest forward + slowest backward)")
    for i, pool in enumerate(pools_of(segs, args.pools)):
        plan = plan_pool(pool, cfg, layout, heads, validate=False).exchange
        shipped, every, best, cands, kept = study_pool(plan, model)
        totals += (shipped, every, best)
        print(f"  pool {i}: shipped {shipped:.2f}  all local-first {every:.2f}  best {best:.2f}  "
              f"(ranks with local entries {cands}, kept {kept})", flush=True)
    print(f"sum: shipped {totals[0]:.2f} ms; local-first all / shipped {totals[1] / totals[0]:.4f}, "
          f"best per rank / shipped {totals[2] / totals[0]:.4f}")


if __name__ == "__main__":
    main()
