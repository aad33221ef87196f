"""What the priced-pool proxy leaves at PP > 1 (issue 26): the shipped placement, which prices candidate pools by
``plan.sequences.pool_proxy``, against the same placement fed the plans' own priced seconds. Side by side, on the
same windows, the same tiles and the same model (the simulator's ``sync_straggler_vs_lower_bound``: step / its
balanced lower bound, whole layer):

    sampler        the sampler order (Ulysses' grouping, with TAP)
    alg1           the paper's Algorithm 1 order
    shipped        ``--sequence-placement sync`` as the plugin runs it at PP > 1: the priced lanes, Algorithm 1's
                   and the sampler's, the fastest under the pool proxy, its lanes' pipelines then evened by
                   whole-pool swaps (``plan.sequences.priced_lanes.place_for_pipelines``)
    F proxy        the sync placement without pool prices (Algorithm 1's pools dealt to lanes by F, microbatch
                   order by the F proxy): what shipped before the proxy
    exact          the shipped placement with every candidate pool planned and priced (``sim.pools``: the planner's
                   plan, peers coupled, forward and backward), the same three candidates and lane balancing: what
                   the proxy approximates; not runnable by the sampler, which orders a window before its pools
                   are planned

Run:  .venv/bin/python benchmarks/bench_pp_priced_lanes.py --trace data/traces/wikipedia-flexsp.txt --pp 2
      [--model qwen3-30b-a3b] [--windows 8] [--vpp 1]      (256K, GBS 128, DP 32, CP 8, configs/libra/256k.yaml)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from libra_megatron.config import SequencePlacement  # noqa: E402
from libra_megatron.plan.sequences import place_sequences  # noqa: E402
from libra_megatron.plan.sequences.priced_lanes import place_for_pipelines  # noqa: E402
from libra_megatron.sim import runner  # noqa: E402
from libra_megatron.sim.__main__ import _load_traces, parse_args, spec_from_args  # noqa: E402

ORDERS = ("contiguous", "alg1", "placed", "f_proxy", "exact")
LABELS = {"contiguous": "sampler", "alg1": "alg1", "placed": "shipped", "f_proxy": "F proxy", "exact": "exact"}


def exact_order(win, spec, ev, cand, layout):
    """The shipped placement (``place_for_pipelines``) with every candidate pool planned and priced by the
    simulator's evaluator (the pool's slowest worker per phase; a pool's P x CP GPUs fill whole nodes at these
    layouts, so it starts at GPU 0)."""
    def pool_seconds(pools):
        results = [ev.evaluate(win.ids[p], cand.knobs, spec.tile_placement, 0) for p in pools]
        return np.array([r.fwd_seconds.max() for r in results]), np.array([r.bwd_seconds.max() for r in results])

    return place_for_pipelines(win.flops, layout, pool_seconds)[0]


def simulated_windows(description: str, argv=None):
    """The command line both PP benchmarks share (--trace, --pp, --vpp, --model, --windows; 256K, GBS 128, DP 32,
    CP 8, configs/libra/256k.yaml), parsed and prepared: (args, spec, corpus, windows, evaluator, candidate, layout)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--windows", type=int, default=8)
    args = parser.parse_args(argv)
    sim_argv = ["--trace", args.trace, "--libra-config", "configs/libra/256k.yaml", "--seq-len", "262144",
                "--gbs", "128", "--dp", "32", "--cp", "8", "--model", args.model, "--max-windows", str(args.windows),
                "--no-distca", "--no-progress", "--pp", str(args.pp), "--vpp", str(args.vpp)]
    print("simulator spec:", " ".join(sim_argv))
    sim_args = parse_args(sim_argv)
    spec = spec_from_args(sim_args)
    corpus, num_windows, ev = runner.prepare_corpus(_load_traces(sim_args.trace, spec), spec, 1)
    cand = runner._make_candidates(spec)[0]
    return args, spec, corpus, min(num_windows, args.windows), ev, cand, spec.sync_layout(cand.pool_size)


def main(argv=None) -> None:
    args, spec, corpus, num_windows, ev, cand, layout = simulated_windows(__doc__, argv)
    totals = dict.fromkeys(ORDERS + ("lower_bound",), 0.0)
    start = time.perf_counter()
    for w in range(num_windows):
        win = runner._window_data(corpus, w, spec)
        orders = runner._orders(win.flops, cand.pool_size, spec,
                                runner.window_pool_seconds(corpus, win.ids, cand.pool_size, spec))
        orders["f_proxy"] = place_sequences(win.flops, cand.pool_size, SequencePlacement.SYNC, layout)
        orders["exact"] = exact_order(win, spec, ev, cand, layout)
        assert np.array_equal(np.sort(orders["exact"]), np.arange(win.flops.size)), "not a permutation"
        timings, _ = runner.sync_timings(cand, ev, win, orders, spec)
        for name in totals:
            totals[name] += timings[name].seconds
        ratios = "  ".join(f"{LABELS[n]} {timings[n].seconds / timings['lower_bound'].seconds:.3f}" for n in ORDERS)
        print(f"window {w}: {ratios}", flush=True)
    lb = totals["lower_bound"]
    print(f"PP={args.pp} VPP={args.vpp} {args.model}, {os.path.basename(args.trace)}, step / lower bound over "
          f"{num_windows} windows: "
          + ", ".join(f"{LABELS[n]} {totals[n] / lb:.3f}" for n in ORDERS)
          + f"; shipped vs F proxy {totals['placed'] / totals['f_proxy']:.3f}, exact vs shipped "
          f"{totals['exact'] / totals['placed']:.3f}"
          + f" ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
