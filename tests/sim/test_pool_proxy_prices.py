"""The priced-pool proxy (plan.sequences.pool_proxy) against freshly planned and priced pools of the shipped traces:
the pools the PP > 1 placement chooses between (both groupings of every lane), each planned by the simulator's
evaluator (the dense placement at the shipped knobs, the whole layer, peers coupled)."""
import pathlib

import numpy as np
import pytest

from libra_megatron.plan.sequences.lanes import lane_members, like_with_like
from libra_megatron.plan.sequences.vrsp import place_alg1
from libra_megatron.sim import runner as R
from libra_megatron.sim.__main__ import _load_traces, parse_args, spec_from_args

REPO = pathlib.Path(__file__).resolve().parents[2]


def _priced(trace: str, geometry: list, window: int, weights=None):
    """(proxy (forward, backward), priced (forward, backward)) seconds of the window's candidate pools."""
    args = parse_args(["--trace", str(REPO / "data" / "traces" / trace), "--libra-config",
                       str(REPO / "configs" / "libra" / "256k.yaml"), *geometry, "--model", "qwen3-30b-a3b",
                       "--max-windows", str(window + 1), "--no-distca", "--no-progress", "--pp", "2"])
    spec = spec_from_args(args)
    corpus, num_windows, ev = R.prepare_corpus(_load_traces(args.trace, spec), spec, 1)
    assert num_windows > window
    cand = R._make_candidates(spec)[0]
    layout, P = spec.sync_layout(cand.pool_size), cand.pool_size
    win = R._window_data(corpus, window, spec)
    pools = set()
    for lane in lane_members(win.flops, layout):
        for grouping in (like_with_like(win.flops, lane, P), lane[place_alg1(win.flops[lane], P)].reshape(-1, P)):
            pools.update(tuple(sorted(p)) for p in grouping.tolist())
    pools = np.array(sorted(pools), dtype=np.int64)
    proxy = spec.pool_proxy(P)
    stats = R.sequence_stats(corpus, win.ids)
    if weights is None:
        predicted = proxy.seconds(stats, pools)
    else:
        x = proxy.features(stats, pools)
        predicted = (x @ np.asarray(weights), x @ np.asarray(weights))
    results = [ev.evaluate(win.ids[p], cand.knobs, spec.tile_placement, 0) for p in pools]
    return predicted, (np.array([r.fwd_seconds.max() for r in results]), np.array([r.bwd_seconds.max() for r in results]))


def _ordered_right(pred, true, margin=0.10):
    """Share of the pool pairs more than ``margin`` apart that ``pred`` orders as ``true`` does, and their count."""
    i, j = np.triu_indices(true.size, 1)
    far = np.abs(true[i] - true[j]) > margin * np.maximum(true[i], true[j])
    return float(np.mean(np.sign(pred[i] - pred[j])[far] == np.sign(true[i] - true[j])[far])), int(far.sum())


def _scaled_error(pred, true):
    """Median relative error after one common scale (what ordering and pipelining decisions read)."""
    ratio = pred / true
    return float(np.median(np.abs(ratio / np.median(ratio) - 1.0)))


SHIPPED_256K = ["--seq-len", "262144", "--gbs", "128", "--dp", "32", "--cp", "8"]


def test_proxy_prices_a_held_out_window_like_its_plans():
    """Wikipedia 256K, window 20: not in the fit (windows 8-13) nor in the simulator's tables (0-7). Per phase the
    proxy is within 8% (median) of the priced plan and orders the pools like their plans; the compute term alone
    at the model's rate (weights 1, 0, 0, 0, 0) is far off: the copies and the exchange are most of a wikipedia pool."""
    (fwd, bwd), (true_fwd, true_bwd) = _priced("wikipedia-flexsp.txt", SHIPPED_256K, 20)
    for pred, true in ((fwd, true_fwd), (bwd, true_bwd)):
        assert np.median(np.abs(pred / true - 1.0)) <= 0.08
        right, pairs = _ordered_right(pred, true)
        assert pairs >= 100 and right >= 0.95, (right, pairs)
    (alone, _), _ = _priced("wikipedia-flexsp.txt", SHIPPED_256K, 20, weights=(1.0, 0.0, 0.0, 0.0, 0.0))
    assert np.median(np.abs(alone / true_fwd - 1.0)) > 0.3


@pytest.mark.parametrize("trace", ["wikipedia-flexsp.txt", "linux-6.12-files.qwen.txt"])
def test_proxy_orders_pools_of_an_unseen_layout(trace):
    """128K tokens, CP=4, DP16 GBS64 P=8, a layout the weights never saw: the proxy keeps the pools' order and
    their relative sizes (within 15% after one common scale), which is what the placement's choices read; its
    absolute scale is not claimed there (the forward is priced ~0.5-0.7x: docs/plan-algos.md)."""
    geometry = ["--seq-len", "131072", "--gbs", "64", "--dp", "16", "--cp", "4"]
    (fwd, bwd), (true_fwd, true_bwd) = _priced(trace, geometry, 0)
    for pred, true in ((fwd, true_fwd), (bwd, true_bwd)):
        right, pairs = _ordered_right(pred, true)
        assert pairs >= 90 and right >= 0.9, (right, pairs)
        assert _scaled_error(pred, true) <= 0.15

