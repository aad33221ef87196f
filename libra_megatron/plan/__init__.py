"""The planner (§4.2-§4.4), pure Python + numpy: frozen, validated plan records; no torch, no megatron.

    layout.py, pool.py, errors.py   a pool's token / head layout; ``plan_pool``, the one entry point per pool
    sequences/                      §4.2 VRSP: which pool, GA step and DP rank runs every packed sequence
    tiles/                          §4.3 SH-Tiles and their placement (Algorithm 2, time-aware moves)
    exchange/                       §4.3.3-§4.4 the routes that execute a placement, and the bytes they move
    model/                          what everything costs: FLOPs, the one time model, default rates, memory
    traces.py, packing.py           corpus input: document-length traces, fixed-token packing

Import direction (``docs/architecture.md``): sequences, tiles -> exchange -> model; every room may read
layout and errors; nothing here imports ``sim``, ``runtime`` or ``megatron``.
"""
from .errors import PlanError
from .layout import CpChunk, HeadLayout, TokenLayout
from .pool import PoolPlan, place_pool_tiles, plan_pool, pool_timing

__all__ = ["PlanError", "CpChunk", "HeadLayout", "TokenLayout", "PoolPlan", "place_pool_tiles", "plan_pool",
           "pool_timing"]
