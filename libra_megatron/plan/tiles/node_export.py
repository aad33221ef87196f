"""Dense-first node export (issue 14): after Algorithm 2, only overloaded nodes ship work, and they ship their
densest tiles.

Pure numpy. Algorithm 2 walks tiles by decreasing load and gives each the cheapest feasible worker, so a
heavy node's big tiles -- the late rows of its long documents, the most compute per byte moved -- fill the
*other* nodes' workers first, and those nodes' own small tiles then overflow and cross nodes as well: the
flow between nodes runs both ways, and most of it is short documents, whose Q and O cost far more link time
than the attention they carry (wikipedia 256K, Qwen3-30B-A3B: a median 0.2 ms of compute per ms of
inter-node transfer). The placement keeps Algorithm 2's load per node and its busiest worker as the cap C,
and nets the flow:

    node n homes H_n of load and hosts A_n under Algorithm 2; excess E_n = H_n - A_n
    exports: a node with E_n > 0 ships its densest tiles (f_t / bytes_t, bytes_t = Q + O of the tile plus its
        whole key prefix), every one that still fits in what is left of E_n; every other tile stays on its node
    exports are placed first, largest first: on the worker that took the tile's KV group last while it and
        its node have room (the prefix is fetched once), else on the least-loaded worker of the node with
        E_n < 0 that has the most room (room = workers * C - the load it keeps; any other node's when no
        importer has room for the tile)
    kept tiles then fill around them, largest first: on their home worker while it stays <= C, else on the
        node's least-loaded worker (intra-node moves only)

So a node that Algorithm 2 does not overload sends nothing, the load that crosses nodes is at most the net
imbalance, and a node's own small tiles pack around the big imported ones (placing imports last left
fragmented room, 10-30% imbalance on wikipedia pools). ``place_tiles`` keeps the result
only when the step-time model prices its slowest worker below Algorithm 2's (``plan.tiles.placement``): never
slower under the model. Cost: O(tiles log tiles) numpy plus a Python loop over tiles.

A node cannot export a fraction of a tile (one carries up to a quarter of a worker's load), and on 1M pools the
export ends up to 10% above the cap C its busiest worker should keep; ``even_heaviest`` then exchanges the busiest
worker's tiles, one at a time (or one for a lighter one), with the least-loaded worker of its node (of the pool when
nothing fits there). The dense placement prices the result as one more candidate: on linux 1M pools it is kept on
about a third of those it changes (the layer 0.1-5.5% shorter there); elsewhere the exchange it adds costs more than
it saves.
"""
from __future__ import annotations

import numpy as np

from .tiles import TileSet

__all__ = ["export_dense_first", "tile_density", "even_heaviest"]


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
    """The dense-first assignment (module docstring) of Algorithm 2's ``assignment``; int64 [num_tiles].
    ``loads`` = f_t; ``node_of_worker`` int [W]."""
    node = np.asarray(node_of_worker, dtype=np.int64)
    f = np.asarray(loads, dtype=np.float64)
    home = tiles.tile_home().astype(np.int64)
    home_node = node[home]
    hosted = np.bincount(np.asarray(assignment, dtype=np.int64), weights=f, minlength=node.size)
    cap = float(hosted.max())
    excess = np.bincount(home_node, weights=f, minlength=node.max() + 1) - np.bincount(node, weights=hosted)
    excess[np.abs(excess) <= 1e-9 * f.sum()] = 0.0  # rounding of the two sums, not load
    density = tile_density(tiles, f)
    exported = _exports(f, density, home_node, excess)
    kept_load = np.bincount(home_node, weights=np.where(exported, 0.0, f), minlength=excess.size)
    room = np.bincount(node, minlength=excess.size) * cap - kept_load  # per node, before imports
    out = np.empty(home.size, dtype=np.int64)
    load = np.zeros(node.size)
    _place_exports(out, load, np.flatnonzero(exported), f, _prefix_group(tiles), node, home_node, excess < 0, room,
                   cap)
    for n in np.unique(node).tolist():
        kept = np.flatnonzero((home_node == n) & ~exported)
        _keep_on_node(out, load, kept, f, home, np.flatnonzero(node == n), cap)
    return out


def _exports(f, density, home_node, excess) -> np.ndarray:
    """bool [num_tiles]: the tiles each node with excess E_n > 0 ships: densest first, every tile that still
    fits in what is left of E_n (module docstring)."""
    out = np.zeros(f.size, dtype=bool)
    for n in np.flatnonzero(excess > 0).tolist():
        mine = np.flatnonzero(home_node == n)
        left = float(excess[n])
        for t in mine[np.lexsort((mine, -density[mine]))].tolist():
            if f[t] <= left:
                out[t] = True
                left -= f[t]
    return out


