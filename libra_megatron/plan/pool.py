"""One call from packed-sequence segments to a validated exchange plan for one sequence pool (§4.3-§4.4).

    build_tiles (Eq. 5-7; config.tiling, config.kv_fetch) -> place_tiles (Algorithm 2, Eq. 8)
    -> build_exchange_plan -> validate_plan
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Sequence

from ..config import KvRelay, LibraConfig, flag_name
from .exchange import ExchangePlan, build_exchange_plan, validate_plan
from .layout import HeadLayout, TokenLayout
from .tiles import TileSet, build_tiles, place_tiles, reads_timing
from .model import StepTimeModel

__all__ = ["PoolPlan", "plan_pool", "place_pool_tiles", "pool_timing"]


@dataclass(frozen=True, eq=False)
class PoolPlan:
    """Everything planned for one pool instance.

    tiles      the pool's SH-Tiles and KV groups
    placement  ``placement.TilePlacementResult`` (assignment, loads, capacity, Eq. 8 comm_bytes)
    exchange   the ExchangePlan realising ``placement.assignment`` (per-rank plans built on access)
    seconds    wall time of tiles + placement + exchange (+ validation when requested)
    """

    tiles: TileSet
    placement: object
    exchange: ExchangePlan
    seconds: float

    @property
    def fingerprint(self) -> str:
        return self.exchange.fingerprint


def _check_consistent(seq_segments, config: LibraConfig, layout: TokenLayout, heads: HeadLayout) -> None:
    """The config, layouts and segments must describe the same pool; ValueError names the flag. ``num_chunks: auto``
    is compared as it resolves for these heads (``LibraConfig.chunks_for``)."""
    chunks = config.chunks_for(heads.num_q_heads, heads.num_kv_heads)
    pairs = [
        ("pool_size", config.pool_size, len(seq_segments), "packed sequences given"),
        ("head_split", config.head_split, heads.head_split, "HeadLayout.head_split"),
        ("num_chunks", chunks, heads.num_chunks, "HeadLayout.num_chunks"),
        ("token_layout", config.token_layout, layout.kind, "TokenLayout.kind"),
    ]
    for key, want, got, what in pairs:
        if want != got:
            shown = getattr(want, "value", want)
            if key == "num_chunks" and config.num_chunks != chunks:
                shown = (f"{config.num_chunks} (= {chunks} for {heads.num_q_heads} query / {heads.num_kv_heads} K/V "
                         f"heads at head_split {config.head_split})")
            raise ValueError(f"{flag_name(key)}={shown} but {what} is {getattr(got, 'value', got)}")


def plan_pool(
    seq_segments: Sequence[Sequence[int]],
    config: LibraConfig,
    layout: TokenLayout,
    heads: HeadLayout,
    *,
    validate: bool = True,
    tile_cost_model=None,
    timing=None,
) -> PoolPlan:
    """Plan one pool: ``seq_segments[p]`` are the document lengths of its p-th packed sequence.

    Deterministic: the same inputs give the same fingerprint on every rank. ``validate`` runs
    ``validate_plan`` over all ranks (O(total units); for tests and debugging at scale, switch off).
    ``tile_cost_model`` (a ``plan.model.kernel_cost.TileCostModel``, default None = Eq. 6 FLOPs) prices the tiles
    that Algorithm 2 balances; every rank must pass the same model to get the same fingerprint.
    ``timing`` (a ``plan.model.timing.StepTimeModel`` with the pool's nodes) chooses every rank's Pipeliner lead and
    whether K/V is relayed (``config.kv_relay``), and is read by tile placement 'time' and 'dense'; None = its
    default rates, the pool's workers consecutive GPUs from a node boundary.
    """
    start = time.perf_counter()
    timing = pool_timing(config, heads, timing)
    tiles, placement = place_pool_tiles(seq_segments, config, layout, heads, tile_cost_model=tile_cost_model,
                                        timing=timing)
    exchange = placement.exchange if placement.exchange is not None else \
        build_exchange_plan(tiles, placement.assignment, timing)
    if validate:
        validate_plan(exchange, tiles)
    return PoolPlan(tiles=tiles, placement=placement, exchange=exchange, seconds=time.perf_counter() - start)


def pool_timing(config: LibraConfig, heads: HeadLayout, timing=None) -> StepTimeModel:
    """The pool's time model (default rates, consecutive GPUs when None) with ``config.kv_relay``: it chooses every
    rank's Pipeliner lead and whether the plan relays K/V."""
    timing = timing if timing is not None else StepTimeModel(heads.head_dim)
    return dataclasses.replace(timing, kv_relay=config.kv_relay is KvRelay.AUTO)


def place_pool_tiles(seq_segments: Sequence[Sequence[int]], config: LibraConfig, layout: TokenLayout,
                     heads: HeadLayout, *, tile_cost_model=None, timing=None) -> tuple:
    """(TileSet, TilePlacementResult) of one pool: ``plan_pool``'s tiles and TAP placement, no exchange plan."""
    _check_consistent(seq_segments, config, layout, heads)
    tiles = build_tiles(seq_segments, layout, heads, config.block_size, tiling=config.tiling, tau=config.tau,
                        kv_fetch=config.kv_fetch)
    tile_cost = None if tile_cost_model is None else tile_cost_model.tile_costs(tiles)
    return tiles, place_tiles(tiles, config.tau, config.tile_placement, tile_cost=tile_cost,
                              timing=timing if reads_timing(config.tile_placement) else None)
