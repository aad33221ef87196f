"""What no grouping can beat at PP > 1 (issue 26): per window, the critical path of the heaviest pool every grouping
of the window's sequences into pools of P must hold, against the simulator's lower bound and the shipped step.

Every grouping puts the window's heaviest sequence (and, by counting, its heavy neighbours) into some pool of P
sequences (``plan.model.pool_lower_bound_counting`` on Eq. 6 pair-heads); that pool's work spread perfectly over its
P x CP workers at the peak rate still crosses every pipeline stage forward and back in turn
(``plan.sequences.critical_path_seconds``), so no order of any grouping runs the step shorter. The simulator's lower
bound (``sync_straggler_vs_lower_bound``'s denominator) is the balanced schedule of equal microbatches, its own bubble
included; unequal microbatches can beat it (``tests/plan/test_critical_path.py``), so it is a yardstick, not a bound.
Where path / bound > 1 the window's own spread keeps every placement above the simulator's bound by that factor,
before any exchange, copy or imbalance; the shipped step / path is what placement and TAP could still win there.

Run:  .venv/bin/python benchmarks/bench_pp_bounds.py --trace data/traces/wikipedia-flexsp.txt --pp 4
      [--vpp 2] [--model qwen3-30b-a3b] [--windows 8] [--no-step]
      (256K, GBS 128, DP 32, CP 8, configs/libra/256k.yaml)
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from libra_megatron.plan.model import pool_lower_bound_counting  # noqa: E402
from libra_megatron.plan.sequences import critical_path_seconds  # noqa: E402
from libra_megatron.sim import runner  # noqa: E402
from libra_megatron.sim.sync import score_orders  # noqa: E402
from bench_pp_priced_lanes import simulated_windows  # noqa: E402


def heaviest_pool_path(pair_heads: np.ndarray, pool_size: int, spec, layout) -> tuple:
    """(critical path seconds of the heaviest pool any grouping holds, that pool / the mean pool)."""
    heavy = pool_lower_bound_counting(pair_heads, pool_size)
    workers = pool_size * spec.context_parallel_size
    forward = spec.cost.balanced_seconds(heavy, workers)
    path = critical_path_seconds(forward, spec.cost.balanced_layer_seconds(heavy, workers) - forward, layout)
    return path, heavy / (pair_heads.sum() / (pair_heads.size // pool_size))


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    with_step = "--no-step" not in argv
    argv = [a for a in argv if a != "--no-step"]
    args, spec, corpus, num_windows, ev, cand, layout = simulated_windows(__doc__, argv)
    totals = dict(bound=0.0, path=0.0, step=0.0)
    start = time.perf_counter()
    for w in range(num_windows):
        win = runner._window_data(corpus, w, spec)
        forward = win.forward_lower_bound_step
        bound = score_orders({}, forward, layout, {}, win.lower_bound_step - forward)["lower_bound"].seconds
        path, heavy = heaviest_pool_path(corpus.pair_heads[win.ids], cand.pool_size, spec, layout)
        line = f"window {w}: heaviest pool {heavy:.2f} x the mean, its path / lower bound {path / bound:.3f}"
        totals["bound"] += bound
        totals["path"] += max(path, bound)
        if with_step:
            orders = {"placed": runner._orders(win.flops, cand.pool_size, spec, runner.window_pool_seconds(
                corpus, win.ids, cand.pool_size, spec))["placed"]}
            step = runner.sync_timings(cand, ev, win, orders, spec)[0]["placed"].seconds
            totals["step"] += step
            line += f"; shipped step / lower bound {step / bound:.3f}, / path {step / path:.3f}"
        print(line, flush=True)
    summary = (f"PP={args.pp} VPP={args.vpp} {args.model}, {os.path.basename(args.trace)}, {num_windows} windows: "
               f"max(path, lower bound) / lower bound {totals['path'] / totals['bound']:.3f}")
    if with_step:
        summary += (f"; shipped step / lower bound {totals['step'] / totals['bound']:.3f}, / max(path, lower bound) "
                    f"{totals['step'] / totals['path']:.3f}")
    print(summary + f" ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
