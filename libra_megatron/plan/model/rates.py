"""The default rates of the time model, stated once (``StepTimeModel``, the simulator's flags and docs read them).

H200-class bf16 attention, NVLink-class intra-node and 400 Gb/s-class inter-node links per GPU, 8 GPUs per
node. Every other module takes these names; a test checks that the simulator's flag defaults are these
objects.
"""
from __future__ import annotations

__all__ = ["GB", "TFLOP", "DEFAULT_ATTN_TFLOPS", "DEFAULT_INTRA_NODE_GBPS", "DEFAULT_INTER_NODE_GBPS",
           "DEFAULT_GPUS_PER_NODE"]

GB = 1e9
TFLOP = 1e12
DEFAULT_ATTN_TFLOPS = 400.0  # effective attention TFLOP/s per GPU
DEFAULT_INTRA_NODE_GBPS = 300.0  # GB/s per GPU to same-node peers
DEFAULT_INTER_NODE_GBPS = 50.0  # GB/s per GPU to other nodes
DEFAULT_GPUS_PER_NODE = 8
