"""Planning off the critical path (§4.1, Fig. 6): a background planner (a process or a thread) plans the next pools.

Every rank asks for its plans from the same metadata (``libra_pool_segments``: the segment lengths of its pool's P
sequences); ``plan_pool`` is a pure function of them, the config, the layouts and the pool's step-time model, so a
plan is the same whoever makes it (``libra_attn_func`` checks fingerprints before its first collective). In a
Megatron-LM run the planner processes share a per-run plan directory (``plan_store``;
``planner_setup.build_planner_from_args``): each pool is planned by the one process of the node that claims it and
read by the node's other ranks, so a pool costs one planning call per node instead of P*CP (per job, with
``LIBRA_PLAN_SHARE_DIR`` on a filesystem every node mounts). ``LIBRA_PLANNER_LEDGER=<file>`` logs every planning
call (``planner_process``).

Where it runs (issue 25). ``mode="process"`` (what ``planner_setup.build_planner_from_args`` starts for a
Megatron-LM run) plans in a separate, spawned Python process per rank: the training interpreter only pickles the
pool segments to it and unpickles the finished ``PoolPlan`` with this worker's row run tables, built in the
process (two small threads, ~0.5-1 ms of interpreter lock per plan), so the placement's search never holds the
training thread's lock; it is the class's default. ``mode="thread"`` (for tests, debugging and stand-in
``plan_fn``s that do not pickle) plans in a thread of this interpreter. In the process: a plan that raises comes
back as that pool's ``PlannerError`` (its traceback attached); a process that dies (crash, OOM kill) fails every
pool still pending with its exit code; one that hangs fails the ``get`` after ``timeout_s``; ``close`` stops it
(join, then terminate, then kill). Nothing falls back silently: a failed pool raises on every ``get``.

Usage (one ``BackgroundPlanner`` per training process)::

    planner = BackgroundPlanner(config, layout, heads)
    planner.submit(pool_segments)              # as soon as the sampler knows the microbatch (look-ahead)
    plan = planner.get(pool_segments, position=p, cp_rank=c); planner.close()   # RankPlan of worker p*CP + c

Keys are content hashes of the pool's segments, so ``get`` without a prior ``submit`` also works (it plans then
waits). A failure is re-raised by the ``get`` of that key as a ``PlannerError`` with the original traceback; ``get``
never blocks longer than ``timeout_s`` and fails at once if the planner has died.

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
import pickle
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np

from ..config import LibraConfig, SaveModeName
from ..plan.layout import HeadLayout, TokenLayout
from .planner_process import default_plan_fn, memory as _memory, pool_key, spawn_planner, stop_planner

__all__ = ["BackgroundPlanner", "PlannerError", "PlannedPool", "pool_key"]

PlanFn = Callable[..., Any]  # plan_pool(seq_segments, config, layout, heads, validate=...) -> PoolPlan


class PlannerError(RuntimeError):
    """The background planner failed (or timed out) for a pool; raised in the training thread by ``get``."""


@dataclass(frozen=True, eq=False)
class PlannedPool:
    """A finished plan: the ``PoolPlan``, how long the thread took (seconds, wall clock; for a plan read from the
    shared plan directory, from its arrival at the planner process until it was read), the predicted
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


