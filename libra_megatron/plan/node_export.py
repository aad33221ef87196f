"""Dense-first node export (issue 14): after Algorithm 2, the work a node ships to other nodes is its densest.

Pure numpy. Algorithm 2 walks tiles by decreasing load and gives each the cheapest feasible worker: a node's
big tiles -- the late rows of its long documents, the most compute per byte moved -- land at home while
there is room, and the node's overflow ships its *small* tiles: short documents, whose Q and O cost far
more link time than the attention they carry (wikipedia 256K, Qwen3-30B-A3B: a median 0.2 ms of compute per
ms of inter-node transfer). The placement keeps Algorithm 2's flow between nodes and changes only *which*
tiles carry it:

    for every node n and every worker d on another node that received tiles homed on n (quota q_d = their
    load), refill q_d with n's tiles in decreasing density f_t / bytes_t (bytes_t: Q + O of the tile plus
    its whole key prefix, as if d held nothing), never past q_d; what is left of q_d keeps the tiles it had;
    tiles of n that no longer leave go back to n's workers, largest first onto the worker with the most
    freed load (the workers whose dense tiles left).

Loads per node and per destination stay within one tile of Algorithm 2's; intra-node balance is
restored by the refill. ``place_tiles`` keeps the result only when the step-time model prices its slowest
worker below Algorithm 2's (``plan.placement``): never slower under the model.
Cost: O(tiles log tiles) numpy plus a Python loop over (node, destination) pairs.
"""
from __future__ import annotations

import numpy as np

from .tiles import TileSet

__all__ = ["export_dense_first", "tile_density"]


def tile_density(tiles: TileSet, loads: np.ndarray) -> np.ndarray:
    """f_t / bytes_t: load per byte a tile moves to a destination that holds none of its rows."""
    heads = tiles.heads
    block = tiles.tile_block()
    kv_rows = np.add.reduceat(tiles.frag_kv_end, tiles.frag_ptr[:-1])[block]
    moved = 2 * tiles.tile_tokens() * heads.q_bytes_per_token() + kv_rows * heads.kv_bytes_per_token()
    return np.asarray(loads, dtype=np.float64) / np.maximum(moved, 1)


def _prefix_group(tiles: TileSet) -> np.ndarray:
    """int64 [num_tiles]: KV group (doc * G + class) of each tile's last fragment -- the one with the longest
    key prefix, which dominates what a destination fetches for it."""
    block = tiles.tile_block()
    last_doc = tiles.frag_doc[tiles.frag_ptr[1:] - 1][block]
    shard = np.arange(tiles.num_tiles, dtype=np.int64) % tiles.head_split
    return last_doc * tiles.num_kv_classes + tiles.heads.kv_class_of_shard()[shard]


def export_dense_first(tiles: TileSet, assignment: np.ndarray, loads: np.ndarray, node_of_worker) -> np.ndarray:
    """The dense-first assignment (module docstring) of ``assignment``; int64 [num_tiles]. ``loads`` = f_t."""
    node = np.asarray(node_of_worker, dtype=np.int64)
    out = np.array(assignment, dtype=np.int64)
    f = np.asarray(loads, dtype=np.float64)
    home_node = node[tiles.tile_home()]
    density = tile_density(tiles, f)
    group = _prefix_group(tiles)
    for n in np.unique(home_node).tolist():
        _refill_node(out, f, density, node, home_node == n, n, group)
    return out


def _refill_node(out: np.ndarray, f: np.ndarray, density: np.ndarray, node: np.ndarray, homed: np.ndarray,
                 n: int, group: np.ndarray) -> None:
    """Re-choose which tiles homed on node ``n`` leave it (in place on ``out``)."""
    mine = np.flatnonzero(homed)
    away = mine[node[out[mine]] != n]
    if away.size == 0:
        return
    quota = np.bincount(out[away], weights=f[away], minlength=node.size)
    origin = out.copy()
    ranked = mine[np.lexsort((mine, -density[mine]))]  # densest first, then tile id
    by_group = {}
    for t in ranked.tolist():
        by_group.setdefault(int(group[t]), []).append(t)
    taken = np.zeros(out.size, dtype=bool)
    for d in np.flatnonzero(quota > 0)[np.argsort(-quota[quota > 0], kind="stable")].tolist():
        room = quota[d]
        for t in ranked[~taken[ranked]].tolist():
            if room <= 0:
                break
            if taken[t] or f[t] > room:
                continue
            for u in by_group[int(group[t])]:  # the tile's KV group first: its prefix is fetched once
                if not taken[u] and f[u] <= room:
                    out[u], taken[u] = d, True
                    room -= f[u]
        for t in away[(origin[away] == d) & ~taken[away]].tolist():  # top up with d's own tiles, as before
            if f[t] <= room:
                out[t], taken[t] = d, True
                room -= f[t]
    _return_home(out, f, node, n, origin, mine[~taken[mine]])


def _return_home(out, f, node, n: int, origin, staying) -> None:
    """Tiles of node n that stay on it: kept where they were when they were on n; the ones that used to leave
    go largest first onto the worker of n with the most freed load (dense tiles that left) -- or, when that
    would lift it above Algorithm 2's busiest worker, onto the least-loaded worker of the pool."""
    workers = np.flatnonzero(node == n)
    was_away = staying[node[origin[staying]] != n]
    left = np.flatnonzero((node[origin] == n) & (node[out] != n))  # tiles that now leave n from its workers
    freed = np.bincount(origin[left], weights=f[left], minlength=node.size)[workers]
    limit = np.bincount(origin, weights=f, minlength=node.size).max()
    loads = np.bincount(out, weights=f, minlength=node.size)
    for t in was_away[np.lexsort((was_away, -f[was_away]))].tolist():
        loads[out[t]] -= f[t]
        i = int(np.argmax(freed))
        w = int(workers[i])
        if loads[w] + f[t] > limit:
            w = int(np.argmin(loads))
        else:
            freed[i] -= f[t]
        out[t] = w
        loads[w] += f[t]
