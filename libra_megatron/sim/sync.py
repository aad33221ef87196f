"""The simulator's step scores under the synchronisation model (``plan.sequences.sync``), next to the per-instance ones.

Imports only ``libra_megatron.plan``. For every candidate and window, each order (``placed`` = the configured
``--sequence-placement``, ``alg1`` = the paper's Algorithm 1, ``contiguous`` = sampler order) runs with the
candidate's tile placement; its pools' per-worker forward and backward seconds (compute + exposed comm, per
attention layer, ``sim.pools``: ``plan.exchange.plan_layer_timing``, peers coupled, the backward in the pool's
save mode) become ``worker_seconds[GA, DP*CP]`` and ``backward_seconds[GA, DP*CP]``, and
``plan.sequences.sync.step_timing`` turns them into a step: pools wait for their slowest worker in each phase, EP
ties lanes, each lane runs its pipeline (``--pp``, ``--vpp``), DP waits for the slowest lane. The lower bound is
the same model fed with the perfectly balanced, communication-free worker times (the window's forward work at
peak rate / (GA*DP*CP) for every worker and GA step, and the backward's: 2.5 x the forward FLOPs,
``BACKWARD_FLOPS_FACTOR``), so at PP > 1 it keeps the schedule's own bubble and a ratio of 1 means no
imbalance-induced waiting. The ``forward_sync_*`` keys are the earlier figures: the forward-only Pipeliner
timeline, backward = the layout's ``backward_ratio`` (2) x forward, over the same rule's forward-only bound.

JSON keys (per candidate, means over windows; ratios are sums over windows):
    sync_straggler_vs_lower_bound[_alg1|_contiguous]   step time / lower bound under the model (whole layer)
    forward_sync_straggler_vs_lower_bound[...]         the same from the forward-only figures (see above)
    sync_step_seconds {placed, alg1, contiguous, lower_bound}   mean step, in "one attention layer per stage,
                                                       forward + backward" units; forward_sync_step_seconds: the
                                                       forward-only figures' (backward = 2 x forward)
    lane_imbalance {placed, alg1, contiguous}           max/mean - 1 of lane totals of F = sum l^2 (Eq. 4)
    pipeline_bubble_fraction[_alg1]                    PP > 1 only: mean over windows and lanes of the idle
                                                       share of a lane's stages (``PipelineRun.bubble_fraction``)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..plan.sequences import StepTiming, SyncLayout, lane_loads, step_timing
from ..plan.model import imbalance

__all__ = ["SYNC_ORDERS", "SyncAccum", "LaneView", "worker_seconds", "describe_layout", "format_sync"]

SYNC_ORDERS = ("placed", "alg1", "contiguous")


def worker_seconds(pool_seconds: Sequence[np.ndarray], layout: SyncLayout) -> np.ndarray:
    """[GA, DP*CP] from the per-worker seconds of every pool instance k of a GA-major, pool-minor order
    (pool k runs at GA step k*P // DP on DP ranks (k mod DP/P)*P + j; its worker p*CP + c is DP rank
    first + p, CP rank c)."""
    lanes = layout.num_lanes
    out = np.stack([np.concatenate(pool_seconds[g * lanes:(g + 1) * lanes]) for g in range(layout.num_microbatches)])
    return out


@dataclass
class LaneView:
    """One window's per-lane, per-microbatch pool seconds [GA, lanes] of every order (the Fig. 12 view)."""

    window: int
    microbatch_seconds: Dict[str, np.ndarray]

    def to_json(self) -> Dict[str, object]:
        return {"window": self.window, **{k: v.tolist() for k, v in self.microbatch_seconds.items()}}


