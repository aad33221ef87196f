"""The default rates of the time model, stated once (``StepTimeModel``, the simulator's flags and docs read them).

H200-class bf16 attention, NVLink-class intra-node and 400 Gb/s-class inter-node links per GPU, 8 GPUs per
node. Every other module takes these names; a test checks that the simulator's flag defaults are these
objects.

Latencies and copy rates (the whole-layer model, ``plan.model.events``), with where each number comes from:
    DEFAULT_COLLECTIVE_US      every ``all_to_all_single`` call: NCCL's launch + group setup. nccl-tests
                               ``alltoall_perf`` on one 8x H100 NVSwitch node reports ~15-25 us at the smallest
                               sizes (the size-independent floor of the curve); 15 us is taken.
    DEFAULT_INTRA_MESSAGE_US   every peer an exchange sends to or receives from on the same node: NVLink p2p
                               small-message latency, ~2 us (nccl-tests ``sendrecv_perf`` floor on NVSwitch).
    DEFAULT_INTER_MESSAGE_US   every peer on another node: InfiniBand NDR (400 Gb/s) with GPUDirect RDMA,
                               ~5 us (ib_write_lat ~1-2 us + NCCL's proxy and network-plugin path; nccl-tests
                               ``sendrecv_perf`` between two nodes floors at ~6-10 us).
    DEFAULT_KERNEL_LAUNCH_US   every attention kernel call: a CUDA launch (~3-5 us host-to-start, NVIDIA's
                               CUDA C++ Best Practices Guide) plus flash-attn's varlen setup; 8 us.
    DEFAULT_KERNEL_ENTRY_US    every varlen entry of a call: 0 (flash-attn's varlen kernel takes all entries in one
                               launch); a CPU fit's per-entry loop cost goes here.
    DEFAULT_COPY_GBPS          gathers, scatters and index_add copies: each moves its bytes twice (read +
                               write) at this HBM rate. H200's HBM3e peaks at 4.8 TB/s (NVIDIA H200 datasheet);
                               indexed row copies reach ~60% of peak: 2900 GB/s.
    DEFAULT_COPY_LAUNCH_US     every copy kernel: 4 us.
    BACKWARD_FLOPS_FACTOR      FlashAttention's backward runs 5 matmuls per (query, key) block -- S = QK^T
                               recomputed, dP = dO V^T, dV += P^T dO, dQ += dS K, dK += dS^T Q -- against the
                               forward's 2 (S = QK^T, O = PV): 2.5x the forward FLOPs, at the same rate.
"""
from __future__ import annotations

__all__ = ["GB", "TFLOP", "DEFAULT_ATTN_TFLOPS", "DEFAULT_INTRA_NODE_GBPS", "DEFAULT_INTER_NODE_GBPS",
           "DEFAULT_GPUS_PER_NODE", "DEFAULT_COLLECTIVE_US", "DEFAULT_INTRA_MESSAGE_US", "DEFAULT_INTER_MESSAGE_US",
           "DEFAULT_KERNEL_LAUNCH_US", "DEFAULT_KERNEL_ENTRY_US", "DEFAULT_COPY_GBPS", "DEFAULT_COPY_LAUNCH_US", "BACKWARD_FLOPS_FACTOR", "US"]

GB = 1e9
TFLOP = 1e12
US = 1e-6
DEFAULT_ATTN_TFLOPS = 400.0  # effective attention TFLOP/s per GPU
DEFAULT_INTRA_NODE_GBPS = 300.0  # GB/s per GPU to same-node peers
DEFAULT_INTER_NODE_GBPS = 50.0  # GB/s per GPU to other nodes
DEFAULT_GPUS_PER_NODE = 8
DEFAULT_COLLECTIVE_US = 15.0
DEFAULT_INTRA_MESSAGE_US = 2.0
DEFAULT_INTER_MESSAGE_US = 5.0
DEFAULT_KERNEL_LAUNCH_US = 8.0
DEFAULT_KERNEL_ENTRY_US = 0.0
DEFAULT_COPY_GBPS = 2900.0
DEFAULT_COPY_LAUNCH_US = 4.0
BACKWARD_FLOPS_FACTOR = 2.5
