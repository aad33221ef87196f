"""Every rank's op lists of an exchange plan, phase by phase (``schedule.rank_phase_ops`` per rank), with the cache
the dense placement's candidates share.

Pure Python. ``rank_inputs`` reads what the lists read of every rank at once (``pool_sizes.pool_rank_sizes``);
``phase_ops`` builds one phase of every rank, reusing a rank's list when a cache already holds its inputs
(``rank_ops_key``); ``layer_ops`` builds both phases. ``traffic.LayerPricing`` prices them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..model import RELAY
from .pool_sizes import pool_rank_sizes, sizes_key
from .runtime_tables import RankSizes
from .schedule import PHASES, check_modes, rank_phase_ops

__all__ = ["LayerOps", "layer_ops", "phase_ops", "rank_inputs", "rank_ops_key"]


@dataclass(frozen=True)
class LayerOps:
    """Per rank (index = pool worker), the op tuples of the layer's forward and of its backward."""

    forward: Tuple[tuple, ...]
    backward: Tuple[tuple, ...]


def rank_ops_key(sizes: RankSizes, heads, rank: int, num_workers: int, local_tokens: int, local_lead: int) -> tuple:
    """Everything ``rank_layer_ops`` reads of a rank (its sizes: ``pool_sizes.sizes_key``; rank, pool size, tokens,
    heads, lead; not the pool's fingerprint), hashable: equal keys, equal op lists. Candidate placements of one
    pool share most ranks' sizes (``plan.tiles.placement.fastest_layer``), so their op lists are built once."""
    return (rank, num_workers, local_tokens, local_lead, heads, sizes_key(sizes))


def rank_inputs(plan) -> Tuple[tuple, ...]:
    """Per rank of an ``ExchangePlan``, what its op lists read (``rank_ops_key``'s arguments), every rank's sizes
    read at once from the plan's pool-wide tables (``pool_sizes.pool_rank_sizes``)."""
    tables = getattr(plan.ranks, "_tables", None)
    W, out = plan.num_workers, []
    for r, sizes in enumerate(pool_rank_sizes(plan)):
        if tables is None:
            rank_plan = plan.for_rank(r)
            out.append((sizes, rank_plan.heads, r, W, rank_plan.local_tokens, rank_plan.local_lead))
        else:
            lead = -1 if tables.local_lead is None else int(tables.local_lead[r])
            out.append((sizes, tables.heads, r, W, tables.local_tokens, lead))
    return tuple(out)


def phase_ops(inputs: Tuple[tuple, ...], phase: str, save_mode: str = "arranged", relay_comm: str = RELAY,
              cache: Optional[Dict[tuple, tuple]] = None, byte_rows: Optional[dict] = None) -> Tuple[tuple, ...]:
    """The op lists of every rank in one phase ("forward" | "backward"), from ``rank_inputs``. ``cache``: a dict
    shared by several plans of one pool: a rank whose inputs another candidate already had reuses its list.
    ``byte_rows``: a dict shared by the phases of these inputs (``schedule.rank_phase_ops``; None: one per call)."""
    check_modes(save_mode, relay_comm)
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    byte_rows = {} if byte_rows is None else byte_rows
    if cache is None:
        return tuple(rank_phase_ops(x, phase, save_mode, relay_comm, byte_rows) for x in inputs)
    out = []
    for x in inputs:
        key = (rank_ops_key(*x), save_mode, relay_comm, phase)
        ops = cache.get(key)
        if ops is None:
            ops = cache[key] = rank_phase_ops(x, phase, save_mode, relay_comm, byte_rows)
        out.append(ops)
    return tuple(out)


def layer_ops(plan, save_mode: str = "arranged", relay_comm: str = RELAY,
              cache: Optional[Dict[tuple, tuple]] = None) -> LayerOps:
    """``rank_layer_ops`` of every rank of an ``ExchangePlan`` (``rank_inputs``, ``phase_ops``; ``cache`` as there)."""
    inputs, byte_rows = rank_inputs(plan), {}
    return LayerOps(*(phase_ops(inputs, phase, save_mode, relay_comm, cache, byte_rows) for phase in PHASES))
