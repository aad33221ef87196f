"""Sequence placement (§4.2): which pool instance, GA step and DP rank every packed sequence of a step runs on.

    vrsp        Algorithm 1 (exact-cardinality LPT), the refined swaps, the sampler order
    lanes       sync-aware VRSP: balance what the step waits for (lane totals; pipelines at PP > 1)
    sync        the synchronisation model: lanes, EP ties, Megatron's pipeline schedules, DP at step end
    placement   ``place_sequences`` (the one entry point) and ``assign_to_ranks``
    priced_lanes  PP > 1: each lane's grouping and microbatch order by priced pool seconds, guarded by the sync
                model against Algorithm 1's order and the sampler's, the lanes' pipelines then evened
    pool_proxy  priced pools without plans: a pool's layer seconds from its documents (fitted on priced plans)

Every order is a permutation of the step's sequences: the sample multiset is kept by construction.
Imports ``plan.model`` only.
"""
from .lanes import lane_loads, place_for_sync, priced_lanes_apply, sync_proxy_seconds
from .placement import assign_to_ranks, place_sequences
from .pool_proxy import PoolProxy, SequenceStats
from .sync import (SIM_FLAGS, PipelineRun, PipelineSchedule, StepTiming, SyncLayout, critical_path_seconds,
                   lane_of_pool, pipeline_schedule, pool_step_timing, run_lane_pipelines, step_timing)
from .vrsp import pool_loads

__all__ = ["lane_loads", "place_for_sync", "priced_lanes_apply", "sync_proxy_seconds", "assign_to_ranks", "place_sequences", "SIM_FLAGS",
           "PipelineRun", "PipelineSchedule", "StepTiming", "SyncLayout", "lane_of_pool", "pipeline_schedule",
           "pool_step_timing", "run_lane_pipelines", "step_timing", "pool_loads", "PoolProxy", "SequenceStats",
           "critical_path_seconds"]
