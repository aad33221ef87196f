"""Algorithm 2 (``plan.tiles.alg2``) as it was before issue 25's speed-up of its greedy loop (dict-per-field group
state, key lambdas), kept only as the reference the shipped loop is tested against (``tests/plan/test_planner_speed.py``):
the same assignments, capacity, fallbacks and Eq. 8 bytes. ``tests/plan/test_placement.py`` also checks both
against a direct O(W) implementation of Algorithm 2."""
from __future__ import annotations

import math
from dataclasses import dataclass
from heapq import heappop, heappush
from typing import Dict, List, Optional, Tuple

import numpy as np

from libra_megatron.plan.exchange import home_runs_in_prefix
from libra_megatron.plan.tiles.tiles import TileSet

__all__ = ["place_alg2", "tile_loads", "capacity"]

_FEW_RESIDENTS = 64  # score up to this many savers one by one, else scan workers in (load, id) order


def tile_loads(tiles: TileSet, tile_cost) -> np.ndarray:
    """f_t of Algorithm 2: int64 Eq. 6 pair-heads, or the validated float64 ``tile_cost`` vector."""
    if tile_cost is None:
        return tiles.tile_flops()
    f = np.asarray(tile_cost, dtype=np.float64)
    if f.shape != (tiles.num_tiles,):
        raise ValueError(f"tile_cost must have shape ({tiles.num_tiles},) (one load per tile), got {f.shape}")
    if not (np.isfinite(f).all() and (f >= 0).all()):
        raise ValueError("tile_cost must be finite and >= 0 for every tile")
    return f


def capacity(tile_flops: np.ndarray, num_workers: int, tau: float) -> float:
    """C = (1 + tau) * sum(f) / W; the sum is exact (int64, or math.fsum for float loads)."""
    if not tau >= 0:
        raise ValueError(f"tau (--libra-tau) must be >= 0, got {tau!r}")
    total = int(tile_flops.sum()) if tile_flops.dtype.kind in "iu" else math.fsum(tile_flops.tolist())
    return (1.0 + float(tau)) * total / num_workers


# --------------------------------------------------------------------------- per-block static data
@dataclass
class _Static:
    """Per-block Python lists the greedy loop reads (built once, vectorized up to the final lists).

    Nested containers are tuples of ints, not lists: the collector untracks them at its first pass, so
    the tens of thousands of them a 1M pool needs do not count towards the next *full* collection, whose
    cost grows with every object of the process (a training process holds millions) and which would
    otherwise start every few plans, inside one of them (``benchmarks/bench_plan_ready.py``, "gc max").

    The *candidates* of a block are its home and the workers holding rows of the prefixes its tiles need:
    every other worker costs ``worst`` unless a shared group of the tile is selected there (a *saver*).
    A doc inside one block is *private*: its groups are referenced by one tile only, so C_r never holds
    them when that tile is scored. Only *shared* docs (at most the first and last fragment of a block)
    need residency tracking -- unless several shards share a KV class (H > hkv): then all docs do.
    """

    homes: List[int]
    qo_bytes: List[int]  # V_Q + V_O of one tile of the block
    worst: List[int]  # Eq. 8 of a worker that is not the home and holds nothing: sum_g e_g * v + V_Q + V_O
    groups: List[Tuple[Tuple[int, Tuple[int, ...]], ...]]  # candidates grouped by equal cost: ascending cost, then id
    cost: Dict[int, int]  # block * W + candidate -> its Eq. 8 cost, residency aside
    shared_ends: List[tuple]  # per block: ((doc*G, doc*W, kv end), ...) of its shared docs
    held_runs: Dict[int, tuple]  # shared doc * W + worker -> ((first row, end row), ...) it holds
    holders: Dict[int, Tuple[int, ...]]  # shared doc * W -> the workers holding rows of it
    all_shared_groups: List[int]  # every shared group id
    kv_bytes_per_row: int
    class_of_shard: List[int]  # KV class of head shard h (group of a tile = doc * G + its class)


