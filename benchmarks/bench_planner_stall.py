"""Does the background planner slow the training thread? (issue 25: "the planner costs training nothing")

Run:  .venv/bin/python benchmarks/bench_planner_stall.py [--rounds 10] [--seconds 1] [--modes neighbour process thread]
                                                         [--cases 256K 1M] [--traces linux wikipedia]

A launch-bound training-thread stand-in (a loop of ``--ops`` small torch ops per iteration, one torch thread: what
Megatron's training thread does between kernels when it only launches them) runs in blocks of ``--seconds`` beside
a ``BackgroundPlanner`` at the shipped knobs (configs/libra/256k.yaml, 1m.yaml; Qwen3-30B-A3B heads, CP=8 / 16)
planning real pools (linux-6.12 and wikipedia traces packed Megatron-style, VRSP pools of P=8). A feeder thread
submits the pools ``--window`` ahead and takes each plan (as ``LibraHooks`` does). Per planner mode, ``thread``
(the planner in a thread of this interpreter, the code before issue 25), ``process`` (its own process, what a
Megatron-LM run starts) or ``neighbour`` (the control: the same planning in a process whose plans never reach this
interpreter), ``--rounds`` rounds each run one block with the planner idle (``none``: started, nothing
submitted) and one with it busy, in alternating order: the machine's drift over a run (several % here) falls on
both sides, and the median's rise is the median over rounds of the busy block's median over its idle partner's.
Printed per case: the loop's median, p99 and longest iteration in ms over all blocks of a side, iterations per
second, pools planned, the median's rise (floor <= 2%) with its range over rounds, and the p99's (floor <= 5 ms).
Needs two free cores: the planner's, and the training thread's.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import threading
import time
from typing import Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_balance import pack  # noqa: E402
from bench_planner import pools_of  # noqa: E402
from libra_megatron.config import LibraConfig  # noqa: E402
from libra_megatron.megatron.planner import BackgroundPlanner  # noqa: E402
from libra_megatron.plan.layout import HeadLayout, TokenLayout  # noqa: E402
from libra_megatron.plan.traces import find_trace, load_trace  # noqa: E402

CASES = {"256K": (256 * 1024, 8, "256k.yaml"), "1M": (1024 * 1024, 16, "1m.yaml")}
TRACES = {"linux": "linux-6.12-files.qwen.txt", "wikipedia": "wikipedia-flexsp.txt"}
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "libra")


def training_loop(seconds: float, ops: int) -> np.ndarray:
    """Iteration times (s) of ``ops`` small torch ops per iteration, for ``seconds``."""
    x = torch.ones(64)
    out = []
    end = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        for _ in range(ops // 2):
            x = x * 1.0001
            x = x + 1e-4
        now = time.perf_counter()
        out.append(now - start)
        if now >= end:
            return np.asarray(out)


class Feeder:
    """A thread that keeps ``planner`` busy while ``run`` is set: it submits ``window`` pools ahead and takes their
    plans (as ``LibraHooks`` does), round robin over ``pools``. ``pause`` returns once the batch in flight is taken,
    so the planner is idle until the next ``resume``."""

    def __init__(self, planner: BackgroundPlanner, pools, window: int):
        self.planner, self.pools, self.window = planner, pools, window
        self.run, self.idle, self.stop, self.planned = threading.Event(), threading.Event(), threading.Event(), 0
        self.error: Optional[BaseException] = None  # a plan that failed: raised by the next pause
        self.idle.set()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        i = 0
        while True:
            self.run.wait()  # no polling: a thread waking in this interpreter is what the loop would feel
            if self.stop.is_set():
                return
            self.idle.clear()
            if not self.run.is_set():  # paused between the wait and here: stay idle
                self.idle.set()
                continue
            batch = [self.pools[(i + k) % len(self.pools)] for k in range(self.window)]
            try:
                self.planner.submit_many(batch)
                for pool in batch:
                    self.planner.get_pool(pool)
                    self.planned += 1
                i += self.window
                self.planner._slots.clear()  # noqa: SLF001 - plan the same pools again (a benchmark, not a cache test)
            except BaseException as exc:  # noqa: BLE001 - re-raised by pause on the main thread, never a hang
                self.error = exc
                return
            finally:
                self.idle.set()

    def resume(self) -> None:
        self.run.set()
        time.sleep(0.2)  # the planner is busy before the loop's block starts

    def pause(self) -> None:
        self.run.clear()
        self.idle.wait(timeout=600)
        if self.error is not None:
            raise RuntimeError(f"the planner failed while the loop ran: {self.error}") from self.error

    def close(self) -> None:
        self.run.clear()
        self.idle.wait(timeout=600)
        self.stop.set()
        self.run.set()
        self.thread.join(timeout=60)


def _neighbour(config, layout, heads, pools, run, idle, stop, planned) -> None:
    """Body of the ``neighbour`` control: plan ``pools`` round robin while ``run`` is set and drop the plans."""
    from libra_megatron.plan.pool import plan_pool

    i = 0
    while not stop.is_set():
        if not run.wait(timeout=0.05):
            idle.set()
            continue
        idle.clear()
        plan_pool([list(s) for s in pools[i % len(pools)]], config, layout, heads, validate=False)
        with planned.get_lock():
            planned.value += 1
        i += 1


class Neighbour:
    """The control: a spawned process doing the planner's CPU work (the same ``plan_pool`` calls) whose plans never
    reach this interpreter. Its rise is what any busy neighbour on the other core costs the loop on this machine;
    the planner's rise above it is what plans arriving in the trainer cost."""

    def __init__(self, config, layout, heads, pools):
        ctx = multiprocessing.get_context("spawn")
        self.run, self.idle, self.stop = ctx.Event(), ctx.Event(), ctx.Event()
        self.count = ctx.Value("i", 0)
        self.process = ctx.Process(target=_neighbour, daemon=True, args=(
            config, layout, heads, pools, self.run, self.idle, self.stop, self.count))
        self.process.start()
        self.resume()  # its first plan imports and warms up the planner, as ``warm_up`` does
        self.pause()

    @property
    def planned(self) -> int:
        return self.count.value

    def resume(self) -> None:
        self.run.set()
        time.sleep(0.2)

    def pause(self) -> None:
        self.run.clear()
        time.sleep(0.1)
        while not self.idle.wait(timeout=1.0):  # a plan in flight; a dead process never sets idle
            if not self.process.is_alive():
                raise RuntimeError(f"the neighbour process died (exit code {self.process.exitcode})")

    def close(self) -> None:
        self.pause()
        self.stop.set()
        self.process.join(timeout=60)