class _Slot:
    """State of one key: done event, result or (exception, traceback text)."""

    def __init__(self, segments: tuple):
        self.segments = segments
        self.submitted = time.perf_counter()
        self.done = threading.Event()
        self.gets_owed = 0  # submits not yet matched by a get; 0 = consumed, evicted first
        self.low = False  # queued for the metrics only: planned when no other pool waits
        self.taken = False  # handed to the planner (thread or process)
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
    num_layers: this rank's layers whose saved tensors are alive at once (``plan.model.memory.saved_layers``), for
        the ``save_mode=auto`` budget (``config.activation_budget_gb`` covers all of them).
    timing: the ``plan.model.timing.StepTimeModel`` tile placement 'time' / 'dense' prices by (the pool's nodes).
    mode: "process" (the default: a spawned planner process, module docstring; ``plan_fn`` must then pickle, a
        module-level function) or "thread" (plan in a thread of this interpreter: it takes the training thread's
        interpreter lock while it plans, ``benchmarks/bench_planner_stall.py``; for tests and debugging).
    pools_per_window: the pools this rank gets per optimizer step (GA), for ``planner_lead_windows``.
    share_dir: process mode only: a directory the planner processes of a node (or of all nodes, on a shared
        filesystem) share (``plan_store``): each pool is planned by the one process that claims it and read by
        the others. None: this process plans every pool it is asked for.
    """

    def __init__(self, config: LibraConfig, layout: TokenLayout, heads: HeadLayout, *,
                 plan_fn: Optional[PlanFn] = None, capacity: int = 64, timeout_s: float = 300.0,
                 validate: bool = False, worker: Optional[int] = None, num_layers: int = 1, timing=None,
                 mode: str = "process", pools_per_window: int = 1, share_dir: Optional[str] = None):
        self.config, self.layout, self.heads = config, layout, heads
        self._timing = timing  # plan.model.timing.StepTimeModel with the pool's nodes (tile placement time/dense)
        self._worker = worker  # pool-local worker id whose RankPlan the thread materialises too
        self._num_layers = int(num_layers)
        self._plan_fn = plan_fn or default_plan_fn
        self._capacity, self._timeout_s, self._validate = int(capacity), float(timeout_s), bool(validate)
        self._slots: "collections.OrderedDict[str, _Slot]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self._queue: "queue.Queue[Optional[str]]" = queue.Queue()
        self._latencies: list = []
        self._last: Optional[PlannedPool] = None
        self._closed = False
        if mode not in ("thread", "process"):
            raise ValueError(f"BackgroundPlanner: mode must be 'thread' or 'process', got {mode!r}")
        self.mode = mode
        if mode == "process" and plan_fn is not None:
            try:
                pickle.dumps(plan_fn)
            except Exception as exc:  # noqa: BLE001 - lambdas, closures, bound methods of unpicklable objects
                raise ValueError(f"BackgroundPlanner: plan_fn {plan_fn!r} does not pickle ({type(exc).__name__}), "
                                 f"and mode='process' (the default) sends it to the planner process: pass a "
                                 f"module-level function, or mode='thread' to plan in this interpreter") from None
        if share_dir is not None and mode != "process":
            raise ValueError("BackgroundPlanner: share_dir needs mode='process' (the plan store is polled by the "
                             "planner process)")
        self._share_dir = share_dir
        self._process = self._reader = None
        self.plans_made = 0  # pools this planner planned (finished or failed), for the "planned once" checks
        self.plans_shared = 0  # pools read from the shared plan directory (planned by another process)
        self._per_window = max(1, int(pools_per_window))
        self._low: "collections.deque[str]" = collections.deque()  # metrics' pools: planned when nothing else is
        self._in_flight = 0  # pools handed to the process and not back yet
        self._waited_s, self._lead = 0.0, 0.0  # the last get_pool's wait (s) and plans ready ahead of it (windows)
        if mode == "process":
            self._start_process()
        self._thread = threading.Thread(target=self._run if mode == "thread" else self._send,
                                        name="libra-planner", daemon=True)
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
        with self._lock:  # plans ready ahead of this get (this one included), in windows
            lead = sum(1 for s in self._slots.values() if s.done.is_set() and s.error is None and s.gets_owed)
        begin = time.perf_counter()
        try:
            self._wait(key, slot, self._timeout_s if timeout is None else float(timeout))
        finally:
            with self._lock:
                self._waited_s, self._lead = time.perf_counter() - begin, lead / self._per_window
        if slot.error is not None:
            raise PlannerError(
                f"background planner failed for pool {key} (segments per sequence: "
                f"{[len(s) for s in slot.segments]}): {type(slot.error).__name__}: {slot.error}\n"
                f"--- planner thread traceback ---\n{slot.error_text}"
            ) from slot.error
        with self._lock:  # the plan training runs next: what the step's metrics describe
            self._last = slot.result
        return slot.result

    def get_for_metrics(self, pool_segments: Sequence[Sequence[int]], timeout: Optional[float] = None) -> PlannedPool:
        """The plan of a pool for the metrics: this planner's own plan when it has it (the pools of this rank),
        else planned behind every pool training waits for. Announces no ``get`` and counts no wait."""
        key, slot = self._slot_for(pool_segments, owed=0, low=True)
        self._wait(key, slot, self._timeout_s if timeout is None else float(timeout))
        if slot.error is not None:
            raise PlannerError(f"background planner failed for pool {key}: {type(slot.error).__name__}: "
                               f"{slot.error}") from slot.error
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

    def latencies(self) -> list:
        """Planner latencies (seconds) of every plan finished so far, in completion order."""
        with self._lock:
            return list(self._latencies)

    def latest(self) -> Optional[PlannedPool]:
        with self._lock:
            return self._last

    def latest_metrics(self) -> Dict[str, float]:
        """Metrics (``metrics.pool_plan_metrics``) of the plan training got last (``get_pool``): the step's own."""
        from .metrics import pool_plan_metrics

        last = self.latest()
        if last is None:
            return {}
        out = pool_plan_metrics(last.pool_plan, planner_latency_s=last.latency_s)
        with self._lock:  # snapshots of the last get: the same values however often they are read
            out["planner_lead_windows"], out["planner_wait_ms"] = self._lead, self._waited_s * 1e3
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
        if self._process is not None:
            self._stop_process()

    def __enter__(self) -> "BackgroundPlanner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def num_cached(self) -> int:
        """Pools held (finished, failed or queued); bounded by ``capacity`` plus the queued ones."""
        with self._lock:
            return len(self._slots)

    # ------------------------------------------------------------------ slots
    def _slot_for(self, pool_segments: Sequence[Sequence[int]], owed: int, low: bool = False) -> tuple:
        """(key, slot) of a pool, created and queued if unknown; ``owed`` +1 for a submit, -1 for a get, 0 for
        the metrics (``low``: queued behind every other pool; a later submit or get moves it up).

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
                slot.low = low
            self._slots.move_to_end(key)
            slot.gets_owed = max(0, slot.gets_owed + owed)
            promote = not is_new and slot.low and not low and not slot.taken
            if promote:
                slot.low = False
            if is_new and low:
                self._low.append(key)
            self._evict_locked()
        if (is_new and not low) or promote:
            self._queue.put(key)
        elif is_new:
            self._queue.put("")
        return key, slot

    def _next_key(self) -> Optional[str]:
        """The next pool to plan: queued ones first, the metrics' ones when nothing else is queued or in flight."""
        while True:
            try:
                key = self._queue.get(timeout=0.05 if self._low else None)
                if key != "":  # "": a wake-up for a metrics pool
                    return key
            except queue.Empty:
                pass
            with self._lock:
                if self._low and self._in_flight == 0 and self._queue.empty():
                    return self._low.popleft()

    def _take(self, key: str) -> Optional[_Slot]:
        """The slot of ``key`` if it still needs planning, marked taken (a key can be queued twice)."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None or slot.done.is_set() or slot.taken:
                return None
            slot.taken = True
            return slot

    def _wait(self, key: str, slot: _Slot, wait: float) -> None:
        """Block until ``slot`` is done; PlannerError after ``wait`` seconds or as soon as the thread is dead."""
        deadline = time.perf_counter() + wait
        while not slot.done.wait(max(0.0, min(1.0, deadline - time.perf_counter()))):
            if self._process is not None and not self._process.is_alive() and not slot.done.wait(2.0):
                raise PlannerError(f"the planner process is dead (exit code {self._process.exitcode}); pool {key} "
                                   f"will never be planned")
            if not self._thread.is_alive() and not slot.done.is_set():
                raise PlannerError(f"the planner thread is dead; pool {key} will never be planned")
            if time.perf_counter() >= deadline:
                where = "process" if self._process is not None else "thread"
                raise PlannerError(f"planner did not finish pool {key} within {wait:.1f}s ({where} alive)")

    # ------------------------------------------------------------------ thread body
    def _run(self) -> None:
        while True:
            key = self._next_key()
            if key is None:
                break
            slot = self._take(key)
            if slot is not None:
                self._plan_one(key, slot)
        self._fail_pending("the planner was closed before planning this pool")

    def _plan_one(self, key: str, slot: _Slot) -> None:
        start = time.perf_counter()
        try:
            extra = {} if self._timing is None else {"timing": self._timing}
            plan = self._plan_fn([list(s) for s in slot.segments], self.config, self.layout, self.heads,
                                 validate=self._validate, **extra)
            rank_ready = self._materialise_rank(plan, slot.submitted)
            saved, mode = _memory(plan, self.config, self.heads, self.layout, self._num_layers)
            latency = time.perf_counter() - start
            self._finish(slot, PlannedPool(key, slot.segments, plan, latency, start - slot.submitted, saved, mode,
                                           rank_ready))
        except BaseException as exc:  # noqa: BLE001 - surfaced to the training thread by get()
            slot.error, slot.error_text = exc, traceback.format_exc()
            self._finish(slot, None)

    def _finish(self, slot: _Slot, result: Optional[PlannedPool], planned_here: bool = True) -> None:
        with self._lock:
            if planned_here:
                self.plans_made += 1
            else:
                self.plans_shared += 1
            if result is not None:
                slot.result = result
                self._latencies.append(result.latency_s)
        slot.done.set()

    def _materialise_rank(self, plan, submitted: float, tables=None) -> Optional[float]:
        """Build this worker's RankPlan and its row run tables now (``tables``: built by the planner process, only
        cached here); seconds since submit, or None."""
        exchange = getattr(plan, "exchange", None)
        if self._worker is None or exchange is None:
            return None
        from ..plan.exchange import rank_tables, seed_rank_tables

        if tables is None:
            rank_tables(exchange.for_rank(self._worker))
        else:
            seed_rank_tables(exchange.for_rank(self._worker), tables)
        return time.perf_counter() - submitted

    # ------------------------------------------------------------------ process mode
    def _start_process(self) -> None:
        """Spawn the planner process (a fresh interpreter: no training state, no CUDA) and its result reader."""
        keep = 2 * self._per_window + 2  # plans each process keeps published: two windows' worth, at the most
        share = None if self._share_dir is None else (self._share_dir, keep, self._timeout_s)
        spec = (self.config, self.layout, self.heads, self._timing, self._validate, self._worker, self._num_layers,
                self._plan_fn, share)
        self._process, self._tasks, self._results = spawn_planner(spec)
        self._reader = threading.Thread(target=self._read, name="libra-planner-reader", daemon=True)
        self._reader.start()

    def _send(self) -> None:
        """Thread body (process mode): hand queued pools to the process, in submit order."""
        while True:
            key = self._next_key()
            slot = self._take(key) if key is not None else None
            try:
                if key is None:
                    self._tasks.send(None)
                    break
                if slot is not None:
                    with self._lock:
                        self._in_flight += 1
                    self._tasks.send((key, slot.segments))
            except (OSError, EOFError, ValueError):  # the process is gone: the reader fails the pending pools
                break

    def _read(self) -> None:
        """Thread body (process mode): publish every plan or error the process sends back."""
        while True:
            try:
                key, ok, payload = self._results.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # noqa: BLE001 - an unpicklable result: that pool cannot be served
                self._fail_pending(f"a plan from the planner process did not unpickle: {type(exc).__name__}: {exc}")
                continue
            finally:
                with self._lock:
                    self._in_flight = max(0, self._in_flight - 1)
            with self._lock:
                slot = self._slots.get(key)
            if slot is None or slot.done.is_set():
                continue
            if not ok:
                slot.error, slot.error_text = payload
                self._finish(slot, None)
                continue
            plan, latency, saved, mode, here, tables = payload
            try:
                rank_ready = self._materialise_rank(plan, slot.submitted, tables)
            except BaseException as exc:  # noqa: BLE001
                slot.error, slot.error_text = exc, traceback.format_exc()
                self._finish(slot, None)
                continue
            queued = max(0.0, time.perf_counter() - slot.submitted - latency)
            self._finish(slot, PlannedPool(key, slot.segments, plan, latency, queued, saved, mode, rank_ready),
                         planned_here=here)
        if self._process is not None:
            self._process.join(timeout=5)
            code = self._process.exitcode
        why = "closed" if self._closed else f"died (exit code {code})"
        self._fail_pending(f"the planner process {why} before planning this pool")

    def _stop_process(self) -> None:
        stop_planner(self._process, (self._tasks, self._results))
        if self._reader is not None:
            self._reader.join(timeout=10)

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
