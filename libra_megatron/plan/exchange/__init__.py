"""Exchange plans (§4.3.3, §4.4): the routes that execute a tile assignment, and what they move.

    records         the plan schema the runtime reads: ``Route``, ``RankPlan``, ``ExchangePlan``, unit -> row maps
    builder         ``build_exchange_plan``: routes, varlen entries and Eq. 8 byte totals of an assignment
    tables          the pool-wide run tables a plan's ranks are cut from (built once, read lazily per rank)
    relay           the K/V relay choice (one inter-node copy per home run and node; single or striped) and every
                    rank's lead
    kv_refs         which K/V rows a destination fetches (deduplicated per (sample, head shard) group)
    local_entries   which varlen entries need no received data (the Pipeliner's local-first split)
    arranged_order  every destination's arranged Q grouped by entry kind (each entry set one slice)
    traffic         per-worker, per-chunk bytes of a plan, and their seconds under ``plan.model``
    schedule        one rank's op list of a layer, forward and backward, as the runtime issues it
    op_lists        every rank's op lists of a plan, phase by phase, cached across a pool's candidate plans
    runtime_tables  ``rank_tables``: a rank's plan as index runs for the runtime (cached); ``rank_sizes``: its
                    split sizes and varlen lengths alone (what the op lists read)
    pool_sizes      ``pool_rank_sizes``: every rank's ``rank_sizes`` at once, from the pool-wide tables
    validate        ``validate_plan``: every structural invariant, checked before any collective

Imports ``plan.model``, ``plan.layout``, ``plan.errors`` and ``config``; never ``plan.tiles`` or ``plan.sequences``.
"""
from .builder import build_exchange_plan
from .kv_refs import FetchedGroups, expand_ranges, fetched_groups, held_rows, home_runs_in_prefix
from .records import ExchangePlan, IndexRuns, RankPlan, Route, expand_runs, kv_rows, q_rows
from .relay import RELAY_SENDER_CUTS, RELAY_STRIPE_UNITS
from .runtime_tables import RankSizes, RankTables, RouteSplits, RowRuns, build_rank_tables, rank_sizes, rank_tables, \
    seed_rank_tables
from .op_lists import LayerOps, layer_ops, phase_ops
from .schedule import SAVE_MODES, entry_pairs, rank_layer_ops
from .traffic import (LayerPricing, LayerTiming, PlanTraffic, chunk_phase_bytes, plan_layer_timing, plan_traffic,
                      plan_worker_seconds, traffic_of_units)
from .validate import validate_plan

__all__ = ["build_exchange_plan", "FetchedGroups", "expand_ranges", "fetched_groups", "held_rows",
           "home_runs_in_prefix", "ExchangePlan", "IndexRuns", "RankPlan", "Route", "expand_runs", "kv_rows", "q_rows",
           "RELAY_SENDER_CUTS", "RELAY_STRIPE_UNITS", "RankSizes", "RankTables", "RouteSplits", "RowRuns", "build_rank_tables", "rank_sizes",
           "rank_tables", "seed_rank_tables",
           "SAVE_MODES", "LayerOps", "entry_pairs", "layer_ops", "phase_ops", "rank_layer_ops", "LayerPricing",
           "LayerTiming", "plan_layer_timing",
           "PlanTraffic", "chunk_phase_bytes", "plan_traffic", "plan_worker_seconds", "traffic_of_units",
           "validate_plan"]