def run_mode(mode: str, config, layout, heads, pools, rounds: int, seconds: float, ops: int, window: int):
    """``rounds`` rounds of two loop blocks of ``seconds``, one with the planner idle and one with it busy (order
    alternating round by round, so drift in the machine's speed falls on both): (idle blocks, busy blocks, pools
    planned during busy blocks)."""
    if mode == "neighbour":
        planner, feeder = None, Neighbour(config, layout, heads, pools)
    else:
        planner = BackgroundPlanner(config, layout, heads, mode=mode, capacity=4 * len(pools), timeout_s=600,
                                    worker=0)
        planner.warm_up()
        feeder = Feeder(planner, pools, window)
    idle, busy = [], []
    try:
        start = feeder.planned
        for r in range(rounds):
            for busy_block in ((False, True) if r % 2 == 0 else (True, False)):
                if busy_block:
                    feeder.resume()
                    busy.append(training_loop(seconds, ops))
                    feeder.pause()
                else:
                    idle.append(training_loop(seconds, ops))
        planned = feeder.planned - start
    finally:
        feeder.close()
        if planner is not None:
            planner.close()
    return idle, busy, planned


def summary(blocks) -> tuple:
    """(median, p99, max) in ms of every iteration of ``blocks``, and the number of iterations."""
    times = np.concatenate(blocks)
    return tuple(float(np.percentile(times, q)) * 1e3 for q in (50, 99, 100)) + (times.size,)


def paired_rise(idle, busy) -> np.ndarray:
    """Per round, the busy block's median over the idle block's, minus 1."""
    return np.array([np.median(b) / np.median(a) - 1.0 for a, b in zip(idle, busy)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds per loop block")
    parser.add_argument("--rounds", type=int, default=10, help="idle / busy block pairs per planner mode")
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--pools", type=int, default=8, help="distinct pools per trace and case")
    parser.add_argument("--window", type=int, default=2, help="pools submitted ahead")
    parser.add_argument("--modes", nargs="+", default=["neighbour", "process", "thread"],
                        choices=["none", "thread", "process", "neighbour"],
                        help="planner modes (the idle blocks, 'none', are always run; 'neighbour': the control)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--traces", nargs="+", default=list(TRACES), choices=list(TRACES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}; {args.ops} ops per iteration; per planner "
          f"mode {args.rounds} rounds of a {args.seconds:g} s block with the planner idle and one busy, alternating")
    print(f"{'case':<6}{'trace':<11}{'mode':<9}{'median':>8}{'p99':>8}{'max':>8}{'it/s':>8}{'pools':>7}"
          f"{'d_med':>8}{'d_p99':>8}   (ms; d_med: median over rounds of busy/idle block medians - 1, [min, max]; "
          f"d_p99: busy - idle p99; floors +2% and +5 ms)")
    for case in args.cases:
        seq_len, cp, yaml = CASES[case]
        config = LibraConfig.from_yaml(os.path.join(CONFIGS, yaml))
        layout = TokenLayout(config.token_layout, seq_len, cp)
        heads = HeadLayout(32, 4, 128, config.head_split, config.chunks_for(32, 4), elem_bytes=2)
        for trace in args.traces:
            segs = pack(load_trace(find_trace(TRACES[trace])), seq_len)
            pools = [[list(map(int, s)) for s in pool] for pool in pools_of(segs, args.pools)]
            for mode in [m for m in args.modes if m != "none"]:
                idle, busy, planned = run_mode(mode, config, layout, heads, pools, args.rounds, args.seconds,
                                               args.ops, args.window)
                base, with_planner = summary(idle), summary(busy)
                rise = paired_rise(idle, busy)
                d_med, d_p99 = float(np.median(rise)), with_planner[1] - base[1]
                ok = "OK" if d_med <= 0.02 and d_p99 <= 5 else "OVER"
                for name, (med, p99, top, n), tail in (
                        ("none", base, ""),
                        (mode, with_planner, f"{100 * d_med:>+7.1f}%{d_p99:>+8.2f}  {ok} "
                                             f"[{100 * rise.min():+.1f}%, {100 * rise.max():+.1f}%]")):
                    print(f"{case:<6}{trace:<11}{name:<9}{med:>8.3f}{p99:>8.3f}{top:>8.2f}"
                          f"{n / (args.seconds * len(idle)):>8.0f}{planned if name != 'none' else 0:>7}{tail}",
                          flush=True)


if __name__ == "__main__":
    main()
