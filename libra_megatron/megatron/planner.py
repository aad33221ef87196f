"""Planning off the critical path (§4.1, Fig. 6): a background CPU thread plans the next pools.

Design choice: *every rank plans deterministically from the same metadata*. The sampler hands each rank
the segment lengths of all P packed sequences of its pool (``libra_pool_segments``); ``plan_pool`` is a
pure function of (segments, LibraConfig, TokenLayout, HeadLayout), so the P*CP ranks of a pool compute
byte-identical plans with no broadcast. Agreement is verified by fingerprint: ``libra_attn_func`` checks
the ranks' plan fingerprints before its first collective. Compared with a coordinator broadcasting an
encoded plan, this costs P*CP-fold redundant CPU work (a few ms per pool at our sizes, on an otherwise
idle core) but needs no extra collective on the step's critical path.

Usage (one ``BackgroundPlanner`` per training process)::

    planner = BackgroundPlanner(config, layout, heads)
    planner.submit(pool_segments)              # as soon as the sampler knows the microbatch (look-ahead)
    plan = planner.get(pool_segments, position=p, cp_rank=c)   # RankPlan of worker p*CP + c
    planner.close()

Keys are content hashes of the pool's segments, so ``get`` without a prior ``submit`` also works (it
plans then waits). A failure inside the thread is stored and re-raised by the ``get`` of that key as a
``PlannerError`` carrying the original traceback; ``get`` never blocks longer than ``timeout_s`` and fails
at once if the thread has died.

Off the training thread, per pool: the PoolPlan; the predicted bytes every rank keeps for backward per
layer in each save mode (``plan.model.memory``), and the ``save_mode=auto`` decision from them (pool-wide
numbers, so every rank of the pool decides the same); and, when ``worker`` is set, this rank's RankPlan
and its row run tables (``plan.exchange.runtime_tables``, O(runs)), so the training thread only uploads the runs and
expands them into index tensors on the device (``runtime.routes``, once per plan).

Thread safety and memory. ``submit``/``get`` may be called from any thread; slot state is guarded by one
lock, and a slot's result is published by its ``done`` event. Each ``submit`` announces one upcoming
``get``: finished plans no ``get`` is still owed to are evicted first (least recently used), plans still
owed only when ``capacity`` finished plans are exceeded anyway, so the cache holds at most ``capacity``
finished plans plus the ones still queued, however long the run.
"""
from __future__ import annotations

import collections
import hashlib
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np

from ..config import LibraConfig, SaveModeName
from ..plan.layout import HeadLayout, TokenLayout

__all__ = ["BackgroundPlanner", "PlannerError", "PlannedPool", "pool_key", "build_planner_from_args"]

PlanFn = Callable[..., Any]  # plan_pool(seq_segments, config, layout, heads, validate=...) -> PoolPlan


class PlannerError(RuntimeError):
    """The background planner failed (or timed out) for a pool; raised in the training thread by ``get``."""


@dataclass(frozen=True, eq=False)
class PlannedPool:
    """A finished plan: the ``PoolPlan``, how long the thread took (seconds, wall clock), the predicted
    saved bytes per rank per layer ({"arranged": int64 [W], "refetch": int64 [W]}; empty for plans without
    an exchange) and the resolved save mode (None then)."""

    key: str
    segments: tuple
    pool_plan: Any
    latency_s: float
    queued_s: float  # time between submit and the start of planning
    saved_bytes: Dict[str, np.ndarray] = None
    save_mode: Optional[SaveModeName] = None
    rank_ready_s: Optional[float] = None  # submit -> this worker's RankPlan and tables built (worker set)


def pool_key(pool_segments: Sequence[Sequence[int]]) -> str:
    """Content hash of a pool's segment lengths (order matters: position p is worker p's sequence)."""
    h = hashlib.blake2b(digest_size=16)
    for seg in pool_segments:
        arr = np.ascontiguousarray(np.asarray(seg, dtype=np.int64).reshape(-1))
        h.update(np.int64(arr.size).tobytes())
        h.update(arr.tobytes())
    return h.hexdigest()


def _default_plan_fn(*args, **kwargs):
    from ..plan.pool import plan_pool

    return plan_pool(*args, **kwargs)


