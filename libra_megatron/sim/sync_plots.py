"""The per-lane and per-microbatch view of the sync model (the paper's Fig. 12 as a picture), matplotlib Agg.

lanes_and_microbatches.png, for the recommended candidate:
  left   one window (the one where the sampler order waits longest beyond ours): per lane, its GA microbatches'
         pool seconds stacked (what the lane's pipeline runs), sampler order / Alg. 1 / ours side by side; the
         step waits for the tallest stack (at PP > 1 plus the lane's bubble)
  right  every microbatch of every lane and window, its pool seconds over ours' mean of that window (like Fig. 12,
         but forward + backward and the sampler order *with* TAP; ``--fig12``, ``sim.fig12``, is the paper's
         figure: forward only, Ulysses vs ours), sampler order vs ours
"""
from __future__ import annotations

import os
from typing import Dict

import numpy as np

__all__ = ["plot_lanes_and_microbatches"]

_LABELS = {"contiguous": "sampler order", "alg1": "Alg. 1", "placed": "ours"}


def plot_lanes_and_microbatches(plt, result, report: Dict, out_dir: str) -> str:
    cand = result.recommended()
    view = cand.sync.view
    path = os.path.join(out_dir, "lanes_and_microbatches.png")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    _stacked_lanes(left, view)
    _normalised_microbatches(right, cand.sync.microbatch_over_mean)
    fig.suptitle(f"Sync model, P={cand.pool_size} H={cand.head_split} B={cand.block_size}: lanes (left) and "
                 f"microbatches (right); PP={report['assumptions']['sync']['pp']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _stacked_lanes(ax, view) -> None:
    names = ("contiguous", "alg1", "placed")
    num_lanes = view.microbatch_seconds["placed"].shape[1]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        seconds = view.microbatch_seconds[name] * 1e3  # [GA, lanes]
        bottom = np.zeros(num_lanes)
        x = np.arange(num_lanes) + (i - 1) * width
        for g, row in enumerate(seconds):
            ax.bar(x, row, width * 0.95, bottom=bottom, color=f"C{g % 10}", edgecolor="k", linewidth=0.3)
            bottom += row
        for xi, total in zip(x, bottom):
            ax.text(xi, total, _LABELS[name].split()[0], ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set(xticks=np.arange(num_lanes), xticklabels=[f"lane {j}" for j in range(num_lanes)],
           ylabel="ms per attention layer (fwd + bwd), stacked over GA microbatches",
           title=f"window {view.window}: each bar = one lane's microbatches (colour = GA step)")
    ax.margins(y=0.12)


def _normalised_microbatches(ax, values: Dict[str, list]) -> None:
    data = [np.asarray(values["contiguous"]), np.asarray(values["placed"])]
    top = max(float(d.max()) for d in data if d.size) if any(d.size for d in data) else 1.0
    bins = np.linspace(0.0, max(top, 1.0) * 1.02, 40)
    for d, name, color in zip(data, ("contiguous", "placed"), ("tab:gray", "tab:blue")):
        ax.hist(d, bins=bins, alpha=0.6, color=color,
                label=f"{_LABELS[name]}: range {d.min():.2f}-{d.max():.2f}, mean {d.mean():.2f}")
    ax.axvline(1.0, color="k", ls="--", lw=1)
    ax.set(xlabel="microbatch pool seconds / ours' mean of the window", ylabel="microbatches (all lanes, windows)",
           title="per-microbatch fwd + bwd (sampler order with TAP; --fig12: the paper's Fig. 12)")
    ax.legend(fontsize=8)
