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
    DEFAULT_GATHER_GBPS        row gathers (``index_select`` / advanced-index reads: send buffers, packed K|V,
    DEFAULT_PLACE_GBPS         received rows that fill their target), row placements (``index_put_``) and fp32
    DEFAULT_ADD_GBPS           row sums (``index_add_``, dK|dV): each moves its bytes twice (read + write) at its
                               own rate, measured on one H200 from the runtime's own calls (torch.profiler device
                               time of ``libra_attn_func`` fwd+bwd at P=1, 32K tokens, 32 / 4 heads, H=1 M=1 and
                               H=2 M=2, ``docs/gpu/h200-2026-12-04/overhead_profile_after.txt``, over the bytes of
                               ``plan.exchange.schedule``'s op lists, less 4 us a call): gather 3490, index_put_
                               890, fp32 index_add_ 1160 GB/s (``tests/plan/test_rates.py`` derives them again
                               from that file). One rate for all three (2900 before) priced index_put_ at 3.3x and
                               index_add_ at 2.5x their speed.
    DEFAULT_WIDEN_GBPS         dense kernels of the runtime, priced like the copies above from the same profile
    DEFAULT_ELEMENTWISE_GBPS   and the same op lists (``tests/plan/test_rates.py``): casts to a wider dtype (bf16
                               -> fp32 dK|dV, torch's unvectorised ``direct_copy`` with a cast: 2210 GB/s) and the
                               rest (``torch.cat`` of K|V, ``new_zeros`` of the fp32 sums, casts back to bf16:
                               4820 GB/s, a fill counting half its bytes). Unpriced before: 14% of the profile's
                               copy time.
    DEFAULT_COPY_GBPS          a plain device copy (the self segment of an ``all_to_all_single``): 4180 GB/s, one
                               H200 copying a 268 MB buffer (``place_copies``, docs/gpu.md).
    DEFAULT_COPY_LAUNCH_US     every copy kernel: 4 us.
    BACKWARD_FLOPS_FACTOR      FlashAttention's backward runs 5 matmuls per (query, key) block -- S = QK^T
                               recomputed, dP = dO V^T, dV += P^T dO, dQ += dS K, dK += dS^T Q -- against the
                               forward's 2 (S = QK^T, O = PV): 2.5x the forward FLOPs, at the same rate.
"""
from __future__ import annotations

__all__ = ["GB", "TFLOP", "DEFAULT_ATTN_TFLOPS", "DEFAULT_INTRA_NODE_GBPS", "DEFAULT_INTER_NODE_GBPS",
           "DEFAULT_GPUS_PER_NODE", "DEFAULT_COLLECTIVE_US", "DEFAULT_INTRA_MESSAGE_US", "DEFAULT_INTER_MESSAGE_US",
           "DEFAULT_KERNEL_LAUNCH_US", "DEFAULT_KERNEL_ENTRY_US", "DEFAULT_COPY_GBPS", "DEFAULT_GATHER_GBPS",
           "DEFAULT_PLACE_GBPS", "DEFAULT_ADD_GBPS", "DEFAULT_WIDEN_GBPS", "DEFAULT_ELEMENTWISE_GBPS",
           "DEFAULT_COPY_LAUNCH_US", "BACKWARD_FLOPS_FACTOR", "US"]

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
DEFAULT_COPY_GBPS = 4180.0
DEFAULT_GATHER_GBPS = 3490.0
DEFAULT_PLACE_GBPS = 890.0
DEFAULT_ADD_GBPS = 1160.0
DEFAULT_WIDEN_GBPS = 2210.0
DEFAULT_ELEMENTWISE_GBPS = 4820.0
DEFAULT_COPY_LAUNCH_US = 4.0
BACKWARD_FLOPS_FACTOR = 2.5
