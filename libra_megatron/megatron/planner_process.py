"""The planner process of ``megatron.planner.BackgroundPlanner(mode="process")`` (issue 25): a spawned interpreter that
plans the pools it is sent and pipes back the pickled plans, so the search never takes the training thread's
interpreter lock. Also the pool-wide saved-bytes / save-mode step both planner modes run after ``plan_pool``."""
from __future__ import annotations

import hashlib
import multiprocessing
import pickle
import sys
import time
import traceback
from typing import Sequence

import numpy as np

from ..config import LibraConfig
from ..plan.layout import HeadLayout, TokenLayout

__all__ = ["default_plan_fn", "memory", "pool_key", "planner_process", "spawn_planner", "stop_planner"]


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
    from ..plan.model import choose_save_mode, predicted_saved_bytes

    saved = predicted_saved_bytes(exchange, heads, layout.local_len)
    return saved, choose_save_mode(config.save_mode, saved["arranged"], config.activation_budget_gb, num_layers)


def planner_process(tasks, results, spec) -> None:
    """Body of the planner process: plan every pool it is sent, send back (key, True, (plan, seconds, saved bytes,
    save mode)) or (key, False, (exception, traceback text)); exits on None or when the trainer is gone."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's: it closes this process
    config, layout, heads, timing, validate, worker, num_layers, plan_fn = spec
    plan_fn = plan_fn or default_plan_fn
    extra = {} if timing is None else {"timing": timing}
    while True:
        try:
            task = tasks.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        key, segments = task
        start = time.perf_counter()
        try:
            plan = plan_fn([list(s) for s in segments], config, layout, heads, validate=validate, **extra)
            exchange = getattr(plan, "exchange", None)
            if worker is not None and exchange is not None:
                exchange.for_rank(worker)  # the RankPlan travels in the plan's cache
            saved, mode = memory(plan, config, heads, layout, num_layers)
            out = (key, True, (plan, time.perf_counter() - start, saved, mode))
        except BaseException as exc:  # noqa: BLE001 - sent to the trainer, raised by its get()
            text = traceback.format_exc()
            try:
                pickle.dumps(exc)
            except Exception:  # noqa: BLE001
                exc = RuntimeError(f"{type(exc).__name__}: {exc}")
            out = (key, False, (exc, text))
        try:
            results.send(out)
        except (EOFError, OSError):
            return


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