def _keep_on_node(out, load, kept, f, home, workers, cap: float) -> None:
    """Place a node's kept tiles, largest first: home while it stays <= cap, else the node's least-loaded worker."""
    kept = kept[np.lexsort((kept, -f[kept]))]
    node_load = {int(w): float(load[w]) for w in workers}  # plain floats: this loop runs per tile
    for t, w, size in zip(kept.tolist(), home[kept].tolist(), f[kept].tolist()):
        if node_load[w] + size > cap:
            w = min(node_load, key=node_load.__getitem__)  # least loaded; ties: the lowest worker id
        out[t] = w
        node_load[w] += size
    load[workers] = [node_load[int(w)] for w in workers]


def _place_exports(out, load, exported, f, group, node, home_node, importer, room, cap: float) -> None:
    """Place exported tiles largest first, before any kept tile (module docstring): on their group's last
    worker while it and its node have room, else on the least-loaded worker of the importing node with the
    most room (of any other node when no importer has room for it)."""
    last = {}
    for t in exported[np.lexsort((exported, -f[exported]))].tolist():
        abroad = np.arange(room.size) != home_node[t]
        d = last.get(int(group[t]), -1)
        if d < 0 or load[d] + f[t] > cap or room[node[d]] < f[t]:
            n = _most_room(room, f[t], abroad & importer)
            n = _most_room(room, f[t], abroad) if n < 0 else n
            n = int(np.argmax(np.where(abroad, room, -np.inf))) if n < 0 else n
            workers = np.flatnonzero(node == n)
            d = int(workers[np.argmin(load[workers])])
        out[t] = d
        load[d] += f[t]
        room[node[d]] -= f[t]
        last[int(group[t])] = d


def _most_room(room, need: float, allowed) -> int:
    """The allowed node with the most room when it fits ``need``; -1 when none does."""
    free = np.where(allowed, room, -np.inf)
    n = int(np.argmax(free))
    return n if free[n] >= need else -1


def even_heaviest(tiles: TileSet, assignment: np.ndarray, loads: np.ndarray, node_of_worker, cap: float,
                  max_moves: int = 0) -> np.ndarray:
    """``assignment`` with its busiest worker evened tile by tile (module docstring): while the busiest worker h is
    above ``cap``, it exchanges with the least-loaded worker d of its node (of the pool when nothing of h fits that
    gap) the pair whose moved load f_a - f_b (a tile a of h; b a tile of d, or none) is nearest half their gap, among
    those with 0 < f_a - f_b < gap (by more than 1e-9 of h's load: no exchange of equal tiles through the sums'
    rounding), so the pair's maximum and the busiest load fall (ties: a move before a swap, then the earlier b, then
    the earlier a). Stops when nothing fits or after ``max_moves`` exchanges (0: one per worker). int64 [num_tiles],
    a new array."""
    out = np.array(assignment, dtype=np.int64, copy=True)
    node = np.asarray(node_of_worker, dtype=np.int64)
    f = np.asarray(loads, dtype=np.float64)
    W = tiles.num_workers
    hosted = np.bincount(out, weights=f, minlength=W)
    for _ in range(max_moves or W):
        h = int(np.argmax(hosted))
        if hosted[h] <= cap:
            break
        exchange = _next_exchange(out, f, hosted, h, node)
        if exchange is None:
            break
        a, d, b, moved = exchange
        out[a] = d
        if b >= 0:
            out[b] = h
        hosted[h] -= moved
        hosted[d] += moved
    return out


def _next_exchange(out, f, hosted, h: int, node):
    """(tile a of h, worker d, tile b of d or -1, moved load) of ``even_heaviest``'s next exchange, or None."""
    W = hosted.size
    mine = np.flatnonzero(out == h)
    for workers in (np.flatnonzero((node == node[h]) & (np.arange(W) != h)), np.flatnonzero(np.arange(W) != h)):
        if workers.size == 0:
            continue
        d = int(workers[np.argmin(hosted[workers])])
        gap = hosted[h] - hosted[d]
        theirs = np.flatnonzero(out == d)
        moved = f[mine][None, :] - np.concatenate([[0.0], f[theirs]])[:, None]  # [none + b, a]: f_a - f_b
        slack = 1e-9 * hosted[h]  # a move inside the rounding of the loads' sums would only swap equal tiles
        score = np.where((moved > slack) & (moved < gap - slack), np.abs(moved - gap / 2.0), np.inf)
        if np.isfinite(score).any():  # ties: a move before any swap, then the earlier b, then the earlier a
            j, i = np.unravel_index(int(np.argmin(score)), score.shape)
            return int(mine[i]), d, (int(theirs[j - 1]) if j else -1), float(moved[j, i])
    return None