@dataclass
class SyncAccum:
    """Per-candidate accumulators of the sync scores (one entry per window)."""

    step: Dict[str, List[float]] = field(default_factory=lambda: {k: [] for k in SYNC_ORDERS + ("lower_bound",)})
    forward_step: Dict[str, List[float]] = field(default_factory=lambda: {k: [] for k in SYNC_ORDERS + ("lower_bound",)})
    bubble: Dict[str, List[float]] = field(default_factory=lambda: {k: [] for k in SYNC_ORDERS})
    lanes: Dict[str, List[float]] = field(default_factory=lambda: {k: [] for k in SYNC_ORDERS})
    microbatch_over_mean: Dict[str, List[float]] = field(default_factory=lambda: {"placed": [], "contiguous": []})
    view: Optional[LaneView] = None  # the window whose sampler order waits longest (kept for the plot)
    view_gap: float = -np.inf

    def record(self, window: int, timings: Dict[str, StepTiming], lower_bound: StepTiming,
               flops: np.ndarray, orders: Dict[str, np.ndarray], layout: SyncLayout,
               forward: Optional[Dict[str, StepTiming]] = None) -> None:
        """One window: ``timings`` (whole layer, ``lower_bound`` its bound) and ``forward`` (the forward-only
        figures' timings, with their own "lower_bound")."""
        self.step["lower_bound"].append(lower_bound.seconds)
        for name, timing in (forward or {}).items():
            self.forward_step[name].append(timing.seconds)
        for name in SYNC_ORDERS:
            self.step[name].append(timings[name].seconds)
            self.bubble[name].append(float(timings[name].bubble_fraction.mean()))
            self.lanes[name].append(imbalance(lane_loads(flops, orders[name], layout.data_parallel_size,
                                                         layout.pool_size)))
        layer = {k: _microbatch_layer(timings[k]) for k in SYNC_ORDERS}  # forward + backward per microbatch
        mean = float(layer["placed"].mean())  # Fig. 12: normalised by Libra's mean
        for name in self.microbatch_over_mean:
            values = layer[name].reshape(-1) / (mean if mean > 0 else 1.0)
            self.microbatch_over_mean[name].extend(values.tolist())
        gap = timings["contiguous"].seconds - timings["placed"].seconds
        if gap > self.view_gap:
            self.view_gap = gap
            self.view = LaneView(window, layer)

    def merge(self, other: "SyncAccum") -> None:
        for mine, theirs in ((self.step, other.step), (self.forward_step, other.forward_step),
                             (self.bubble, other.bubble), (self.lanes, other.lanes),
                             (self.microbatch_over_mean, other.microbatch_over_mean)):
            for key, values in theirs.items():
                mine[key].extend(values)
        if other.view is not None and other.view_gap > self.view_gap:
            self.view, self.view_gap = other.view, other.view_gap

    def to_json(self, layout: SyncLayout) -> Dict[str, object]:
        lb = float(np.sum(self.step["lower_bound"]))
        out: Dict[str, object] = {
            "sync_straggler_vs_lower_bound": float(np.sum(self.step["placed"])) / lb,
            "sync_straggler_vs_lower_bound_alg1": float(np.sum(self.step["alg1"])) / lb,
            "sync_straggler_vs_lower_bound_contiguous": float(np.sum(self.step["contiguous"])) / lb,
            "sync_step_seconds": {k: float(np.mean(v)) for k, v in self.step.items()},
            "lane_imbalance": {k: float(np.mean(v)) for k, v in self.lanes.items()},
        }
        if self.forward_step["lower_bound"]:
            flb = float(np.sum(self.forward_step["lower_bound"]))
            for name, suffix in (("placed", ""), ("alg1", "_alg1"), ("contiguous", "_contiguous")):
                out["forward_sync_straggler_vs_lower_bound" + suffix] = float(np.sum(self.forward_step[name])) / flb
            out["forward_sync_step_seconds"] = {k: float(np.mean(v)) for k, v in self.forward_step.items()}
        if layout.pipeline_parallel_size > 1:
            out["pipeline_bubble_fraction"] = float(np.mean(self.bubble["placed"]))
            out["pipeline_bubble_fraction_alg1"] = float(np.mean(self.bubble["alg1"]))
            out["pipeline_bubble_fraction_contiguous"] = float(np.mean(self.bubble["contiguous"]))
        return out


