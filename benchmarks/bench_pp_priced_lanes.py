"""Design study for issue 26 (PP > 1): lanes first, then each lane's pools and microbatch order chosen by the
time model's priced pool seconds instead of F. Side by side, on the same windows, the same tiles and the same
model (the simulator's ``sync_straggler_vs_lower_bound``: step / its balanced lower bound, whole layer):

    sampler        the sampler order (Ulysses' grouping, with TAP)
    alg1           the paper's Algorithm 1 order
    shipped        ``--sequence-placement sync`` as the plugin runs it at PP > 1 (Algorithm 1's pools dealt to
                   lanes by F, microbatch order by the F proxy)
    priced lanes   lanes of GA*P sequences as at PP=1 (Algorithm 1 + swaps on F); inside every lane two pool
                   groupings -- like with like (sorted by F, groups of P) and Algorithm 1 over the lane's
                   sequences --, each pool planned and priced (``sim.pools``: the planner's plan, peers coupled,
                   forward and backward), each grouping's microbatch order the best of (as cut, lightest first,
                   heaviest first, lightest at both ends) under the lane's simulated pipeline with those priced
                   seconds; the lane keeps the grouping whose pipeline is shorter. Lanes are independent, so a
                   lane decides from its own pools only.

"priced lanes" is NOT what the plugin runs: the sampler emits a window's order before its pools are planned,
and this needs the plans of 2 x GA pools per lane first (the planner's look-ahead, one window ahead). It
measures what that integration would gain under the model before it is built.

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

from libra_megatron.plan.sequences.priced_lanes import assemble_order, choose_lane, lane_groupings  # noqa: E402
from libra_megatron.sim import runner  # noqa: E402
from libra_megatron.sim.__main__ import _load_traces, parse_args, spec_from_args  # noqa: E402

ORDERS = ("contiguous", "alg1", "placed", "priced_lanes")
LABELS = {"contiguous": "sampler", "alg1": "alg1", "placed": "shipped", "priced_lanes": "priced lanes"}


def priced_lanes_order(win, spec, ev, cand, layout):
    """The "priced lanes" order of one window (module docstring) and how many lanes kept like with like: every
    candidate pool planned and priced by the simulator's evaluator (the pool's slowest worker per phase, on the
    lane's GPUs), ``plan.sequences.priced_lanes.choose_lane`` per lane."""
    pool, cp = cand.pool_size, spec.context_parallel_size
    chosen, like_lanes = [], 0
    for lane, groupings in enumerate(lane_groupings(win.flops, layout)):
        priced = {}
        for name, pools in groupings.items():
            results = [ev.evaluate(win.ids[p], cand.knobs, spec.tile_placement, lane * pool * cp) for p in pools]
            priced[name] = (np.array([r.fwd_seconds.max() for r in results]),
                            np.array([r.bwd_seconds.max() for r in results]))
        name, order, _ = choose_lane(priced, layout)
        chosen.append(groupings[name][order])
        like_lanes += name == "like"
    return assemble_order(chosen, layout), like_lanes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    layout = spec.sync_layout(cand.pool_size)
    totals = dict.fromkeys(ORDERS + ("lower_bound",), 0.0)
    start = time.perf_counter()
    for w in range(min(num_windows, args.windows)):
        win = runner._window_data(corpus, w, spec)
        orders = runner._orders(win.flops, cand.pool_size, spec)
        orders["priced_lanes"], like_lanes = priced_lanes_order(win, spec, ev, cand, layout)
        assert np.array_equal(np.sort(orders["priced_lanes"]), np.arange(win.flops.size)), "not a permutation"
        timings, _ = runner.sync_timings(cand, ev, win, orders, spec)
        for name in totals:
            totals[name] += timings[name].seconds
        ratios = "  ".join(f"{LABELS[n]} {timings[n].seconds / timings['lower_bound'].seconds:.3f}" for n in ORDERS)
        print(f"window {w}: {ratios}  (like with like kept in {like_lanes}/{layout.num_lanes} lanes)", flush=True)
    lb = totals["lower_bound"]
    print(f"PP={args.pp} VPP={args.vpp} {args.model}, {os.path.basename(args.trace)}, step / lower bound over "
          f"{min(num_windows, args.windows)} windows: "
          + ", ".join(f"{LABELS[n]} {totals[n] / lb:.3f}" for n in ORDERS)
          + f"; priced lanes vs shipped {totals['priced_lanes'] / totals['placed']:.3f}"
          + f" ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