class _Slot:
    """State of one key: done event, result or (exception, traceback text)."""

    def __init__(self, segments: tuple):
        self.segments = segments
        self.submitted = time.perf_counter()
        self.done = threading.Event()
        self.gets_owed = 0  # submits not yet matched by a get; 0 = consumed, evicted first
        self.result: Optional[PlannedPool] = None
        self.error: Optional[BaseException] = None
        self.error_text = ""


class BackgroundPlanner:
    """One daemon thread that turns pool metadata into ``PoolPlan``s ahead of use.

    config/layout/heads: the run's LibraConfig, per-sequence TokenLayout (L, CP) and HeadLayout.
    capacity: finished plans kept; consumed ones (no get owed) are evicted first, least recently used
        first; pending ones are never evicted. Size it to the plans submitted ahead (a window's worth).
    timeout_s: the longest ``get`` waits before raising ``PlannerError``.
    validate: run ``validate_plan`` on every plan (all ranks' invariants; costs O(units)).
    worker: this process's pool-local worker id p*CP + c, when fixed; its RankPlan and row run tables
        are then built in the thread too (otherwise on first ``get`` / first use).
    num_layers: Libra layers per microbatch on this rank (the pipeline stage's layers), for the
        ``save_mode=auto`` budget (``config.activation_budget_gb`` covers all of them).
    timing: the ``plan.model.timing.StepTimeModel`` tile placement 'time' / 'dense' prices by (the pool's nodes).
    """

    def __init__(self, config: LibraConfig, layout: TokenLayout, heads: HeadLayout, *,
                 plan_fn: Optional[PlanFn] = None, capacity: int = 64, timeout_s: float = 300.0,
                 validate: bool = False, worker: Optional[int] = None, num_layers: int = 1, timing=None):
        self.config, self.layout, self.heads = config, layout, heads
        self._timing = timing  # plan.model.timing.StepTimeModel with the pool's nodes (tile placement time/dense)
        self._worker = worker  # pool-local worker id whose RankPlan the thread materialises too
        self._num_layers = int(num_layers)
        self._plan_fn = plan_fn or _default_plan_fn
        self._capacity, self._timeout_s, self._validate = int(capacity), float(timeout_s), bool(validate)
        self._slots: "collections.OrderedDict[str, _Slot]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self._queue: "queue.Queue[Optional[str]]" = queue.Queue()
        self._latencies: list = []
        self._last: Optional[PlannedPool] = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="libra-planner", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side
    def submit(self, pool_segments: Sequence[Sequence[int]]) -> str:
        """Queue a pool for planning ahead of its ``get`` (a known pool is not planned twice). Returns its key.

        Each call announces one later ``get`` of the pool; until then the plan is evicted only after all
        consumed ones (see ``capacity``).
        """
        return self._slot_for(pool_segments, owed=+1)[0]

    def submit_many(self, pools: Sequence[Sequence[Sequence[int]]]) -> list:
        return [self.submit(p) for p in pools]

    # ------------------------------------------------------------------ consumer side
    def get_pool(self, pool_segments: Sequence[Sequence[int]], timeout: Optional[float] = None) -> PlannedPool:
        """The finished plan of a pool (queued now if it was never submitted). Raises PlannerError on failure."""
        key, slot = self._slot_for(pool_segments, owed=-1)
        self._wait(key, slot, self._timeout_s if timeout is None else float(timeout))
        if slot.error is not None:
            raise PlannerError(
                f"background planner failed for pool {key} (segments per sequence: "
                f"{[len(s) for s in slot.segments]}): {type(slot.error).__name__}: {slot.error}\n"
                f"--- planner thread traceback ---\n{slot.error_text}"
            ) from slot.error
        return slot.result

    def get(self, pool_segments: Sequence[Sequence[int]], *, position: int, cp_rank: int,
            timeout: Optional[float] = None):
        """``RankPlan`` of pool worker ``position*CP + cp_rank`` for this pool."""
        return self.get_planned(pool_segments, position=position, cp_rank=cp_rank, timeout=timeout)[0]

    def get_planned(self, pool_segments: Sequence[Sequence[int]], *, position: int, cp_rank: int,
                    timeout: Optional[float] = None) -> tuple:
        """(``RankPlan`` of worker ``position*CP + cp_rank``, its ``PlannedPool``) -- one ``get`` of the pool."""
        planned = self.get_pool(pool_segments, timeout)
        return planned.pool_plan.exchange.for_rank(int(position) * self.layout.cp + int(cp_rank)), planned

    def warm_up(self) -> float:
        """Plan one throw-away pool now (pays imports and first-call costs off the training path).

        Its sequences are ``[L-1, 1]`` each, a shape real batches rarely repeat, so its (cold) latency
        does not stand in for a cached real plan. Returns the seconds it took.
        """
        start = time.perf_counter()
        L = self.layout.seq_len
        self.get_pool([[L - 1, 1] if L > 1 else [L]] * self.config.pool_size)
        return time.perf_counter() - start

    # ------------------------------------------------------------------ metrics / lifecycle
    def latencies(self) -> list:
        """Planner latencies (seconds) of every plan finished so far, in completion order."""
        with self._lock:
            return list(self._latencies)

    def latest(self) -> Optional[PlannedPool]:
        with self._lock:
            return self._last

    def latest_metrics(self) -> Dict[str, float]:
        """Metrics of the most recently finished pool plan (see ``metrics.pool_plan_metrics``)."""
        from .metrics import pool_plan_metrics

        last = self.latest()
        if last is None:
            return {}
        out = pool_plan_metrics(last.pool_plan, planner_latency_s=last.latency_s)
        for mode, per_rank in (last.saved_bytes or {}).items():  # predicted, worst rank, one layer
            out[f"saved_bytes_{mode}_max"] = float(np.max(per_rank, initial=0))
        if last.save_mode is not None:
            out["save_mode_refetch"] = float(last.save_mode is SaveModeName.REFETCH)
        return out

    def close(self) -> None:
        """Stop the thread after the plan in progress; pending gets raise PlannerError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=30)

    def __enter__(self) -> "BackgroundPlanner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def num_cached(self) -> int:
        """Pools held (finished, failed or queued); bounded by ``capacity`` plus the queued ones."""
        with self._lock:
            return len(self._slots)

    # ------------------------------------------------------------------ slots
    def _slot_for(self, pool_segments: Sequence[Sequence[int]], owed: int) -> tuple:
        """(key, slot) of a pool, created and queued if unknown; ``owed`` +1 for a submit, -1 for a get.

        The slot is returned under the same lock that found it, so a concurrent eviction cannot lose it.
        """
        segments = tuple(tuple(int(x) for x in np.asarray(s).reshape(-1)) for s in pool_segments)
        key = pool_key(segments)
        with self._lock:
            if self._closed:
                raise PlannerError("submit()/get() on a closed BackgroundPlanner")
            slot = self._slots.get(key)
            is_new = slot is None
            if is_new:
                slot = self._slots[key] = _Slot(segments)
            self._slots.move_to_end(key)
            slot.gets_owed = max(0, slot.gets_owed + owed)
            self._evict_locked()
        if is_new:
            self._queue.put(key)
        return key, slot

    def _wait(self, key: str, slot: _Slot, wait: float) -> None:
        """Block until ``slot`` is done; PlannerError after ``wait`` seconds or as soon as the thread is dead."""
        deadline = time.perf_counter() + wait
        while not slot.done.wait(max(0.0, min(1.0, deadline - time.perf_counter()))):
            if not self._thread.is_alive() and not slot.done.is_set():
                raise PlannerError(f"the planner thread is dead; pool {key} will never be planned")
            if time.perf_counter() >= deadline:
                raise PlannerError(f"planner did not finish pool {key} within {wait:.1f}s (thread alive)")

    # ------------------------------------------------------------------ thread body
    def _run(self) -> None:
        while True:
            key = self._queue.get()
            if key is None:
                break
            with self._lock:
                slot = self._slots.get(key)
            if slot is None or slot.done.is_set():
                continue
            self._plan_one(key, slot)
        self._fail_pending("the planner was closed before planning this pool")

    def _plan_one(self, key: str, slot: _Slot) -> None:
        start = time.perf_counter()
        try:
            extra = {} if self._timing is None else {"timing": self._timing}
            plan = self._plan_fn([list(s) for s in slot.segments], self.config, self.layout, self.heads,
                                 validate=self._validate, **extra)
            rank_ready = self._materialise_rank(plan, slot.submitted)
            saved, mode = self._memory(plan)
            latency = time.perf_counter() - start
            slot.result = PlannedPool(key, slot.segments, plan, latency, start - slot.submitted, saved, mode,
                                      rank_ready)
            with self._lock:
                self._latencies.append(latency)
                self._last = slot.result
        except BaseException as exc:  # noqa: BLE001 - surfaced to the training thread by get()
            slot.error, slot.error_text = exc, traceback.format_exc()
        finally:
            slot.done.set()

    def _materialise_rank(self, plan, submitted: float) -> Optional[float]:
        """Build this worker's RankPlan and its row run tables now; seconds since submit, or None."""
        exchange = getattr(plan, "exchange", None)
        if self._worker is None or exchange is None:
            return None
        from ..plan.exchange import rank_tables

        rank_tables(exchange.for_rank(self._worker))
        return time.perf_counter() - submitted

    def _memory(self, plan) -> tuple:
        """(predicted saved bytes per rank per layer by mode, resolved save mode) of a PoolPlan."""
        exchange = getattr(plan, "exchange", None)
        if getattr(exchange, "arranged_q_units", None) is None:  # a stand-in plan (tests) carries no tables
            return {}, None
        from ..plan.model import choose_save_mode, predicted_saved_bytes

        saved = predicted_saved_bytes(exchange, self.heads, self.layout.local_len)
        mode = choose_save_mode(self.config.save_mode, saved["arranged"], self.config.activation_budget_gb,
                                self._num_layers)
        return saved, mode

    def _fail_pending(self, why: str) -> None:
        with self._lock:
            for slot in self._slots.values():
                if not slot.done.is_set():
                    slot.error = PlannerError(why)
                    slot.done.set()

    def _evict_locked(self) -> None:
        """Drop finished slots beyond ``capacity``: consumed ones first, then owed ones, oldest first."""
        finished = [k for k, s in self._slots.items() if s.done.is_set()]
        finished.sort(key=lambda k: self._slots[k].gets_owed > 0)  # stable: keeps LRU order within each group
        for key in finished[: max(0, len(finished) - self._capacity)]:
            del self._slots[key]


