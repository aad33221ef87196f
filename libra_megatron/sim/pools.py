"""Evaluate one sequence-pool instance: tiles -> placement -> per-worker compute and link seconds.

Imports only ``libra_megatron.plan``. Worker ids are pool-local (w = p*CP + c, ``plan.layout``); a
pool whose first GPU has global index ``first_gpu`` puts worker w on node (first_gpu + w) // gpus_per_node.

Per-worker traffic (bytes per layer forward) mirrors what the exchange plan moves:
    Q   home(t) -> dest(t), tile_tokens * V_Q per token, for every migrated tile
    O   dest(t) -> home(t), same bytes
    KV  holder -> r for every distinct (KV group, destination r) pair and every fragment of the
        group's sample held by a worker other than r (deduplicated per group and destination, §4.3.3)
The totals equal ``ExchangePlan.bytes_q/kv/o`` (checked in tests/sim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np

from ..plan.layout import HeadLayout, TokenLayout
from ..plan.placement import place_tiles
from ..plan.tiles import TileSet, build_tiles
from .cost import CostModel

__all__ = ["PoolResult", "TrafficEdges", "traffic_edges", "link_bytes", "evaluate_pool", "PoolEvaluator"]


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
    H, W = tiles.head_split, tiles.num_workers
    frag_block = np.repeat(np.arange(tiles.num_blocks, dtype=np.int64), np.diff(tiles.frag_ptr))
    dest = assignment[(frag_block[:, None] * H + np.arange(H)[None, :]).reshape(-1)]
    group = (tiles.frag_sample[:, None] * H + np.arange(H)[None, :]).reshape(-1)
    pairs = np.unique(group * W + dest)
    sample, r = (pairs // W) // H, pairs % W
    per_sample = np.diff(tiles.sample_home_ptr)[sample]
    first = np.repeat(tiles.sample_home_ptr[sample], per_sample)
    entry = first + np.arange(int(per_sample.sum()), dtype=np.int64) - np.repeat(np.cumsum(per_sample) - per_sample, per_sample)
    kv_dst = np.repeat(r, per_sample)
    kv_src = tiles.sample_home_worker[entry]
    remote = kv_src != kv_dst
    kvb = tiles.sample_home_count[entry][remote] * tiles.heads.kv_bytes_per_token()
    return TrafficEdges(
        src=np.concatenate([home[moved], kv_src[remote], assignment[moved]]),
        dst=np.concatenate([assignment[moved], kv_dst[remote], home[moved]]),
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
    comm_seconds: np.ndarray  # before overlap
    seconds: np.ndarray  # compute + exposed comm
    bytes_qkvo: Tuple[int, int, int]  # per layer forward, pool total
    num_tiles: int
    num_fallback: int

    @property
    def intra_imbalance(self) -> float:
        """max/mean - 1 of the Eq. 6 worker loads (0 = perfect)."""
        mean = float(self.pair_heads.mean())
        return float(self.pair_heads.max()) / mean - 1.0 if mean > 0 else 0.0


def _tile_compute_seconds(tiles: TileSet, assignment: np.ndarray, cost: CostModel) -> np.ndarray:
    per_tile = cost.compute_seconds(tiles.tile_flops(), tiles.tile_tokens(), tiles.heads.q_piece)
    return np.bincount(assignment, weights=per_tile, minlength=tiles.num_workers)


def evaluate_pool(tiles: TileSet, tau: float, method, cost: CostModel, first_gpu: int) -> PoolResult:
    """Place the pool's tiles with ``method`` and turn the assignment into per-worker seconds."""
    placed = place_tiles(tiles, tau, method)
    edges = traffic_edges(tiles, placed.assignment)
    nodes = (first_gpu + np.arange(tiles.num_workers)) // cost.gpus_per_node
    intra, inter = link_bytes(edges, nodes)
    compute = _tile_compute_seconds(tiles, placed.assignment, cost)
    comm = cost.comm_seconds(intra, inter)
    return PoolResult(
        pair_heads=np.asarray(placed.loads, dtype=np.float64), compute_seconds=compute, comm_seconds=comm,
        seconds=cost.worker_seconds(compute, comm), bytes_qkvo=tuple(int(b) for b in placed.comm_bytes),
        num_tiles=tiles.num_tiles, num_fallback=int(placed.num_fallback),
    )


class PoolEvaluator:
    """Memoised ``evaluate_pool`` keyed by (sequence ids, H, B, method, node offset).

    ``segments[i]`` are the segment lengths of packed sequence i of the corpus. Pools that recur
    between placement variants (contiguous / Alg. 1 / refined often share pools) are evaluated once.
    """

    def __init__(self, segments, layout: TokenLayout, hq: int, hkv: int, elem_bytes: int, tau: float,
                 num_chunks: int, cost: CostModel):
        self.segments, self.layout, self.tau, self.cost = segments, layout, tau, cost
        self._head_args = (hq, hkv, cost.head_dim, num_chunks, elem_bytes)
        self._cache: Dict[tuple, PoolResult] = {}

    def heads(self, head_split: int) -> HeadLayout:
        hq, hkv, d, m, eb = self._head_args
        return HeadLayout(hq, hkv, d, head_split, m, eb)

    def evaluate(self, seq_ids, head_split: int, block_size: int, method, first_gpu: int) -> PoolResult:
        ids = tuple(int(i) for i in seq_ids)
        key = (ids, head_split, block_size, str(method), first_gpu % self.cost.gpus_per_node)
        hit = self._cache.get(key)
        if hit is None:
            tiles = build_tiles([self.segments[i] for i in ids], self.layout, self.heads(head_split), block_size)
            hit = self._cache[key] = evaluate_pool(tiles, self.tau, method, self.cost, first_gpu)
        return hit

    def clear(self) -> None:
        """Drop memoised pools (called between windows: pools never recur across windows)."""
        self._cache.clear()
