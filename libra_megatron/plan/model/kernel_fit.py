"""A kernel price fitted on measured calls shaped like Libra's (``--calibration <name>`` of kind ``kernel_fit``).

Pure numpy. The square-block table (``calibration.CalibrationTable``) is looked up by a call's query rows; the
device check's ``call_shapes`` section showed that misprices Libra's calls (a query block over a long causal
prefix) by 0.6-1.2x. This model prices a call the way a FlashAttention kernel runs it: one thread block (CTA)
per 128 query rows x one head, each CTA's time linear in the keys its rows see, CTAs run in waves of ``slots``:

    seconds = launch + max(ctas / slots, 1) * (cta + keys_per_row * per_key)
    ctas = q_rows / 128 * heads,   keys_per_row = pair_heads / (heads * q_rows)

one such phase for the forward and one for the backward (its own constants: the backward is not a fixed multiple
of the forward on a GPU). ``fit_kernel_calls`` fits the four constants of a phase to measured rows (relative
error, least squares over ``launch, cta, per_key`` for each ``slots`` of a geometric grid); the shipped fit is
``data/calibration/h200-torch-fa2-calls.json``, made by ``benchmarks/gpu/fit_call_shapes.py`` from the rows
in ``data/calibration/raw/``.

JSON: ``{"kind": "kernel_fit", "device": str, "head_dim": int, "fwd": PHASE, "bwd": PHASE, "source": str,
"quality": {...}}``, PHASE = ``{"launch_us", "cta_us", "key_ns", "slots"}``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Mapping, Sequence

import numpy as np

from .kernel_cost import nnls
from .workload import entry_pair_heads

__all__ = ["KernelFit", "PhaseFit", "fit_kernel_calls", "fit_phase", "fit_quality", "ROWS_PER_CTA"]

ROWS_PER_CTA = 128  # query rows of one thread block of FlashAttention-2's forward (Hopper and Ampere, d = 128)
_PHASE_KEYS = ("launch_us", "cta_us", "key_ns", "slots")
SLOT_GRID = 2.0 ** (np.arange(3 * 24, 12 * 24 + 1) / 24.0)  # 8 .. 4096 slots, 24 per octave (powers of 2 exact)
TIE_RTOL = 1e-9  # fit errors this close are one error in floating point (``fit_phase``)


@dataclass(frozen=True)
class PhaseFit:
    """One direction's constants: seconds = launch + max(ctas / slots, 1) * (cta + keys_per_row * per_key)."""

    launch_us: float
    cta_us: float
    key_ns: float
    slots: float

    def _waves_and_cta_seconds(self, pair_heads, q_rows, heads):
        """(pair_heads, fractional waves ctas / slots, seconds of one CTA) of calls of this shape."""
        pair_heads = np.asarray(pair_heads, dtype=np.float64)
        rows = np.maximum(np.asarray(q_rows, dtype=np.float64), 1.0)
        heads = max(int(heads), 1)
        per_cta = self.cta_us * 1e-6 + pair_heads / (heads * rows) * self.key_ns * 1e-9
        return pair_heads, rows / ROWS_PER_CTA * heads / self.slots, per_cta

    def seconds(self, pair_heads, q_rows, heads) -> np.ndarray:
        pair_heads, waves, per_cta = self._waves_and_cta_seconds(pair_heads, q_rows, heads)
        return np.where(pair_heads > 0, self.launch_us * 1e-6 + np.maximum(waves, 1.0) * per_cta, 0.0)

    def share_seconds(self, pair_heads, q_rows, heads) -> np.ndarray:
        """A piece's share of a call large enough to fill the waves (ctas / slots x per-CTA time, no launch):
        what one SH-Tile adds to its chunk's call, so tiles' shares add up to that call's seconds less its launch."""
        pair_heads, waves, per_cta = self._waves_and_cta_seconds(pair_heads, q_rows, heads)
        return np.where(pair_heads > 0, waves * per_cta, 0.0)

    def peak_flops_per_second(self, head_dim: int) -> float:
        """The rate of a call large enough that launch and per-CTA costs vanish (forward FLOPs per second)."""
        return 4.0 * head_dim * ROWS_PER_CTA * self.slots / (self.key_ns * 1e-9)

    def to_mapping(self) -> Dict[str, float]:
        return {k: float(getattr(self, k)) for k in _PHASE_KEYS}


