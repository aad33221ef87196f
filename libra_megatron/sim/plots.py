"""PNG plots of a simulator run (matplotlib, Agg backend, imported lazily by the CLI).

inter_pool_imbalance.png  R-1 vs P: contiguous (sampler order = random grouping for shuffled packing),
                          Algorithm 1, the configured placement, the counting lower bound, and the Eq. 3
                          curve with the corpus' mean per-window CV of F_i.
speedup_heatmap.png       estimated speedup over Ulysses (sum of Ulysses step stragglers / Libra's) on
                          the B x H grid, one panel per P.
worst_step_loads.png      per-worker seconds (compute + exposed comm) of the recommended candidate's
                          slowest step next to Ulysses on the same window and step.
lanes_and_microbatches.png  the sync model's per-lane and per-microbatch view (``sim.sync_plots``).
fig12_microbatch_forward.png  ``--fig12`` only (``write_fig12_plot``): the paper's Fig. 12 (``sim.fig12``).
"""

from __future__ import annotations

import os
from typing import Dict, List

import numpy as np

from ..plan.model import clt_expected_imbalance
from .fig12 import plot_fig12
from .sync_plots import plot_lanes_and_microbatches

__all__ = ["write_plots", "write_fig12_plot"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _inter_by_pool(report: Dict) -> Dict[int, Dict[str, float]]:
    """Inter-pool metrics per P (they do not depend on H, B: take the first candidate of each P)."""
    out: Dict[int, Dict[str, float]] = {}
    for cand in report["candidates"]:
        out.setdefault(cand["pool_size"], cand["inter_pool_imbalance"])
    return dict(sorted(out.items()))


def _plot_inter(plt, report: Dict, mean_cv: float, path: str) -> None:
    inter = _inter_by_pool(report)
    pools = np.array(list(inter))
    gbs = report["assumptions"]["gbs"]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    styles = (("contiguous", "random / contiguous", "o-"), ("alg1", "Alg. 1 (VRSP)", "s-"),
              ("placed", "configured placement", "^--"), ("lower_bound", "lower bound", "k:"))
    floor = 1e-5  # log axis: show exact zeros at the floor
    for key, label, style in styles:
        ax.plot(pools, [max(inter[p][key], floor) for p in pools], style, label=label)
    dense = np.geomspace(max(1, pools.min() / 2), min(gbs / 2, pools.max() * 2), 50)
    ax.plot(dense, [clt_expected_imbalance(mean_cv, p, gbs) if p < gbs else 0 for p in dense], "r-", alpha=0.5,
            label=f"Eq. 3 (CV={mean_cv:.2f}, D={gbs})")
    ax.set(xscale="log", yscale="log", xlabel="pool size P", ylabel="inter-pool R - 1 (mean over windows)",
           title="Inter-pool imbalance vs pool size")
    ax.set_xticks(pools, [str(p) for p in pools])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_SLICE = ("tau", "num_chunks", "tiling", "kv_fetch")  # a sweep of these: the heatmap shows the recommended slice


def _plot_heatmap(plt, report: Dict, path: str) -> None:
    pools = sorted({c["pool_size"] for c in report["candidates"]})
    hs = sorted({c["head_split"] for c in report["candidates"]})
    bs = sorted({c["block_size"] for c in report["candidates"]})
    width = 1.6 + len(pools) * (1.2 + 0.7 * len(hs))
    fig, axes = plt.subplots(1, len(pools), figsize=(width, 1.6 + 0.6 * len(bs) + 1.2), squeeze=False,
                             layout="constrained")
    rec = report["recommended"]  # a tau/M sweep: show the recommended (tau, M) slice of the grid
    grid = {(c["pool_size"], c["head_split"], c["block_size"]): 1.0 / c["straggler_vs_ulysses"]
            for c in report["candidates"] if all(c[k] == rec[k] for k in _SLICE)}
    vmin, vmax = min(grid.values()), max(grid.values())
    vmin = vmin - 0.05 * max(vmax - vmin, 1e-9)
    for ax, p in zip(axes[0], pools):
        data = np.array([[grid[(p, h, b)] for h in hs] for b in bs])
        im = ax.imshow(data, cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto", origin="lower")
        for (i, j), v in np.ndenumerate(data):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w" if v < (vmin + vmax) / 2 else "k", fontsize=9)
        ax.set(xticks=range(len(hs)), xticklabels=hs, yticks=range(len(bs)), yticklabels=bs,
               xlabel="head split H", title=f"P={p}")
    axes[0][0].set_ylabel("block size B")
    fig.colorbar(im, ax=list(axes[0]), label="est. speedup over Ulysses")
    swept = len({tuple(c[k] for k in _SLICE) for c in report["candidates"]}) > 1
    slice_ = (f" at tau={rec['tau']:g}, M={rec['num_chunks']}, {rec['tiling']} tiles, {rec['kv_fetch']} KV fetch"
              if swept else "")
    fig.suptitle(f"Estimated straggler speedup over Ulysses{slice_}", fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_worst(plt, report: Dict, path: str) -> None:
    rec = report["recommended"]
    worst = rec["worst_step"]
    compute = np.asarray(worst["compute_seconds"]) * 1e3
    exposed = np.asarray(worst["exposed_comm_seconds"]) * 1e3
    uly = np.asarray(worst["ulysses_seconds"]) * 1e3
    x = np.arange(compute.size)
    fig, ax = plt.subplots(figsize=(9, 4.8))
    ax.bar(x, compute, width=0.8, color="tab:blue", label="Libra compute")
    ax.bar(x, exposed, width=0.8, bottom=compute, color="tab:orange", label="Libra exposed comm")
    ax.step(x, uly, where="mid", color="k", lw=1, label=f"Ulysses, same GA step in sampler order (max {uly.max():.1f} ms)")
    ax.axhline((compute + exposed).max(), color="tab:red", lw=1, label=f"Libra max {(compute + exposed).max():.1f} ms")
    ax.set(xlabel="worker (DP rank x CP rank)", ylabel="ms per attention layer (fwd + bwd)",
           title=f"Slowest step of P={rec['pool_size']} H={rec['head_split']} B={rec['block_size']} "
                 f"(window {worst['window']}, step {worst['step']})")
    ax.set_xlim(-0.5, compute.size - 0.5)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(result, report: Dict, out_dir: str) -> List[str]:
    """Write the four PNGs into ``out_dir`` (created if needed); returns their paths."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("inter_pool_imbalance.png", "speedup_heatmap.png", "worst_step_loads.png")]
    _plot_inter(plt, report, float(np.mean(result.window_cv)), paths[0])
    _plot_heatmap(plt, report, paths[1])
    _plot_worst(plt, report, paths[2])
    return paths + [plot_lanes_and_microbatches(plt, result, report, out_dir)]


def write_fig12_plot(report: Dict, out_dir: str) -> str:
    """``--fig12``: write its PNG into ``out_dir`` (created if needed); returns the path."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    return plot_fig12(plt, report, out_dir)