def _block_held_rows(tiles: TileSet) -> np.ndarray:
    """float64 [num_blocks * W]: rows of the prefixes a block's tiles need that each worker holds."""
    W, nb = tiles.num_workers, tiles.num_blocks
    frag_block = np.repeat(np.arange(nb, dtype=np.int64), np.diff(tiles.frag_ptr))
    row, entry, count = home_runs_in_prefix(tiles, tiles.frag_doc, tiles.frag_kv_end)
    keys = frag_block[row] * W + tiles.doc_home_worker[entry]
    return np.bincount(keys, weights=count, minlength=nb * W)


def _candidate_rows(tiles: TileSet, qo: np.ndarray, full: np.ndarray):
    """Keys block*W + worker of all candidates and their Eq. 8 costs, sorted by (block, cost, worker)."""
    W, nb = tiles.num_workers, tiles.num_blocks
    held = _block_held_rows(tiles)
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
    workers = tuple((key - block * W).tolist())
    groups = tuple((c, workers[a:e]) for c, a, e in zip(cost[starts].tolist(), starts.tolist(), ends))
    bounds = np.searchsorted(block[starts], np.arange(nb + 1)).tolist()
    return [groups[bounds[b] : bounds[b + 1]] for b in range(nb)]


def _shared_ends(tiles: TileSet, is_shared: np.ndarray) -> List[tuple]:
    """Per block: (doc*G, doc*W, kv end) of its first and/or last fragment when that doc is shared."""
    W, G = tiles.num_workers, tiles.num_kv_classes
    first_frag, last_frag = tiles.frag_ptr[:-1], tiles.frag_ptr[1:] - 1
    columns = []
    for frag in (first_frag, last_frag):
        s = tiles.frag_doc[frag]
        columns += [(s * G).tolist(), (s * W).tolist(), tiles.frag_kv_end[frag].tolist()]
    use_first = is_shared[tiles.frag_doc[first_frag]].tolist()
    use_last = (is_shared[tiles.frag_doc[last_frag]] & (last_frag != first_frag)).tolist()
    out = []
    for ua, ue, ga, ka, ea, gb, kb, eb in zip(use_first, use_last, *columns):
        out.append(((ga, ka, ea), (gb, kb, eb)) if ua and ue else ((ga, ka, ea),) if ua else
                   ((gb, kb, eb),) if ue else ())
    return out


def _all_ends(tiles: TileSet) -> List[tuple]:
    """Per block: (doc*G, doc*W, kv end) of every fragment (when shards share a KV class, H > G, the H/G
    tiles of one block reference each of its groups, so every group needs residency tracking)."""
    W, G = tiles.num_workers, tiles.num_kv_classes
    rows = list(zip((tiles.frag_doc * G).tolist(), (tiles.frag_doc * W).tolist(), tiles.frag_kv_end.tolist()))
    ptr = tiles.frag_ptr.tolist()
    return [tuple(rows[ptr[b] : ptr[b + 1]]) for b in range(tiles.num_blocks)]


def _held_runs(tiles: TileSet, is_shared: np.ndarray):
    """(shared doc * W + worker -> the doc-local row runs the worker holds, shared doc * W -> holders)."""
    W = tiles.num_workers
    owner = np.repeat(np.arange(tiles.num_docs, dtype=np.int64), np.diff(tiles.doc_home_ptr))
    keep = np.flatnonzero(is_shared[owner])
    runs: Dict[int, tuple] = {}
    holders: Dict[int, List[int]] = {}
    for doc_key, w, lo, n in zip((owner[keep] * W).tolist(), tiles.doc_home_worker[keep].tolist(),
                                 tiles.doc_home_offset[keep].tolist(), tiles.doc_home_count[keep].tolist()):
        if doc_key + w not in runs:
            holders.setdefault(doc_key, []).append(w)
        runs[doc_key + w] = runs.get(doc_key + w, ()) + ((lo, lo + n),)
    return runs, {doc_key: tuple(workers) for doc_key, workers in holders.items()}


