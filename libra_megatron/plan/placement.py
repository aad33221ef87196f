"""Communication-aware SH-Tile placement inside one sequence pool (§4.3.2, Algorithm 2, Eq. 8).

Pure Python + numpy. Inputs come from ``TileSet`` (``build_tiles``): tile loads ``f_t`` are Eq. 6
(``tiles.tile_flops()``, int64 pair-heads) unless ``place_tiles(tile_cost=...)`` passes another work
vector (e.g. calibrated seconds from ``plan.cost.TileCostModel.tile_costs``, review objection 2); byte
volumes are per layer forward, in bytes.

Eq. 8:  dcomm(t, r) = sum_{g in K(t) \\ C_r} V_g(r) + [r != home(t)] * (V_Q(t) + V_O(t))
    V_g(r)  = ``tiles.group_remote_bytes(g, r)``: bytes of g's K/V fragments r does not hold;
    V_Q(t) = V_O(t) = tile_tokens * heads.q_bytes_per_token();
    C_r     = KV groups already selected for r (a fetched group is reused by later tiles at r).

Fast exact Algorithm 2. A worker that is not the home of t, holds no fragment of any group of t and
has none of them resident pays the same (maximal) dcomm = sum_g V_g + V_Q + V_O. So only the home and
the fragment holders (*candidates*, grouped by equal static cost: all 16 holders of a document spanning
a whole 1M sequence form one group) and the workers where a group of K(t) is resident (*savers*) need a
score; among all others only the least loaded (lowest id on ties) can win either branch of Algorithm 2.
In a group only its least-loaded member can win. The tests prove bit-equality with a direct
implementation of Algorithm 2 over all W workers.

``comm_bytes`` is recomputed from the final assignment by ``assignment_comm_bytes``: Q and O once per
migrated tile, KV once per (group, destination) with that destination's V_g(r) -- which is what an
exchange plan built from the assignment moves, and equals the sum of Eq. 8 along Algorithm 2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from heapq import heappop, heappush
from typing import Callable, Dict, List, Tuple

import numpy as np

from ..config import TilePlacement
from .tiles import TileSet

__all__ = ["TilePlacementResult", "place_tiles", "assignment_comm_bytes", "worker_loads"]

_MAX_REFINE_STEPS_PER_WORKER = 4  # REFINED stops after 4*W accepted moves/swaps
_FEW_RESIDENTS = 64  # score up to this many savers one by one, else scan workers in (load, id) order


@dataclass(frozen=True, eq=False)
class TilePlacementResult:
    """One pool's tile assignment.

    assignment   int64 [num_tiles]  destination worker (pool-local id w = p*CP + c) of every tile
    loads        float64 [W]        sum of tile loads f_t per worker (Eq. 6, or the ``tile_cost`` given)
    capacity     float              C = (1 + tau) * sum(f) / W (Algorithm 2, line 3)
    comm_bytes   (q, kv, o) ints    Eq. 8 total of the assignment split by kind (bytes per layer forward)
    num_fallback int                tiles placed by the fallback branch (no worker had headroom)
    """

    assignment: np.ndarray
    loads: np.ndarray
    capacity: float
    comm_bytes: Tuple[int, int, int]
    num_fallback: int = 0

    def __post_init__(self) -> None:
        if self.assignment.ndim != 1 or self.loads.ndim != 1:
            raise ValueError("TilePlacementResult: assignment and loads must be 1-D")
        if self.assignment.size and not (0 <= self.assignment.min() and self.assignment.max() < self.loads.size):
            raise ValueError("TilePlacementResult: assignment names a worker outside the pool")
        for arr in (self.assignment, self.loads):
            arr.setflags(write=False)

    @property
    def max_over_mean(self) -> float:
        """Intra-pool imbalance R = max/mean of worker loads (1.0 = perfect)."""
        mean = float(self.loads.mean()) if self.loads.size else 0.0
        return float(self.loads.max()) / mean if mean > 0 else 1.0

    @property
    def total_comm_bytes(self) -> int:
        return int(sum(self.comm_bytes))


# --------------------------------------------------------------------------- shared helpers
def worker_loads(tiles: TileSet, assignment: np.ndarray, tile_cost=None) -> np.ndarray:
    """float64 [W]: sum of the tile loads hosted by each worker (Eq. 6, or ``tile_cost`` [num_tiles])."""
    f = tiles.tile_flops() if tile_cost is None else tile_cost
    return np.bincount(assignment, weights=np.asarray(f, dtype=np.float64), minlength=tiles.num_workers)


def _tile_loads(tiles: TileSet, tile_cost) -> np.ndarray:
    """f_t of Algorithm 2: int64 Eq. 6 pair-heads, or the validated float64 ``tile_cost`` vector."""
    if tile_cost is None:
        return tiles.tile_flops()
    f = np.asarray(tile_cost, dtype=np.float64)
    if f.shape != (tiles.num_tiles,):
        raise ValueError(f"tile_cost must have shape ({tiles.num_tiles},) (one load per tile), got {f.shape}")
    if not (np.isfinite(f).all() and (f >= 0).all()):
        raise ValueError("tile_cost must be finite and >= 0 for every tile")
    return f


def _doc_holdings(tiles: TileSet) -> Tuple[np.ndarray, np.ndarray]:
    """Sorted keys ``doc * W + worker`` of every (doc, holder) pair and the tokens held, int64."""
    W = tiles.num_workers
    owner_doc = np.repeat(np.arange(tiles.num_docs), np.diff(tiles.doc_home_ptr))
    # a worker may hold two zigzag chunks of one doc: sum its entries
    keys, inverse = np.unique(owner_doc * W + tiles.doc_home_worker, return_inverse=True)
    counts = np.bincount(inverse.reshape(-1), weights=tiles.doc_home_count, minlength=keys.size).astype(np.int64)
    return keys, counts


def _lookup(keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
    """``values`` at ``query`` in the sorted ``keys``, 0 where absent."""
    if keys.size == 0:
        return np.zeros_like(query)
    pos = np.minimum(np.searchsorted(keys, query), keys.size - 1)
    return np.where(keys[pos] == query, values[pos], 0)


def _held_tokens(tiles: TileSet, docs: np.ndarray, workers: np.ndarray) -> np.ndarray:
    """Tokens of each ``docs[i]`` held by ``workers[i]`` (vectorized over the doc-home CSR)."""
    return _lookup(*_doc_holdings(tiles), docs * tiles.num_workers + workers)


def assignment_comm_bytes(tiles: TileSet, assignment) -> Tuple[int, int, int]:
    """(q, kv, o) bytes an exchange plan for ``assignment`` moves per layer forward (Eq. 8 summed).

    q = o = sum over migrated tiles of tokens * q_bytes_per_token; kv = sum over distinct
    (group, destination) pairs of V_g(destination) (fragments the destination does not hold).
    """
    assignment = np.asarray(assignment, dtype=np.int64)
    H, heads = tiles.head_split, tiles.heads
    migrated = assignment != tiles.tile_home()
    q_bytes = int(tiles.tile_tokens()[migrated].sum()) * heads.q_bytes_per_token()
    o_bytes = int(tiles.tile_tokens()[migrated].sum()) * heads.o_bytes_per_token()
    frag_block = np.repeat(np.arange(tiles.num_blocks), np.diff(tiles.frag_ptr))
    tile_of_frag = frag_block[:, None] * H + np.arange(H)[None, :]
    group = (tiles.frag_doc[:, None] * H + np.arange(H)[None, :]).reshape(-1)
    dest = assignment[tile_of_frag.reshape(-1)]
    pairs = np.unique(group * tiles.num_workers + dest)
    g, r = np.divmod(pairs, tiles.num_workers)
    doc = g // H
    missing = tiles.doc_len[doc] - _held_tokens(tiles, doc, r)
    kv_bytes = int(missing.sum()) * heads.kv_bytes_per_token()
    return q_bytes, kv_bytes, o_bytes


def _capacity(tile_flops: np.ndarray, num_workers: int, tau: float) -> float:
    """C = (1 + tau) * sum(f) / W; the sum is exact (int64, or math.fsum for float loads)."""
    if not tau >= 0:
        raise ValueError(f"tau (--libra-tau) must be >= 0, got {tau!r}")
    total = int(tile_flops.sum()) if tile_flops.dtype.kind in "iu" else math.fsum(tile_flops.tolist())
    return (1.0 + float(tau)) * total / num_workers


def _tile_order(tile_flops: np.ndarray) -> np.ndarray:
    """Algorithm 2 line 4: decreasing f_t, then increasing tile id."""
    return np.argsort(-tile_flops, kind="stable")


# --------------------------------------------------------------------------- per-block static data
@dataclass
class _Static:
    """Per-block Python lists the greedy loop reads (built once, vectorized up to the final lists).

    The *candidates* of a block are its home and the workers holding a fragment of its docs: every
    other worker costs ``worst`` unless a shared group of the tile is resident there (a *saver*).
    A doc inside one block is *private*: its groups are referenced by one tile only, so C_r never
    holds them when that tile is scored and their Eq. 8 term is the static V_g(r). Only *shared*
    docs (at most the first and last fragment of a block) need residency tracking.
    """

    homes: List[int]
    qo_bytes: List[int]  # V_Q + V_O of one tile of the block
    worst: List[int]  # Eq. 8 of a worker that is not the home and holds nothing: sum_g V_g + V_Q + V_O
    groups: List[List[Tuple[int, List[int]]]]  # candidates grouped by equal cost: ascending cost, then id
    cost: Dict[int, int]  # block * W + candidate -> its Eq. 8 cost, residency aside
    shared_groups: List[List[int]]  # per block: s * H of its shared docs s (group of head h: + h)
    home_adds: List[List[Tuple[int, int]]]  # (s * H, V_g(home)) of shared groups the home holds only partly
    away_adds: List[tuple]  # (s * H, s * W, len_s * kv bytes, V_g(home)) of its shared docs
    held_bytes: Dict[int, int]  # shared doc * W + worker -> kv bytes the worker holds (absent: 0)
    all_shared_groups: List[int]  # every shared group id


def _expand_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of range(starts[i], starts[i] + counts[i])."""
    total = int(counts.sum())
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + np.arange(total, dtype=np.int64) - offsets


