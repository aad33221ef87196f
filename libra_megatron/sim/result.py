"""What a simulator run measured: per-variant step seconds, per-candidate accumulators, the run's ``SimResult``
and its JSON (``SimResult.to_json``, the stable machine-readable form); windows merge in order.

Every step figure exists twice. Unprefixed keys are the **whole layer**, forward then backward as the runtime
runs them (``plan.exchange.plan_layer_timing``: every rank's op list, peers coupled, latencies and copies; the
backward in the pool's save mode): a step's straggler time is max over the step's workers of the forward plus
max over them of the backward (the pools meet at every exchange of both phases), and the lower bound is the
balanced, communication-free forward + backward compute (``StepTimeModel.balanced_layer_seconds``: backward =
``BACKWARD_FLOPS_FACTOR`` = 2.5 x the forward FLOPs). ``forward_*`` keys are the earlier forward-only figures:
the Pipeliner timeline of each worker priced alone (``StepTimeModel.worker_seconds``) over the forward lower bound
(``balanced_seconds``). ``straggler_split`` = {forward, backward: {seconds, compute_seconds,
exposed_comm_seconds}}: mean per step of each phase's straggler (compute = its compute stream's busy time, kernels
and index copies; exposed = the rest)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..config import KvFetch, TilingPolicy
from ..plan.sequences import SyncLayout
from .pools import PoolKnobs
from .spec import VARIANTS, SimSpec
from .sync import SyncAccum, describe_layout

__all__ = ["Candidate", "SimResult", "WorstStep", "OBJECTIVE"]

_PHASES = ("forward", "backward")


@dataclass
class _Steps:
    """Per-step straggler seconds of one variant over all windows.

    ``seconds`` / ``compute``: the whole layer (forward + backward, the event model) and its straggler compute
    (forward straggler's + backward straggler's); ``forward_seconds`` / ``forward_compute``: the forward-only
    Pipeliner figures; ``phases[f"{phase}_{seconds|compute}"]``: each phase's straggler under the event model.
    The compute lists stay empty where a baseline has no split."""

    seconds: List[float] = field(default_factory=list)
    compute: List[float] = field(default_factory=list)
    forward_seconds: List[float] = field(default_factory=list)
    forward_compute: List[float] = field(default_factory=list)
    phases: Dict[str, List[float]] = field(default_factory=lambda: {f"{p}_{k}": [] for p in _PHASES
                                                                    for k in ("seconds", "compute")})

    def extend(self, seconds, compute=(), forward_seconds=(), forward_compute=(), phases=None) -> None:
        for mine, values in ((self.seconds, seconds), (self.compute, compute),
                             (self.forward_seconds, forward_seconds), (self.forward_compute, forward_compute)):
            mine.extend(np.asarray(values, dtype=np.float64).reshape(-1).tolist())
        for key, values in (phases or {}).items():
            self.phases[key].extend(np.asarray(values, dtype=np.float64).reshape(-1).tolist())

    def merge(self, other: "_Steps") -> None:
        self.extend(other.seconds, other.compute, other.forward_seconds, other.forward_compute, other.phases)

    @staticmethod
    def _split(seconds: List[float], compute: List[float]) -> Dict[str, float]:
        if not compute:
            return {}
        s, c = np.asarray(seconds), np.asarray(compute)
        return {"compute_seconds": float(c.mean()), "exposed_comm_seconds": float((s - c).mean())}

    def split(self) -> Dict[str, float]:
        """Whole layer: mean per step of the straggler's compute and exposed communication (they sum to the mean
        step)."""
        return self._split(self.seconds, self.compute)

    def forward_split(self) -> Dict[str, float]:
        """The same for the forward-only figures, as ``forward_compute_seconds`` / ``forward_exposed_comm_seconds``."""
        return {f"forward_{k}": v for k, v in self._split(self.forward_seconds, self.forward_compute).items()}

    def phase_split(self) -> Dict[str, Dict[str, float]]:
        """``{"forward": {seconds, compute_seconds, exposed_comm_seconds}, "backward": {...}}`` (empty without)."""
        if not self.phases["forward_seconds"]:
            return {}
        out = {}
        for phase in _PHASES:
            s, c = self.phases[f"{phase}_seconds"], self.phases[f"{phase}_compute"]
            out[phase] = {"seconds": float(np.mean(s)), **self._split(s, c)}
        return {"straggler_split": out}

    def summary(self, ulysses: "_Steps") -> Dict[str, object]:
        s, u = np.asarray(self.seconds), np.asarray(ulysses.seconds)
        out: Dict[str, object] = {
            "mean_step_seconds": float(s.mean()), "max_step_seconds": float(s.max()),
            "speedup_vs_ulysses": float(u.sum() / s.sum()), "max_speedup_vs_ulysses": float(u.max() / s.max()),
            **self.split(), **self.phase_split()}
        if self.forward_seconds:
            f, uf = np.asarray(self.forward_seconds), np.asarray(ulysses.forward_seconds)
            out.update({"forward_mean_step_seconds": float(f.mean()), "forward_max_step_seconds": float(f.max()),
                        "forward_speedup_vs_ulysses": float(uf.sum() / f.sum()),
                        "forward_max_speedup_vs_ulysses": float(uf.max() / f.max()), **self.forward_split()})
        return out


@dataclass
class WorstStep:
    """Per-worker seconds of the slowest step of a candidate (for the load-bar plot): the whole layer, each
    worker's forward + backward (compute = its compute streams' busy time, exposed = the rest)."""

    window: int
    step: int
    compute_seconds: np.ndarray  # [DP*CP], Libra worker order (pool slot major)
    exposed_comm_seconds: np.ndarray
    ulysses_seconds: np.ndarray  # [DP*CP], the same window and step under Ulysses

    def to_json(self) -> Dict[str, object]:
        return {"window": self.window, "step": self.step,
                "compute_seconds": self.compute_seconds.tolist(),
                "exposed_comm_seconds": self.exposed_comm_seconds.tolist(),
                "ulysses_seconds": self.ulysses_seconds.tolist()}


@dataclass
class Candidate:
    """Accumulated measurements of one (P, H, B, tau, M, tiling, KV fetch)."""

    pool_size: int
    head_split: int
    block_size: int
    tau: float
    num_chunks: int
    tiling: TilingPolicy = TilingPolicy.ADAPTIVE
    kv_fetch: KvFetch = KvFetch.PREFIX
    inter: Dict[str, List[float]] = field(default_factory=lambda: {k: [] for k in ("contiguous", "alg1", "placed", "lower_bound", "eq3")})
    intra: List[float] = field(default_factory=list)
    bytes_qkvo: List[Tuple[int, int, int]] = field(default_factory=list)
    num_tiles: List[int] = field(default_factory=list)
    num_fallback: int = 0
    steps: Dict[str, _Steps] = field(default_factory=lambda: {k: _Steps() for k in VARIANTS + ("distca",)})
    lower_bound: List[float] = field(default_factory=list)  # whole layer: balanced forward + backward
    forward_lower_bound: List[float] = field(default_factory=list)  # balanced forward only
    worst: Optional[WorstStep] = None
    save_modes: Dict[str, int] = field(default_factory=lambda: {"arranged": 0, "refetch": 0})  # pools per mode
    sync: SyncAccum = field(default_factory=SyncAccum)

    @property
    def knobs(self) -> PoolKnobs:
        """Everything but P that a pool evaluation depends on."""
        return PoolKnobs(self.head_split, self.block_size, self.tau, self.num_chunks, self.tiling, self.kv_fetch)

    @property
    def estimated_step_seconds(self) -> float:
        return float(np.mean(self.steps["libra"].seconds))

    @property
    def forward_estimated_step_seconds(self) -> float:
        return float(np.mean(self.steps["libra"].forward_seconds))

    def to_json(self, ulysses: _Steps, layout: SyncLayout) -> Dict[str, object]:
        libra = np.asarray(self.steps["libra"].seconds)
        forward = np.asarray(self.steps["libra"].forward_seconds)
        bytes_mean = np.asarray(self.bytes_qkvo, dtype=np.float64).mean(axis=0)
        baselines = {k: self.steps[k].summary(ulysses) for k in ("tap", "tap_vrsp", "distca") if self.steps[k].seconds}
        return {
            "pool_size": self.pool_size, "head_split": self.head_split, "block_size": self.block_size,
            "tau": self.tau, "num_chunks": self.num_chunks, "tiling": self.tiling.value, "kv_fetch": self.kv_fetch.value,
            "num_tiles": int(round(float(np.mean(self.num_tiles)))),
            "inter_pool_imbalance": {k: float(np.mean(v)) for k, v in self.inter.items()},
            "intra_pool_imbalance": float(np.mean(self.intra)),
            "intra_pool_imbalance_max": float(np.max(self.intra)),
            "num_fallback_tiles": int(self.num_fallback),
            "straggler_vs_ulysses": float(libra.sum() / np.sum(ulysses.seconds)),
            "straggler_max_vs_ulysses": float(libra.max() / np.max(ulysses.seconds)),
            "straggler_vs_lower_bound": float(libra.sum() / np.sum(self.lower_bound)),
            **self.steps["libra"].split(), **self.steps["libra"].phase_split(),
            "forward_straggler_vs_ulysses": float(forward.sum() / np.sum(ulysses.forward_seconds)),
            "forward_straggler_max_vs_ulysses": float(forward.max() / np.max(ulysses.forward_seconds)),
            "forward_straggler_vs_lower_bound": float(forward.sum() / np.sum(self.forward_lower_bound)),
            **self.steps["libra"].forward_split(),
            "bytes_per_layer": {"q": float(bytes_mean[0]), "kv": float(bytes_mean[1]), "o": float(bytes_mean[2])},
            "estimated_step_seconds": self.estimated_step_seconds,
            "max_step_seconds": float(libra.max()),
            "forward_estimated_step_seconds": self.forward_estimated_step_seconds,
            "forward_max_step_seconds": float(forward.max()),
            "save_mode_pools": dict(self.save_modes),
            "baselines": baselines,
            **self.sync.to_json(layout),
        }


# --------------------------------------------------------------------------- corpus and windows
def _worst_seconds(worst: WorstStep) -> float:
    return float((worst.compute_seconds + worst.exposed_comm_seconds).max())


OBJECTIVE = ("estimated_step_seconds = mean over GA steps of the whole attention layer's straggler: max over the "
             "step's workers of the forward plus max over them of the backward (plan.exchange.plan_layer_timing: "
             "every rank's op list, peers coupled); recommended = argmin, ties -> smaller P, H, B")


@dataclass
class SimResult:
    """Everything a run measured; ``to_json`` is the stable machine-readable form."""

    spec: SimSpec
    candidates: List[Candidate]
    ulysses: _Steps
    wlb: _Steps
    num_windows: int
    num_sequences: int
    num_documents: int
    seconds: float = 0.0
    window_cv: List[float] = field(default_factory=list)  # CV of F_i per window (Eq. 3 input)
    orders_dump: List[Dict[str, object]] = field(default_factory=list)  # --dump-orders lines, window order
    megatron_hybrid_cp: Optional[Dict[str, float]] = None  # ``sim.hybrid_cp`` summary when asked for

    def recommended(self) -> Candidate:
        """argmin of the objective (``OBJECTIVE``); ties go to smaller (P, H, B, tau, M), then the earlier
        (tiling, KV fetch) of the grid (candidates are kept in grid order)."""
        return min(enumerate(self.candidates), key=lambda ic: (ic[1].estimated_step_seconds, ic[1].pool_size,
                                                              ic[1].head_split, ic[1].block_size, ic[1].tau,
                                                              ic[1].num_chunks, ic[0]))[1]

    def _assumptions(self) -> Dict[str, object]:
        s = self.spec
        cost = s.cost.assumptions()
        cost["num_chunks"] = _scalar_or_list(s.chunk_counts)
        return {
            "seq_len": s.seq_len, "gbs": s.global_batch_size, "dp": s.data_parallel_size,
            "cp": s.context_parallel_size, "num_heads": s.dims.num_q_heads, "num_kv_heads": s.dims.num_kv_heads,
            "head_dim": s.dims.head_dim, "elem_bytes": s.dims.elem_bytes,
            "heads": "num_heads and num_kv_heads of one tensor-parallel rank (--tp divides the model's)",
            "num_chunks": _scalar_or_list(s.chunk_counts), "tau": _scalar_or_list(s.taus),
            "tiling": _scalar_or_list(tuple(t.value for t in s.tilings)),
            "kv_fetch": _scalar_or_list(tuple(f.value for f in s.kv_fetches)),
            "token_layout": s.token_layout.value, "sequence_placement": s.sequence_placement.value,
            "tile_placement": s.tile_placement.value, "packing": s.packing.value, "seed": s.seed,
            "wlb_cap_factor": s.wlb_cap_factor, "cost": cost,
            "sync": describe_layout(s.sync_layout(s.pool_sizes[0])),
            "objective": OBJECTIVE + (", tau, M" if len(s.taus) * len(s.chunk_counts) > 1 else "")
            + (", then grid order of tiling, KV fetch" if len(s.tilings) * len(s.kv_fetches) > 1 else ""),
            "save_mode": s.save_mode.value, "activation_budget_gb": s.activation_budget_gb,
            "num_layers": s.num_layers, "layers_per_stage": s.layers_per_stage,
            "recompute_num_layers": s.recompute_num_layers, "saved_layers": s.saved_layers, "libra_config": s.libra_config,
            "units": "seconds per attention layer, forward + backward (forward_* keys: forward only, the Pipeliner "
                     "timeline); bytes per attention layer, forward pass",
        }

    def to_json(self) -> Dict[str, object]:
        best = self.recommended()
        return {
            "num_windows": self.num_windows, "num_sequences": self.num_sequences,
            "num_documents": self.num_documents, "runtime_seconds": self.seconds,
            "assumptions": self._assumptions(),
            "baselines": {"ulysses": self.ulysses.summary(self.ulysses), "wlb_llm": self.wlb.summary(self.ulysses),
                          **({"megatron_hybrid_cp": self.megatron_hybrid_cp} if self.megatron_hybrid_cp else {})},
            **({"megatron_hybrid_cp_straggler_vs_lower_bound": self.megatron_hybrid_cp["straggler_vs_lower_bound"],
                "forward_megatron_hybrid_cp_straggler_vs_lower_bound":
                    self.megatron_hybrid_cp.get("forward_straggler_vs_lower_bound")}
               if self.megatron_hybrid_cp else {}),
            "candidates": [c.to_json(self.ulysses, self.spec.sync_layout(c.pool_size)) for c in self.candidates],
            "recommended": {"pool_size": best.pool_size, "head_split": best.head_split, "block_size": best.block_size,
                            "tau": best.tau, "num_chunks": best.num_chunks, "tiling": best.tiling.value,
                            "kv_fetch": best.kv_fetch.value, "estimated_step_seconds": best.estimated_step_seconds,
                            "worst_step": best.worst.to_json() if best.worst else None},
        }


def _scalar_or_list(values: Tuple) -> object:
    """A single swept value as itself (the JSON of a one-value run), several as a list."""
    return values[0] if len(values) == 1 else list(values)


def _merge_window(into: SimResult, part: SimResult) -> None:
    """Append one window's measurements (``part``) to ``into``; windows must arrive in order."""
    into.ulysses.merge(part.ulysses)
    into.wlb.merge(part.wlb)
    into.window_cv.extend(part.window_cv)
    into.orders_dump.extend(part.orders_dump)
    for mine, theirs in zip(into.candidates, part.candidates):
        for key, values in theirs.inter.items():
            mine.inter[key].extend(values)
        for name, steps in theirs.steps.items():
            mine.steps[name].merge(steps)
        mine.intra.extend(theirs.intra)
        mine.bytes_qkvo.extend(theirs.bytes_qkvo)
        mine.num_tiles.extend(theirs.num_tiles)
        mine.lower_bound.extend(theirs.lower_bound)
        mine.forward_lower_bound.extend(theirs.forward_lower_bound)
        for mode, count in theirs.save_modes.items():
            mine.save_modes[mode] += count
        mine.num_fallback += theirs.num_fallback
        mine.sync.merge(theirs.sync)
        if theirs.worst is not None and (mine.worst is None or _worst_seconds(theirs.worst) > _worst_seconds(mine.worst)):
            mine.worst = theirs.worst