def _static_data(tiles: TileSet) -> _Static:
    kvb, G = tiles.heads.kv_bytes_per_token(), tiles.num_kv_classes
    full = np.add.reduceat(tiles.frag_kv_end, tiles.frag_ptr[:-1]) * kvb
    qo = 2 * (tiles.block_end - tiles.block_start) * tiles.heads.q_bytes_per_token()
    classes_shared = tiles.head_split > G
    if classes_shared:
        is_shared = np.ones(tiles.num_docs, dtype=bool)
    else:
        is_shared = np.bincount(tiles.frag_doc, minlength=tiles.num_docs) > 1
    key, cost = _candidate_rows(tiles, qo, full)
    runs, holders = _held_runs(tiles, is_shared)
    return _Static(
        homes=tiles.block_home.tolist(), qo_bytes=qo.tolist(), worst=(full + qo).tolist(),
        groups=_candidate_groups(tiles, key, cost), cost=dict(zip(key.tolist(), cost.tolist())),
        shared_ends=_all_ends(tiles) if classes_shared else _shared_ends(tiles, is_shared), held_runs=runs,
        holders=holders, all_shared_groups=(np.flatnonzero(is_shared)[:, None] * G + np.arange(G)).reshape(-1).tolist(),
        kv_bytes_per_row=kvb, class_of_shard=tiles.heads.kv_class_of_shard().tolist(),
    )


def _held_below(runs: tuple, end: int) -> int:
    """Rows in [0, end) covered by ``runs``."""
    held = 0
    for lo, hi in runs:
        if lo < end:
            held += (hi if hi < end else end) - lo
    return held


