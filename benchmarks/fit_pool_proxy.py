"""Fit the weights of ``plan.sequences.pool_proxy`` (issue 26) against the plans the planner makes, and report
how well the shipped weights predict them.

The pools are those the PP > 1 placement chooses between (``plan.sequences.lanes``): every pool of the sampler
order, Algorithm 1's order, the shipped sync order at PP=2, and both groupings of every lane (like with like,
Algorithm 1 over the lane), on windows 8-13 of each trace -- held out from the simulator's 8-window tables
(windows 0-7). Each pool is planned and priced by the simulator's evaluator (``sim.pools``: the dense placement
at the shipped knobs, the whole layer, peers coupled); the slowest worker's forward and backward seconds are the
targets. Configurations: wikipedia and linux-files at 256K (DP32 CP8 GBS128, configs/libra/256k.yaml) with
Qwen3-30B-A3B and Qwen3-8B heads, and linux-files at 1M (DP16 CP16 GBS32, configs/libra/1m.yaml) with
Qwen3-30B-A3B heads. The weights minimise the relative squared error over all of them (non-negative least
squares on features / target); the shipped ones are the output of this command, rounded to 4 significant digits.

Run:  .venv/bin/python benchmarks/fit_pool_proxy.py [--first-window 8] [--windows 6] [--jobs 2]
Prints the fitted weights, then per configuration the median / 90th-percentile relative error and the share of
pool pairs of a window (differing by > 5%) that the proxy orders right, for the fitted and the shipped weights.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from libra_megatron.plan.model import nnls  # noqa: E402
from libra_megatron.plan.sequences.pool_proxy import BACKWARD_WEIGHTS, FORWARD_WEIGHTS  # noqa: E402

CONFIGS = (  # (name, trace, model, geometry)
    ("wikipedia 256K 30B", "wikipedia-flexsp.txt", "qwen3-30b-a3b", "256K"),
    ("linux 256K 30B", "linux-6.12-files.qwen.txt", "qwen3-30b-a3b", "256K"),
    ("wikipedia 256K 8B", "wikipedia-flexsp.txt", "qwen3-8b", "256K"),
    ("linux 256K 8B", "linux-6.12-files.qwen.txt", "qwen3-8b", "256K"),
    ("linux 1M 30B", "linux-6.12-files.qwen.txt", "qwen3-30b-a3b", "1M"),
)
GEOMETRY = {
    "256K": ["--libra-config", "configs/libra/256k.yaml", "--seq-len", "262144", "--gbs", "128", "--dp", "32", "--cp", "8"],
    "1M": ["--libra-config", "configs/libra/1m.yaml", "--seq-len", "1048576", "--gbs", "32", "--dp", "16", "--cp", "16"],
}


def priced_pools(config, first_window: int, windows: int):
    """(features [n, 5], forward [n], backward [n], window [n]) of every distinct candidate pool of the windows."""
    from libra_megatron.plan.sequences.lanes import lane_members, like_with_like
    from libra_megatron.plan.sequences.vrsp import place_alg1
    from libra_megatron.sim import runner
    from libra_megatron.sim.__main__ import _load_traces, parse_args, spec_from_args
    name, trace, model, geometry = config
    os.chdir(ROOT)
    args = parse_args(["--trace", os.path.join("data/traces", trace), *GEOMETRY[geometry], "--model", model,
                       "--max-windows", str(first_window + windows), "--no-distca", "--no-progress", "--pp", "2"])
    spec = spec_from_args(args)
    corpus, num_windows, ev = runner.prepare_corpus(_load_traces(args.trace, spec), spec, 1)
    cand = runner._make_candidates(spec)[0]
    layout = spec.sync_layout(cand.pool_size)
    proxy = spec.pool_proxy(cand.pool_size)
    P = cand.pool_size
    rows = []
    for w in range(first_window, min(num_windows, first_window + windows)):
        win = runner._window_data(corpus, w, spec)
        pools = set()
        for order in runner._orders(win.flops, P, spec).values():
            pools.update(tuple(sorted(p)) for p in np.asarray(order).reshape(-1, P).tolist())
        for lane in lane_members(win.flops, layout):
            for grouping in (like_with_like(win.flops, lane, P), lane[place_alg1(win.flops[lane], P)].reshape(-1, P)):
                pools.update(tuple(sorted(p)) for p in grouping.tolist())
        pools = np.array(sorted(pools), dtype=np.int64)
        stats = runner.sequence_stats(corpus, win.ids)
        feats = proxy.features(stats, pools)
        for p, x in zip(pools, feats):
            r = ev.evaluate(win.ids[p], cand.knobs, spec.tile_placement, 0)
            rows.append((x, float(r.fwd_seconds.max()), float(r.bwd_seconds.max()), w))
        ev.clear()
    x, f, b, w = zip(*rows)
    return name, np.array(x), np.array(f), np.array(b), np.array(w)


def fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Weights >= 0 minimising sum ((x @ w - y) / y)^2 (non-negative: every term adds time, and no pool can be
    priced below zero)."""
    return nnls(x / y[:, None], np.ones_like(y))


def quality(pred: np.ndarray, y: np.ndarray, window: np.ndarray):
    """(median relative error, 90th percentile, share of same-window pairs differing by > 5% ordered right)."""
    err = np.abs(pred - y) / y
    right, pairs = 0, 0
    for w in np.unique(window):
        m = window == w
        i, j = np.triu_indices(int(m.sum()), 1)
        p, t = pred[m], y[m]
        far = np.abs(t[i] - t[j]) > 0.05 * np.maximum(t[i], t[j])
        right += int((np.sign(p[i] - p[j]) == np.sign(t[i] - t[j]))[far].sum())
        pairs += int(far.sum())
    return float(np.median(err)), float(np.quantile(err, 0.9)), right / max(pairs, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first-window", type=int, default=8)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    start = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        data = list(pool.map(priced_pools, CONFIGS, [args.first_window] * len(CONFIGS), [args.windows] * len(CONFIGS)))
    x = np.vstack([d[1] for d in data])
    weights = {"forward": fit(x, np.concatenate([d[2] for d in data])),
               "backward": fit(x, np.concatenate([d[3] for d in data]))}
    shipped = {"forward": np.asarray(FORWARD_WEIGHTS), "backward": np.asarray(BACKWARD_WEIGHTS)}
    for phase, w in weights.items():
        print(f"{phase.upper()}_WEIGHTS = ({', '.join(f'{v:.4g}' for v in w)})")
    print(f"{len(x)} pools, windows {args.first_window}-{args.first_window + args.windows - 1}, "
          f"{time.perf_counter() - start:.0f} s; relative error median / p90, pairs ordered right:")
    for name, feats, fwd, bwd, window in data:
        line = []
        for phase, y in (("forward", fwd), ("backward", bwd)):
            for label, w in (("fitted", weights[phase]), ("shipped", shipped[phase])):
                med, p90, right = quality(feats @ w, y, window)
                line.append(f"{phase} {label} {med:.3f} / {p90:.3f}, {right:.3f}")
        print(f"  {name} ({len(fwd)} pools): " + "; ".join(line))


if __name__ == "__main__":
    main()