def _block_held_tokens(tiles: TileSet) -> np.ndarray:
    """float64 [num_blocks * W]: tokens of the block's docs held by each worker (key block*W + w)."""
    W, nb = tiles.num_workers, tiles.num_blocks
    frag_block = np.repeat(np.arange(nb, dtype=np.int64), np.diff(tiles.frag_ptr))
    per_doc = np.diff(tiles.doc_home_ptr)[tiles.frag_doc]
    entry = _expand_ranges(tiles.doc_home_ptr[tiles.frag_doc], per_doc)
    keys = np.repeat(frag_block, per_doc) * W + tiles.doc_home_worker[entry]
    return np.bincount(keys, weights=tiles.doc_home_count[entry], minlength=nb * W)


def _candidate_rows(tiles: TileSet, qo: np.ndarray, full: np.ndarray):
    """Keys block*W + worker of all candidates and their Eq. 8 costs, sorted by (block, cost, worker)."""
    W, nb = tiles.num_workers, tiles.num_blocks
    held = _block_held_tokens(tiles)
    is_candidate = held > 0
    is_candidate[np.arange(nb, dtype=np.int64) * W + tiles.block_home] = True
    key = np.flatnonzero(is_candidate)
    block = key // W
    away = key != block * W + tiles.block_home[block]
    cost = full[block] - held[key].astype(np.int64) * tiles.heads.kv_bytes_per_token() + qo[block] * away
    order = np.lexsort((key, cost, block))
    return key[order], cost[order]


