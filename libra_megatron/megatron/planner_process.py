"""The planner process of ``megatron.planner.BackgroundPlanner(mode="process")`` (issue 25): a spawned interpreter that
plans the pools it is sent and pipes back the pickled plans, so the search never takes the training thread's
interpreter lock. Also the pool-wide saved-bytes / save-mode step both planner modes run after ``plan_pool``."""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import socket
import pickle
import sys
import time
import traceback
from typing import Sequence

import numpy as np

from ..config import LibraConfig
from ..plan.exchange import rank_tables
from ..plan.layout import HeadLayout, TokenLayout

__all__ = ["default_plan_fn", "memory", "pool_key", "planner_process", "spawn_planner", "stop_planner", "LEDGER_ENV"]

LEDGER_ENV = "LIBRA_PLANNER_LEDGER"


def pool_key(pool_segments: Sequence[Sequence[int]]) -> str:
    """Content hash of a pool's segment lengths (order matters: position p is worker p's sequence)."""
    h = hashlib.blake2b(digest_size=16)
    for seg in pool_segments:
        arr = np.ascontiguousarray(np.asarray(seg, dtype=np.int64).reshape(-1))
        h.update(np.int64(arr.size).tobytes())
        h.update(arr.tobytes())
    return h.hexdigest()


def default_plan_fn(*args, **kwargs):
    from ..plan.pool import plan_pool

    return plan_pool(*args, **kwargs)


def memory(plan, config: LibraConfig, heads: HeadLayout, layout: TokenLayout, num_layers: int) -> tuple:
    """(predicted saved bytes per rank per layer by mode, resolved save mode) of a PoolPlan."""
    exchange = getattr(plan, "exchange", None)
    if getattr(exchange, "arranged_q_units", None) is None:  # a stand-in plan (tests) carries no tables
        return {}, None
    from ..plan.model import choose_save_mode, deferred_relay_bytes, predicted_saved_bytes

    saved = predicted_saved_bytes(exchange, heads, layout.local_len)
    return saved, choose_save_mode(config.save_mode, saved["arranged"], config.activation_budget_gb, num_layers,
                                   deferred_relay_bytes(exchange, heads))


