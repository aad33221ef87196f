"""Multi-process gloo harness for tests and CPU benchmarks.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, initialises a gloo default
process group in each, calls ``fn(rank, world_size, *args)`` and returns the list of per-rank return
values. An exception on any rank is re-raised in the caller with that rank's traceback. A run that
exceeds ``timeout`` seconds is killed and reported as a hang (``TimeoutError``), so a test that would
deadlock fails instead.

``fn`` must be importable at module level (processes come from a forkserver, which is fast and does not
inherit the parent's OpenMP state).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable, List, Optional

__all__ = ["run_distributed", "free_port"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn, rank, world_size, port, args, queue, env):
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, False, traceback.format_exc()))


_CTX: Optional[mp.context.BaseContext] = None


def _context():
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        # megatron.core is slow to import (~6 s CPU); preloading it once in the server saves that per rank.
        # The forkserver skips preload modules that fail to import.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy", "megatron.core.parallel_state"])
        _CTX = ctx
    return _CTX


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    env: Optional[dict] = None,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return per-rank results."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue, dict(env or {})), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict = {}
    failures = []
    try:
        import queue as queue_mod

        while len(results) + len(failures) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=timeout)
            except queue_mod.Empty:
                missing = sorted(set(range(world_size)) - set(results) - {f[0] for f in failures})
                raise TimeoutError(
                    f"distributed run timed out after {timeout}s (hang?); ranks without a result: {missing}"
                    + ("".join(f"\n--- rank {r} failed:\n{tb}" for r, tb in failures))
                ) from None
            if ok:
                results[rank] = payload
            else:
                failures.append((rank, payload))
                if len(failures) == 1:
                    # Give the other ranks a moment to report (they usually fail the same way).
                    timeout = min(timeout, 20.0)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if failures:
        failures.sort()
        detail = "".join(f"\n--- rank {r}:\n{tb}" for r, tb in failures)
        raise RuntimeError(f"{len(failures)} of {world_size} ranks failed:{detail}")
    return [results[r] for r in range(world_size)]