def _candidate_groups(tiles: TileSet, key: np.ndarray, cost: np.ndarray):
    """Per block: its candidates grouped by equal cost (see ``_Static.groups``)."""
    W, nb = tiles.num_workers, tiles.num_blocks
    block = key // W
    starts = np.flatnonzero(np.diff(block, prepend=-1) | np.diff(cost, prepend=-1))
    ends = np.append(starts[1:], key.size).tolist()
    workers = (key - block * W).tolist()
    groups = [(c, workers[a:e]) for c, a, e in zip(cost[starts].tolist(), starts.tolist(), ends)]
    bounds = np.searchsorted(block[starts], np.arange(nb + 1)).tolist()
    return [groups[bounds[b] : bounds[b + 1]] for b in range(nb)]


def _shared_ends(tiles: TileSet, is_shared: np.ndarray, holdings):
    """Per block, for its shared docs s (first and/or last fragment): the group bases s*H; the
    (s*H, V_g(home)) of those its home holds only partly; and (s*H, s*W, len_s * kv bytes) of all."""
    W, H, kvb = tiles.num_workers, tiles.head_split, tiles.heads.kv_bytes_per_token()
    first = tiles.frag_doc[tiles.frag_ptr[:-1]]
    last = tiles.frag_doc[tiles.frag_ptr[1:] - 1]
    use_last = is_shared[last] & (last != first)
    columns = []
    for s in (first, last):
        home_missing = (tiles.doc_len[s] - _lookup(*holdings, s * W + tiles.block_home)) * kvb
        columns += [(s * H).tolist(), (s * W).tolist(), (tiles.doc_len[s] * kvb).tolist(), home_missing.tolist()]
    shared_groups, home_adds, away_adds = [], [], []
    for ua, ue, ga, ka, fa, ma, ge, ke, fe, me in zip(is_shared[first].tolist(), use_last.tolist(), *columns):
        ends = ((ga, ka, fa, ma), (ge, ke, fe, me)) if ua and ue else ((ga, ka, fa, ma),) if ua else (
            ((ge, ke, fe, me),) if ue else ())
        shared_groups.append([g for g, _, _, _ in ends])
        home_adds.append([(g, m) for g, _, _, m in ends if m > 0])
        away_adds.append(ends)
    return shared_groups, home_adds, away_adds


