"""Synchronisation model of one optimizer step: who waits for whom, and the step time that follows.

Pure Python + numpy. Input: per GA microbatch g and per worker w, the seconds of one attention layer's
forward of that worker, ``worker_seconds[g, w]``, and of its backward, ``backward_seconds[g, w]`` (same shape;
the simulator passes each pool's priced backward, ``plan.exchange.plan_layer_timing``), with w = dp*CP + c (DP
replica major, CP rank minor; ``plan.sequences.assign_to_ranks``: pool instance k runs at GA step k*P // DP on
the P consecutive DP replicas starting at (k mod DP/P)*P). Output: the step's seconds under these rules:

pool        The P*CP workers of a pool meet at every attention layer (the KV/tile exchange), forward and
            backward, so a pool's forward (backward) time for a microbatch is the max over its workers of
            their forward (backward) seconds. The P replicas forming a pool are the
            same at every GA step: they form a *lane* (``num_lanes = DP/P``).
EP          An expert-parallel group meets at every MoE layer. Megatron places it by rank order
            (``tp-cp-ep-dp-pp``; experts use ``etp-ep-edp`` over the same ranks of a PP stage), so the
            group of rank r = tp + TP*(cp + CP*dp) is the EP consecutive multiples of ETP around it. Lanes
            whose replicas share an EP group are *tied*: they advance at the max of their times, layer by
            layer, so a tied set of lanes behaves as one lane with the per-microbatch max. In the shipped
            configs EP*ETP <= TP*CP: every EP group stays inside one replica and nothing is tied.
pipeline    Each (tied set of) lane(s) runs its GA microbatches through PP stages with Megatron's 1F1B
            schedule, or the interleaved schedule with VPP model chunks per stage
            (``megatron.core.pipeline_parallel.schedules``, microbatch group size = PP). The schedule is
            simulated op by op (``PipelineSchedule``): an op starts when its stage finished the previous op
            and its producer finished (forward: the previous virtual stage; backward: the next one, or the
            microbatch's last forward). Point-to-point transfers take no time.
DP          Lanes meet once, at the step's gradient reduction, which is assumed fully overlapped with the
            backward (Megatron's --overlap-grad-reduce): the step ends when the slowest lane ends.

Stage times: layers are split evenly over the PP*VPP virtual stages, so a microbatch's forward (backward) on
one virtual stage is its per-layer attention forward (backward) seconds / VPP (the unit is "one attention layer
per stage": every stage carries the same number of layers, and a common factor does not change any ratio).
Without a backward array (the sequence placement's F proxies, ``plan.sequences.lanes``), backward =
``backward_ratio`` x forward (default 2). Non-attention work is equal for every packed sequence (same token
count) and is added as ``other_seconds`` per microbatch and stage to the forward and ``backward_ratio`` x
``other_seconds`` to the backward (default 0: attention only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

__all__ = ["SyncLayout", "PipelineSchedule", "PipelineRun", "StepTiming", "pipeline_schedule", "step_timing", "pool_step_timing", "run_lane_pipelines",
           "lane_of_pool", "SIM_FLAGS", "critical_path_seconds"]

SIM_FLAGS: Dict[str, str] = {  # SyncLayout field -> the simulator flag that sets it (error messages)
    "data_parallel_size": "--dp", "pool_size": "--pool-size", "num_microbatches": "--gbs / --dp",
    "pipeline_parallel_size": "--pp", "virtual_pipeline_size": "--vpp", "tensor_parallel_size": "--tp",
    "context_parallel_size": "--cp", "expert_parallel_size": "--ep", "expert_tensor_parallel_size": "--etp",
    "backward_ratio": "--backward-ratio", "other_seconds": "--other-seconds",
}


@dataclass(frozen=True)
class SyncLayout:
    """The parallel layout the step's synchronisation follows (see the module docstring).

    ``flags`` names, per field, the flag that set it (errors quote it; default: the simulator's flags).
    """

    data_parallel_size: int
    pool_size: int
    num_microbatches: int  # GA = GBS / DP (mbs = 1)
    pipeline_parallel_size: int = 1
    virtual_pipeline_size: int = 1
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    backward_ratio: float = 2.0
    other_seconds: float = 0.0
    flags: Mapping[str, str] = field(default_factory=lambda: dict(SIM_FLAGS), compare=False, repr=False)

    def __post_init__(self) -> None:
        for key in ("data_parallel_size", "pool_size", "num_microbatches", "pipeline_parallel_size",
                    "virtual_pipeline_size", "tensor_parallel_size", "context_parallel_size",
                    "expert_parallel_size", "expert_tensor_parallel_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{self.flags[key]} must be a positive integer, got {value!r}")
        for key in ("backward_ratio", "other_seconds"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{self.flags[key]} must be a finite number >= 0, got {value!r}")
        self._check_divisions()

    def _check_divisions(self) -> None:
        dp, p, f = self.data_parallel_size, self.pool_size, self.flags
        if dp % p:
            raise ValueError(f"{f['pool_size']} {p} must divide {f['data_parallel_size']} {dp} ({dp} % {p} = {dp % p})")
        ranks = self.tensor_parallel_size * self.context_parallel_size * dp
        experts = self.expert_parallel_size * self.expert_tensor_parallel_size
        if ranks % experts:
            raise ValueError(f"{f['expert_parallel_size']} {self.expert_parallel_size} x {f['expert_tensor_parallel_size']} "
                             f"{self.expert_tensor_parallel_size} = {experts} must divide the TP*CP*DP = {ranks} ranks of "
                             f"a pipeline stage ({ranks} % {experts} = {ranks % experts})")
        pp, vpp, m = self.pipeline_parallel_size, self.virtual_pipeline_size, self.num_microbatches
        if vpp > 1 and (pp < 2 or m % pp):
            raise ValueError(f"{f['virtual_pipeline_size']} {vpp} (interleaved schedule) needs {f['pipeline_parallel_size']} "
                             f">= 2 and the {m} GA microbatches ({f['num_microbatches']}) a multiple of it "
                             f"(Megatron's microbatch groups of PP): {m} % {pp} = {m % pp if pp else m}")

    @property
    def num_lanes(self) -> int:
        """DP / P: pools running side by side at every GA step."""
        return self.data_parallel_size // self.pool_size

    def lane_ties(self) -> np.ndarray:
        """int64 (num_lanes,): the tied set of every lane (EP groups across lanes), numbered 0.. in lane order."""
        return _lane_ties(self.data_parallel_size, self.pool_size, self.tensor_parallel_size * self.context_parallel_size,
                          self.expert_parallel_size, self.expert_tensor_parallel_size)

    @property
    def ep_ties_lanes(self) -> bool:
        """True when some EP group spans two lanes (then only per-instance balance helps)."""
        ties = self.lane_ties()
        return int(ties.max()) + 1 < ties.size


@lru_cache(maxsize=64)
def _lane_ties_cached(dp: int, pool: int, replica_ranks: int, ep: int, etp: int) -> Tuple[int, ...]:
    parent = list(range(dp // pool))

    def root(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    ranks = replica_ranks * dp
    group_stride = ep * etp
    for first in range(0, ranks, group_stride):  # expert DP block: etp fastest, then ep
        for etp_rank in range(etp):
            members = first + etp_rank + etp * np.arange(ep)
            lanes = np.unique(members // replica_ranks // pool)
            for other in lanes[1:].tolist():
                parent[root(other)] = root(int(lanes[0]))
    roots = [root(a) for a in range(len(parent))]
    numbering: Dict[int, int] = {}
    return tuple(numbering.setdefault(r, len(numbering)) for r in roots)


def _lane_ties(dp: int, pool: int, replica_ranks: int, ep: int, etp: int) -> np.ndarray:
    return np.asarray(_lane_ties_cached(int(dp), int(pool), int(replica_ranks), int(ep), int(etp)), dtype=np.int64)


def lane_of_pool(num_pools: int, pool_size: int, data_parallel_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(GA step, lane) of every pool instance k of a GA-major, pool-minor order: (k*P // DP, k mod DP/P)."""
    k = np.arange(num_pools, dtype=np.int64)
    return k * pool_size // data_parallel_size, k % (data_parallel_size // pool_size)


# ------------------------------------------------------------------------------------------- pipeline
@dataclass(frozen=True)
class PipelineSchedule:
    """Ops of one pipeline step in an order that respects every dependency.

    Op i runs on ``stage[i]`` (physical), is a forward (``backward[i]`` False) or backward of microbatch
    ``microbatch[i]`` on virtual stage ``virtual[i]`` (chunk c of stage s is virtual stage c*PP + s), and
    starts after op ``after_stage[i]`` (the stage's previous op, -1 for none) and op ``after_data[i]``
    (its producer, -1 for none).
    """

    num_stages: int
    num_chunks: int
    num_microbatches: int
    stage: np.ndarray
    backward: np.ndarray
    microbatch: np.ndarray
    virtual: np.ndarray
    after_stage: np.ndarray
    after_data: np.ndarray

    def run(self, forward: np.ndarray, backward: np.ndarray) -> "PipelineRun":
        """Simulate with per-(microbatch, virtual stage) seconds ``forward``/``backward`` [m, PP*VPP, ...] (broadcast
        views are fine: nothing of their size is copied); trailing axes (e.g. lanes) are simulated independently.
        Returns the end time and (computed when read) the busy time of every stage."""
        fwd, bwd = np.asarray(forward, dtype=np.float64), np.asarray(backward, dtype=np.float64)
        ops = self._ops
        trailing = fwd.shape[2:]
        if math.prod(trailing) <= _PYTHON_COLUMNS:  # few columns: plain floats beat numpy's per-call cost
            f, b = (x.reshape(x.shape[:2] + (-1,)) for x in (fwd, bwd))
            makespan = np.asarray([_column_makespan(f[:, :, c].tolist(), b[:, :, c].tolist(), ops)
                                   for c in range(f.shape[2])]).reshape(trailing)
        else:
            makespan = _rows_makespan(fwd, bwd, ops)
        return PipelineRun(makespan, lambda: self._busy(fwd, bwd))

    @cached_property
    def _ops(self) -> List[Tuple[bool, int, int, int, int]]:
        """(backward?, microbatch, virtual stage, after_stage, after_data) of every op, in order."""
        return list(zip(self.backward.tolist(), self.microbatch.tolist(), self.virtual.tolist(),
                        self.after_stage.tolist(), self.after_data.tolist()))

    def _busy(self, fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
        """[PP, ...]: the seconds every stage computes (the sum of its ops' durations, in op order)."""
        duration = np.where(self.backward.reshape((-1,) + (1,) * (fwd.ndim - 2)),
                            bwd[self.microbatch, self.virtual], fwd[self.microbatch, self.virtual])
        return np.stack([duration[self.stage == s].sum(axis=0) for s in range(self.num_stages)])


_PYTHON_COLUMNS = 8  # up to this many independent pipelines ``PipelineSchedule.run`` simulates in plain Python


def _column_makespan(fwd: List[List[float]], bwd: List[List[float]], ops) -> float:
    """One pipeline of ``PipelineSchedule.run`` in plain floats (``fwd``/``bwd`` [m][PP*VPP]): end[i] = max(end of
    the stage's previous op, end of the producer) + duration, the same operations as ``_rows_makespan``."""
    end = [0.0] * (len(ops) + 1)  # end[-1] = 0: "no op"
    for i, (back, g, v, a, b) in enumerate(ops):
        ea, eb = end[a], end[b]
        end[i] = (ea if ea >= eb else eb) + (bwd if back else fwd)[g][v]
    return max(end[:-1])


def _rows_makespan(fwd: np.ndarray, bwd: np.ndarray, ops) -> np.ndarray:
    """Every trailing column at once: one row of ends per op (small arrays; a [ops, columns] table of ends would be
    one large allocation per call), the makespan their running maximum."""
    zero = np.zeros(fwd.shape[2:])
    ends: List[np.ndarray] = []
    makespan = zero.copy()
    for back, g, v, a, b in ops:
        row = np.maximum(ends[a] if a >= 0 else zero, ends[b] if b >= 0 else zero)
        row += (bwd if back else fwd)[g, v]
        np.maximum(makespan, row, out=makespan)
        ends.append(row)
    return makespan


class PipelineRun:
    """``makespan`` [...] and ``busy`` [PP, ...] seconds of every stage (``busy`` is computed when first read: the
    placements read only the makespan)."""

    def __init__(self, makespan: np.ndarray, busy) -> None:
        self.makespan = makespan
        self._busy = busy if callable(busy) else (lambda: busy)

    @cached_property
    def busy(self) -> np.ndarray:
        return self._busy()

    @property
    def bubble_fraction(self) -> np.ndarray:
        """Idle share of the stages until the makespan: 1 - mean_s busy_s / makespan ((p-1)/(m+p-1) for 1F1B
        with equal times)."""
        span = np.where(self.makespan > 0, self.makespan, 1.0)
        return np.where(self.makespan > 0, 1.0 - self.busy.mean(axis=0) / span, 0.0)


def _stage_ops(stage: int, pp: int, vpp: int, m: int) -> List[Tuple[bool, int, int]]:
    """(backward?, microbatch, chunk) in the order Megatron runs them on ``stage``."""
    total = m * vpp
    if vpp == 1:
        table = [(g, 0) for g in range(m)]
        warmup = min(pp - stage - 1, m)
    else:  # get_schedule_table with microbatch_group_size_per_vp_stage = PP (m % PP == 0)
        table = [(g, c) for first in range(0, m, pp) for c in range(vpp) for g in range(first, first + pp)]
        warmup = min((pp - stage - 1) * 2 + (vpp - 1) * pp, total)
    fwd = [(False, g, c) for g, c in table]
    bwd = [(True, g, vpp - 1 - c) for g, c in table]
    ops = fwd[:warmup]
    for k in range(total - warmup):
        ops += [fwd[warmup + k], bwd[k]]
    return ops + bwd[total - warmup:]


@lru_cache(maxsize=128)
def pipeline_schedule(num_stages: int, num_chunks: int, num_microbatches: int) -> PipelineSchedule:
    """Megatron's 1F1B (``num_chunks`` 1) or interleaved schedule as a dependency-ordered op list."""
    pp, vpp, m = num_stages, num_chunks, num_microbatches
    per_stage = [_stage_ops(s, pp, vpp, m) for s in range(pp)]
    index: Dict[Tuple[bool, int, int], int] = {}
    rows: List[Tuple[int, bool, int, int, int, int]] = []
    cursor = [0] * pp
    while len(rows) < 2 * m * vpp * pp:
        progressed = False
        for s in range(pp):
            while cursor[s] < len(per_stage[s]):
                back, g, c = per_stage[s][cursor[s]]
                v = c * pp + s
                producer = _producer(back, g, v, pp * vpp)
                if producer is not None and producer not in index:
                    break
                prev = index[("op", s, cursor[s] - 1)] if cursor[s] else -1
                index[(back, g, v)] = index[("op", s, cursor[s])] = len(rows)
                rows.append((s, back, g, v, prev, -1 if producer is None else index[producer]))
                cursor[s] += 1
                progressed = True
        assert progressed, "pipeline schedule deadlocked"  # internal invariant: Megatron's order is acyclic
    cols = list(zip(*rows))
    arrays = [np.asarray(col, dtype=np.int64) for col in cols]
    return PipelineSchedule(pp, vpp, m, arrays[0], arrays[1].astype(bool), arrays[2], arrays[3], arrays[4], arrays[5])


def _producer(backward: bool, g: int, v: int, num_virtual: int) -> Optional[Tuple[bool, int, int]]:
    if not backward:
        return (False, g, v - 1) if v > 0 else None
    return (True, g, v + 1) if v + 1 < num_virtual else (False, g, num_virtual - 1)


# ------------------------------------------------------------------------------------------- step time
@dataclass(frozen=True)
class StepTiming:
    """One step under the model. ``lane_seconds`` [num_lanes]: when each lane finishes (tied lanes share it);
    ``seconds`` = their max (DP meets at the end); ``microbatch_seconds`` [GA, num_lanes]: the per-layer
    forward time each lane's pool waits for (after EP ties); ``bubble_fraction`` [num_lanes] (0 at PP=1);
    ``microbatch_backward_seconds`` [GA, num_lanes]: the same for the backward (``backward_ratio`` x forward
    when no backward was given)."""

    seconds: float
    lane_seconds: np.ndarray
    microbatch_seconds: np.ndarray
    bubble_fraction: np.ndarray
    microbatch_backward_seconds: Optional[np.ndarray] = None


def _same_shape(backward, forward: np.ndarray, name: str) -> Optional[np.ndarray]:
    """``backward`` as float64 of ``forward``'s shape (None stays None: the ``backward_ratio`` fallback)."""
    if backward is None:
        return None
    out = np.asarray(backward, dtype=np.float64)
    if out.shape != forward.shape:
        raise ValueError(f"{name} must have the forward seconds' shape {list(forward.shape)}, got {list(out.shape)}")
    return out


def step_timing(worker_seconds, layout: SyncLayout, backward_seconds=None) -> StepTiming:
    """Step time of per-worker, per-microbatch forward seconds ``worker_seconds`` [GA, DP*CP] and backward
    seconds ``backward_seconds`` (same shape; None: ``backward_ratio`` x forward) (module docstring)."""
    times = np.asarray(worker_seconds, dtype=np.float64)
    ga, lanes = layout.num_microbatches, layout.num_lanes
    if times.shape != (ga, layout.data_parallel_size * layout.context_parallel_size):
        raise ValueError(f"worker_seconds must be [GA, DP*CP] = [{ga}, {layout.data_parallel_size}*"
                         f"{layout.context_parallel_size}], got {list(times.shape)}")
    back = _same_shape(backward_seconds, times, "backward_seconds")
    pool_back = None if back is None else back.reshape(ga, lanes, -1).max(axis=2)
    # a pool waits for its slowest worker, forward and backward
    return pool_step_timing(times.reshape(ga, lanes, -1).max(axis=2), layout, pool_back)


def pool_step_timing(pool_seconds, layout: SyncLayout, backward_seconds=None) -> StepTiming:
    """Step time of per-pool forward seconds ``pool_seconds`` [GA, DP/P] (pool instance of lane j at GA step g)
    and backward seconds ``backward_seconds`` (same shape; None: ``backward_ratio`` x forward)."""
    pools = np.asarray(pool_seconds, dtype=np.float64)
    if pools.shape != (layout.num_microbatches, layout.num_lanes):
        raise ValueError(f"pool_seconds must be [GA, DP/P] = [{layout.num_microbatches}, {layout.num_lanes}], "
                         f"got {list(pools.shape)}")
    back = _same_shape(backward_seconds, pools, "backward_seconds")
    if back is None:
        back = pools * layout.backward_ratio
    ties = layout.lane_ties()
    tied = np.zeros((layout.num_microbatches, int(ties.max()) + 1))
    tied_back = np.zeros_like(tied)
    np.maximum.at(tied.T, ties, pools.T)  # tied lanes advance at the max of their pools
    np.maximum.at(tied_back.T, ties, back.T)
    run = run_lane_pipelines(tied, layout, tied_back)
    return StepTiming(float(run.makespan.max()), run.makespan[ties], tied[:, ties], run.bubble_fraction[ties],
                      tied_back[:, ties])


def run_lane_pipelines(microbatch_seconds: np.ndarray, layout: SyncLayout, backward_seconds=None) -> PipelineRun:
    """Pipeline every column of [GA, lanes] per-layer forward seconds and backward seconds ``backward_seconds``
    (same shape; None: ``backward_ratio`` x forward): uniform stages, ``other_seconds`` added to the forward and
    ``backward_ratio`` x ``other_seconds`` to the backward."""
    pp, vpp = layout.pipeline_parallel_size, layout.virtual_pipeline_size
    fwd_layer = np.asarray(microbatch_seconds, dtype=np.float64)
    bwd_layer = _same_shape(backward_seconds, fwd_layer, "backward_seconds")
    if bwd_layer is None:
        bwd_layer = fwd_layer * layout.backward_ratio
    fwd_stage = (fwd_layer + layout.other_seconds) / vpp  # [GA, lanes]
    bwd_stage = (bwd_layer + layout.backward_ratio * layout.other_seconds) / vpp
    if pp == 1:  # one stage: forward then backward of every microbatch, nothing waits
        busy = ((fwd_stage.sum(axis=0) + bwd_stage.sum(axis=0)) * vpp)[None, :]
        return PipelineRun(busy[0], busy)
    shape = (fwd_stage.shape[0], pp * vpp) + fwd_stage.shape[1:]  # [GA, PP*VPP, lanes]: views, every stage alike
    fwd = np.broadcast_to(fwd_stage[:, None], shape)
    bwd = np.broadcast_to(bwd_stage[:, None], shape)
    return pipeline_schedule(pp, vpp, layout.num_microbatches).run(fwd, bwd)


def critical_path_seconds(forward_seconds: float, backward_seconds: float, layout: SyncLayout) -> float:
    """Seconds no lane can beat once one of its microbatches takes ``forward_seconds`` / ``backward_seconds`` per
    attention layer: that microbatch crosses the PP*VPP virtual stages forward, then all of them backward, one
    after another (``run_lane_pipelines``' stage times: (forward + other) / VPP, (backward + ratio x other) / VPP),
    whatever the lane's other microbatches and their order. (The balanced bound the simulator divides by is the
    schedule of equal microbatches; unequal ones, light at the ends, can beat it, so a window's heaviest pool is
    only binding where this path is longer.)"""
    if not (math.isfinite(forward_seconds) and math.isfinite(backward_seconds)) or min(forward_seconds,
                                                                                        backward_seconds) < 0:
        raise ValueError(f"critical_path_seconds needs finite seconds >= 0, got {forward_seconds!r}, "
                         f"{backward_seconds!r}")
    other = layout.other_seconds * (1.0 + layout.backward_ratio)
    return float(layout.pipeline_parallel_size * (forward_seconds + backward_seconds + other))
