"""Time-aware SH-Tile placement (issue 14): Algorithm 2, then moves that lower the slowest worker's time.

Pure Python + numpy. Algorithm 2 balances FLOPs and prices bytes only among workers with headroom; it
never trades a little balance for much less traffic, and it does not know which bytes cross nodes. Here
the objective is the step time of ``plan.model.timing`` (the Pipeliner timeline per worker, from the traffic the
exchange plan of the assignment moves -- the same per-link, per-kind and per-phase bytes as ``plan.exchange.traffic``
-- and its split into local and remote entries). Starting from Algorithm 2's assignment, each round takes
the slowest worker w* and tries single-tile moves that touch it:
    tiles w* hosts                   -> their Q-home, the lightest workers, workers on w*'s node
    tiles whose Q-home is w*         -> back to w*, or onto w*'s node
    tiles fetching K/V rows from w*  -> w*, the lightest workers of w*'s node, or a worker that already
                                        fetched a long enough prefix of the tile's group (no new bytes)
and applies the best one if it lowers (max over workers, time of w*) lexicographically without raising
the max. Moves are evaluated incrementally: only the workers a move touches are re-priced, all candidate
moves of a round in one ``pipeline_seconds`` call, and a round's candidate set is priced with numpy over all its
moves at once (issue 25: the per-move Python dicts cost ~100 ms a pool). A move's K/V bytes are the change of
every touched (group, worker)'s longest selected prefix, read from a table of each pair's longest and next shorter
kv end; a move set's (group moves, swaps) the change of those prefixes after the whole set (a tile references a
group at most once, so the two agree). The incremental link bytes per phase are exact; the local compute is a per-fragment estimate (a fragment on its Q-home computes locally over the suffix of its
key rows the home holds), which can call local what the plan merges into a remote or shorter-tailed entry.
So the search is a heuristic, and the guarantee is checked on the real plans: ``refine_for_time`` prices
both final assignments with ``worker_times`` (the exchange plan's traffic, ``hosted_pair_heads`` and lead)
and returns Algorithm 2's unless the refined one is faster. The result is never slower than Algorithm 2
under the model (tested), even where it leaves more FLOPs imbalance. The same search (``time_moves``) is the
last step of the 'dense' placement (``plan.tiles.placement``): ``DENSE_TIME_ROUNDS`` rounds of a narrower search
(``DENSE_WIDTH``) after the node export, kept only when the exchange plans price them faster.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from ..exchange import build_exchange_plan, chunk_phase_bytes, expand_ranges, home_runs_in_prefix, plan_worker_seconds
from ..model import StepTimeModel, entry_pair_heads
from .tiles import TileSet

__all__ = ["refine_for_time", "time_moves", "worker_times", "MAX_MOVES_PER_WORKER",
           "DENSE_TIME_ROUNDS", "DENSE_WIDTH"]

MAX_MOVES_PER_WORKER = 2  # at most 2*W accepted moves per pool
DENSE_TIME_ROUNDS = 16  # rounds after the dense placement's node export (planner cost: docs/exchange.md) ...
DENSE_WIDTH = (6, 5)  # ... each trying (tiles per kind, moves extended) instead of (_TILES_PER_KIND, _EXTEND)
_TILES_PER_KIND = 10  # candidate tiles per kind of contact with w* (hosted, homed, fetching), largest first
_LIGHTEST = 3  # lightest workers tried as destinations (globally and on a node)
_SWAPS = 2  # tiles of a destination tried as swap partners
_EXTEND = 10  # best single moves retried as group moves and swaps
_EPS = 1e-12

# columns of the per-worker state: Q and K/V bytes sent and received, intra-node (0-3) and inter-node (4-7)
# (O mirrors Q), then local and remote compute seconds
_QS, _QR, _KS, _KR = range(4)
_INTER = 4
_L, _X = 8, 9
_NCOL = 10


def _home_local_flops(tiles: TileSet) -> np.ndarray:
    """float64 [T]: pair-heads every tile computes before any dispatch arrives when it stays on its Q-home
    (``plan.exchange.local_entries`` before entries merge): each fragment [a, e) attends locally to the suffix [s, e)
    of its key rows [0, e) that the home holds (s = 0: a local entry; s > 0: a split entry's key tail)."""
    nfrag = np.diff(tiles.frag_ptr)
    block = np.repeat(np.arange(nfrag.size, dtype=np.int64), nfrag)
    home, a, e = tiles.block_home[block], tiles.frag_q_start, tiles.frag_q_end
    frag, run, count = home_runs_in_prefix(tiles, tiles.frag_doc, e)
    foreign = tiles.doc_home_worker[run] != home[frag]
    tail = np.zeros(e.size, dtype=np.int64)
    np.maximum.at(tail, frag[foreign], tiles.doc_home_offset[run[foreign]] + count[foreign])
    pairs = entry_pair_heads(e - a, e - tail, tiles.heads.q_heads_per_shard)
    covered = tail <= a  # the tail covers the queries (always: the home holds rows [a, e)); else remote
    return np.bincount(block, weights=np.where(covered, pairs, 0), minlength=nfrag.size)[tiles.tile_block()]


def _tile_refs(tiles: TileSet):
    """Every tile's K/V references as int64 arrays (tile, group, kv end), tile-major, each tile's in
    ``tiles.tile_kv_refs`` order (its block's fragments), and int64 [T + 1] offsets of each tile's."""
    H, G = tiles.head_split, tiles.num_kv_classes
    per_tile = np.repeat(np.diff(tiles.frag_ptr), H)
    frag = expand_ranges(np.repeat(tiles.frag_ptr[:-1], H), per_tile)  # fragments of tile 0, 1, ...
    tile = np.repeat(np.arange(tiles.num_tiles, dtype=np.int64), per_tile)
    group = tiles.frag_doc[frag] * G + tiles.heads.kv_class_of_shard()[tile % H]
    ptr = np.concatenate([[0], np.cumsum(per_tile)]).astype(np.int64)
    return tile, group.astype(np.int64), tiles.frag_kv_end[frag].astype(np.int64), ptr


def _segments(keys: np.ndarray) -> np.ndarray:
    """Start of every run of equal values of the sorted ``keys``."""
    return np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]])) if keys.size else keys[:0]


