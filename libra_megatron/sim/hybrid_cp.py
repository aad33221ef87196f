"""Megatron-LM's hybrid-CP balancer as a baseline: price its schedules with the simulator's time model.

Pure numpy. The schedules come from Megatron-LM's own ``BalancedCPScheduler`` run by
``libra_megatron.megatron.hybrid_cp_baseline`` in a subprocess (this package imports neither torch nor
megatron); ``subprocess_scheduler`` is the client the ``--megatron-hybrid-cp`` flag uses.

What is modelled (per attention layer, forward then backward, the same ``StepTimeModel`` as Libra):
  schedule   per GBS window, Megatron's groups run one after another (a barrier between groups); in a group
             every GPU runs its documents one after another; a document listed by cp GPUs of a group runs
             as one CP group of those GPUs (ranks of the DP x CP grid, GPU g on node g // gpus_per_node).
  compute    a document of l tokens is hq * l (l + 1) / 2 pair-heads (Eq. 6), split evenly over its cp
             GPUs (zigzag load balance), at the constant throughput (or the calibration table at l/cp
             query tokens and hq heads per call).
  comm       cp > 1: ring attention with per-step overlap, as Transformer Engine's P2P ring
             (``AttnFuncWithCPAndKVP2P``) runs it. Forward: cp steps of equal compute c, each one kernel call of
             compute / cp pair-heads (a q block against one K|V block) plus its launch
             (``StepTimeModel.launch_seconds``: none under a kernel fit, whose call price includes it); before step i (i >= 1) the K/V block of l/cp tokens (2 * hkv * d * elem bytes per
             token, all kv heads) arrives from the ring neighbour, sent while step i-1 computes, in
             x = alpha + bytes / bandwidth: alpha = the message latency (``StepTimeModel.intra_message_us`` /
             ``inter_message_us``) per ring step, the bandwidth intra-node when the CP group's GPUs share one
             node, inter-node otherwise (the ring's slowest link paces every step: every GPU waits for its
             neighbour, the coupling of a ring).
             forward  = c + (cp - 1) * max(c, x)
             Backward: cp steps of compute c_b = 2.5 x c (``BACKWARD_FLOPS_FACTOR``: FlashAttention's backward
             recomputes QK^T, 5 matmuls vs 2; a kernel fit's own backward) plus a launch; the K/V block travels the ring again and the
             partial dK|dV sums travel with it (TE sends K|V and dK|dV in one buffer per step, at the
             activation dtype), so each of the cp - 1 overlapped transfers moves twice the bytes,
             x_b = alpha + 2 * bytes / bandwidth; after the last step the dK|dV block takes one more hop home,
             x (exposed: nothing is left to compute).
             backward = c_b + (cp - 1) * max(c_b, x_b) + x
             The exposed part of each phase is its time minus its compute (cp x c or cp x c_b, launches included).
  not        the per-step all-to-all that reroutes sub-samples to their GPUs (once per step, not per
             layer), padding of documents to multiples of 2*cp, the softmax-correction copies of every ring step
             and the zigzag halves' extra kernel calls -- all favour Megatron.
The window's time is the sum over groups of the slowest GPU's time (forward + backward of its documents); it is
compared with Libra's sum of GA step stragglers over the same window and the same lower bound (whole layer;
the ``forward_*`` keys: the forward alone, without latencies and launches, over the forward-only bound).
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..plan.model import US, StepTimeModel

__all__ = ["HybridCpBaseline", "HybridCpDims", "price_schedule", "subprocess_scheduler", "ring_document_seconds",
           "ring_layer_seconds", "BASELINE_MODULE"]


BASELINE_MODULE = "libra_megatron.megatron.hybrid_cp_baseline"
Schedule = List[List[List[int]]]  # groups x GPUs x document indices


@dataclass(frozen=True)
class HybridCpDims:
    """Attention shape as the baseline needs it: query heads, kv heads, bytes per element."""

    num_q_heads: int
    num_kv_heads: int
    elem_bytes: int


def ring_document_seconds(length: int, members: Sequence[int], dims: HybridCpDims,
                          cost: StepTimeModel) -> Tuple[float, float]:
    """(seconds, compute seconds) of one document of ``length`` tokens on the CP group ``members`` (GPU ids)."""
    cp = len(members)
    pair_heads = dims.num_q_heads * length * (length + 1) / 2.0
    compute = float(cost.call_seconds(pair_heads / cp, length / cp, dims.num_q_heads))
    if cp == 1:
        return compute, compute
    nodes = {g // cost.gpus_per_node for g in members}
    block_bytes = length / cp * 2 * dims.num_kv_heads * cost.head_dim * dims.elem_bytes
    x = float(cost.comm_seconds(block_bytes, 0.0) if len(nodes) == 1 else cost.comm_seconds(0.0, block_bytes))
    step = compute / cp
    return step + (cp - 1) * max(step, x), compute


def ring_layer_seconds(length: int, members: Sequence[int], dims: HybridCpDims,
                       cost: StepTimeModel) -> Tuple[float, float, float, float]:
    """(forward seconds, forward compute, backward seconds, backward compute) of one document of ``length``
    tokens on the CP group ``members`` (GPU ids), the whole-layer ring model of the module docstring."""
    cp = len(members)
    pair_heads = dims.num_q_heads * length * (length + 1) / 2.0
    step = pair_heads / cp / cp  # one ring step's call: a q block of l/cp tokens against one K|V block
    launch, launch_b = (cost.launch_seconds(d) if length > 0 else 0.0 for d in ("fwd", "bwd"))
    step_f = float(cost.call_seconds(step, length / cp, dims.num_q_heads)) + launch
    step_b = float(cost.bwd_call_seconds(step, length / cp, dims.num_q_heads)) + launch_b
    if cp == 1:
        return step_f, step_f, step_b, step_b
    inter = len({g // cost.gpus_per_node for g in members}) > 1
    alpha = (cost.inter_message_us if inter else cost.intra_message_us) * US
    block_bytes = length / cp * 2 * dims.num_kv_heads * cost.head_dim * dims.elem_bytes

    def hop(nbytes: float) -> float:
        return alpha + float(cost.comm_seconds(0.0, nbytes) if inter else cost.comm_seconds(nbytes, 0.0))

    x, x_b = hop(block_bytes), hop(2.0 * block_bytes)
    forward = step_f + (cp - 1) * max(step_f, x)
    backward = step_b + (cp - 1) * max(step_b, x_b) + x
    return forward, cp * step_f, backward, cp * step_b


def _group_gpu_seconds(group: List[List[int]], doc_lens: Sequence[int], dims: HybridCpDims,
                       cost: StepTimeModel, layer: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """(seconds [GPUs], compute [GPUs]) of one group of the schedule: forward only (``ring_document_seconds``)
    or, ``layer``, forward + backward (``ring_layer_seconds``)."""
    members = {}
    for gpu, docs in enumerate(group):
        for d in docs:
            members.setdefault(d, []).append(gpu)
    if layer:
        per_doc = {}
        for d, gpus in members.items():
            fs, fc, bs, bc = ring_layer_seconds(int(doc_lens[d]), gpus, dims, cost)
            per_doc[d] = (fs + bs, fc + bc)
    else:
        per_doc = {d: ring_document_seconds(int(doc_lens[d]), gpus, dims, cost) for d, gpus in members.items()}
    seconds = np.array([sum(per_doc[d][0] for d in docs) for docs in group])
    compute = np.array([sum(per_doc[d][1] for d in docs) for docs in group])
    return seconds, compute


def price_schedule(schedule: Schedule, doc_lens: Sequence[int], dims: HybridCpDims,
                   cost: StepTimeModel, layer: bool = False) -> Tuple[float, float]:
    """(window seconds, compute seconds on the critical path): sum over groups of the slowest GPU's time and
    of that GPU's compute (ties go to the largest compute); forward only, or ``layer``: forward + backward."""
    total = compute_total = 0.0
    for group in schedule:
        seconds, compute = _group_gpu_seconds(group, doc_lens, dims, cost, layer)
        top = seconds.max(initial=0.0)
        total += top
        compute_total += compute[seconds >= top * (1.0 - 1e-9)].max(initial=0.0)
    return total, compute_total