@dataclass(frozen=True)
class KernelFit:
    """Forward and backward ``PhaseFit`` of one device and kernel, measured at ``head_dim``."""

    device: str
    head_dim: int
    fwd: PhaseFit
    bwd: PhaseFit
    source: str = ""
    heads: tuple = ()  # no per-head table (``StepTimeModel.assumptions`` reads it)

    kind = "kernel_fit"

    @classmethod
    def from_mapping(cls, data: Mapping, source: str = "--calibration") -> "KernelFit":
        try:
            phases = [PhaseFit(**{k: float(data[p][k]) for k in _PHASE_KEYS}) for p in ("fwd", "bwd")]
            head_dim = int(data["head_dim"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{source}: a kernel_fit needs head_dim and fwd/bwd with {', '.join(_PHASE_KEYS)} "
                             f"({err!r})") from None
        for name, phase in zip(("fwd", "bwd"), phases):
            values = phase.to_mapping()
            if not all(math.isfinite(v) and v >= 0 for v in values.values()) or phase.slots <= 0 or phase.key_ns <= 0:
                raise ValueError(f"{source}: {name} constants must be finite and >= 0, slots and key_ns > 0, "
                                 f"got {values}")
        return cls(str(data.get("device", "unknown")), head_dim, phases[0], phases[1], str(data.get("source", "")))

    def call_seconds(self, pair_heads, q_rows, heads: int, direction: str = "fwd") -> np.ndarray:
        return (self.fwd if direction == "fwd" else self.bwd).seconds(pair_heads, q_rows, heads)

    def peak_flops_per_second(self, direction: str = "fwd") -> float:
        """Forward FLOPs per second of the phase's largest calls (the lower bound's rate)."""
        return (self.fwd if direction == "fwd" else self.bwd).peak_flops_per_second(self.head_dim)


def _rows_features(rows: Sequence[Mapping]):
    """(pair_heads, q_rows, heads) per measured row of the device check's ``call_shapes.json``."""
    n = np.array([r["entries"] for r in rows], dtype=np.float64)
    q = np.array([r["q_block"] for r in rows], dtype=np.int64)
    k = np.array([r["k_len"] for r in rows], dtype=np.int64)
    heads = np.array([r["heads"] for r in rows], dtype=np.float64)
    return n * entry_pair_heads(q, k, 1) * heads, n * q, heads


def fit_phase(pair_heads, q_rows, heads, seconds, slot_grid=None) -> PhaseFit:
    """Least squares in relative error: for each ``slots`` of the grid, the non-negative (launch, cta, per_key)
    that minimise sum ((predicted - measured) / measured)^2; the best slots wins. Slots at or below every row's
    CTA count fit equally well (each row fills its waves; only cta / slots and per_key / slots are determined), so
    errors within ``TIE_RTOL`` of the best are ties and the largest tied slots wins: the longest one-wave call
    (the conservative price of a call with fewer CTAs than any row), and the same answer under every BLAS."""
    pair_heads, q_rows, heads, seconds = (np.asarray(x, dtype=np.float64) for x in (pair_heads, q_rows, heads, seconds))
    grid = SLOT_GRID if slot_grid is None else np.asarray(slot_grid, dtype=np.float64)
    kpr = pair_heads / (heads * q_rows)
    fits = []
    for slots in grid:
        waves = np.maximum(q_rows / ROWS_PER_CTA * heads / slots, 1.0)
        a = np.stack([np.full_like(waves, 1e-6), waves * 1e-6, waves * kpr * 1e-9], axis=1) / seconds[:, None]
        x = nnls(a, np.ones_like(seconds))
        fits.append((float(np.sum((a @ x - 1.0) ** 2)), PhaseFit(float(x[0]), float(x[1]), float(x[2]), float(slots))))
    best = min(err for err, _ in fits)
    return max((fit for err, fit in fits if err <= best * (1.0 + TIE_RTOL)), key=lambda fit: fit.slots)


def fit_kernel_calls(rows: Sequence[Mapping], head_dim: int, device: str, source: str = "") -> KernelFit:
    """The ``KernelFit`` of measured ``call_shapes`` rows (each with fwd_s and bwd_s)."""
    pair_heads, q_rows, heads = _rows_features(rows)
    fwd = fit_phase(pair_heads, q_rows, heads, [r["fwd_s"] for r in rows])
    bwd = fit_phase(pair_heads, q_rows, heads, [r["bwd_s"] for r in rows])
    return KernelFit(device, int(head_dim), fwd, bwd, source)


def fit_quality(fit: KernelFit, rows: Sequence[Mapping]) -> Dict[str, Dict[str, float]]:
    """Predicted / measured per direction over ``rows``: median, p10, p90, min, max."""
    pair_heads, q_rows, heads = _rows_features(rows)
    out = {}
    for direction in ("fwd", "bwd"):
        measured = np.array([r[f"{direction}_s"] for r in rows], dtype=np.float64)
        pred = np.array([float(fit.call_seconds(p, q, int(h), direction)) for p, q, h in zip(pair_heads, q_rows, heads)])
        ratio = pred / measured
        out[direction] = {"median": float(np.median(ratio)), "p10": float(np.percentile(ratio, 10)),
                          "p90": float(np.percentile(ratio, 90)), "min": float(ratio.min()), "max": float(ratio.max())}
    return out