class _PoolTraffic:
    """Per-worker bytes and compute of an assignment, priced for whole sets of tile moves with numpy.

    The prefix table holds, for every (group, worker) with a tile there referencing the group, the longest kv end
    selected (``_m1``), how many references select it (``_c1``) and the next shorter end (``_m2``, 0: none): a
    reference leaving the pair shortens its prefix to ``_m2`` only when it is the one longest."""

    def __init__(self, tiles: TileSet, assignment: np.ndarray, model: StepTimeModel):
        self.tiles, self.model = tiles, model
        W, heads = tiles.num_workers, tiles.heads
        self.W, self.T = W, tiles.num_tiles
        self.node = np.asarray(model.nodes(W), dtype=np.int64)
        self.assignment = np.array(assignment, dtype=np.int64).reshape(-1)
        self.home = tiles.tile_home().astype(np.int64)
        self.q_bytes = (tiles.tile_tokens() * heads.q_bytes_per_token()).astype(np.float64)
        self.compute = np.asarray(model.compute_seconds(tiles.tile_flops()), dtype=np.float64)
        self.home_local = np.asarray(model.compute_seconds(_home_local_flops(tiles)), dtype=np.float64)
        self.kv_bytes = float(heads.kv_bytes_per_token())
        self.G = tiles.num_kv_classes
        self.num_groups = tiles.num_docs * self.G
        self.ref_tile, self.ref_group, self.ref_end, self.ref_ptr = _tile_refs(tiles)
        self.ref_doc = self.ref_group // self.G
        self.group_refs = np.argsort(self.ref_group, kind="stable")  # references of group g, CSR by group_ptr
        self.group_ptr = np.searchsorted(self.ref_group[self.group_refs], np.arange(self.num_groups + 1))
        self.top_ref = np.full(self.T, -1, dtype=np.int64)  # a tile's first reference with its longest kv end
        self._E = int(self.ref_end.max(initial=0)) + 1  # kv ends < E: (key, end) sort as one int64
        by_end = np.argsort(self.ref_tile * self._E + (self._E - 1 - self.ref_end), kind="stable")
        first = by_end[_segments(self.ref_tile[by_end])]
        self.top_ref[self.ref_tile[first]] = first
        self.hptr = tiles.doc_home_ptr.astype(np.int64)
        self.holder = tiles.doc_home_worker.astype(np.int64)
        self.hoff, self.hcnt = tiles.doc_home_offset.astype(np.int64), tiles.doc_home_count.astype(np.int64)
        self.holder_doc = np.repeat(np.arange(tiles.num_docs, dtype=np.int64), np.diff(self.hptr))
        self._build_prefixes()
        self.state = self._initial_state()

    # ----------------------------------------------------------------- prefix table
    def _build_prefixes(self) -> None:
        E = self._E
        both = np.sort((self.ref_group * self.W + self.assignment[self.ref_tile]) * E + (E - 1 - self.ref_end))
        key, end = both // E, E - 1 - both % E  # by pair, longest end first
        start = _segments(key)
        size = np.diff(np.append(start, key.size))
        self._key, self._m1 = key[start], end[start]
        self._c1 = np.add.reduceat((end == np.repeat(self._m1, size)).astype(np.int64), start) if start.size \
            else start.copy()
        nxt = start + self._c1
        self._m2 = np.where(nxt < start + size, end[np.minimum(nxt, max(key.size - 1, 0))], 0)

    def _lookup(self, group: np.ndarray, worker: np.ndarray):
        """(longest end, references at it, next shorter end) of pairs (group, worker); zeros for empty pairs."""
        if not self._key.size:
            zero = np.zeros(np.shape(group), dtype=np.int64)
            return zero, zero, zero
        k = group * self.W + worker
        i = np.minimum(np.searchsorted(self._key, k), self._key.size - 1)
        hit = self._key[i] == k
        return (np.where(hit, self._m1[i], 0), np.where(hit, self._c1[i], 0), np.where(hit, self._m2[i], 0))

    def _reprefix(self, group: int, w: int) -> None:
        """Recompute pair (group, w) of the table from the group's references (after a move)."""
        refs = self.group_refs[self.group_ptr[group]:self.group_ptr[group + 1]]
        ends = np.sort(self.ref_end[refs[self.assignment[self.ref_tile[refs]] == w]])[::-1]
        m1 = int(ends[0]) if ends.size else 0
        c1 = int((ends == m1).sum()) if ends.size else 0
        m2 = int(ends[c1]) if c1 < ends.size else 0
        k = group * self.W + w
        i = int(np.searchsorted(self._key, k))
        if i < self._key.size and self._key[i] == k:
            self._m1[i], self._c1[i], self._m2[i] = m1, c1, m2
        elif c1:
            self._key, self._m1 = np.insert(self._key, i, k), np.insert(self._m1, i, m1)
            self._c1, self._m2 = np.insert(self._c1, i, c1), np.insert(self._m2, i, m2)

    @property
    def ends(self) -> dict:
        """{(group, worker): (longest kv end selected, references at it, next shorter end)} of non-empty pairs."""
        live = self._c1 > 0
        return {(int(k) // self.W, int(k) % self.W): (int(a), int(b), int(c)) for k, a, b, c in
                zip(self._key[live], self._m1[live], self._c1[live], self._m2[live])}

    @property
    def fetchers(self) -> dict:
        """{group: workers with a prefix of it selected}."""
        out: dict = {}
        for group, w in self.ends:
            out.setdefault(group, set()).add(w)
        return out

    def _initial_state(self) -> np.ndarray:
        """[W, 10] state of the whole assignment at once: what moving every tile from nowhere to its worker
        one at a time sums to (``tests/plan/test_timeaware.py`` checks the two agree)."""
        tiles, W = self.tiles, self.W
        node, dst, home = self.node, self.assignment, self.home
        state = np.zeros((W, _NCOL))
        local = np.where(dst == home, self.home_local, 0.0)
        state[:, _L] = np.bincount(dst, weights=local, minlength=W)
        state[:, _X] = np.bincount(dst, weights=self.compute - local, minlength=W)
        self._add_edges(state, node, home, dst, self.q_bytes, _QS)
        # K/V: every (group, destination) fetches rows [0, its longest kv end) from the group's holders
        key, end = self._key, self._m1  # the prefix table: every pair's longest kv end
        fetcher = key % W
        row, entry, count = home_runs_in_prefix(tiles, key // W // self.G, end)
        self._add_edges(state, node, tiles.doc_home_worker[entry], fetcher[row], count * self.kv_bytes, _KS)
        return state

    @staticmethod
    def _add_edges(state, node, src, dst, nbytes, kind: int) -> None:
        """Add arrays of (src, dst, bytes) edges of ``kind`` (_QS: Q, _KS: K/V) to ``state`` (self edges dropped)."""
        W = state.shape[0]
        for base, cross in ((0, False), (_INTER, True)):
            keep = (src != dst) & ((node[src] != node[dst]) == cross)
            state[:, base + kind] += np.bincount(src[keep], weights=nbytes[keep], minlength=W)
            state[:, base + kind + 1] += np.bincount(dst[keep], weights=nbytes[keep], minlength=W)

    # ----------------------------------------------------------------- pricing
    def seconds(self, rows: np.ndarray) -> np.ndarray:
        """Seconds of workers with state ``rows`` [n, 10] (``plan.model.timing`` over ``plan.exchange.traffic``'s phases)."""
        rows = np.asarray(rows, dtype=np.float64).reshape(-1, _NCOL)
        phases = chunk_phase_bytes(*(rows[:, [k, _INTER + k]] for k in (_QS, _QR, _KS, _KR)), self.tiles.heads)
        link = self.model.comm_seconds(phases[:, 0], phases[:, 1])  # [n, 2, M]: (intra, inter) -> phase seconds
        return self.model.worker_seconds(rows[:, _L], rows[:, _X], link[:, 0], link[:, 1])

    def _edges(self, parts: list, cand, src, dst, nbytes, kind: int) -> None:
        """Contributions (candidate, worker, column, value) of edges src -> dst of ``nbytes`` ``kind``."""
        keep = (src != dst) & (nbytes != 0)
        cand, src, dst, nbytes = cand[keep], src[keep], dst[keep], nbytes[keep]
        col = kind + np.where(self.node[src] == self.node[dst], 0, _INTER)
        parts.append((cand, src, col, nbytes))
        parts.append((cand, dst, col + 1, nbytes))

    def _kv(self, parts: list, cand, doc, w, old, new) -> None:
        """K/V edges of worker ``w``'s prefix of ``doc`` growing (or shrinking) from ``old`` to ``new`` rows."""
        keep = old != new
        cand, doc, w, old, new = cand[keep], doc[keep], w[keep], old[keep], new[keep]
        per = self.hptr[doc + 1] - self.hptr[doc]
        entry, i = expand_ranges(self.hptr[doc], per), np.repeat(np.arange(doc.size), per)
        off, cnt = self.hoff[entry], self.hcnt[entry]
        rows = np.clip(new[i] - off, 0, cnt) - np.clip(old[i] - off, 0, cnt)
        self._edges(parts, cand[i], self.holder[entry], w[i], rows * self.kv_bytes, _KS)

    def _host_parts(self, parts: list, cand, t, src, dst) -> None:
        """Compute of tiles t leaving src for dst (local on the Q-home, ``_home_local_flops``), move by move."""
        at_dst = np.where(dst == self.home[t], self.home_local[t], 0.0)
        at_src = np.where(src == self.home[t], self.home_local[t], 0.0)
        c = self.compute[t]
        cols = np.broadcast_to(np.array([_L, _X, _L, _X]), (t.size, 4))
        parts.append((np.repeat(cand, 4), np.stack([dst, dst, src, src], 1).ravel(), cols.ravel(),
                      np.stack([at_dst, c - at_dst, -at_src, -(c - at_src)], 1).ravel()))

    def _deltas(self, n: int, parts: list):
        """(delta [n, W, 10], touched [n, W]) from the contributions."""
        cand, w, col, val = (np.concatenate(x) for x in zip(*parts))
        W = self.W
        delta = np.bincount((cand * W + w) * _NCOL + col, weights=val, minlength=n * W * _NCOL)
        touched = np.bincount(cand * W + w, minlength=n * W) > 0
        return delta.reshape(n, W, _NCOL), touched.reshape(n, W)

    def single_deltas(self, t: np.ndarray, dst: np.ndarray):
        """(delta, touched) of moving tile t[i] from its worker to dst[i], each move alone."""
        n = t.size
        cand, src = np.arange(n, dtype=np.int64), self.assignment[t]
        parts: list = []
        self._host_parts(parts, cand, t, src, dst)
        self._edges(parts, cand, self.home[t], dst, self.q_bytes[t], _QS)
        self._edges(parts, cand, self.home[t], src, -self.q_bytes[t], _QS)
        cnt = self.ref_ptr[t + 1] - self.ref_ptr[t]
        r, ci = expand_ranges(self.ref_ptr[t], cnt), np.repeat(cand, cnt)
        group, end, doc = self.ref_group[r], self.ref_end[r], self.ref_doc[r]
        m1, c1, m2 = self._lookup(group, src[ci])
        self._kv(parts, ci, doc, src[ci], m1, np.where((c1 > 1) | (end < m1), m1, m2))
        old = self._lookup(group, dst[ci])[0]
        self._kv(parts, ci, doc, dst[ci], old, np.maximum(old, end))
        return self._deltas(n, parts)

    def set_deltas(self, sets: List[tuple]):
        """(delta, touched) of each move set [(tile, destination), ...] applied as a whole."""
        n = len(sets)
        j = np.repeat(np.arange(n, dtype=np.int64), [len(s) for s in sets])
        t, dst = np.asarray([m for s in sets for m in s], dtype=np.int64).reshape(-1, 2).T
        src = self.assignment[t]
        parts: list = []
        self._host_parts(parts, j, t, src, dst)
        self._edges(parts, j, self.home[t], dst, self.q_bytes[t], _QS)
        self._edges(parts, j, self.home[t], src, -self.q_bytes[t], _QS)
        cnt = self.ref_ptr[t + 1] - self.ref_ptr[t]
        r = expand_ranges(self.ref_ptr[t], cnt)
        jr, group = np.repeat(j, cnt), self.ref_group[r]
        W, Gn = self.W, self.num_groups
        pair = np.unique(np.concatenate([(jr * Gn + group) * W + np.repeat(w, cnt) for w in (src, dst)]))
        pj, pg, pw = pair // W // Gn, pair // W % Gn, pair % W
        per = self.group_ptr[pg + 1] - self.group_ptr[pg]
        rr = self.group_refs[expand_ranges(self.group_ptr[pg], per)]
        owner = np.repeat(np.arange(pair.size), per)
        tile = self.ref_tile[rr]
        moved = np.sort(j * self.T + t)  # a tile moves at most once per set
        where = np.argsort(j * self.T + t)
        k = pj[owner] * self.T + tile
        i = np.minimum(np.searchsorted(moved, k), moved.size - 1)
        post = np.where(moved[i] == k, dst[where[i]], self.assignment[tile])
        val = np.where(post == pw[owner], self.ref_end[rr], 0)
        new = np.maximum.reduceat(val, np.cumsum(per) - per)
        self._kv(parts, pj, pg // self.G, pw, self._lookup(pg, pw)[0], new)
        return self._deltas(n, parts)

    def score(self, deltas, touched, times: np.ndarray, star: int):
        """(new max over workers [n], new time of ``star`` [n], all new times [n, W]) after each candidate."""
        ci, wi = np.nonzero(touched)
        new = np.repeat(times[None, :], deltas.shape[0], axis=0)
        new[ci, wi] = self.seconds(self.state[wi] + deltas[ci, wi])
        return new.max(axis=1), new[:, star], new

    def move(self, t: int, dst: int) -> None:
        self.apply(((int(t), int(dst)),))

    def apply(self, moves) -> None:
        """Move tiles [(tile, destination), ...] one after another: the bytes of the whole set (integers, exact in
        any order), the compute move by move (the float sums of moving them one at a time)."""
        moves = tuple((int(t), int(d)) for t, d in moves if int(self.assignment[t]) != int(d))
        if not moves:
            return
        delta, _ = self.set_deltas([moves])
        self.state[:, :_L] += delta[0][:, :_L]
        pairs = set()
        for t, dst in moves:
            src, home = int(self.assignment[t]), int(self.home[t])
            at_dst = self.home_local[t] if dst == home else 0.0
            at_src = self.home_local[t] if src == home else 0.0
            self.state[dst, _L] += at_dst
            self.state[dst, _X] += self.compute[t] - at_dst
            self.state[src, _L] += -at_src
            self.state[src, _X] += -(self.compute[t] - at_src)
            self.assignment[t] = dst
            for group in self.ref_group[self.ref_ptr[t]:self.ref_ptr[t + 1]].tolist():
                pairs.update(((group, src), (group, dst)))
        for group, w in sorted(pairs):
            self._reprefix(group, w)


def worker_times(tiles: TileSet, assignment, model: StepTimeModel) -> np.ndarray:
    """float64 [W]: seconds of every worker under ``model`` for ``assignment``, priced from the exchange plan
    the runtime executes (``plan_worker_seconds``)."""
    return plan_worker_seconds(build_exchange_plan(tiles, np.asarray(assignment, dtype=np.int64), model), model)


def _candidate_tiles(pool: _PoolTraffic, star: int, limit: int) -> np.ndarray:
    """Tiles whose traffic or compute touches worker ``star`` (module docstring), a few of each kind, largest
    first (ties: hosted and homed by tile id, fetching by the first document held by ``star``, then id)."""
    a = pool.assignment
    on = np.flatnonzero(a == star)
    hosted = on[np.argsort(-(pool.compute[on] + pool.q_bytes[on] * 1e-15), kind="stable")[:limit]]
    away = np.flatnonzero((pool.home == star) & (a != star))
    homed = away[np.argsort(-pool.q_bytes[away], kind="stable")[:limit]]
    held = np.zeros(pool.tiles.num_docs, dtype=bool)
    held[pool.holder_doc[pool.holder == star]] = True
    sel = np.flatnonzero(held[pool.ref_doc] & (a[pool.ref_tile] != star))
    fetch = sel[:0]
    if sel.size:
        start = _segments(pool.ref_tile[sel])
        tile = pool.ref_tile[sel][start]
        longest = np.maximum.reduceat(pool.ref_end[sel], start)
        first_doc = np.minimum.reduceat(pool.ref_doc[sel], start)
        fetch = tile[np.lexsort((tile, first_doc, -longest))[:limit]]
    return np.unique(np.concatenate([hosted, homed, fetch]))


def _destinations(pool: _PoolTraffic, cands: np.ndarray, star: int, times: np.ndarray, light: np.ndarray):
    """(tiles, destinations) of the single moves, sorted by (tile, destination): each tile to its Q-home, w*, the
    lightest workers (``light``: ascending time), the lightest of w*'s node and of its home node, and the lightest
    that already fetched enough of its longest group (ties by id); never to the tile's own worker. One numpy pass
    over all tiles (issue 25); the order of the moves does not change their prices (each is priced alone)."""
    node, W, n = pool.node, pool.W, cands.size
    _, node_rank = np.unique(node, return_inverse=True)
    per_node = np.full((int(node_rank.max()) + 1, _LIGHTEST), -1, dtype=np.int64)  # the lightest of every node
    by_node = light[np.argsort(node_rank[light], kind="stable")]
    rank = np.arange(W) - np.searchsorted(node_rank[by_node], node_rank[by_node])
    few = rank < _LIGHTEST
    per_node[node_rank[by_node[few]], rank[few]] = by_node[few]
    home = pool.home[cands]
    fixed = np.concatenate([[star], light[:_LIGHTEST], per_node[node_rank[star]]])
    cols = [home[:, None], np.broadcast_to(fixed, (n, fixed.size)), per_node[node_rank[home]], _have(pool, cands, times)]
    dests = np.concatenate(cols, axis=1)
    row = np.broadcast_to(np.arange(n)[:, None], dests.shape)
    keep = (dests >= 0) & (dests != pool.assignment[cands][:, None])
    pair = np.unique(row[keep] * W + dests[keep])
    return cands[pair // W], pair % W


def _have(pool: _PoolTraffic, cands: np.ndarray, times: np.ndarray) -> np.ndarray:
    """int64 [n, _LIGHTEST]: per tile, the lightest workers (ties by id) whose selected prefix of the tile's longest
    group already covers its kv end (-1: none)."""
    W, out = pool.W, np.full((cands.size, _LIGHTEST), -1, dtype=np.int64)
    top = pool.top_ref[cands]
    tile = np.flatnonzero(top >= 0)
    if not tile.size or not pool._key.size:
        return out
    group, end = pool.ref_group[top[tile]], pool.ref_end[top[tile]]
    lo, hi = np.searchsorted(pool._key, group * W), np.searchsorted(pool._key, group * W + W)
    pos, seg = expand_ranges(lo, hi - lo), np.repeat(np.arange(tile.size), hi - lo)
    ok = (pool._c1[pos] > 0) & (pool._m1[pos] >= end[seg])
    pos, seg = pos[ok], seg[ok]
    ws = pool._key[pos] - group[seg] * W
    order = np.lexsort((pos, times[ws], seg))  # per tile: by time, ties in table order (= worker id)
    ws, seg = ws[order], seg[order]
    rank = np.arange(seg.size) - np.searchsorted(seg, seg)
    few = rank < _LIGHTEST
    out[tile[seg[few]], rank[few]] = ws[few]
    return out


def _extended_sets(pool: _PoolTraffic, t: int, dst: int) -> List[tuple]:
    """Moving t to dst together with the tiles of its source that share its longest group (one fetch less),
    and as swaps with the tiles of dst closest to t in compute (keeps the FLOPs balance)."""
    a = pool.assignment
    src, top = int(a[t]), int(pool.top_ref[t])
    out = []
    if top >= 0:
        group = int(pool.ref_group[top])
        mates = pool.ref_tile[pool.group_refs[pool.group_ptr[group]:pool.group_ptr[group + 1]]]
        mates = np.unique(mates[(a[mates] == src) & (mates != t)])
        if mates.size:
            out.append(tuple((s, dst) for s in [t] + mates.tolist()))
    there = np.flatnonzero(a == dst)
    there = there[np.lexsort((there, np.abs(pool.compute[there] - pool.compute[t])))[:_SWAPS]]
    return out + [((t, dst), (s, src)) for s in there.tolist()]


def _best_move(pool: _PoolTraffic, star: int, times: np.ndarray, width: Tuple[int, int]) -> Optional[tuple]:
    """(new max, new time of star, moves, new times [W] of a single move else None) of the best candidate move
    set, or None. Single moves of
    ``width[0]`` tiles per kind are scored first; the ``width[1]`` best of them are retried as group moves and
    swaps. Ties: the lowest (tile, destination) moves."""
    light = np.argsort(-times, kind="stable")[::-1]
    t, dst = _destinations(pool, _candidate_tiles(pool, star, width[0]), star, times, light)
    if not t.size:
        return None
    new_max, star_time, new = pool.score(*pool.single_deltas(t, dst), times, star)
    order = np.lexsort((dst, t, star_time, new_max))
    i = order[0]
    best = [(float(new_max[i]), float(star_time[i]), ((int(t[i]), int(dst[i])),), new[i])]
    sets = [s for i in order[:width[1]].tolist() for s in _extended_sets(pool, int(t[i]), int(dst[i]))]
    if sets:
        new_max, star_time, _ = pool.score(*pool.set_deltas(sets), times, star)
        best += [(float(m), float(s), moves, None) for m, s, moves in zip(new_max, star_time, sets)]
    return min(best, key=lambda k: (k[0], k[1], k[2]))


def time_moves(tiles: TileSet, assignment: np.ndarray, model: StepTimeModel, max_rounds: int,
               width: Tuple[int, int] = (_TILES_PER_KIND, _EXTEND)) -> np.ndarray:
    """The search alone: up to ``max_rounds`` rounds of the best move off the slowest worker under ``model``'s
    incremental estimate (module docstring; ``width`` as in ``_best_move``), stopping at the first round with
    no improving move. Unchecked: callers keep the result only when the exchange plans price it faster
    (``refine_for_time``, ``plan.tiles.placement``'s dense placement)."""
    pool = _PoolTraffic(tiles, np.asarray(assignment, dtype=np.int64), model)
    times = pool.seconds(pool.state)
    for _ in range(max_rounds):
        star = int(np.argmax(times))
        cur = float(times[star])
        best = _best_move(pool, star, times, width)
        if best is None or not (best[0] < cur * (1 - _EPS) or (best[0] <= cur and best[1] < cur * (1 - 1e-9))):
            break
        pool.apply(best[2])
        # a single move's state rows are the ones it was priced with (same sums): its times are the next round's
        times = best[3] if best[3] is not None else pool.seconds(pool.state)
    return pool.assignment.copy()


def refine_for_time(tiles: TileSet, assignment: np.ndarray, model: StepTimeModel) -> np.ndarray:
    """Moves after Algorithm 2 that lower (max worker time, time of the slowest worker) under ``model``'s
    incremental estimate (``time_moves``, up to ``MAX_MOVES_PER_WORKER`` * W rounds); returns them only when
    the exchange plans' ``worker_times`` say the result is faster than ``assignment``, so it is never slower
    under the model."""
    start = np.asarray(assignment, dtype=np.int64)
    refined = time_moves(tiles, start, model, MAX_MOVES_PER_WORKER * tiles.num_workers)
    if np.array_equal(refined, start) or worker_times(tiles, refined, model).max() >= worker_times(tiles, start, model).max():
        return start
    return refined
