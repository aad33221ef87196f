"""Does the background planner slow the training thread? (issue 25: "the planner costs training nothing")

Run:  .venv/bin/python benchmarks/bench_planner_stall.py [--seconds 6] [--modes none thread process]
                                                         [--cases 256K 1M] [--traces linux wikipedia]

A launch-bound training-thread stand-in (a loop of ``--ops`` small torch ops per iteration, one torch thread: what
Megatron's training thread does between kernels when it only launches them) runs for ``--seconds`` beside a
``BackgroundPlanner`` kept busy planning real pools (linux-6.12 and wikipedia traces packed Megatron-style, VRSP
pools of P=8) at the shipped knobs (configs/libra/256k.yaml, 1m.yaml; Qwen3-30B-A3B heads, CP=8 / 16). A feeder
thread submits the pools a window ahead and takes each plan (as ``LibraHooks`` does). Modes: ``none`` (no
planner), ``thread`` (the planner in a thread of this interpreter, the code before issue 25) and ``process``
(its own process, what a Megatron-LM run starts). Printed per case: the loop's median, p99 and longest
iteration in ms, iterations per second, pools planned, and for each planner mode the median's rise (floor
<= 2%) and the p99's (floor <= 5 ms) over ``none``. Needs two free cores: the planner's, and the training thread's.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

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


def feed(planner: BackgroundPlanner, pools, stop: threading.Event, window: int, done: list) -> None:
    """Submit ``window`` pools ahead and take their plans, round robin over ``pools``, until ``stop``."""
    i = 0
    while not stop.is_set():
        batch = [pools[(i + k) % len(pools)] for k in range(window)]
        planner.submit_many(batch)
        for pool in batch:
            if stop.is_set():
                return
            planner.get_pool(pool)
            done.append(1)
        i += window
        planner._slots.clear()  # noqa: SLF001 - plan the same pools again (a benchmark, not a cache test)


def run_case(mode: str, config, layout, heads, pools, seconds: float, ops: int):
    if mode == "none":
        return training_loop(seconds, ops), 0
    planner = BackgroundPlanner(config, layout, heads, mode=mode, capacity=4 * len(pools), timeout_s=600)
    planner.warm_up()
    stop, done = threading.Event(), []
    feeder = threading.Thread(target=feed, args=(planner, pools, stop, 8, done), daemon=True)
    feeder.start()
    time.sleep(0.5)  # the planner is busy before the loop starts
    times = training_loop(seconds, ops)
    stop.set()
    feeder.join(timeout=60)
    planner.close()
    return times, len(done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--pools", type=int, default=8, help="distinct pools per trace and case")
    parser.add_argument("--modes", nargs="+", default=["none", "thread", "process"],
                        choices=["none", "thread", "process"])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--traces", nargs="+", default=list(TRACES), choices=list(TRACES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}; {args.ops} ops per iteration, "
          f"{args.seconds:.0f} s per run")
    print(f"{'case':<6}{'trace':<11}{'mode':<9}{'median':>8}{'p99':>8}{'max':>8}{'it/s':>8}{'pools':>7}"
          f"{'d_med':>8}{'d_p99':>8}   (ms; d_ = rise over 'none', floors +2% and +5 ms)")
    for case in args.cases:
        seq_len, cp, yaml = CASES[case]
        config = LibraConfig.from_yaml(os.path.join(CONFIGS, yaml))
        layout = TokenLayout(config.token_layout, seq_len, cp)
        heads = HeadLayout(32, 4, 128, config.head_split, config.chunks_for(32, 4), elem_bytes=2)
        for trace in args.traces:
            segs = pack(load_trace(find_trace(TRACES[trace])), seq_len)
            pools = [[list(map(int, s)) for s in pool] for pool in pools_of(segs, args.pools)]
            base = None
            for mode in args.modes:
                times, planned = run_case(mode, config, layout, heads, pools, args.seconds, args.ops)
                med, p99, top = (float(np.percentile(times, q)) * 1e3 for q in (50, 99, 100))
                if mode == "none":
                    base = (med, p99)
                rise = "" if base is None or mode == "none" else \
                    f"{100 * (med / base[0] - 1):>+7.1f}%{p99 - base[1]:>+8.2f}" + \
                    ("  OK" if med <= 1.02 * base[0] and p99 <= base[1] + 5 else "  OVER")
                print(f"{case:<6}{trace:<11}{mode:<9}{med:>8.3f}{p99:>8.3f}{top:>8.2f}{times.size / args.seconds:>8.0f}"
                      f"{planned:>7}{rise}", flush=True)


if __name__ == "__main__":
    main()
