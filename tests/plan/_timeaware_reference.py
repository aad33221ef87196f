"""The time-aware search of ``plan.tiles.timeaware`` as it was before issue 25 (per-move Python dicts), kept only as
the reference the vectorised search is tested against (``tests/plan/test_timeaware.py``). One change: ties among
a worker's hosted tiles and among the workers that already fetched a group are broken by id (the shipped code
broke them by a ``set``'s iteration order); the vectorised search breaks them the same way."""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Tuple

import numpy as np

from libra_megatron.plan.exchange import chunk_phase_bytes, home_runs_in_prefix
from libra_megatron.plan.model import StepTimeModel
from libra_megatron.plan.tiles.tiles import TileSet
from libra_megatron.plan.exchange import expand_ranges
from libra_megatron.plan.tiles.timeaware import _home_local_flops

_TILES_PER_KIND, _LIGHTEST, _SWAPS, _EXTEND, _EPS = 10, 3, 2, 10, 1e-12
_QS, _QR, _KS, _KR = range(4)
_INTER = 4
_L, _X = 8, 9
_NCOL = 10


def _tile_refs(tiles: TileSet):
    """Every tile's K/V references as flat lists (tile, group, kv end), tile-major, each tile's in
    ``tiles.tile_kv_refs`` order (its block's fragments), and int64 [T + 1] offsets of each tile's."""
    H, G = tiles.head_split, tiles.num_kv_classes
    per_tile = np.repeat(np.diff(tiles.frag_ptr), H)
    frag = expand_ranges(np.repeat(tiles.frag_ptr[:-1], H), per_tile)  # fragments of tile 0, 1, ...
    tile = np.repeat(np.arange(tiles.num_tiles, dtype=np.int64), per_tile)
    group = tiles.frag_doc[frag] * G + tiles.heads.kv_class_of_shard()[tile % H]
    ptr = np.concatenate([[0], np.cumsum(per_tile)])
    return tile.tolist(), group.tolist(), tiles.frag_kv_end[frag].tolist(), ptr.tolist()