def build_planner_from_args(config: LibraConfig, args) -> BackgroundPlanner:
    """The planner of a Megatron-LM run: layouts from ``--seq-length``, CP, heads and ``--kv-channels``;
    this rank's pool worker id (its RankPlan is materialised in the thread) and its stage's layer count.

    Its capacity holds two windows of plans (GBS / (mbs * DP) each, at least 64 plans): the sampler submits a
    whole window ahead (``LibraHooks`` plan-ahead), and the DataLoader may start the next one early.
    """
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    hq = args.num_attention_heads // tp
    hkv = (args.num_query_groups if getattr(args, "group_query_attention", False) else args.num_attention_heads)
    kv_channels = getattr(args, "kv_channels", None) or args.hidden_size // args.num_attention_heads
    elem_bytes = 2 if (getattr(args, "bf16", False) or getattr(args, "fp16", False)) else 4
    layout = TokenLayout(config.token_layout, args.seq_length, cp)
    heads = HeadLayout(hq, max(1, hkv // tp), kv_channels, config.head_split, config.num_chunks, elem_bytes)
    dp = int(getattr(args, "data_parallel_size", 1) or 1)
    ga_per_window = int(args.global_batch_size) // (int(getattr(args, "micro_batch_size", 1) or 1) * dp)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    layers = -(-int(getattr(args, "num_layers", 1) or 1) // pp)
    return BackgroundPlanner(config, layout, heads, capacity=max(64, 2 * ga_per_window), worker=_pool_worker(),
                             num_layers=layers, timing=_pool_timing(kv_channels))


def _pool_timing(head_dim: int):
    """The step-time model of this rank's pool: its workers' nodes = pool ranks // GPUs per node (torchrun's
    LOCAL_WORLD_SIZE, else the visible CUDA devices, else 8); None before the pool groups exist (the placers
    then assume consecutive GPUs from a node boundary). The same on every rank of a pool: same ranks, same env."""
    import os

    from ..plan.model import StepTimeModel
    from . import groups

    if not groups.pool_groups_initialized():
        return None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if per_node < 1:
        import torch

        per_node = torch.cuda.device_count() if torch.cuda.is_available() else 8
    nodes = tuple(int(r) // per_node for r in groups.get_pool_ranks())
    return StepTimeModel(head_dim, gpus_per_node=per_node, worker_nodes=nodes)


def _pool_worker() -> Optional[int]:
    """This rank's pool-local worker id p*CP + c, when the pool groups exist (they do in the launcher)."""
    from . import groups

    return groups.get_pool_rank() if groups.pool_groups_initialized() else None
