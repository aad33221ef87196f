"""Per-step Libra metrics: imbalance before/after each level of balancing, bytes moved, planner latency.

All functions return flat ``{name: float}`` dicts (names are TensorBoard tags under ``libra/``).
``microbatch_max_mean_*`` (the pipeline-bubble proxy of Fig. 12) are max/mean over a step's GA microbatches
of the worst worker's Eq. 6 load, >= 1 (1 = every microbatch takes as long as the others), and
``microbatch_slowest_after_over_before`` the slowest of them, VRSP + TAP over the sampler order at home.
Units: imbalance is ``R - 1 = max/mean - 1`` (§3.2) of attention workload proxies -- Eq. 4
``F_i = sum_j l_ij^2`` per packed sequence for the inter-pool level, Eq. 6 causal pairs per tile for the
intra-pool level. Bytes are per transformer layer, forward, remote only (Eq. 8 volumes).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterable, Optional, Sequence

import numpy as np

from ..config import TilePlacement
from ..plan.sequences import lane_loads, pool_loads
from ..plan.tiles import worker_loads
from ..plan.model import imbalance, sequence_flops

__all__ = ["inter_pool_metrics", "microbatch_metrics", "microbatch_worst_workers", "pool_plan_metrics",
           "aggregate_pool_metrics", "step_metrics", "write_metrics", "format_metrics"]

logger = logging.getLogger(__name__)


def inter_pool_metrics(window_segments: Sequence[Sequence[int]], order: Sequence[int], pool_size: int,
                       data_parallel_size: Optional[int] = None) -> Dict[str, float]:
    """Inter-pool R-1 of one optimizer-step window, sampler order (before) vs VRSP order (after); with
    ``data_parallel_size`` also the lane R-1 (``plan.sequences.lanes.lane_loads``: each lane's sum over its GA steps).

    window_segments[i]: raw-sample lengths of the i-th packed sequence in *sampler* order (GBS entries).
    order: the VRSP permutation (pool k = order[k*P:(k+1)*P]).
    """
    flops = sequence_flops(window_segments)
    contiguous = np.arange(flops.size, dtype=np.int64)
    order = np.asarray(order, dtype=np.int64)
    out = {
        "inter_pool_r1_before": imbalance(pool_loads(flops, contiguous, pool_size)),
        "inter_pool_r1_after": imbalance(pool_loads(flops, order, pool_size)),
    }
    if data_parallel_size is not None:
        out["lane_r1_before"] = imbalance(lane_loads(flops, contiguous, data_parallel_size, pool_size))
        out["lane_r1_after"] = imbalance(lane_loads(flops, order, data_parallel_size, pool_size))
    return out


def microbatch_worst_workers(pool_worst: Sequence[float], data_parallel_size: int, pool_size: int) -> np.ndarray:
    """float64 [GA]: per GA index g, the heaviest worker of the DP/P pools that run at g.

    ``pool_worst[k]``: the heaviest worker load of pool k (window order); pool k runs at GA index
    ``k*P // DP`` (``plan.sequences.assign_to_ranks``), so the DP/P pools of one GA index are consecutive.
    """
    return np.asarray(pool_worst, dtype=np.float64).reshape(-1, data_parallel_size // pool_size).max(axis=1)


def microbatch_metrics(window_segments: Sequence[Sequence[int]], order: Sequence[int], data_parallel_size: int,
                       config: Any, layout: Any, heads: Any, plans: Optional[Callable] = None) -> Dict[str, float]:
    """Pipeline-bubble proxy (Fig. 12) of one window: over its GA microbatches, max/mean of the worst
    worker's Eq. 6 attention load (``microbatch_worst_workers``).

    before: the sampler's order (Megatron's: position n on DP rank n % DP at GA n // DP), every tile at its
    Q-home (no TAP). after: the VRSP ``order``, tiles as TAP places them (``config.tile_placement``, the
    planner's ``plan.pool.place_pool_tiles``). ``config``/``layout``/``heads``: the planner's. ``plans``: pool segments
    -> the planner's ``PlannedPool`` (``BackgroundPlanner.get_for_metrics``): the after loads are then read from
    the planner's placements (its node grouping, nothing placed again); without it they are placed here.
    ``microbatch_slowest_after_over_before``: the slowest microbatch's worst worker, after / before. The
    spread alone can rise while every microbatch gets faster (sampler-order microbatches that all hold one
    L-token document have the same worst worker: spread 1), so both are reported.
    """
    home = config.replace(tile_placement=TilePlacement.HOME)
    contiguous = np.arange(len(window_segments), dtype=np.int64)
    per_ga = {}
    for name, run_order, pool_config in (("before", contiguous, home), ("after", order, config)):
        pools = _window_pools(window_segments, run_order, config.pool_size)
        if plans is not None and name == "after":
            worst = [float(np.max(plans(pool).pool_plan.placement.loads)) for pool in pools]
        else:  # the sampler-order pools at their Q-homes: tiles only, no placement search
            worst = [_worst_worker_load(pool, pool_config, layout, heads) for pool in pools]
        per_ga[name] = microbatch_worst_workers(worst, data_parallel_size, config.pool_size)
    out = {f"microbatch_max_mean_{name}": _max_over_mean(loads) for name, loads in per_ga.items()}
    slowest_before = float(per_ga["before"].max())
    out["microbatch_slowest_after_over_before"] = (float(per_ga["after"].max()) / slowest_before
                                                   if slowest_before > 0 else 1.0)
    return out


def _window_pools(window_segments: Sequence[Sequence[int]], order: Sequence[int], pool_size: int) -> list:
    """The segments of every pool k = order[k*P:(k+1)*P] (window order)."""
    order = np.asarray(order, dtype=np.int64).reshape(-1, pool_size)
    return [[window_segments[i] for i in members] for members in order.tolist()]


def _worst_worker_load(pool_segments: Sequence[Sequence[int]], config: Any, layout: Any, heads: Any) -> float:
    from ..plan.pool import place_pool_tiles, pool_timing

    _, placement = place_pool_tiles(pool_segments, config, layout, heads, timing=pool_timing(config, heads))
    return float(np.max(placement.loads))


def pool_plan_metrics(pool_plan: Any, planner_latency_s: Optional[float] = None) -> Dict[str, float]:
    """Intra-pool worker balance of one ``PoolPlan``: max/mean at the Q-homes (no TAP) vs as placed."""
    tiles, placement, exchange = pool_plan.tiles, pool_plan.placement, pool_plan.exchange
    home = worker_loads(tiles, tiles.tile_home())
    placed = worker_loads(tiles, np.asarray(placement.assignment))
    out = {
        "intra_pool_max_over_mean_home": _max_over_mean(home),
        "intra_pool_max_over_mean_placed": _max_over_mean(placed),
        "bytes_q": float(exchange.bytes_q),
        "bytes_kv": float(exchange.bytes_kv),
        "bytes_o": float(exchange.bytes_o),
        "plan_seconds": float(pool_plan.seconds),
    }
    if planner_latency_s is not None:
        out["planner_latency_s"] = float(planner_latency_s)
    return out


def _max_over_mean(loads: np.ndarray) -> float:
    mean = float(np.mean(loads)) if loads.size else 0.0
    return float(np.max(loads)) / mean if mean > 0 else 1.0


def aggregate_pool_metrics(per_pool: Iterable[Dict[str, float]]) -> Dict[str, float]:
    """Combine the pool metrics of one step: worst max/mean, summed bytes, mean and max planner latency."""
    rows = list(per_pool)
    if not rows:
        return {}
    out = {
        "intra_pool_max_over_mean_home": max(r["intra_pool_max_over_mean_home"] for r in rows),
        "intra_pool_max_over_mean_placed": max(r["intra_pool_max_over_mean_placed"] for r in rows),
    }
    for key in ("bytes_q", "bytes_kv", "bytes_o"):
        out[key] = float(sum(r[key] for r in rows))
    lat = [r["planner_latency_s"] for r in rows if "planner_latency_s" in r]
    if lat:
        out["planner_latency_mean_s"] = float(np.mean(lat))
        out["planner_latency_max_s"] = float(np.max(lat))
    return out


def step_metrics(window_segments: Sequence[Sequence[int]], order: Sequence[int], pool_size: int,
                 pool_plans: Iterable[Any] = (), latencies: Iterable[float] = ()) -> Dict[str, float]:
    """All metrics of one step: inter-pool (window) + aggregated intra-pool (the given pool plans)."""
    out = inter_pool_metrics(window_segments, order, pool_size)
    lat = list(latencies)
    rows = [pool_plan_metrics(p, lat[i] if i < len(lat) else None) for i, p in enumerate(pool_plans)]
    out.update(aggregate_pool_metrics(rows))
    return out


def write_metrics(values: Dict[str, float], iteration: int, writer: Any = None, prefix: str = "libra/",
                  log: bool = False) -> int:
    """Write scalars to a TensorBoard-style ``writer`` (``add_scalar``); returns how many were written.

    ``writer=None`` looks up Megatron-LM's ``megatron.training.get_tensorboard_writer()`` when that package
    is importable; with no writer this is a no-op (returns 0). ``log=True`` also emits one
    ``format_metrics`` line on this module's logger (INFO), e.g. next to Megatron's iteration log.
    """
    if log and values:
        logger.info("libra iteration %d: %s", iteration, format_metrics(values))
    if writer is None:
        writer = _megatron_writer()
    if writer is None:
        return 0
    for name, value in values.items():
        writer.add_scalar(prefix + name, float(value), iteration)
    return len(values)


def _megatron_writer():
    try:
        from megatron.training import get_tensorboard_writer
    except Exception:  # noqa: BLE001 - Megatron-LM training code is optional (not on PyPI)
        return None
    try:
        return get_tensorboard_writer()
    except Exception:  # noqa: BLE001 - global vars not initialised outside a Megatron-LM run
        return None


def format_metrics(values: Dict[str, float]) -> str:
    """One log line: ``name=value`` pairs, bytes as integers, the rest with 4 significant digits."""
    parts = []
    for name, value in values.items():
        parts.append(f"{name}={int(value)}" if name.startswith("bytes") else f"{name}={value:.4g}")
    return " ".join(parts)
