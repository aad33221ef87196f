"""Seconds of one pool's attention layer forward per worker: the Pipeliner's event timeline (§4.4, issue 14).

Pure numpy; one rule shared by the simulator (``sim.pools``, ``sim.baselines``) and the time-aware tile placement
(``plan.tiles.timeaware``). Per worker, with M chunks (chunk m holds head piece m of every hosted entry):
    L_m = local compute / M      entries whose Q and K/V rows all come from the worker itself (the all_to_all's
                                 self segment, ``ExchangePlan.hosted_pair_heads[0]``): they need no received data
    X_m = remote compute / M     every other entry
    D_m, R_m                     seconds of chunk m's dispatch (Q/M, plus K/V/F when chunk m sends K/V) and
                                 return (O/M) on the worker's link (``PlanTraffic.phase_seconds``)
The runtime's forward (``runtime.libra_attn._fwd``) runs, per worker, with k = the worker's *lead* (local
chunks computed before the first remote one; ``best_lead`` picks it per worker, the plan carries it):
    issue D_0, D_1, ..., D_{M-1}                (all at t = 0; they queue on the link in chunk order)
    compute L_0 .. L_{k-1}                      (local entries: overlap the dispatches in flight)
    for m in 0..M-1: wait D_m; compute X_m; issue R_m
    compute L_k .. L_{M-1}                      (the rest of the local entries overlap the returns)
    wait R_0 .. R_{M-1}
k = M + 1 means no local split: each chunk's entries run in one call after its dispatch (L = 0, X = all).
With a relay (``RelayTiming``: the plan's relay route, ``plan.exchange``), every rank issues chunk m's relay
F_m when it has waited D_m (on a second communicator: its own FIFO link), and a rank that receives relayed
rows in chunk m also waits F_m before X_m:
    issue_m[w] = max(compute free, D_m arrived)
    F_m ends   = max(issue_m[w], issue_m of every relay partner of w, relay link free) + F_m seconds
(an all_to_all moves a pair's rows once both sides have issued it); the relay link's last F ends before
the layer does.
Two resources: one FIFO comm link (transfers run one at a time in issue order D_0, ..., D_{M-1}, R_0, ...,
R_{M-1}; each starts at max(issue time, link free)) and one compute stream (sequential; a wait blocks later
compute until the transfer ends). seconds = when the last wait returns; compute = sum(L) + sum(X); exposed
communication = seconds - compute. With L = 0 (``local_first=False``) every entry waits for its chunk's
dispatch (the runtime where no entry is local; and the price of this schedule without the local split).

Default rates: ``plan.model.rates`` (the one place). Compute runs at a constant rate, or -- for the simulator's
pricing of kernel calls (``call_seconds``) -- at the rate of a measured per-shape table (``calibration``); the
placements and the leads always price at the constant rate.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import numpy as np

from .calibration import CalibrationTable
from .kernel_fit import KernelFit
from .rates import (BACKWARD_FLOPS_FACTOR, DEFAULT_ATTN_TFLOPS, DEFAULT_COLLECTIVE_US, DEFAULT_COPY_GBPS, DEFAULT_ADD_GBPS, DEFAULT_GATHER_GBPS, DEFAULT_PLACE_GBPS,
                    DEFAULT_WIDEN_GBPS, DEFAULT_ELEMENTWISE_GBPS,
                    DEFAULT_COPY_LAUNCH_US, DEFAULT_GPUS_PER_NODE, DEFAULT_INTER_MESSAGE_US, DEFAULT_INTER_NODE_GBPS,
                    DEFAULT_INTRA_MESSAGE_US, DEFAULT_INTRA_NODE_GBPS, DEFAULT_KERNEL_ENTRY_US, DEFAULT_KERNEL_LAUNCH_US, GB,
                    TFLOP, US)
from .workload import attention_flops

__all__ = ["StepTimeModel", "RelayTiming", "pipeline_seconds", "best_lead", "link_seconds"]


def link_seconds(intra_bytes, inter_bytes, intra_node_gbps: float, inter_node_gbps: float) -> np.ndarray:
    """Busy seconds of a worker's links: max(intra bytes / intra bw, inter bytes / inter bw) (the two link
    classes run concurrently; bytes are already max(sent, received) per class: full-duplex links)."""
    intra = np.asarray(intra_bytes, dtype=np.float64) / (intra_node_gbps * GB)
    inter = np.asarray(inter_bytes, dtype=np.float64) / (inter_node_gbps * GB)
    return np.maximum(intra, inter)


@dataclass(frozen=True, eq=False)
class RelayTiming:
    """The relay hop of a plan on the timeline (``PlanTraffic.relay_timing``).

    seconds   float64 [W, M]  link seconds of chunk m's relay F_m per worker (0 on chunks that send no K/V)
    partners  bool [W, W]     w and v exchange relayed rows (either direction)
    receives  bool [W, M]     w receives relayed rows in chunk m (it waits F_m before its remote entries)
    """

    seconds: np.ndarray
    partners: np.ndarray
    receives: np.ndarray


def pipeline_seconds(local_compute, remote_compute, dispatch_seconds, return_seconds,
                     local_first: bool = True, lead=None, relay: Optional[RelayTiming] = None
                     ) -> Tuple[np.ndarray, np.ndarray]:
    """(seconds [W], compute [W]) of the Pipeliner timeline (module docstring), vectorised over workers.

    local_compute, remote_compute  float [W]: seconds of the worker's local / remote entries (all M chunks)
    dispatch_seconds, return_seconds  float [W, M]: link seconds of chunk m's dispatch / return
    local_first  False: local entries run with the remote ones, after their chunk's dispatch (for comparison)
    lead         int [W] in [0, M + 1]: local chunks before the first remote one, M + 1 = no local split
                 (default ``best_lead``)
    relay        the plan's relay hop (``RelayTiming``), None without one
    """
    local, remote, dispatch, ret = _timeline_inputs(local_compute, remote_compute, dispatch_seconds, return_seconds)
    compute = local + remote
    if not local_first:
        local, remote = np.zeros_like(local), compute
    if lead is None:
        lead = best_lead(local, remote, dispatch, ret, relay)
    lead = np.broadcast_to(np.asarray(lead, dtype=np.int64), local.shape)
    return _timeline(local, remote, dispatch, ret, lead, relay), compute


def best_lead(local_compute, remote_compute, dispatch_seconds, return_seconds,
              relay: Optional[RelayTiming] = None) -> np.ndarray:
    """int64 [W]: the lead in [0, M + 1] with the shortest timeline per worker (ties, to 1e-12 relative: the
    largest). Lead M + 1 = no local split: every entry in its chunk's single call, after the dispatch. With a
    relay each candidate lead is priced with every worker on it (a worker's relay partners move with it)."""
    local, remote, dispatch, ret = _timeline_inputs(local_compute, remote_compute, dispatch_seconds, return_seconds)
    M = dispatch.shape[1]
    # every lead in one pass: the timeline is elementwise over (lead, worker) rows (the relay's partners
    # couple workers of one lead only), so stacking the M + 2 candidates gives the same floats as M + 2 calls
    leads = np.broadcast_to(np.arange(M + 2, dtype=np.int64)[:, None], (M + 2,) + local.shape)
    times = _timeline(local, remote, dispatch, ret, leads, relay)  # [M+2, W]
    near = times <= times.min(axis=0) * (1.0 + 1e-12) + 1e-300  # floating-point ties count as ties
    return (M + 1 - np.argmax(near[::-1], axis=0)).astype(np.int64)


def _timeline_inputs(local_compute, remote_compute, dispatch_seconds, return_seconds):
    local = np.asarray(local_compute, dtype=np.float64)
    remote = np.asarray(remote_compute, dtype=np.float64)
    dispatch = np.asarray(dispatch_seconds, dtype=np.float64)
    ret = np.asarray(return_seconds, dtype=np.float64)
    if dispatch.ndim != 2 or dispatch.shape != ret.shape or dispatch.shape[:1] != local.shape or \
            local.shape != remote.shape or dispatch.shape[1] < 1:
        raise ValueError(f"pipeline_seconds needs local, remote [W] and dispatch, return [W, M >= 1] seconds, got "
                         f"{local.shape}, {remote.shape}, {dispatch.shape}, {ret.shape}")
    return local, remote, dispatch, ret


def _timeline(local, remote, dispatch, ret, lead, relay: Optional[RelayTiming] = None) -> np.ndarray:
    """seconds [..., W] of the listing with lead k = ``lead`` [..., W] (k = M + 1: no local split); local, remote
    [W] and dispatch, ret [W, M] broadcast over the leading dimensions of ``lead`` (``best_lead``: one per lead)."""
    M = dispatch.shape[1]
    unsplit = lead > M
    local, remote, lead = np.where(unsplit, 0.0, local), np.where(unsplit, local + remote, remote), np.minimum(lead, M)
    arrived = np.cumsum(dispatch, axis=1)  # D_m issued at t = 0, one after another on the link
    link = np.broadcast_to(arrived[:, -1], lead.shape)
    relay_free = np.zeros(lead.shape)
    t = local * lead / M  # L_0 .. L_{k-1}
    for m in range(M):
        t = np.maximum(t, arrived[:, m])
        if relay is not None and (relay.seconds[:, m].any() or relay.receives[:, m].any()):
            peers = np.where(relay.partners, t[..., None, :], 0.0).max(axis=-1, initial=0.0)
            relay_free = np.maximum(np.maximum(t, peers), relay_free) + relay.seconds[:, m]
            t = np.where(relay.receives[:, m], np.maximum(t, relay_free), t)
        t = t + remote / M
        link = np.maximum(t, link) + ret[:, m]  # R_m issued after X_m
    t = t + local * (M - lead) / M  # L_k .. L_{M-1}
    return np.maximum(np.maximum(t, link), relay_free)


@dataclass(frozen=True)
class StepTimeModel:
    """The constant-rate time model of one pool (defaults: the module constants).

    first_gpu: global GPU index of pool worker 0; worker w sits on node (first_gpu + w) // gpus_per_node.
    worker_nodes: when given, the node of every pool worker (a run's pool ranks // GPUs per node: with TP > 1
        a pool's workers are not consecutive GPUs); it overrides first_gpu / gpus_per_node in ``nodes``.
    local_first: the runtime computes local entries while the dispatches are in flight (False: every entry
    after its chunk's dispatch, for comparison).
    kv_relay: exchange plans relay K/V through one destination per node (``plan.exchange``, "Relay"): a
    home run fetched by several workers of another node crosses nodes once.
    calibration: a measured per-shape kernel table, or a ``kernel_fit.KernelFit`` on measured Libra-shaped calls
    (forward and backward each its own, launch included); ``call_seconds``, ``bwd_call_seconds``,
    ``peak_compute_seconds``, ``balanced_layer_seconds`` and the event model's kernels read it; None = the constant
    ``attn_tflops``.
    collective_us, intra_message_us, inter_message_us, kernel_launch_us, kernel_entry_us, copy_launch_us, gather_gbps,
    place_gbps, add_gbps, widen_gbps, elementwise_gbps, copy_gbps: the whole-layer event model's latencies and copy
    rates, each copy kind its own (gather, ``index_put_``, ``index_add_``, widening casts, cat / fill / narrowing
    casts; copy_gbps: the all_to_all's self segment) (``plan.model.events``; defaults and their sources in
    ``plan.model.rates``); attn_bwd_tflops, bwd_kernel_launch_us, bwd_kernel_entry_us: the backward kernel's own
    rate and costs where they differ from the forward's (None: the forward's; a CPU fit measures them). The Pipeliner timeline (``pipeline_seconds``, the placements' search) reads none of them.
    """

    head_dim: int
    attn_tflops: float = DEFAULT_ATTN_TFLOPS
    intra_node_gbps: float = DEFAULT_INTRA_NODE_GBPS
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    first_gpu: int = 0
    worker_nodes: tuple = ()
    local_first: bool = True
    kv_relay: bool = False
    calibration: Optional[Union[CalibrationTable, KernelFit]] = None
    collective_us: float = DEFAULT_COLLECTIVE_US
    intra_message_us: float = DEFAULT_INTRA_MESSAGE_US
    inter_message_us: float = DEFAULT_INTER_MESSAGE_US
    kernel_launch_us: float = DEFAULT_KERNEL_LAUNCH_US
    kernel_entry_us: float = DEFAULT_KERNEL_ENTRY_US  # per varlen entry of a call (0 for flash-attn; a CPU fit's per-entry loop cost)
    copy_gbps: float = DEFAULT_COPY_GBPS  # plain copies: the self segment of an all_to_all
    gather_gbps: float = DEFAULT_GATHER_GBPS  # Copy op "gather" (index_select)
    place_gbps: float = DEFAULT_PLACE_GBPS  # Copy op "place" (index_put_)
    add_gbps: float = DEFAULT_ADD_GBPS  # Copy op "add" (index_add_ into fp32 sums)
    widen_gbps: float = DEFAULT_WIDEN_GBPS  # Copy op "widen" (a cast to a larger dtype)
    elementwise_gbps: float = DEFAULT_ELEMENTWISE_GBPS  # Copy op "elementwise" (cat, fill, a narrowing cast)
    copy_launch_us: float = DEFAULT_COPY_LAUNCH_US
    attn_bwd_tflops: Optional[float] = None  # the backward kernel's rate on its FLOPs; None: attn_tflops
    bwd_kernel_launch_us: Optional[float] = None  # None: kernel_launch_us
    bwd_kernel_entry_us: Optional[float] = None  # None: kernel_entry_us

    def __post_init__(self) -> None:
        for name in ("attn_tflops", "intra_node_gbps", "inter_node_gbps", "copy_gbps", "gather_gbps", "place_gbps",
                     "add_gbps", "widen_gbps", "elementwise_gbps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value!r} "
                                 f"(StepTimeModel.{name})")
        for name in ("collective_us", "intra_message_us", "inter_message_us", "kernel_launch_us", "kernel_entry_us",
                     "copy_launch_us"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value!r} "
                                 f"(StepTimeModel.{name})")
        for name in ("head_dim", "gpus_per_node"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)!r} "
                                 f"(StepTimeModel.{name})")
        for name in ("attn_bwd_tflops", "bwd_kernel_launch_us", "bwd_kernel_entry_us"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)
                                          and (value > 0 if name == "attn_bwd_tflops" else value >= 0)):
                raise ValueError(f"StepTimeModel.{name} must be a finite number ({'> 0' if name == 'attn_bwd_tflops' else '>= 0'}) "
                                 f"or None, got {value!r}")
        if int(self.first_gpu) < 0:
            raise ValueError(f"StepTimeModel.first_gpu must be >= 0, got {self.first_gpu!r}")
        if self.calibration is not None and self.calibration.head_dim != self.head_dim:
            raise ValueError(f"--calibration was measured at head_dim {self.calibration.head_dim}, "
                             f"but --head-dim is {self.head_dim}")

    def at_gpu(self, first_gpu: int) -> "StepTimeModel":
        """The same model for a pool whose worker 0 is global GPU ``first_gpu``."""
        return dataclasses.replace(self, first_gpu=int(first_gpu))

    def nodes(self, num_workers: int) -> np.ndarray:
        """int64 [W]: node of every pool worker."""
        if self.worker_nodes:
            if len(self.worker_nodes) != num_workers:
                raise ValueError(f"StepTimeModel.worker_nodes names {len(self.worker_nodes)} workers, the pool has "
                                 f"{num_workers}")
            return np.asarray(self.worker_nodes, dtype=np.int64)
        return (self.first_gpu + np.arange(num_workers, dtype=np.int64)) // self.gpus_per_node

    def compute_seconds(self, pair_heads) -> np.ndarray:
        """Seconds of ``pair_heads`` causal pairs x query heads at the constant ``attn_tflops``."""
        return attention_flops(pair_heads, self.head_dim) / (self.attn_tflops * TFLOP)

    def call_seconds(self, pair_heads, call_tokens, heads_per_call: int) -> np.ndarray:
        """Seconds of kernel calls of ``pair_heads`` work, each ``call_tokens`` query tokens x ``heads_per_call``
        heads: at the ``calibration`` table's rate for that shape, else the constant rate; a ``KernelFit``
        prices the whole forward call (its launch included)."""
        if self.calibration is None:
            return self.compute_seconds(pair_heads)
        if isinstance(self.calibration, KernelFit):
            return self.calibration.call_seconds(pair_heads, call_tokens, heads_per_call, "fwd")
        return attention_flops(pair_heads, self.head_dim) / self.calibration.flops_per_second(call_tokens,
                                                                                             heads_per_call)

    def tile_seconds(self, pair_heads, tile_tokens, heads_per_call: int) -> np.ndarray:
        """Forward seconds of pieces of a chunk's call (SH-Tiles), each priced alone: ``call_seconds``, except under
        a ``KernelFit``, where a tile is its share of a full call (``PhaseFit.share_seconds``: no launch of its own,
        no wave of its own)."""
        if isinstance(self.calibration, KernelFit):
            return self.calibration.fwd.share_seconds(pair_heads, tile_tokens, heads_per_call)
        return self.call_seconds(pair_heads, tile_tokens, heads_per_call)

    def bwd_call_seconds(self, pair_heads, call_tokens, heads_per_call: int) -> np.ndarray:
        """The backward of ``call_seconds``' call: a ``KernelFit``'s own backward, else ``BACKWARD_FLOPS_FACTOR`` x
        the forward's seconds."""
        if isinstance(self.calibration, KernelFit):
            return self.calibration.call_seconds(pair_heads, call_tokens, heads_per_call, "bwd")
        return self.call_seconds(pair_heads, call_tokens, heads_per_call) * BACKWARD_FLOPS_FACTOR

    def launch_seconds(self, direction: str = "fwd") -> float:
        """What one kernel call adds on top of ``call_seconds`` / ``bwd_call_seconds``: nothing under a ``KernelFit``
        (its call price includes the launch), else ``kernel_launch_us`` (``bwd_kernel_launch_us`` for "bwd", when
        set) -- what ``plan.model.events`` charges Libra's calls, for the baselines' calls too."""
        if direction not in ("fwd", "bwd"):
            raise ValueError(f"launch_seconds: direction must be 'fwd' or 'bwd', got {direction!r}")
        if isinstance(self.calibration, KernelFit):
            return 0.0
        if direction == "bwd" and self.bwd_kernel_launch_us is not None:
            return self.bwd_kernel_launch_us * US
        return self.kernel_launch_us * US

    def peak_compute_seconds(self, pair_heads) -> np.ndarray:
        """Seconds at the best throughput any call shape reaches (lower bounds)."""
        if self.calibration is None:
            return self.compute_seconds(pair_heads)
        return attention_flops(pair_heads, self.head_dim) / self.calibration.peak_flops_per_second()

    def balanced_seconds(self, pair_heads, num_workers: int) -> float:
        """The lower bound a step is measured against: ``pair_heads`` of attention work at the peak rate
        (``peak_compute_seconds``) spread perfectly over ``num_workers`` worker-steps, no communication."""
        if int(num_workers) < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        return float(self.peak_compute_seconds(pair_heads)) / int(num_workers)

    def balanced_layer_seconds(self, pair_heads, num_workers: int) -> float:
        """``balanced_seconds`` of the whole layer: forward plus backward, the backward at
        ``BACKWARD_FLOPS_FACTOR`` x the forward FLOPs (FlashAttention's recomputation included, ``plan.model.rates``)."""
        if isinstance(self.calibration, KernelFit):  # each direction at its own peak
            fwd_peak, bwd_peak = (self.calibration.peak_flops_per_second(d) for d in ("fwd", "bwd"))
            return self.balanced_seconds(pair_heads, num_workers) * (1.0 + fwd_peak / bwd_peak)
        return self.balanced_seconds(pair_heads, num_workers) * (1.0 + BACKWARD_FLOPS_FACTOR)

    def comm_seconds(self, intra_bytes, inter_bytes) -> np.ndarray:
        return link_seconds(intra_bytes, inter_bytes, self.intra_node_gbps, self.inter_node_gbps)

    def worker_seconds(self, local_compute, remote_compute, dispatch_seconds, return_seconds, lead=None,
                       relay: Optional[RelayTiming] = None) -> np.ndarray:
        """float64 [W]: compute + exposed comm per worker (``pipeline_seconds``; ``lead`` None = the best)."""
        return pipeline_seconds(local_compute, remote_compute, dispatch_seconds, return_seconds, self.local_first,
                                lead, relay)[0]

    def assumptions(self) -> Dict[str, object]:
        """JSON-ready record of what the model assumes (the simulator's report)."""
        out: Dict[str, object] = {
            "attn_tflops": self.attn_tflops, "intra_node_gbps": self.intra_node_gbps,
            "inter_node_gbps": self.inter_node_gbps, "gpus_per_node": self.gpus_per_node,
            "head_dim": self.head_dim, "flops_per_pair_head": 4 * self.head_dim,
            "local_first": self.local_first, "kv_relay": self.kv_relay,
            "collective_us": self.collective_us, "intra_message_us": self.intra_message_us,
            "inter_message_us": self.inter_message_us, "kernel_launch_us": self.kernel_launch_us,
            "kernel_entry_us": self.kernel_entry_us,
            "copy_gbps": self.copy_gbps, "gather_gbps": self.gather_gbps, "place_gbps": self.place_gbps,
            "add_gbps": self.add_gbps, "widen_gbps": self.widen_gbps, "elementwise_gbps": self.elementwise_gbps,
            "copy_launch_us": self.copy_launch_us,
            "backward_flops_factor": BACKWARD_FLOPS_FACTOR, "attn_bwd_tflops": self.attn_bwd_tflops,
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
            "device": self.calibration.device, "heads": list(self.calibration.heads),
            "kind": getattr(self.calibration, "kind", "table")}
        if isinstance(self.calibration, KernelFit):
            out["calibration"].update(fwd=self.calibration.fwd.to_mapping(), bwd=self.calibration.bwd.to_mapping())
        return out
