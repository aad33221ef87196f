"""Time model of the simulator: attention seconds from pair counts, link seconds from bytes (§4.4).

Pure numpy. Everything is per attention layer, forward pass.

Compute. A call over ``pair_heads`` causal query-key pairs x query heads does ``4 * d * pair_heads``
FLOPs (2*d for Q K^T and 2*d for P V per pair and head). Seconds = FLOPs / throughput, where
throughput is a constant (``--attn-tflops``, default 400 TFLOP/s, an effective H200-class bf16
FlashAttention figure) or, with ``--calibration``, a measured table interpolated at the call's shape
(block tokens x heads per call; see ``CalibrationTable``).

Communication. A worker's traffic is split by link: peers on the same node (``--gpus-per-node``) use
the intra-node bandwidth (default 300 GB/s), other peers the inter-node bandwidth (default 50 GB/s
per GPU). Per link class the busy time is max(bytes sent, bytes received) / bandwidth (full-duplex
links); the two classes run concurrently, so comm seconds = max(intra time, inter time).

Exposure (TAP Pipeliner, §4.4). Each worker's seconds come from the Pipeliner's event timeline
(``plan.timing.pipeline_seconds``, the one rule): chunk m's dispatch and return take the link seconds of
their bytes (``plan.traffic.PlanTraffic.phase_seconds``); every dispatch is issued at once, the first k
chunks' local entries (Q and K/V from the worker itself) compute while they travel, each chunk's remote
entries after its dispatch arrived, the other local entries while the returns travel (k = the plan's
per-rank lead); transfers share one FIFO link, compute one stream. exposed = seconds - compute.
``local_first=False`` (``--no-local-first``) prices the same plans without the local split (every entry
after its chunk's dispatch) for comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np

from ..paths import read_json
from ..plan.timing import (DEFAULT_ATTN_TFLOPS, DEFAULT_GPUS_PER_NODE, DEFAULT_INTER_NODE_GBPS,
                           DEFAULT_INTRA_NODE_GBPS, TFLOP, StepTimeModel, link_seconds, pipeline_seconds)

__all__ = ["CostModel", "CalibrationTable", "attention_flops"]


def attention_flops(pair_heads, head_dim: int) -> np.ndarray:
    """Forward attention FLOPs of ``pair_heads`` (causal pairs x query heads): 4 * d * pair_heads."""
    return 4.0 * head_dim * np.asarray(pair_heads, dtype=np.float64)


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


@dataclass(frozen=True)
class CostModel:
    """Documented, overridable assumptions turning pair counts and bytes into seconds."""

    head_dim: int
    attn_tflops: float = DEFAULT_ATTN_TFLOPS
    intra_node_gbps: float = DEFAULT_INTRA_NODE_GBPS
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    num_chunks: int = 4
    calibration: Optional[CalibrationTable] = None
    local_first: bool = True  # the runtime's schedule; False prices the previous one (--no-local-first)
    kv_relay: bool = True  # plans relay K/V through one destination per node (--no-kv-relay: direct fetches)

    def __post_init__(self) -> None:
        for name in ("attn_tflops", "intra_node_gbps", "inter_node_gbps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value!r}")
        if self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if self.calibration is not None and self.calibration.head_dim != self.head_dim:
            raise ValueError(f"--calibration was measured at head_dim {self.calibration.head_dim}, "
                             f"but --head-dim is {self.head_dim}")

    def compute_seconds(self, pair_heads, call_tokens, heads_per_call: int) -> np.ndarray:
        """Seconds for calls of ``pair_heads`` work, each ``call_tokens`` query tokens x ``heads_per_call``."""
        flops = attention_flops(pair_heads, self.head_dim)
        if self.calibration is None:
            return flops / (self.attn_tflops * TFLOP)
        return flops / self.calibration.flops_per_second(call_tokens, heads_per_call)

    def peak_compute_seconds(self, pair_heads) -> np.ndarray:
        """Seconds at the best throughput any call shape reaches (for lower bounds)."""
        flops = attention_flops(pair_heads, self.head_dim)
        if self.calibration is None:
            return flops / (self.attn_tflops * TFLOP)
        return flops / max(max(rates) for rates in self.calibration.flops_per_s)

    def comm_seconds(self, intra_bytes, inter_bytes) -> np.ndarray:
        """Per worker: max(intra / intra bw, inter / inter bw); bytes already max(sent, received)."""
        return link_seconds(intra_bytes, inter_bytes, self.intra_node_gbps, self.inter_node_gbps)

    def worker_seconds(self, local_compute, remote_compute, dispatch_seconds, return_seconds, lead=None,
                       relay=None) -> np.ndarray:
        """compute + exposed comm per worker: the Pipeliner timeline (``plan.timing.pipeline_seconds``) over
        the worker's local / remote compute seconds and its per-chunk dispatch / return link seconds [W, M];
        ``lead`` = the plan's per-rank leads (None: each worker's best, what a plan built under this model has);
        ``relay`` = the plan's relay hop (``PlanTraffic.relay_timing``), None without one."""
        return pipeline_seconds(local_compute, remote_compute, dispatch_seconds, return_seconds, self.local_first,
                                lead, relay)[0]

    def step_time_model(self, first_gpu: int) -> StepTimeModel:
        """The constant-rate model ``plan.timeaware`` places by (the calibration table, if any, is not used)."""
        return StepTimeModel(self.head_dim, self.attn_tflops, self.intra_node_gbps, self.inter_node_gbps,
                             self.gpus_per_node, int(first_gpu), local_first=self.local_first,
                             kv_relay=self.kv_relay)

    def assumptions(self) -> Dict[str, object]:
        """JSON-ready record of what the time estimates assumed."""
        out: Dict[str, object] = {
            "attn_tflops": self.attn_tflops, "intra_node_gbps": self.intra_node_gbps,
            "inter_node_gbps": self.inter_node_gbps, "gpus_per_node": self.gpus_per_node,
            "num_chunks": self.num_chunks, "head_dim": self.head_dim,
            "flops_per_pair_head": 4 * self.head_dim,
            "local_first": self.local_first,
            "kv_relay": self.kv_relay,
            "step_time": "max over workers of the Pipeliner timeline (plan.timing.pipeline_seconds): one FIFO "
                         "link (D_0 .. D_{M-1} issued at t = 0, R_m after chunk m's remote entries), one compute "
                         "stream; "
                         + ("the first k chunks' local entries while the dispatches travel, the rest while the "
                            "returns travel (k = the plan's per-rank lead), " if self.local_first else
                            "no local split, ")
                         + "each chunk's remote entries after its dispatch; D_m = Q/M + KV/F on K/V-sending "
                         "chunks, R_m = O/M, link seconds per phase"
                         + ("; K/V relayed once per (home run, destination node): F_m on a second link, issued by "
                            "each rank after D_m, moving a pair's rows once both issued it; receivers wait F_m "
                            "before their remote entries" if self.kv_relay else "; no K/V relay"),
        }
        out["calibration"] = None if self.calibration is None else {
            "device": self.calibration.device, "heads": list(self.calibration.heads)}
        return out
