"""Evaluate one sequence-pool instance: tiles -> placement -> per-worker compute and link seconds.

Imports only ``libra_megatron.plan``. Worker ids are pool-local (w = p*CP + c, ``plan.layout``); a
pool whose first GPU has global index ``first_gpu`` puts worker w on node (first_gpu + w) // gpus_per_node.

Per-worker link bytes, and the Pipeliner phase they travel in, are read off the ExchangePlan built for
the assignment (``plan.exchange.traffic.plan_traffic``: the executed routes' per-peer units), and so is the split of
every worker's varlen entries into local and remote ones (``ExchangePlan.hosted_pair_heads``); the
Pipeliner's timeline (``plan.model.timing.pipeline_seconds``) turns them into forward seconds (the earlier,
forward-only figures: ``seconds``, ``compute_seconds``). The whole layer, forward then backward as the runtime
runs it, is priced by ``plan.exchange.plan_layer_timing`` (every rank's op list, peers coupled, latencies and
copies included) in the pool's save mode: the run's ``--save-mode``, or for ``auto`` what
``plan.model.memory.choose_save_mode`` picks from the plan's predicted arranged bytes, the activation budget and
the layers alive at once (``SimSpec.saved_layers``) (``fwd_*``, ``bwd_*``, ``save_mode``). ``traffic_edges`` is an
independent re-derivation from the tiles (kept to cross-check the plan in tests/sim):
    Q   home(t) -> dest(t), tile_tokens * V_Q per token, for every migrated tile
    O   dest(t) -> home(t), same bytes
    KV  holder -> r for every distinct (KV group, destination r) pair and every run of the group's rows
        [0, p) held by a worker other than r, p = the longest prefix r's tiles need (the whole document
        under group fetch; ``plan.exchange.kv_refs.fetched_groups``, deduplicated per group and destination, §4.3.3)
The totals equal ``ExchangePlan.bytes_q/kv/o`` (checked in tests/sim).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Tuple

import numpy as np

from ..config import KvFetch, LibraConfig, SaveModeName, TilingPolicy
from ..plan.exchange import build_exchange_plan, fetched_groups, home_runs_in_prefix, plan_layer_timing, plan_traffic
from ..plan.layout import HeadLayout, TokenLayout
from ..plan.model import StepTimeModel, choose_save_mode, deferred_relay_bytes, saved_bytes_per_rank
from ..plan.tiles import TilePlacementResult, TileSet, build_tiles, place_tiles, reads_timing

__all__ = ["PoolResult", "TrafficEdges", "traffic_edges", "link_bytes", "evaluate_pool", "pool_result", "PoolEvaluator",
           "PoolKnobs", "local_compute_seconds", "SaveRule", "pool_save_mode"]


@dataclass(frozen=True)
class TrafficEdges:
    """Point-to-point transfers of one pool: src, dst (pool-local workers), nbytes, kind (0 q, 1 kv, 2 o)."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    kind: np.ndarray

    def totals(self) -> Tuple[int, int, int]:
        """(q, kv, o) bytes over all edges."""
        sums = np.bincount(self.kind, weights=self.nbytes.astype(np.float64), minlength=3)
        return tuple(int(round(x)) for x in sums)