# --------------------------------------------------------------------------- Algorithm 2
class _Greedy:
    """Algorithm 2 state: worker loads, a lazy min-heap of keys ``load * W + w`` (integer loads) or
    ``(load, w)`` (float loads; same order), entries whose load is out of date being dropped when they
    surface, and the selected prefixes C_r (shared group -> worker -> prefix end)."""

    def __init__(self, st: _Static, num_workers: int, head_split: int, cap: float, int_loads: bool = True) -> None:
        self.st, self.num_workers, self.head_split, self.cap = st, num_workers, head_split, cap
        self.loads = [0] * num_workers if int_loads else [0.0] * num_workers
        if int_loads:
            self.key, self.unkey = (lambda load, w: load * num_workers + w), (lambda k: divmod(k, num_workers))
        else:
            self.key, self.unkey = (lambda load, w: (load, w)), (lambda k: k)
        self.heap = [self.key(self.loads[w], w) for w in range(num_workers)]  # sorted, so a valid heap
        # C_r of shared groups: group -> worker -> selected prefix end p, and -> bytes of [0, p) it does not hold
        self.prefix: Dict[int, Dict[int, int]] = {g: {} for g in st.all_shared_groups}
        self.saved: Dict[int, Dict[int, int]] = {g: {} for g in st.all_shared_groups}
        self.longest: Dict[int, int] = {g: 0 for g in st.all_shared_groups}
        self.shortest: Dict[int, int] = {}
        self.fallbacks = self.kv_bytes = self.qo_bytes = 0

    def _group_savings(self, group: int, doc_key: int, end: int) -> Dict[int, int]:
        """worker -> bytes of [0, min(p, end)) it does not hold, for the workers with group g in C_r.
        The stored dict itself when no selected prefix is longer than ``end`` (always under group fetch)."""
        if end >= self.longest[group]:
            return self.saved[group]
        saved, runs, kvb = self.saved[group], self.st.held_runs, self.st.kv_bytes_per_row
        if end <= self.shortest[group]:  # every selected prefix covers [0, end): only holders save less
            part = dict.fromkeys(self.prefix[group], end * kvb)
            for w in self.st.holders.get(doc_key, ()):
                if w in part:
                    x = end - _held_below(runs[doc_key + w], end)
                    if x > 0:
                        part[w] = x * kvb
                    else:
                        del part[w]
            return part
        part = {}
        for w, p in self.prefix[group].items():
            if p <= end:
                part[w] = saved[w]
            else:
                held = runs.get(doc_key + w)
                x = end if held is None else end - _held_below(held, end)
                if x > 0:
                    part[w] = x * kvb
        return part

    def savings(self, ends: tuple, klass: int) -> Optional[Dict[int, int]]:
        """worker -> Eq. 8 bytes it saves on this tile because prefixes of its shared groups are in C_r:
        the rows of [0, min(p, e)) it does not hold (only positive savings are listed; read-only)."""
        out = None
        for base, doc_key, end in ends:
            if not self.prefix[base + klass]:
                continue
            part = self._group_savings(base + klass, doc_key, end)
            if out is None:
                out = part
            elif part:
                out = dict(out)
                for w, saved in part.items():
                    out[w] = out.get(w, 0) + saved
        return out

    def select(self, ends: tuple, klass: int, worker: int) -> None:
        """C_worker |= the tile's prefixes of shared groups (Algorithm 2 line 12); a prefix the worker
        holds completely can never save anything and is not recorded."""
        runs, kvb = self.st.held_runs, self.st.kv_bytes_per_row
        for base, doc_key, end in ends:
            group = base + klass
            prefix = self.prefix[group]
            if end <= prefix.get(worker, 0):
                continue
            held = runs.get(doc_key + worker)
            missing = end if held is None else end - _held_below(held, end)
            if missing > 0:
                prefix[worker] = end
                self.saved[group][worker] = missing * kvb
                if end > self.longest[group]:
                    self.longest[group] = end
                self.shortest[group] = min(self.shortest.get(group, end), end)  # a lower bound: prefixes only grow

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
        ends, groups, home = st.shared_ends[block], st.groups[block], st.homes[block]
        loads, heap, cap = self.loads, self.heap, self.cap
        cost_of, offset, worst = st.cost, block * W, st.worst[block]
        for head in range(H) if head_shards is None else head_shards:
            klass = st.class_of_shard[head]
            savings = self.savings(ends, klass) if ends else None
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
            if worker == home:
                self.kv_bytes += cost
            else:
                self.qo_bytes += st.qo_bytes[block]
                self.kv_bytes += cost - st.qo_bytes[block]
            if ends:
                self.select(ends, klass, worker)

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


def place_alg2(tiles: TileSet, tau: float, tile_cost=None):
    """Algorithm 2 over the tiles in (-f_t, t) order. Returns (assignment, C, fallbacks, comm_bytes).

    With Eq. 6 loads the H tiles of a block share f_t and are consecutive in that order, so it is walked
    block by block; a ``tile_cost`` vector may differ between head shards, so it is walked tile by tile.
    """
    f_all = tile_loads(tiles, tile_cost)
    W, H = tiles.num_workers, tiles.head_split
    cap = capacity(f_all, W, tau)
    greedy = _Greedy(_static_data(tiles), W, H, cap, int_loads=tile_cost is None)
    assignment = [0] * tiles.num_tiles
    if tile_cost is None:
        f_block = f_all[::H]
        block_order = np.argsort(-f_block, kind="stable")  # line 4: decreasing f_t, then tile id
        for block, f in zip(block_order.tolist(), f_block[block_order].tolist()):
            greedy.place_block(block, f, assignment)
    else:
        order = np.argsort(-f_all, kind="stable")
        for tile, f in zip(order.tolist(), f_all[order].tolist()):
            greedy.place_block(tile // H, f, assignment, (tile % H,))
    q_bytes = greedy.qo_bytes // 2
    comm = (q_bytes, greedy.kv_bytes, q_bytes)
    return np.asarray(assignment, dtype=np.int64), cap, greedy.fallbacks, comm

