"""Measured attention throughput per kernel-call shape (``--calibration``): the table ``StepTimeModel`` reads.

Pure numpy. Written by the ``calibration`` section of ``benchmarks/gpu/device_check.py``. Tables measured on
real devices ship in the repository's ``data/calibration/`` and are named by their file stem
(``--calibration h200-torch-fa2``; ``resolve_calibration``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np

from ...paths import read_json
from .kernel_fit import KernelFit

__all__ = ["CalibrationTable", "SHIPPED_CALIBRATION_DIR", "shipped_calibrations", "resolve_calibration"]

SHIPPED_CALIBRATION_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "data", "calibration")


@dataclass(frozen=True)
class CalibrationTable:
    """Measured attention throughput per call shape (written by the ``calibration`` section of ``benchmarks/gpu/device_check.py``).

    JSON: ``{"device": str, "head_dim": int, "entries": [{"block_tokens": int, "heads": int,
    "seconds": float, "pairs": int}, ...]}``; ``pairs`` = causal query-key pairs per head of the timed
    call, so its throughput is 4 * head_dim * pairs * heads / seconds FLOP/s.

    Interpolation: for each measured head count, throughput is piecewise linear in log2(block_tokens)
    (clamped to the measured range); between head counts, linear in log2(heads) (clamped).
    """

    device: str
    head_dim: int
    heads: Tuple[int, ...]
    tokens: Tuple[Tuple[float, ...], ...]  # per head count: log2(block_tokens), increasing
    flops_per_s: Tuple[Tuple[float, ...], ...]  # per head count: throughput at those tokens

    @classmethod
    def from_json(cls, path: str) -> "CalibrationTable":
        data = read_json(path, f"--calibration {path}")
        return cls.from_mapping(data, source=f"--calibration {path}")

    @classmethod
    def from_mapping(cls, data, source: str = "--calibration") -> "CalibrationTable":
        try:
            head_dim = int(data["head_dim"])
            rows = [(int(e["block_tokens"]), int(e["heads"]), float(e["seconds"]), int(e["pairs"]))
                    for e in data["entries"]]
        except (KeyError, TypeError, ValueError, OverflowError) as err:
            raise ValueError(f"{source}: expected keys device, head_dim, entries[block_tokens, heads, "
                             f"seconds, pairs] ({err!r})") from None
        if not rows or any(t < 1 or h < 1 or not (math.isfinite(s) and s > 0) or p < 1 for t, h, s, p in rows):
            raise ValueError(f"{source}: need >= 1 entry with block_tokens, heads, pairs >= 1 and finite seconds > 0")
        by_heads: Dict[int, Dict[int, float]] = {}
        for tokens, heads, seconds, pairs in rows:
            by_heads.setdefault(heads, {})[tokens] = 4.0 * head_dim * pairs * heads / seconds
        heads_sorted = tuple(sorted(by_heads))
        tokens = tuple(tuple(math.log2(t) for t in sorted(by_heads[h])) for h in heads_sorted)
        rates = tuple(tuple(by_heads[h][t] for t in sorted(by_heads[h])) for h in heads_sorted)
        return cls(str(data.get("device", "unknown")), head_dim, heads_sorted, tokens, rates)

    def flops_per_second(self, block_tokens, heads: int) -> np.ndarray:
        """Interpolated FLOP/s for calls of ``block_tokens`` (array) tokens and ``heads`` query heads."""
        x = np.log2(np.maximum(np.asarray(block_tokens, dtype=np.float64), 1.0))
        per_head = [np.interp(x, t, r) for t, r in zip(self.tokens, self.flops_per_s)]
        if len(self.heads) == 1:
            return per_head[0]
        logs = np.log2(np.asarray(self.heads, dtype=np.float64))
        stacked = np.stack(per_head, axis=0)
        y = math.log2(max(heads, 1))
        hi = int(np.clip(np.searchsorted(logs, y), 1, len(logs) - 1))
        w = float(np.clip((y - logs[hi - 1]) / (logs[hi] - logs[hi - 1]), 0.0, 1.0))
        return (1.0 - w) * stacked[hi - 1] + w * stacked[hi]

    def peak_flops_per_second(self) -> float:
        """The best throughput any measured shape reaches."""
        return max(max(rates) for rates in self.flops_per_s)


def shipped_calibrations() -> Tuple[str, ...]:
    """Names of the tables in ``data/calibration/`` (file stems), sorted."""
    if not os.path.isdir(SHIPPED_CALIBRATION_DIR):
        return ()
    return tuple(sorted(f[:-5] for f in os.listdir(SHIPPED_CALIBRATION_DIR) if f.endswith(".json")))


def resolve_calibration(value: str, flag: str = "--calibration"):
    """``value`` a file, else the name of a shipped one: a ``CalibrationTable``, or a ``kernel_fit.KernelFit`` when
    the JSON says ``"kind": "kernel_fit"``; ValueError naming ``flag`` and the shipped names."""
    if value in shipped_calibrations() and not os.path.exists(value):
        value = os.path.join(SHIPPED_CALIBRATION_DIR, value + ".json")
    elif not (os.path.exists(value) or os.sep in value or value.endswith(".json")):
        raise ValueError(f"{flag} {value}: neither a file nor a shipped table (shipped in data/calibration: "
                         f"{', '.join(shipped_calibrations()) or 'none'})")
    data = read_json(value, f"{flag} {value}")
    if isinstance(data, dict) and data.get("kind") == "kernel_fit":
        return KernelFit.from_mapping(data, source=f"{flag} {value}")
    return CalibrationTable.from_mapping(data, source=f"{flag} {value}")