def _static_data(tiles: TileSet) -> _Static:
    kvb, W, H = tiles.heads.kv_bytes_per_token(), tiles.num_workers, tiles.head_split
    full = np.add.reduceat(tiles.doc_len[tiles.frag_doc], tiles.frag_ptr[:-1]) * kvb
    qo = 2 * (tiles.block_end - tiles.block_start) * tiles.heads.q_bytes_per_token()
    is_shared = np.bincount(tiles.frag_doc, minlength=tiles.num_docs) > 1
    holdings = _doc_holdings(tiles)
    keep = is_shared[holdings[0] // W]
    shared_groups, home_adds, away_adds = _shared_ends(tiles, is_shared, holdings)
    key, cost = _candidate_rows(tiles, qo, full)
    return _Static(
        homes=tiles.block_home.tolist(), qo_bytes=qo.tolist(), worst=(full + qo).tolist(),
        groups=_candidate_groups(tiles, key, cost), cost=dict(zip(key.tolist(), cost.tolist())),
        shared_groups=shared_groups, home_adds=home_adds, away_adds=away_adds,
        held_bytes=dict(zip(holdings[0][keep].tolist(), (holdings[1][keep] * kvb).tolist())),
        all_shared_groups=(np.flatnonzero(is_shared)[:, None] * H + np.arange(H)).reshape(-1).tolist(),
    )


# --------------------------------------------------------------------------- Algorithm 2
def _resident_savings(shared_groups: List[int], resident: Dict[int, Dict[int, int]], head: int) -> Dict[int, int]:
    """worker -> Eq. 8 bytes it saves because shared groups of the tile are in its C_r (read-only)."""
    first = resident[shared_groups[0] + head]
    if len(shared_groups) == 1:
        return first
    second = resident[shared_groups[1] + head]
    if not first or not second:
        return first or second
    merged = dict(first)
    for w, saved in second.items():
        merged[w] = merged.get(w, 0) + saved
    return merged


class _Greedy:
    """Algorithm 2 state: worker loads, a lazy min-heap of keys ``load * W + w`` (integer loads) or
    ``(load, w)`` (float loads; same order), entries whose load is out of date being dropped when they
    surface, and the resident groups C_r."""

    def __init__(self, st: _Static, num_workers: int, head_split: int, cap: float, int_loads: bool = True) -> None:
        self.st, self.num_workers, self.head_split, self.cap = st, num_workers, head_split, cap
        self.loads = [0] * num_workers if int_loads else [0.0] * num_workers
        if int_loads:
            self.key, self.unkey = (lambda load, w: load * num_workers + w), (lambda k: divmod(k, num_workers))
        else:
            self.key, self.unkey = (lambda load, w: (load, w)), (lambda k: k)
        self.heap = [self.key(self.loads[w], w) for w in range(num_workers)]  # sorted, so a valid heap
        # shared group -> worker -> V_g(worker) for the workers that have it in C_r
        self.resident: Dict[int, Dict[int, int]] = {g: {} for g in st.all_shared_groups}
        self.fallbacks = self.kv_bytes = self.qo_bytes = 0

    def place_block(self, block: int, f, assignment: List[int], head_shards=None) -> None:
        """Algorithm 2 lines 5-12 for the tiles of ``block`` on ``head_shards`` (default all H; they must
        be consecutive in the (-f_t, t) order and share load f).

        Line 7 (feasible argmin (dcomm, L, r)) is inlined because it runs once per tile: first the
        savers, each scored exactly; then the candidate groups in ascending cost, each represented by
        its least-loaded member -- a saver inside a group of cost c <= the best saver's cost cannot be
        feasible (it would beat that saver), so it never hides a better member. Every candidate and
        saver costs less than ``worst``, so other workers only matter if none of them is feasible.
        """
        st, H, W = self.st, self.head_split, self.num_workers
        shared, groups, home, home_adds = st.shared_groups[block], st.groups[block], st.homes[block], st.home_adds[block]
        loads, heap, cap, resident = self.loads, self.heap, self.cap, self.resident
        cost_of, offset, worst = st.cost, block * W, st.worst[block]
        for head in range(H) if head_shards is None else head_shards:
            savings = _resident_savings(shared, resident, head) if shared else None
            best = None
            if savings and len(savings) > _FEW_RESIDENTS:
                best = self._best_saver_by_load(block, savings, f)
            elif savings:
                for w, saved in savings.items():  # ``_best_of``, inlined
                    load = loads[w]
                    if load + f <= cap:
                        score = (cost_of.get(offset + w, worst) - saved, load, w)
                        if best is None or score < best:
                            best = score
            for c, workers in groups:
                if best is not None and best[0] < c:
                    break
                w = workers[0] if len(workers) == 1 else min(workers, key=loads.__getitem__)
                if loads[w] + f <= cap:
                    if best is None or (c, loads[w], w) < best:
                        best = (c, loads[w], w)
                    break
            cost, _, worker = best if best is not None else self._least_loaded(block, savings or {}, f)
            assignment[block * H + head] = worker
            loads[worker] += f
            heappush(heap, self.key(loads[worker], worker))
            if worker == home:  # C_home |= K(t): only groups the home holds partly can ever cost there
                self.kv_bytes += cost
                for group, missing in home_adds:
                    resident[group + head].setdefault(worker, missing)
            else:
                self._add_remote(block, head, worker, cost)

    def _best_of(self, block: int, savings: Dict[int, int], f: int):
        """Feasible argmin (dcomm, L, r) over the workers of ``savings``, each scored directly."""
        offset, worst, cost_of, loads, cap = block * self.num_workers, self.st.worst[block], self.st.cost, self.loads, self.cap
        best = None
        for w, saved in savings.items():
            load = loads[w]
            if load + f <= cap:
                key = (cost_of.get(offset + w, worst) - saved, load, w)
                if best is None or key < best:
                    best = key
        return best

    def _best_saver_by_load(self, block: int, savings: Dict[int, int], f: int):
        """Best feasible saver when there are many: candidates exactly, the others scanned in (load, id) order.

        A saver that is no candidate costs ``worst`` minus its savings, at least ``floor``; the scan stops
        at the first infeasible load or at a feasible saver at the floor (later ones have a higher load).
        """
        groups = self.st.groups[block]
        candidates = {w for _, ws in groups for w in ws}
        best = self._best_of(block, {w: savings[w] for w in candidates if w in savings}, f)
        worst = self.st.worst[block]
        floor = worst - max(savings.values())
        for key in self._sorted_keys():
            load, w = self.unkey(key)
            if load + f > self.cap:
                break
            if w in candidates or w not in savings:
                continue
            cand = (worst - savings[w], load, w)
            if best is None or cand < best:
                best = cand
            if cand[0] <= floor:
                break
        return best

    def _least_loaded(self, block: int, savings: Dict[int, int], f: int):
        """No candidate or saver is feasible; all other workers cost ``worst``. So the least-loaded worker
        wins if feasible (it is none of them then); else Algorithm 2 line 10: argmin (L, dcomm, r).
        Returns (cost, load, worker)."""
        W, worst, heap, loads, unkey = self.num_workers, self.st.worst[block], self.heap, self.loads, self.unkey
        while loads[unkey(heap[0])[1]] != unkey(heap[0])[0]:
            heappop(heap)
        load, w = unkey(heap[0])
        if load + f <= self.cap:
            return worst, load, w
        self.fallbacks += 1
        offset, best = block * W, None
        for w in range(W):  # ascending id: the first of equal cost wins
            if loads[w] != load:
                continue
            cost = self.st.cost.get(offset + w, worst) - savings.get(w, 0)
            if best is None or cost < best[0]:
                best = (cost, load, w)
        return best

    def _sorted_keys(self) -> list:
        """Heap keys of all workers in (load, id) order."""
        return sorted(self.key(load, w) for w, load in enumerate(self.loads))

    def _add_remote(self, block: int, head: int, worker: int, cost: int) -> None:
        """Count a migrated tile's Eq. 8 bytes and add its shared groups to C_worker (Algorithm 2 line 12).

        Private groups are never referenced again and fully held ones never cost, so they are not tracked.
        """
        qo, held = self.st.qo_bytes[block], self.st.held_bytes
        self.qo_bytes += qo
        self.kv_bytes += cost - qo
        for group, key, full, _ in self.st.away_adds[block]:
            missing = full - held.get(key + worker, 0)
            if missing > 0:
                self.resident[group + head].setdefault(worker, missing)


def _place_alg2(tiles: TileSet, tau: float, tile_cost=None):
    """Algorithm 2 over the tiles in (-f_t, t) order. Returns (assignment, C, fallbacks, comm_bytes).

    With Eq. 6 loads the H tiles of a block share f_t and are consecutive in that order, so it is walked
    block by block; a ``tile_cost`` vector may differ between head shards, so it is walked tile by tile.
    """
    f_all = _tile_loads(tiles, tile_cost)
    W, H = tiles.num_workers, tiles.head_split
    cap = _capacity(f_all, W, tau)
    greedy = _Greedy(_static_data(tiles), W, H, cap, int_loads=tile_cost is None)
    assignment = [0] * tiles.num_tiles
    if tile_cost is None:
        f_block = f_all[::H]
        block_order = _tile_order(f_block)
        for block, f in zip(block_order.tolist(), f_block[block_order].tolist()):
            greedy.place_block(block, f, assignment)
    else:
        order = _tile_order(f_all)
        for tile, f in zip(order.tolist(), f_all[order].tolist()):
            greedy.place_block(tile // H, f, assignment, (tile % H,))
    q_bytes = greedy.qo_bytes // 2
    comm = (q_bytes, greedy.kv_bytes, q_bytes)
    return np.asarray(assignment, dtype=np.int64), cap, greedy.fallbacks, comm


# --------------------------------------------------------------------------- refinement
def _best_move(loads: np.ndarray, f: np.ndarray, mine: np.ndarray, heavy: int):
    """Best single move of a tile off the heaviest worker: (new pair max, tile, dest)."""
    fm = f[mine][:, None]
    pair = np.maximum(loads[heavy] - fm, loads[None, :] + fm)
    pair[:, heavy] = np.inf
    i = int(np.argmin(pair))
    a, r = divmod(i, loads.size)
    return float(pair.flat[i]), int(mine[a]), r


def _best_swap(loads: np.ndarray, f: np.ndarray, assignment: np.ndarray, mine: np.ndarray, heavy: int):
    """Best swap of a tile of the heaviest worker with a lighter tile elsewhere: (pair max, t, u)."""
    delta = f[mine][:, None] - f[None, :]
    pair = np.maximum(loads[heavy] - delta, loads[assignment][None, :] + delta)
    pair[(delta <= 0) | (assignment[None, :] == heavy)] = np.inf
    i = int(np.argmin(pair))
    a, u = divmod(i, f.size)
    return float(pair.flat[i]), int(mine[a]), u


def _refine(tiles: TileSet, assignment: np.ndarray, tile_cost=None) -> np.ndarray:
    """Moves, then swaps, off the heaviest worker while they strictly lower its load below the old max."""
    f = _tile_loads(tiles, tile_cost).astype(np.float64)
    assignment = assignment.copy()
    loads = worker_loads(tiles, assignment, tile_cost)
    for _ in range(_MAX_REFINE_STEPS_PER_WORKER * loads.size):
        heavy = int(np.argmax(loads))
        mine = np.flatnonzero(assignment == heavy)
        pair, t, r = _best_move(loads, f, mine, heavy)
        if pair < loads[heavy]:
            assignment[t] = r
            loads[heavy] -= f[t]
            loads[r] += f[t]
            continue
        pair, t, u = _best_swap(loads, f, assignment, mine, heavy)
        if not pair < loads[heavy]:
            break
        other, moved = int(assignment[u]), f[t] - f[u]
        assignment[t], assignment[u] = other, heavy
        loads[heavy] -= moved
        loads[other] += moved
    return assignment


# --------------------------------------------------------------------------- public entry
def _run_home(tiles: TileSet, tau: float, tile_cost=None):
    home = tiles.tile_home().astype(np.int64)
    cap = _capacity(_tile_loads(tiles, tile_cost), tiles.num_workers, tau)
    return home, cap, 0, assignment_comm_bytes(tiles, home)


def _run_refined(tiles: TileSet, tau: float, tile_cost=None):
    start, cap, fallbacks, comm = _place_alg2(tiles, tau, tile_cost)
    refined = _refine(tiles, start, tile_cost)
    if worker_loads(tiles, refined, tile_cost).max() <= worker_loads(tiles, start, tile_cost).max():
        return refined, cap, fallbacks, assignment_comm_bytes(tiles, refined)
    return start, cap, fallbacks, comm


_PLACERS: Dict[TilePlacement, Callable[..., tuple]] = {
    TilePlacement.HOME: _run_home,
    TilePlacement.ALG2: _place_alg2,
    TilePlacement.REFINED: _run_refined,
}


def place_tiles(tiles: TileSet, tau: float = 0.03, method=TilePlacement.ALG2, *,
                tile_cost=None) -> TilePlacementResult:
    """Assign every SH-Tile of the pool to one of its W = P*CP workers (Algorithm 2 by default).

    HOME: every tile at its Q-home. ALG2: Algorithm 2 exactly (ties as in the paper: feasible branch
    argmin (dcomm, L_r, r); fallback argmin (L_r, dcomm, r)). REFINED: ALG2, then moves/swaps off the
    heaviest worker; never a higher max load than ALG2 (comm is recomputed for the final assignment).
    tile_cost: optional float64 [num_tiles] (>= 0, any unit, e.g. seconds from
    ``plan.cost.TileCostModel.tile_costs``) used as f_t instead of Eq. 6 ``tiles.tile_flops()``; C, the
    order and Eq. 8 ties are unchanged. None (default) gives exactly the Eq. 6 placement.
    """
    assignment, cap, fallbacks, comm = _PLACERS[TilePlacement(method)](tiles, tau, tile_cost)
    return TilePlacementResult(
        assignment=assignment,
        loads=worker_loads(tiles, assignment, tile_cost),
        capacity=cap,
        comm_bytes=tuple(int(x) for x in comm),
        num_fallback=int(fallbacks),
    )
