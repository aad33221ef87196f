"""Activation memory per transformer layer of the Libra operator, from real plans on the shipped trace.

For every pool (linux-6.12 trace, Megatron packing, GBS windows placed by refined VRSP, P=8, the shipped
``configs/libra/{256k,1m}.yaml`` knobs, Qwen3-30B-A3B attention: hq=32, hkv=4, d=128, bf16) it plans the
pool exactly as the background planner does and prints, per save mode, the bytes the *worst rank* keeps
for backward in one layer (``plan.model.memory``, which the runtime tests check equal to what the operator
saves), the local q/k/v/out of one rank for scale, what ``save_mode=auto`` picks at the default budget over
the layers whose tensors are alive at once (``plan.model.memory.saved_layers``: the shipped configs' full
recompute of one layer at a time keeps one; ``--recompute-num-layers 0``: all 48), and the host index tables of that worst rank (the runtime uploads them as int32; at most
``set_table_cache_size`` plans' tables live on the device).

    .venv/bin/python benchmarks/bench_memory.py [--pools 16] [--budget-gb 16] [--recompute-num-layers 1]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from libra_megatron.config import LibraConfig, SaveModeName  # noqa: E402
from libra_megatron.plan.layout import HeadLayout, TokenLayout  # noqa: E402
from libra_megatron.plan.model import choose_save_mode, predicted_saved_bytes, saved_layers, sequence_flops  # noqa: E402
from libra_megatron.plan.packing import pack_documents  # noqa: E402
from libra_megatron.plan.pool import plan_pool  # noqa: E402
from libra_megatron.plan.exchange import build_rank_tables  # noqa: E402
from libra_megatron.plan.sequences import place_sequences  # noqa: E402
from libra_megatron.plan.traces import find_trace, load_trace  # noqa: E402

GIB = float(1 << 30)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CASES = {  # name: (L, CP, GBS, YAML)
    "256K": (1 << 18, 8, 128, "configs/libra/256k.yaml"),
    "1M": (1 << 20, 16, 32, "configs/libra/1m.yaml"),
}
HEADS = (32, 4, 128)  # Qwen3-30B-A3B: query heads, kv groups, kv-channels
NUM_LAYERS = 48


def pools(doc_lens, seq_len: int, gbs: int, pool_size: int, limit: int):
    """The first ``limit`` pools (segment lists) of consecutive GBS windows after refined VRSP."""
    segs = [np.asarray(s, dtype=np.int64) for s in pack_documents(doc_lens, seq_len, "megatron", 1234)]
    flops, out = sequence_flops(segs), []
    for w in range(0, len(segs) - gbs + 1, gbs):
        order = w + place_sequences(flops[w:w + gbs], pool_size)
        out += [[segs[i].tolist() for i in order[k * pool_size:(k + 1) * pool_size]] for k in range(gbs // pool_size)]
        if len(out) >= limit:
            break
    return out[:limit]


def measure(name: str, doc_lens, limit: int, budget_gb: float, alive: int) -> dict:
    seq_len, cp, gbs, yaml_path = CASES[name]
    config = LibraConfig.from_yaml(os.path.join(ROOT, yaml_path))
    layout = TokenLayout(config.token_layout, seq_len, cp)
    heads = HeadLayout(*HEADS, config.head_split, config.chunks_for(*HEADS[:2]), elem_bytes=2)
    rows = {"arranged": [], "refetch": [], "tables": [], "auto": []}
    for segs in pools(doc_lens, seq_len, gbs, config.pool_size, limit):
        plan = plan_pool(segs, config, layout, heads, validate=False)
        saved = predicted_saved_bytes(plan.exchange, heads, layout.local_len)
        worst = int(np.argmax(saved["arranged"]))
        rows["arranged"].append(int(saved["arranged"].max()))
        rows["refetch"].append(int(saved["refetch"].max()))
        rows["tables"].append(build_rank_tables(plan.exchange.for_rank(worst)).nbytes())
        rows["auto"].append(choose_save_mode(SaveModeName.AUTO, saved["arranged"], budget_gb, alive).value)
    local = layout.local_len * (2 * HEADS[0] + 2 * HEADS[1]) * HEADS[2] * 2
    return dict(rows=rows, local=local, pools=len(rows["auto"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pools", type=int, default=16, help="pools per case (consecutive windows)")
    ap.add_argument("--budget-gb", type=float, default=LibraConfig().activation_budget_gb)
    ap.add_argument("--recompute-num-layers", type=int, default=1,
                    help="full uniform recompute of N layers at a time (the shipped configs: 1); 0 = none")
    args = ap.parse_args()
    n = args.recompute_num_layers
    alive = saved_layers(NUM_LAYERS, "full" if n else None, "uniform", n or None)
    doc_lens = load_trace(find_trace("linux-6.12-files.qwen.txt"))
    print(f"worst-rank bytes kept for backward per layer, Qwen3-30B-A3B attention, bf16, {args.pools} pools/case")
    print(f"{'case':<6}{'mode':<10}{'max GiB':>9}{'median GiB':>12}{'x local qkvo':>14}{'48 layers GiB':>15}")
    for name in CASES:
        m = measure(name, doc_lens, args.pools, args.budget_gb, alive)
        for mode in ("arranged", "refetch"):
            vals = np.asarray(m["rows"][mode], dtype=np.float64)
            print(f"{name:<6}{mode:<10}{vals.max() / GIB:>9.2f}{np.median(vals) / GIB:>12.2f}"
                  f"{vals.max() / m['local']:>14.2f}{vals.max() * NUM_LAYERS / GIB:>15.1f}")
        picks = {v: m["rows"]["auto"].count(v) for v in ("arranged", "refetch")}
        tables = np.asarray(m["rows"]["tables"], dtype=np.float64)
        print(f"{name:<6}auto @ {args.budget_gb:g} GiB over {alive} layer(s) alive of {NUM_LAYERS}: arranged {picks['arranged']}, refetch "
              f"{picks['refetch']} of {m['pools']} pools | local q,k,v,out {m['local'] / GIB:.3f} GiB | "
              f"worst-rank index tables {tables.max() / (1 << 20):.1f} MiB (int32)")


if __name__ == "__main__":
    main()