def traffic_edges(tiles: TileSet, assignment: np.ndarray) -> TrafficEdges:
    """Every remote transfer the assignment causes (module docstring); self-transfers are dropped."""
    assignment = np.asarray(assignment, dtype=np.int64)
    home, tokens = tiles.tile_home(), tiles.tile_tokens()
    moved = np.flatnonzero(assignment != home)
    qb = tokens[moved] * tiles.heads.q_bytes_per_token()
    fetched = fetched_groups(tiles, assignment)
    pair, entry, count = home_runs_in_prefix(tiles, fetched.group // tiles.num_kv_classes, fetched.end)
    kv_dst, kv_src = fetched.dst[pair], tiles.doc_home_worker[entry]
    remote = kv_src != kv_dst
    kv_dst, kv_src = kv_dst[remote], kv_src[remote]
    kvb = count[remote] * tiles.heads.kv_bytes_per_token()
    return TrafficEdges(
        src=np.concatenate([home[moved], kv_src, assignment[moved]]),
        dst=np.concatenate([assignment[moved], kv_dst, home[moved]]),
        nbytes=np.concatenate([qb, kvb, qb]).astype(np.int64),
        kind=np.concatenate([np.zeros(moved.size, np.int64), np.ones(kvb.size, np.int64), np.full(moved.size, 2, np.int64)]),
    )


def link_bytes(edges: TrafficEdges, node_of_worker: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Per worker, per link class: max(bytes sent, bytes received). Returns (intra [W], inter [W])."""
    W = node_of_worker.size
    same = node_of_worker[edges.src] == node_of_worker[edges.dst]
    out = []
    for mask in (same, ~same):
        w = edges.nbytes[mask].astype(np.float64)
        sent = np.bincount(edges.src[mask], weights=w, minlength=W)
        recv = np.bincount(edges.dst[mask], weights=w, minlength=W)
        out.append(np.maximum(sent, recv))
    return out[0], out[1]


@dataclass(frozen=True)
class PoolResult:
    """One pool instance under one (H, B, tile method). Arrays are per pool-local worker, float64 [W]."""

    pair_heads: np.ndarray  # Eq. 6 load per worker
    compute_seconds: np.ndarray
    local_compute_seconds: np.ndarray  # the part of compute_seconds spent on local entries (``local_compute_seconds``)
    comm_seconds: np.ndarray  # link busy seconds before overlap: every chunk's dispatch and return, summed
    seconds: np.ndarray  # forward only, the Pipeliner timeline: compute + exposed comm (the ``forward_*`` figures)
    bytes_qkvo: Tuple[int, int, int]  # per layer forward, pool total
    num_tiles: int
    num_fallback: int
    # the whole layer under the event model (``plan.exchange.plan_layer_timing``), peers coupled:
    fwd_seconds: np.ndarray = None  # forward: when the worker's last op ends
    fwd_compute_seconds: np.ndarray = None  # its compute stream's busy time (kernels + index copies)
    bwd_seconds: np.ndarray = None  # backward, in ``save_mode``
    bwd_compute_seconds: np.ndarray = None
    save_mode: str = "arranged"  # the mode the backward was priced in (``auto`` resolved per pool)

    @property
    def intra_imbalance(self) -> float:
        """max/mean - 1 of the Eq. 6 worker loads (0 = perfect)."""
        mean = float(self.pair_heads.mean())
        return float(self.pair_heads.max()) / mean - 1.0 if mean > 0 else 0.0


def _tile_compute_seconds(tiles: TileSet, assignment: np.ndarray, cost: StepTimeModel) -> np.ndarray:
    per_tile = cost.tile_seconds(tiles.tile_flops(), tiles.tile_tokens(), tiles.heads.q_piece)
    return np.bincount(assignment, weights=per_tile, minlength=tiles.num_workers)


@dataclass(frozen=True)
class SaveRule:
    """The run's save mode: ``mode`` arranged | refetch | auto; auto's ``budget_gb`` (GiB per GPU and microbatch)
    over ``num_layers`` layers (those alive at once, ``SimSpec.saved_layers``) and the ``local_tokens`` every
    rank holds (L / CP)."""

    mode: SaveModeName = SaveModeName.ARRANGED
    budget_gb: float = LibraConfig.activation_budget_gb
    num_layers: int = 1
    local_tokens: int = 0


def pool_save_mode(plan, heads: HeadLayout, rule: SaveRule) -> str:
    """The mode the runtime runs this pool's plan in: ``rule.mode``, or for auto the planner's rule
    (``choose_save_mode`` on the plan's predicted arranged bytes per rank)."""
    mode = SaveModeName(rule.mode)
    if mode is SaveModeName.AUTO:
        arranged = saved_bytes_per_rank(plan, heads, rule.local_tokens, SaveModeName.ARRANGED)
        mode = choose_save_mode(mode, arranged, rule.budget_gb, rule.num_layers, deferred_relay_bytes(plan, heads))
    return mode.value


def evaluate_pool(tiles: TileSet, tau: float, method, cost: StepTimeModel, first_gpu: int,
                  save: SaveRule = SaveRule()) -> PoolResult:
    """Place the pool's tiles with ``method`` and turn the assignment into per-worker seconds."""
    return pool_result(tiles, place_tiles(tiles, tau, method), cost, first_gpu, save)


def pool_result(tiles: TileSet, placed: TilePlacementResult, cost: StepTimeModel, first_gpu: int,
                save: SaveRule = SaveRule()) -> PoolResult:
    """Per-worker seconds of a given placement (M = ``tiles.heads.num_chunks`` = ``cost.num_chunks``).

    Bytes per link, worker and Pipeliner phase, and the split of every worker's entries into local and
    remote ones, come from the ExchangePlan the runtime would execute for this assignment (``plan.exchange.traffic``,
    ``ExchangePlan.hosted_pair_heads``); ``cost.worker_seconds`` lays them on the Pipeliner's timeline (forward).
    ``plan_layer_timing`` prices the same plan's forward and backward op lists in the pool's save mode."""
    reuse = placed.exchange is not None and placed.exchange.heads == tiles.heads  # the placer's plan, same M
    timing = cost.at_gpu(first_gpu) if cost.kv_relay else None  # the relay follows the pool's nodes
    plan = placed.exchange if reuse else build_exchange_plan(tiles, placed.assignment, timing)
    traffic = plan_traffic(plan)
    nodes = (first_gpu + np.arange(tiles.num_workers)) // cost.gpus_per_node
    compute = _tile_compute_seconds(tiles, placed.assignment, cost)
    local = local_compute_seconds(compute, plan.hosted_pair_heads)
    dispatch, ret = traffic.phase_seconds(nodes, cost)
    mode = pool_save_mode(plan, tiles.heads, save)
    layer = plan_layer_timing(plan, cost.at_gpu(first_gpu), mode)
    return PoolResult(
        pair_heads=np.asarray(placed.loads, dtype=np.float64), compute_seconds=compute, local_compute_seconds=local,
        comm_seconds=dispatch.sum(axis=1) + ret.sum(axis=1),
        seconds=cost.worker_seconds(local, compute - local, dispatch, ret, plan.local_lead,
                                    traffic.relay_timing(nodes, cost)),
        bytes_qkvo=tuple(int(b) for b in placed.comm_bytes), num_tiles=tiles.num_tiles,
        num_fallback=int(placed.num_fallback),
        fwd_seconds=layer.forward.seconds, fwd_compute_seconds=layer.forward.compute,
        bwd_seconds=layer.backward.seconds, bwd_compute_seconds=layer.backward.compute, save_mode=mode,
    )


def local_compute_seconds(compute, hosted_pair_heads) -> np.ndarray:
    """float64 [W]: the part of each worker's compute seconds spent on local entries, in proportion to its
    (local, remote) pair-heads ``hosted_pair_heads`` [2, W] (exact at a constant rate; approximate under
    ``--calibration``, where an entry's rate depends on its call shape)."""
    local, remote = np.asarray(hosted_pair_heads, dtype=np.float64)
    total = local + remote
    return np.asarray(compute, dtype=np.float64) * np.where(total > 0, local / np.where(total > 0, total, 1.0), 0.0)


class PoolEvaluator:
    """Memoised ``evaluate_pool`` over the (H, B, tau, M, tiling, KV fetch) knobs of one window's pools.

    ``segments[i]`` are the segment lengths of packed sequence i of the corpus. Three caches, each
    keyed only by what its stage depends on, so a tau/M sweep does not redo the expensive parts:
        tiles       (sequence ids, H, B, tiling, tau if adaptive, KV fetch)  -- never on M
        placement   (tiles key, method, tau, V_g)     -- Eq. 8 reads M only through
                    V_g = ``HeadLayout.kv_bytes_per_token`` (M-dependent when chunk pieces share a kv head)
        result      (placement key, M, node offset)
    Pools that recur between placement variants (contiguous / Alg. 1 / refined often share pools) are
    evaluated once.
    """

    def __init__(self, segments, layout: TokenLayout, hq: int, hkv: int, elem_bytes: int, cost: StepTimeModel,
                 save: SaveRule = None):
        self.segments, self.layout, self.cost = segments, layout, cost
        self.save = save if save is not None else SaveRule(local_tokens=layout.local_len)
        self._head_args = (hq, hkv, cost.head_dim, elem_bytes)
        self._tiles: Dict[tuple, TileSet] = {}
        self._placed: Dict[tuple, TilePlacementResult] = {}
        self._cache: Dict[tuple, PoolResult] = {}

    def heads(self, head_split: int, num_chunks: int) -> HeadLayout:
        hq, hkv, d, eb = self._head_args
        return HeadLayout(hq, hkv, d, head_split, num_chunks, eb)


    def _tileset(self, key: tuple, knobs: "PoolKnobs") -> TileSet:
        """Tiles of the pool with M = ``knobs.num_chunks`` (build_tiles only stores the HeadLayout)."""
        tiles = self._tiles.get(key)
        heads = self.heads(knobs.head_split, knobs.num_chunks)
        if tiles is None:
            ids = key[0]
            tiles = self._tiles[key] = build_tiles(
                [self.segments[i] for i in ids], self.layout, heads, knobs.block_size, tiling=knobs.tiling,
                tau=knobs.tau, kv_fetch=knobs.kv_fetch)
        return tiles if tiles.heads == heads else replace(tiles, heads=heads)

    def evaluate(self, seq_ids, knobs: "PoolKnobs", method, first_gpu: int) -> PoolResult:
        ids = tuple(int(i) for i in seq_ids)
        adaptive = knobs.tiling is TilingPolicy.ADAPTIVE
        tkey = (ids, knobs.head_split, knobs.block_size, knobs.tiling, knobs.tau if adaptive else None, knobs.kv_fetch)
        key = (tkey, knobs.tau, knobs.num_chunks, str(method), first_gpu % self.cost.gpus_per_node)
        hit = self._cache.get(key)
        if hit is None:
            tiles = self._tileset(tkey, knobs)
            timed = reads_timing(method)  # places by node, so the node offset is a key
            node_offset = first_gpu % self.cost.gpus_per_node if timed else None
            pkey = (tkey, str(method), knobs.tau, tiles.heads.kv_bytes_per_token(), node_offset)
            placed = self._placed.get(pkey)
            if placed is None:
                timing = self.cost.at_gpu(first_gpu) if timed else None
                placed = self._placed[pkey] = place_tiles(tiles, knobs.tau, method, timing=timing)
            hit = self._cache[key] = pool_result(tiles, placed, self.cost, first_gpu, self.save)
        return hit

    def clear(self) -> None:
        """Drop memoised pools (called between windows: pools never recur across windows)."""
        self._tiles.clear()
        self._placed.clear()
        self._cache.clear()


@dataclass(frozen=True)
class PoolKnobs:
    """Everything but P that one pool evaluation depends on."""

    head_split: int
    block_size: int
    tau: float
    num_chunks: int
    tiling: TilingPolicy = TilingPolicy.ADAPTIVE
    kv_fetch: KvFetch = KvFetch.PREFIX