def subprocess_scheduler(python: str = sys.executable) -> Callable[[List[List[int]], int, int], List[Schedule]]:
    """A scheduler that runs Megatron-LM's BalancedCPScheduler in ``python -m BASELINE_MODULE`` (one process
    for all windows). ValueError (one line) when that interpreter cannot import megatron-core."""

    def schedule(windows: List[List[int]], dp_cp: int, max_seqlen_per_rank: int) -> List[Schedule]:
        request = json.dumps({"dp_cp": dp_cp, "max_seqlen_per_rank": max_seqlen_per_rank, "windows": windows})
        proc = subprocess.run([python, "-m", BASELINE_MODULE], input=request, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ValueError(f"--megatron-hybrid-cp: {python} -m {BASELINE_MODULE} failed ({last}); it needs "
                             f"megatron-core 0.16.1 (pip install -e '.[megatron]')")
        return json.loads(proc.stdout)["schedules"]

    return schedule


@dataclass(frozen=True)
class HybridCpBaseline:
    """The baseline as the simulator runs it: ``scheduler(windows, dp_cp, max_seqlen_per_rank)`` returns one
    ``Schedule`` per window (``subprocess_scheduler`` runs Megatron-LM's own code). ``max_seqlen_per_rank``
    is Megatron's ``--max-seqlen-per-dp-cp-rank`` (None: seq_len / CP, the tokens a rank holds under plain CP)."""

    scheduler: Callable[[List[List[int]], int, int], List[Schedule]]
    max_seqlen_per_rank: Optional[int] = None

    def evaluate(self, windows: List[List[int]], lower_bounds: Sequence[float], num_steps: int, dims: HybridCpDims,
                 cost: StepTimeModel, dp_cp: int, seq_len: int, cp: int,
                 forward_lower_bounds: Optional[Sequence[float]] = None) -> dict:
        """JSON-ready summary over ``windows`` (document lengths of each GBS window); ``lower_bounds`` are the
        windows' perfectly balanced, communication-free forward + backward times (GA steps each, as Libra's),
        ``forward_lower_bounds`` the forward-only ones (the ``forward_*`` keys)."""
        cap = self.max_seqlen_per_rank or seq_len // cp
        schedules = self.scheduler(windows, dp_cp, cap)
        out = {"max_seqlen_per_rank": int(cap), "num_groups_mean": float(np.mean([len(s) for s in schedules]))}
        for prefix, layer, bounds in (("", True, lower_bounds), ("forward_", False, forward_lower_bounds)):
            if bounds is None:
                continue
            priced = np.array([price_schedule(s, lens, dims, cost, layer) for s, lens in zip(schedules, windows)])
            seconds, compute = priced[:, 0], priced[:, 1]
            out.update({f"{prefix}mean_step_seconds": float(seconds.mean() / num_steps),
                        f"{prefix}compute_seconds": float(compute.mean() / num_steps),
                        f"{prefix}exposed_comm_seconds": float((seconds - compute).mean() / num_steps),
                        f"{prefix}straggler_vs_lower_bound": float(seconds.sum() / np.sum(bounds))})
        return out