def planner_process(tasks, results, spec) -> None:
    """Body of the planner process: plan every pool it is sent, send back (key, True, (plan, seconds, saved bytes,
    save mode, planned here, the worker's ``rank_tables`` or None)) or (key, False, (exception, traceback text));
    exits on None or when the trainer is gone.

    With a shared plan directory (``spec``'s last item, ``plan_store``), a pool is planned only by the process
    that wins its claim; the others keep serving their other pools while they poll for it (``_SharedPools``)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's: it closes this process
    # A trainer that exits without close() terminates its daemonic children: leave through the finally below, which
    # removes this process's shared plans (a kill or a crash leaves them, in the run's own directory).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config, layout, heads, timing, validate, worker, num_layers, plan_fn, share = spec
    plan_fn = plan_fn or default_plan_fn
    extra = {} if timing is None else {"timing": timing}

    def plan(segments):
        planned = plan_fn([list(s) for s in segments], config, layout, heads, validate=validate, **extra)
        ranks = getattr(getattr(planned, "exchange", None), "ranks", None)
        if hasattr(ranks, "clear_cache"):  # validation built every rank's RankPlan: send (and share) none of them
            ranks.clear_cache()
        return planned

    def finish(key, ok, payload, seconds, here):
        """The message of a pool: payload is the plan (ok) or (exception, traceback text)."""
        if not ok:
            return key, False, payload
        try:
            exchange, tables = getattr(payload, "exchange", None), None
            if worker is not None and exchange is not None:  # the RankPlan travels in the plan's cache, its row
                tables = rank_tables(exchange.for_rank(worker))  # tables beside it: the trainer builds neither
            saved, mode = memory(payload, config, heads, layout, num_layers)
            return key, True, (payload, seconds, saved, mode, here, tables)
        except BaseException as exc:  # noqa: BLE001
            return key, False, _error_payload(exc)

    shared = None
    if share is not None:
        from .plan_store import PlanStore

        directory, keep, timeout_s = share
        shared = _SharedPools(PlanStore(directory, (config, layout, heads, timing, validate, plan_fn), keep),
                              plan, timeout_s)
    try:
        _serve(tasks, results, plan, finish, shared)
    finally:
        if shared is not None:
            shared.store.close()


def _serve(tasks, results, plan, finish, shared) -> None:
    """The task loop: block on the pipe while nothing is pending, else poll the shared pools every 10 ms (a peer
    plans a pool in hundreds of ms; a poll is a few file lookups per pending pool)."""
    while True:
        try:
            while shared is None or not shared.pending or tasks.poll(0.01):
                task = tasks.recv()
                if task is None:
                    return
                key, segments = task
                if shared is None:
                    results.send(finish(key, *_plan_or_error(plan, key, segments), True))
                else:
                    shared.add(key, segments)
                    break
            if shared is not None:
                for done in shared.ready():
                    results.send(finish(*done))
        except (EOFError, OSError):
            return


def _ledger(key: str, seconds: float) -> None:
    """``LIBRA_PLANNER_LEDGER=<file>``: one line ``"<pool key> <host> <pid> <seconds>"`` per planning call (tests
    count them; an operator can audit where planning ran). One short O_APPEND write: lines do not interleave."""
    path = os.environ.get(LEDGER_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{key} {socket.gethostname()} {os.getpid()} {seconds:.6f}\n")


def _plan_or_error(plan, key: str, segments) -> tuple:
    """One planning call, logged in the ledger: (True, plan, seconds) or (False, (exception, traceback text),
    seconds)."""
    start = time.perf_counter()
    try:
        ok, payload = True, plan(segments)
    except BaseException as exc:  # noqa: BLE001 - sent to the trainer, raised by its get()
        ok, payload = False, _error_payload(exc)
    seconds = time.perf_counter() - start
    _ledger(key, seconds)
    return ok, payload, seconds


def _error_payload(exc: BaseException) -> tuple:
    """(exception, traceback text) of the exception being handled; the exception as its text if it does not pickle."""
    text = traceback.format_exc()
    try:
        pickle.dumps(exc)
    except Exception:  # noqa: BLE001
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc, text


class _SharedPools:
    """The pools of one planner process under a shared ``PlanStore``: claimed ones are planned and published,
    the others are read once their claimant publishes them."""

    def __init__(self, store, plan, timeout_s: float):
        self.store, self._plan, self._timeout_s = store, plan, float(timeout_s)
        self.pending: "dict[str, tuple]" = {}  # key -> (digest, segments, when it arrived)
        self._done: list = []

    def add(self, key: str, segments) -> None:
        digest = self.store.digest(key)
        if not self._plan_if_claimed(key, digest, segments):
            self.pending[key] = (digest, segments, time.perf_counter())

    def _plan_if_claimed(self, key: str, digest: str, segments) -> bool:
        if not self.store.claim(digest):
            return False
        ok, payload, seconds = _plan_or_error(self._plan, key, segments)
        try:
            if ok:
                self.store.publish(digest, payload)
            else:
                self.store.publish_error(digest, *payload)
        except BaseException as exc:  # noqa: BLE001 - the waiting peers time out; this rank raises now
            ok, payload = False, _error_payload(exc)
        self._done.append((key, ok, payload, seconds, True))
        return True

    def ready(self) -> list:
        """(key, ok, plan or (exception, text), seconds, planned here) of every pool finished since the last
        call."""
        from .plan_store import PlanStoreError

        for key, (digest, segments, since) in list(self.pending.items()):
            try:
                got = self.store.poll(digest)
                if got is None and not self.store.claimed(digest) and self._plan_if_claimed(key, digest, segments):
                    del self.pending[key]
                    continue
                if got is None and time.perf_counter() - since > self._timeout_s:
                    raise PlanStoreError(f"no plan published within {self._timeout_s:.1f}s by the process that "
                                         f"claimed it")
            except PlanStoreError as exc:
                got = (False, (RuntimeError(f"shared plan of pool {key} in {self.store.directory}: {exc}"), ""))
            except Exception as exc:  # noqa: BLE001 - e.g. a plan file that does not unpickle: that pool fails
                got = (False, _error_payload(exc))
            if got is not None:
                del self.pending[key]
                self._done.append((key, got[0], got[1], time.perf_counter() - since, False))
        done, self._done = self._done, []
        return done


def spawn_planner(spec: tuple):
    """(process, task connection, result connection) of a started planner process planning with ``spec``."""
    ctx = multiprocessing.get_context("spawn")
    task_recv, tasks = ctx.Pipe(duplex=False)
    results, result_send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=planner_process, args=(task_recv, result_send, spec), name="libra-planner",
                          daemon=True)
    main = sys.modules.get("__main__")
    hidden = {k: main.__dict__.get(k) for k in ("__spec__", "__file__") if main is not None and k in main.__dict__}
    # A trainer that is itself a daemonic multiprocessing child (some launchers, the CPU test harness) may not
    # start children: multiprocessing forbids it because a daemon dies without joining them. The planner exits as
    # soon as its task pipe reaches EOF (the trainer is gone), so it cannot outlive the trainer; lift the flag for
    # the start only.
    me = multiprocessing.current_process()
    daemonic = bool(me._config.get("daemon"))
    try:  # the child must not re-import the training script (spawn would run it as __mp_main__)
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        if daemonic:
            me._config["daemon"] = False
        process.start()
    finally:
        if daemonic:
            me._config["daemon"] = True
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(hidden)
    task_recv.close()
    result_send.close()  # the reader sees EOF as soon as the process is gone
    return process, tasks, results


def stop_planner(process, connections) -> None:
    """Join the process (it exits after the plan in progress), else terminate, else kill; no hang."""
    for stop, wait in ((None, 5.0), (process.terminate, 5.0), (process.kill, 5.0)):
        if stop is not None and process.is_alive():
            stop()
        process.join(timeout=wait)
        if not process.is_alive():
            break
    for conn in connections:
        conn.close()
