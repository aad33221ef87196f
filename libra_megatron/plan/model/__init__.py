"""What things cost (§2.3, §3.2, §4.4): the one model every placement, the planner and the simulator price by.

    rates         the default rates, stated once
    workload      FLOPs proxies (Eq. 2, 4, 6), imbalance, the lower bounds
    timing        ``StepTimeModel``: per-worker seconds of one pool's attention layer on the Pipeliner timeline
    ops           the op records one rank issues for a layer (exchanges, waits, kernels, copies)
    events        the whole-layer event model: every rank's op list priced with the peers coupled
    calibration   a measured per-shape kernel table the model can read
    kernel_fit    a kernel price fitted on measured Libra-shaped calls (forward and backward)
    kernel_cost   a calibrated per-tile kernel cost (review objection 2)
    memory        the operator's saved activation bytes and the save-mode rule

Pure numpy; imports nothing else of ``plan`` (every other room may import this one).
"""
from .calibration import CalibrationTable, resolve_calibration, shipped_calibrations
from .kernel_fit import KernelFit, PhaseFit, fit_kernel_calls, fit_quality
from .kernel_cost import FEATURES, TileCostModel, entry_features, fit_tile_cost_model, nnls, tile_features
from .memory import (choose_save_mode, deferred_relay_bytes, hosted_units, predicted_saved_bytes, saved_bytes_per_rank,
                     saved_layers)
from .events import OpCosts, PhaseTiming, kernel_floor_per_pair, price_ops
from .ops import COPY_KINDS, POOL, RELAY, Copy, Exchange, Kernel, Wait, op_keys
from .rates import (BACKWARD_FLOPS_FACTOR, DEFAULT_ATTN_TFLOPS, DEFAULT_COLLECTIVE_US, DEFAULT_COPY_GBPS,
                    DEFAULT_ADD_GBPS, DEFAULT_GATHER_GBPS, DEFAULT_PLACE_GBPS, DEFAULT_WIDEN_GBPS, DEFAULT_ELEMENTWISE_GBPS,
                    DEFAULT_COPY_LAUNCH_US, DEFAULT_GPUS_PER_NODE, DEFAULT_INTER_MESSAGE_US, DEFAULT_INTER_NODE_GBPS,
                    DEFAULT_INTRA_MESSAGE_US, DEFAULT_INTRA_NODE_GBPS, DEFAULT_KERNEL_ENTRY_US, DEFAULT_KERNEL_LAUNCH_US,
                    GB, TFLOP, US)
from .timing import RelayTiming, StepTimeModel, best_lead, link_seconds, pipeline_seconds
from .workload import (attention_flops, causal_pairs, check_pool_split, clt_expected_imbalance,
                       entry_pair_heads, imbalance, pool_lower_bound, pool_lower_bound_counting, sequence_flops,
                       worker_lower_bound)

__all__ = [
    "CalibrationTable", "resolve_calibration", "shipped_calibrations", "KernelFit", "PhaseFit", "fit_kernel_calls",
    "fit_quality", "FEATURES", "TileCostModel", "entry_features", "fit_tile_cost_model", "nnls", "tile_features",
    "choose_save_mode", "deferred_relay_bytes", "hosted_units", "predicted_saved_bytes", "saved_bytes_per_rank", "saved_layers",
    "OpCosts", "PhaseTiming", "kernel_floor_per_pair", "price_ops", "COPY_KINDS", "POOL", "RELAY", "Copy", "Exchange", "Kernel", "Wait", "op_keys", "BACKWARD_FLOPS_FACTOR",
    "DEFAULT_COLLECTIVE_US", "DEFAULT_COPY_GBPS", "DEFAULT_ADD_GBPS", "DEFAULT_GATHER_GBPS", "DEFAULT_PLACE_GBPS",
    "DEFAULT_WIDEN_GBPS", "DEFAULT_ELEMENTWISE_GBPS", "DEFAULT_COPY_LAUNCH_US", "DEFAULT_INTER_MESSAGE_US",
    "DEFAULT_INTRA_MESSAGE_US", "DEFAULT_KERNEL_ENTRY_US", "DEFAULT_KERNEL_LAUNCH_US",
    "DEFAULT_ATTN_TFLOPS", "DEFAULT_GPUS_PER_NODE", "DEFAULT_INTER_NODE_GBPS", "DEFAULT_INTRA_NODE_GBPS", "GB", "TFLOP", "US",
    "RelayTiming", "StepTimeModel", "best_lead", "link_seconds", "pipeline_seconds",
    "attention_flops", "causal_pairs", "check_pool_split", "clt_expected_imbalance",
    "entry_pair_heads", "imbalance", "pool_lower_bound", "pool_lower_bound_counting", "sequence_flops",
    "worker_lower_bound",
]
