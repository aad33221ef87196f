"""Seconds of one pool's attention layer forward per worker: compute plus exposed communication (§4.4).

Pure numpy; one rule shared by the simulator (``sim.cost``) and the time-aware tile placement
(``plan.timeaware``). Per worker:
    compute  = 4 * d * (Eq. 6 pair-heads of its tiles) / throughput
    comm     = max(intra-node bytes / intra bw, inter-node bytes / inter bw),  bytes = max(sent, received)
    exposed  = comm - min((1 - u) * comm, compute)        (= u * comm at best)
    seconds  = compute + exposed
u is the share of the worker's bytes in chunk 0's dispatch and chunk M-1's return (``plan.traffic``: the
only transfers no compute can hide).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["StepTimeModel", "exposed_seconds"]

GB = 1e9
TFLOP = 1e12


def exposed_seconds(comm, compute, unhidable) -> np.ndarray:
    """Communication left on the critical path after Pipeliner overlap: comm - min((1 - u) comm, compute)."""
    comm = np.asarray(comm, dtype=np.float64)
    compute = np.asarray(compute, dtype=np.float64)
    return comm - np.minimum(comm * (1.0 - np.asarray(unhidable, dtype=np.float64)), compute)


@dataclass(frozen=True)
class StepTimeModel:
    """The constant-rate time model of one pool (the simulator's defaults: H200-class bf16 attention,
    NVLink-class intra-node and 400 Gb/s-class inter-node links per GPU, 8 GPUs per node).

    first_gpu: global GPU index of pool worker 0; worker w sits on node (first_gpu + w) // gpus_per_node.
    worker_nodes: when given, the node of every pool worker (a run's pool ranks // GPUs per node: with TP > 1
        a pool's workers are not consecutive GPUs); it overrides first_gpu / gpus_per_node in ``nodes``.
    """

    head_dim: int
    attn_tflops: float = 400.0
    intra_node_gbps: float = 300.0
    inter_node_gbps: float = 50.0
    gpus_per_node: int = 8
    first_gpu: int = 0
    worker_nodes: tuple = ()

    def __post_init__(self) -> None:
        for name in ("attn_tflops", "intra_node_gbps", "inter_node_gbps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"StepTimeModel.{name} must be a finite number > 0, got {value!r}")
        for name in ("head_dim", "gpus_per_node"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"StepTimeModel.{name} must be >= 1, got {getattr(self, name)!r}")
        if int(self.first_gpu) < 0:
            raise ValueError(f"StepTimeModel.first_gpu must be >= 0, got {self.first_gpu!r}")

    def nodes(self, num_workers: int) -> np.ndarray:
        """int64 [W]: node of every pool worker."""
        if self.worker_nodes:
            if len(self.worker_nodes) != num_workers:
                raise ValueError(f"StepTimeModel.worker_nodes names {len(self.worker_nodes)} workers, the pool has "
                                 f"{num_workers}")
            return np.asarray(self.worker_nodes, dtype=np.int64)
        return (self.first_gpu + np.arange(num_workers, dtype=np.int64)) // self.gpus_per_node

    def compute_seconds(self, pair_heads) -> np.ndarray:
        return 4.0 * self.head_dim * np.asarray(pair_heads, dtype=np.float64) / (self.attn_tflops * TFLOP)

    def comm_seconds(self, intra_bytes, inter_bytes) -> np.ndarray:
        intra = np.asarray(intra_bytes, dtype=np.float64) / (self.intra_node_gbps * GB)
        inter = np.asarray(inter_bytes, dtype=np.float64) / (self.inter_node_gbps * GB)
        return np.maximum(intra, inter)

    def worker_seconds(self, compute, intra_bytes, inter_bytes, unhidable) -> np.ndarray:
        """compute + exposed comm per worker (module docstring)."""
        comm = self.comm_seconds(intra_bytes, inter_bytes)
        return np.asarray(compute, dtype=np.float64) + exposed_seconds(comm, compute, unhidable)