def _microbatch_layer(timing: StepTiming) -> np.ndarray:
    """[GA, lanes]: every lane's pool seconds per microbatch, forward + backward."""
    back = timing.microbatch_backward_seconds
    return timing.microbatch_seconds + (back if back is not None else 0.0)


def score_orders(pools_by_order: Dict[str, Sequence[np.ndarray]], lower_bound_seconds: float,
                 layout: SyncLayout, backward_by_order: Optional[Dict[str, Sequence[np.ndarray]]] = None,
                 backward_lower_bound_seconds: Optional[float] = None) -> Dict[str, StepTiming]:
    """``step_timing`` of every order's pools (per-worker forward seconds, and backward seconds where
    ``backward_by_order`` gives them; else ``backward_ratio`` x forward), and of the balanced,
    communication-free step (``lower_bound``: ``lower_bound_seconds`` forward and ``backward_lower_bound_seconds``
    backward per worker)."""
    out = {}
    for name, pools in pools_by_order.items():
        back = None if backward_by_order is None else worker_seconds(backward_by_order[name], layout)
        out[name] = step_timing(worker_seconds(pools, layout), layout, back)
    shape = (layout.num_microbatches, layout.data_parallel_size * layout.context_parallel_size)
    ideal_back = None if backward_lower_bound_seconds is None else np.full(shape, backward_lower_bound_seconds)
    out["lower_bound"] = step_timing(np.full(shape, lower_bound_seconds), layout, ideal_back)
    return out


def describe_layout(layout: SyncLayout) -> Dict[str, object]:
    """JSON-ready record of the sync model's layout (``assumptions.sync``)."""
    return {
        "pp": layout.pipeline_parallel_size, "vpp": layout.virtual_pipeline_size, "tp": layout.tensor_parallel_size,
        "ep": layout.expert_parallel_size, "etp": layout.expert_tensor_parallel_size,
        "backward": "each pool's priced backward seconds (plan.exchange.plan_layer_timing); the forward_sync_* "
                    "figures and the sync placement's F proxies take backward = backward_ratio x forward",
        "backward_ratio": layout.backward_ratio, "other_seconds": layout.other_seconds,
        "other_backward_seconds": layout.backward_ratio * layout.other_seconds, "num_lanes": layout.num_lanes,
        "ga": layout.num_microbatches,
        "lane_ties": layout.lane_ties().tolist(),
        "schedule": "1F1B" if layout.virtual_pipeline_size == 1 else "interleaved",
        "model": "pools wait per attention layer, EP-tied lanes per MoE layer, each lane pipelines its GA "
                 "microbatches (event simulation), DP waits for the slowest lane (gradient reduction overlapped)",
    }


def format_sync(candidate: Dict[str, object]) -> str:
    """One stdout line of a candidate's sync scores."""
    line = (f"sync model (P={candidate['pool_size']} H={candidate['head_split']} B={candidate['block_size']}, "
            f"forward + backward): step vs lower bound {candidate['sync_straggler_vs_lower_bound']:.3f} "
            f"(Alg. 1 {candidate['sync_straggler_vs_lower_bound_alg1']:.3f}, sampler order "
            f"{candidate['sync_straggler_vs_lower_bound_contiguous']:.3f}); lane R-1 "
            f"{candidate['lane_imbalance']['placed']:.4f} (Alg. 1 {candidate['lane_imbalance']['alg1']:.4f})")
    if "forward_sync_straggler_vs_lower_bound" in candidate:
        line += f"; forward only {candidate['forward_sync_straggler_vs_lower_bound']:.3f}"
    if "pipeline_bubble_fraction" in candidate:
        line += (f"; pipeline bubble {candidate['pipeline_bubble_fraction']:.3f} "
                 f"(Alg. 1 {candidate['pipeline_bubble_fraction_alg1']:.3f})")
    return line