class _PoolTraffic:
    """Per-worker bytes and compute of an assignment, updated one tile move at a time."""

    def __init__(self, tiles: TileSet, assignment: np.ndarray, model: StepTimeModel):
        self.tiles, self.model = tiles, model
        W, heads = tiles.num_workers, tiles.heads
        self.node = model.nodes(W).tolist()
        self.assignment = [int(a) for a in assignment]
        self.home = tiles.tile_home().tolist()
        self.q_bytes = (tiles.tile_tokens() * heads.q_bytes_per_token()).astype(float).tolist()
        self.compute = model.compute_seconds(tiles.tile_flops()).tolist()
        self.home_local = model.compute_seconds(_home_local_flops(tiles)).tolist()
        self.kv_bytes = float(heads.kv_bytes_per_token())
        self.G = tiles.num_kv_classes
        ref_tile, ref_group, ref_end, ref_ptr = _tile_refs(tiles)
        self.refs = [tuple(zip(ref_group[lo:hi], ref_end[lo:hi])) for lo, hi in zip(ref_ptr[:-1], ref_ptr[1:])]
        ptr = tiles.doc_home_ptr
        self.holders = [tuple(zip(tiles.doc_home_worker[ptr[d]:ptr[d + 1]].tolist(),
                                  tiles.doc_home_offset[ptr[d]:ptr[d + 1]].tolist(),
                                  tiles.doc_home_count[ptr[d]:ptr[d + 1]].tolist())) for d in range(tiles.num_docs)]
        self.ends: Dict[Tuple[int, int], Dict[int, int]] = defaultdict(dict)  # (group, w) -> {kv_end: tiles}
        self.fetchers: Dict[int, set] = defaultdict(set)  # group -> workers with a prefix of it selected
        for t, group, end in zip(ref_tile, ref_group, ref_end):
            w = self.assignment[t]
            ends = self.ends[(group, w)]
            ends[end] = ends.get(end, 0) + 1
            self.fetchers[group].add(w)
        self.state = self._initial_state(np.asarray(ref_tile, dtype=np.int64), np.asarray(ref_group, dtype=np.int64),
                                         np.asarray(ref_end, dtype=np.int64))

    def _initial_state(self, ref_tile, ref_group, ref_end) -> np.ndarray:
        """[W, 10] state of the whole assignment at once: what moving every tile from nowhere to its worker
        one at a time (``_delta``) sums to (``tests/plan/test_timeaware.py`` checks the two agree)."""
        tiles, W = self.tiles, self.tiles.num_workers
        node, dst, home = np.asarray(self.node), np.asarray(self.assignment), np.asarray(self.home)
        state = np.zeros((W, _NCOL))
        compute, local = np.asarray(self.compute), np.where(dst == home, self.home_local, 0.0)
        state[:, _L] = np.bincount(dst, weights=local, minlength=W)
        state[:, _X] = np.bincount(dst, weights=compute - local, minlength=W)
        self._add_edges(state, node, home, dst, np.asarray(self.q_bytes), _QS)
        # K/V: every (group, destination) fetches rows [0, its longest kv end) from the group's holders
        key, inverse = np.unique(ref_group * W + dst[ref_tile], return_inverse=True)
        end = np.zeros(key.size, dtype=np.int64)
        np.maximum.at(end, inverse, ref_end)
        fetcher = key % W
        row, entry, count = home_runs_in_prefix(tiles, key // W // self.G, end)
        self._add_edges(state, node, tiles.doc_home_worker[entry], fetcher[row], count * self.kv_bytes, _KS)
        return state

    @staticmethod
    def _add_edges(state, node, src, dst, nbytes, kind: int) -> None:
        """``_edge`` for arrays of (src, dst, bytes) edges (self edges dropped)."""
        W = state.shape[0]
        for base, cross in ((0, False), (_INTER, True)):
            keep = (src != dst) & ((node[src] != node[dst]) == cross)
            state[:, base + kind] += np.bincount(src[keep], weights=nbytes[keep], minlength=W)
            state[:, base + kind + 1] += np.bincount(dst[keep], weights=nbytes[keep], minlength=W)

    # ----------------------------------------------------------------- pricing
    def seconds(self, rows: np.ndarray) -> np.ndarray:
        """Seconds of workers with state ``rows`` [n, 10] (``plan.model.timing`` over ``plan.exchange.traffic``'s phases)."""
        rows = np.asarray(rows, dtype=np.float64).reshape(-1, _NCOL)
        heads = self.tiles.heads
        intra, inter = (chunk_phase_bytes(*(rows[:, base + k] for k in (_QS, _QR, _KS, _KR)), heads)
                        for base in (0, _INTER))
        link = self.model.comm_seconds(intra, inter)
        return self.model.worker_seconds(rows[:, _L], rows[:, _X], link[:, 0], link[:, 1])

    # ----------------------------------------------------------------- deltas
    def _row(self, delta, w: int) -> list:
        row = delta.get(w)
        if row is None:
            row = delta[w] = [0.0] * _NCOL
        return row

    def _edge(self, delta, src: int, dst: int, nbytes: float, kind: int) -> None:
        """``nbytes`` of ``kind`` (_QS: Q, _KS: K/V) from src to dst (the O of a Q edge is implied)."""
        if src == dst or nbytes == 0:
            return
        col = kind + (0 if self.node[src] == self.node[dst] else _INTER)
        self._row(delta, src)[col] += nbytes
        self._row(delta, dst)[col + 1] += nbytes

    def _host(self, delta, t: int, w: int, sign: float) -> None:
        """Compute of tile t on w: local on its Q-home (``_home_local_flops``), remote elsewhere."""
        row = self._row(delta, w)
        local = self.home_local[t] if w == self.home[t] else 0.0
        row[_L] += sign * local
        row[_X] += sign * (self.compute[t] - local)

    def _kv_rows(self, delta, doc: int, dst: int, old: int, new: int) -> None:
        """K/V edges of ``dst``'s prefix of ``doc`` growing (or shrinking) from ``old`` to ``new`` rows."""
        if old == new:
            return
        for holder, offset, count in self.holders[doc]:
            rows = min(max(new - offset, 0), count) - min(max(old - offset, 0), count)
            if rows:
                self._edge(delta, holder, dst, rows * self.kv_bytes, _KS)

    def _prefix(self, group: int, w: int) -> int:
        ends = self.ends.get((group, w))
        return max(ends) if ends else 0

    def _prefix_without(self, group: int, w: int, end: int) -> int:
        ends = self.ends[(group, w)]
        if ends[end] > 1 or end < max(ends):
            return max(ends)
        return max((e for e in ends if e != end), default=0)

    def _delta(self, t: int, src, dst: int) -> Dict[int, np.ndarray]:
        """Per-worker state change of moving tile t from ``src`` (None: not placed yet) to ``dst``."""
        delta: Dict[int, list] = {}
        home, qb = self.home[t], self.q_bytes[t]
        self._host(delta, t, dst, 1.0)
        self._edge(delta, home, dst, qb, _QS)
        if src is not None:
            self._host(delta, t, src, -1.0)
            self._edge(delta, home, src, -qb, _QS)
        for group, end in self.refs[t]:
            doc = group // self.G
            if src is not None:
                self._kv_rows(delta, doc, src, self._prefix(group, src), self._prefix_without(group, src, end))
            old = self._prefix(group, dst)
            self._kv_rows(delta, doc, dst, old, max(old, end))
        return delta

    def _apply(self, delta, t: int, src, dst: int) -> None:
        for w, row in delta.items():
            self.state[w] += row
        self._reselect(t, src, dst)

    def _reselect(self, t: int, src, dst: int) -> None:
        """Move tile t's prefix selections (``ends``, ``fetchers``) from ``src`` to ``dst``."""
        for group, end in self.refs[t]:
            if src is not None:
                ends = self.ends[(group, src)]
                ends[end] -= 1
                if not ends[end]:
                    del ends[end]
                if not ends:
                    self.fetchers[group].discard(src)
            self.ends[(group, dst)][end] = self.ends[(group, dst)].get(end, 0) + 1
            self.fetchers[group].add(dst)
        self.assignment[t] = dst

    def move(self, t: int, dst: int) -> None:
        src = self.assignment[t]
        if src == dst:  # (``_delta`` prices a move to another worker)
            return
        self._apply(self._delta(t, src, dst), t, src, dst)


def _largest(items, key, limit: int) -> List[int]:
    return sorted(items, key=key, reverse=True)[:limit]


def _candidate_tiles(pool: _PoolTraffic, star: int, by_worker, by_home, by_doc, limit: int) -> List[int]:
    """Tiles whose traffic or compute touches worker ``star`` (module docstring), a few of each kind."""
    hosted = _largest(sorted(by_worker[star]), lambda t: pool.compute[t] + pool.q_bytes[t] * 1e-15, limit)
    homed = _largest([t for t in by_home[star] if pool.assignment[t] != star], lambda t: pool.q_bytes[t],
                     limit)
    fetching = {}
    for doc in by_doc[star]:
        for t in by_doc[("tiles", doc)]:
            if pool.assignment[t] != star:
                fetching[t] = max(fetching.get(t, 0), max(e for g, e in pool.refs[t] if g // pool.G == doc))
    fetch = _largest(fetching, lambda t: fetching[t], limit)
    return list(dict.fromkeys(hosted + homed + fetch))


def _destinations(pool: _PoolTraffic, t: int, star: int, times: np.ndarray, light: List[int]) -> List[int]:
    """Where tile t may go: its Q-home, w*, the lightest workers (``light``: ascending time), the lightest
    of w*'s node and of t's home node, and the lightest that already fetched enough of t's longest group."""
    lightest = light[:_LIGHTEST]
    near = [w for w in light if pool.node[w] == pool.node[star]][:_LIGHTEST]
    home_near = [w for w in light if pool.node[w] == pool.node[pool.home[t]]][:_LIGHTEST]
    group, end = max(pool.refs[t], key=lambda ge: ge[1]) if pool.refs[t] else (None, 0)
    have = [w for w in pool.fetchers.get(group, ()) if pool._prefix(group, w) >= end] if group is not None else []
    have = sorted(sorted(have), key=lambda w: times[w])[:_LIGHTEST]
    out = dict.fromkeys([pool.home[t], star] + lightest + near + home_near + have)
    out.pop(pool.assignment[t], None)
    return list(out)


def _index(pool: _PoolTraffic):
    """Tiles by destination, by Q-home, and by document; documents by the workers holding their rows."""
    by_worker, by_home, by_doc = defaultdict(set), defaultdict(list), defaultdict(list)
    for t, (w, h) in enumerate(zip(pool.assignment, pool.home)):
        by_worker[w].add(t)
        by_home[h].append(t)
        for group, _ in pool.refs[t]:
            by_doc[("tiles", group // pool.G)].append(t)
    for doc, runs in enumerate(pool.holders):
        for holder, _, _ in runs:
            by_doc[holder].append(doc)
    return by_worker, by_home, by_doc


def _trial(pool: _PoolTraffic, moves) -> Tuple[List[int], np.ndarray]:
    """(touched workers, their state rows [n, 10]) after ``moves`` [(tile, destination)]; the pool is left
    unchanged (only the prefix selections move while a multi-tile set is priced, and they move back)."""
    total: Dict[int, list] = {}
    done = []
    for i, (t, dst) in enumerate(moves):
        src = pool.assignment[t]
        for w, row in pool._delta(t, src, dst).items():
            acc = total.get(w)
            if acc is None:
                total[w] = row
            else:
                for k in range(_NCOL):
                    acc[k] += row[k]
        if i + 1 < len(moves):  # later moves of the set see this one's prefix selections
            pool._reselect(t, src, dst)
            done.append((t, src, dst))
    for t, src, dst in reversed(done):
        pool._reselect(t, dst, src)
    workers = list(total)
    return workers, pool.state[workers] + np.asarray([total[w] for w in workers])


def _extended_sets(pool: _PoolTraffic, t: int, dst: int, by_worker) -> List[tuple]:
    """Moving t to dst together with the tiles of its source that share its longest group (one fetch less),
    and as swaps with the tiles of dst closest to t in compute (keeps the FLOPs balance)."""
    src = pool.assignment[t]
    out = []
    if pool.refs[t]:
        group = max(pool.refs[t], key=lambda ge: ge[1])[0]
        mates = [s for s in by_worker[src] if s != t and any(g == group for g, _ in pool.refs[s])]
        if mates:
            out.append(tuple((s, dst) for s in [t] + sorted(mates)))
    there = sorted(by_worker[dst], key=lambda s: (abs(pool.compute[s] - pool.compute[t]), s))[:_SWAPS]
    return out + [((t, dst), (s, src)) for s in there]


def _score(pool: _PoolTraffic, move_sets, star: int, times: np.ndarray, order: List[int]) -> list:
    """[(new max over workers, new time of star, moves)] after each move set, priced in one batch."""
    trials = [_trial(pool, moves) for moves in move_sets]
    if not trials:
        return []
    seconds = pool.seconds(np.concatenate([rows for _, rows in trials]))
    out, i = [], 0
    for (workers, _), moves in zip(trials, move_sets):
        new = seconds[i:i + len(workers)].tolist()
        i += len(workers)
        rest = next((times[w] for w in order if w not in workers), 0.0)
        star_time = new[workers.index(star)] if star in workers else float(times[star])
        out.append((max(max(new), float(rest)), star_time, moves))
    return out


def _best_move(pool: _PoolTraffic, star: int, times: np.ndarray, index, width: Tuple[int, int]):
    """(new max, new time of star, moves) of the best candidate move set, or None. Single moves of
    ``width[0]`` tiles per kind are scored first; the ``width[1]`` best of them are retried as group moves and
    swaps."""
    by_worker, by_home, by_doc = index
    order = np.argsort(-times, kind="stable").tolist()
    light = order[::-1]
    singles = _score(pool, [((t, dst),) for t in _candidate_tiles(pool, star, by_worker, by_home, by_doc, width[0])
                            for dst in _destinations(pool, t, star, times, light)], star, times, order)
    if not singles:
        return None
    singles.sort(key=lambda k: (k[0], k[1], k[2]))
    extended = _score(pool, [moves for _, _, ((t, dst),) in singles[:width[1]]
                             for moves in _extended_sets(pool, t, dst, by_worker)], star, times, order)
    return min(singles[:1] + extended, key=lambda k: (k[0], k[1], k[2]))


def time_moves(tiles: TileSet, assignment: np.ndarray, model: StepTimeModel, max_rounds: int,
               width: Tuple[int, int] = (_TILES_PER_KIND, _EXTEND)) -> np.ndarray:
    """The search alone: up to ``max_rounds`` rounds of the best move off the slowest worker under ``model``'s
    incremental estimate (module docstring; ``width`` as in ``_best_move``), stopping at the first round with
    no improving move. Unchecked: callers keep the result only when the exchange plans price it faster
    (``refine_for_time``, ``plan.tiles.placement``'s dense placement)."""
    pool = _PoolTraffic(tiles, np.asarray(assignment, dtype=np.int64), model)
    index = _index(pool)
    for _ in range(max_rounds):
        times = pool.seconds(pool.state)
        star = int(np.argmax(times))
        cur = float(times[star])
        best = _best_move(pool, star, times, index, width)
        if best is None or not (best[0] < cur * (1 - _EPS) or (best[0] <= cur and best[1] < cur * (1 - 1e-9))):
            break
        for t, dst in best[2]:
            index[0][pool.assignment[t]].discard(t)
            index[0][dst].add(t)
            pool.move(t, dst)
    return np.asarray(pool.assignment, dtype=np.int64)
