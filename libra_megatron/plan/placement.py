"""Communication-aware SH-Tile placement inside one sequence pool (§4.3.2, Algorithm 2, Eq. 8).

Pure Python + numpy. Inputs come from ``TileSet`` (``build_tiles``): tile loads ``f_t`` are Eq. 6
(``tiles.tile_flops()``, int64 pair-heads); byte volumes are per layer forward, in bytes.

Eq. 8:  dcomm(t, r) = sum_{g in K(t) \\ C_r} V_g(r) + [r != home(t)] * (V_Q(t) + V_O(t))
    V_g(r)  = ``tiles.group_remote_bytes(g, r)``: bytes of g's K/V fragments r does not hold;
    V_Q(t) = V_O(t) = tile_tokens * heads.q_bytes_per_token();
    C_r     = KV groups already selected for r (a fetched group is reused by later tiles at r).

Fast exact Algorithm 2. A worker that is not the home of t, holds no fragment of any group of t and
has none of them resident pays the same (maximal) dcomm = sum_g V_g + V_Q + V_O. So only the home,
the fragment holders and the residents of K(t) need an exact score; among all other workers only the
least loaded (lowest id on ties) can win either branch of Algorithm 2. The tests prove bit-equality
with a direct implementation of Algorithm 2 over all W workers.

``comm_bytes`` is recomputed from the final assignment by ``assignment_comm_bytes``: Q and O once per
migrated tile, KV once per (group, destination) with that destination's V_g(r) -- which is what an
exchange plan built from the assignment moves, and equals the sum of Eq. 8 along Algorithm 2.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..config import TilePlacement
from .tiles import TileSet

__all__ = ["TilePlacementResult", "place_tiles", "assignment_comm_bytes", "worker_loads"]

_MAX_REFINE_STEPS_PER_WORKER = 4  # REFINED stops after 4*W accepted moves/swaps
_FEW_RESIDENTS = 16  # score resident workers explicitly up to this many, else scan workers by load


@dataclass(frozen=True, eq=False)
class TilePlacementResult:
    """One pool's tile assignment.

    assignment   int64 [num_tiles]  destination worker (pool-local id w = p*CP + c) of every tile
    loads        float64 [W]        sum of Eq. 6 tile loads per worker
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
def worker_loads(tiles: TileSet, assignment: np.ndarray) -> np.ndarray:
    """float64 [W]: sum of Eq. 6 tile loads hosted by each worker."""
    return np.bincount(assignment, weights=tiles.tile_flops().astype(np.float64), minlength=tiles.num_workers)


def _held_tokens(tiles: TileSet, samples: np.ndarray, workers: np.ndarray) -> np.ndarray:
    """Tokens of each ``samples[i]`` held by ``workers[i]`` (vectorized over the sample-home CSR)."""
    W = tiles.num_workers
    owner_sample = np.repeat(np.arange(tiles.num_samples), np.diff(tiles.sample_home_ptr))
    # a worker may hold two zigzag chunks of one sample: sum its entries
    keys, inverse = np.unique(owner_sample * W + tiles.sample_home_worker, return_inverse=True)
    counts = np.bincount(inverse.reshape(-1), weights=tiles.sample_home_count, minlength=keys.size).astype(np.int64)
    query = samples * W + workers
    if keys.size == 0:
        return np.zeros_like(query)
    pos = np.minimum(np.searchsorted(keys, query), keys.size - 1)
    return np.where(keys[pos] == query, counts[pos], 0)


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
    group = (tiles.frag_sample[:, None] * H + np.arange(H)[None, :]).reshape(-1)
    dest = assignment[tile_of_frag.reshape(-1)]
    pairs = np.unique(group * tiles.num_workers + dest)
    g, r = np.divmod(pairs, tiles.num_workers)
    sample = g // H
    missing = tiles.sample_len[sample] - _held_tokens(tiles, sample, r)
    kv_bytes = int(missing.sum()) * heads.kv_bytes_per_token()
    return q_bytes, kv_bytes, o_bytes


def _capacity(tile_flops: np.ndarray, num_workers: int, tau: float) -> float:
    if not tau >= 0:
        raise ValueError(f"tau (--libra-tau) must be >= 0, got {tau!r}")
    return (1.0 + float(tau)) * int(tile_flops.sum()) / num_workers


def _tile_order(tile_flops: np.ndarray) -> np.ndarray:
    """Algorithm 2 line 4: decreasing f_t, then increasing tile id."""
    return np.argsort(-tile_flops, kind="stable")


# --------------------------------------------------------------------------- per-block static data
@dataclass
class _Static:
    """Per-block Python lists the greedy loop reads (built once, mostly vectorized).

    A sample inside one block is *private*: its groups are referenced by one tile only, so C_r never
    holds them when that tile is scored and their Eq. 8 term is the static V_g(r). Only *shared*
    samples (at most the first and last fragment of a block) need residency tracking.
    """

    full_bytes: List[int]  # sum over the block's samples of sample_len * kv_bytes_per_token
    held_bytes: List[Dict[int, int]]  # worker -> bytes of the block's samples it holds
    shared: List[List[int]]  # the block's samples that other blocks reference too
    home_partial: List[List[int]]  # shared samples the block's home holds only partly
    sample_full: Dict[int, int]  # shared sample -> len * kv bytes
    sample_held: Dict[int, Dict[int, int]]  # shared sample -> worker -> bytes held
    base_scores: List[Optional[Dict[int, int]]]  # Eq. 8 of the home and holders, residency aside (lazy)


def _expand_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of range(starts[i], starts[i] + counts[i])."""
    total = int(counts.sum())
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + np.arange(total, dtype=np.int64) - offsets


def _block_held_bytes(tiles: TileSet, kvb: int) -> List[Dict[int, int]]:
    """For every block: worker -> bytes of the block's samples' K/V the worker holds."""
    W, nb = tiles.num_workers, tiles.num_blocks
    frag_block = np.repeat(np.arange(nb, dtype=np.int64), np.diff(tiles.frag_ptr))
    per_sample = np.diff(tiles.sample_home_ptr)[tiles.frag_sample]
    entry = _expand_ranges(tiles.sample_home_ptr[tiles.frag_sample], per_sample)
    keys = np.repeat(frag_block, per_sample) * W + tiles.sample_home_worker[entry]
    held = np.bincount(keys, weights=tiles.sample_home_count[entry], minlength=nb * W)
    nonzero = np.flatnonzero(held)
    bounds = np.searchsorted(nonzero, np.arange(nb + 1, dtype=np.int64) * W).tolist()
    workers, vals = (nonzero % W).tolist(), (held[nonzero].astype(np.int64) * kvb).tolist()
    return [dict(zip(workers[bounds[b] : bounds[b + 1]], vals[bounds[b] : bounds[b + 1]])) for b in range(nb)]


def _shared_ends(tiles: TileSet, is_shared: np.ndarray):
    """Per block: its shared samples (first and/or last fragment) and those its home holds only partly."""
    first = tiles.frag_sample[tiles.frag_ptr[:-1]]
    last = tiles.frag_sample[tiles.frag_ptr[1:] - 1]
    use_first, use_last = is_shared[first], is_shared[last] & (last != first)
    part_first = use_first & (_held_tokens(tiles, first, tiles.block_home) < tiles.sample_len[first])
    part_last = use_last & (_held_tokens(tiles, last, tiles.block_home) < tiles.sample_len[last])
    rows = zip(first.tolist(), last.tolist(), use_first.tolist(), use_last.tolist(), part_first.tolist(), part_last.tolist())
    shared, partial = [], []
    for a, e, ua, ue, pa, pe in rows:
        shared.append([a, e] if ua and ue else [a] if ua else [e] if ue else [])
        partial.append([a, e] if pa and pe else [a] if pa else [e] if pe else [])
    return shared, partial


def _static_data(tiles: TileSet) -> _Static:
    kvb = tiles.heads.kv_bytes_per_token()
    full = np.add.reduceat(tiles.sample_len[tiles.frag_sample], tiles.frag_ptr[:-1]) * kvb
    is_shared = np.bincount(tiles.frag_sample, minlength=tiles.num_samples) > 1
    ptr, hw, hc = tiles.sample_home_ptr.tolist(), tiles.sample_home_worker.tolist(), tiles.sample_home_count.tolist()
    sample_full, sample_held = {}, {}
    for s in np.flatnonzero(is_shared).tolist():
        sample_full[s] = int(tiles.sample_len[s]) * kvb
        held = sample_held[s] = {}
        for i in range(ptr[s], ptr[s + 1]):  # a worker may hold two zigzag chunks of one sample
            held[hw[i]] = held.get(hw[i], 0) + hc[i] * kvb
    shared, partial = _shared_ends(tiles, is_shared)
    return _Static(full.tolist(), _block_held_bytes(tiles, kvb), shared, partial, sample_full, sample_held,
                   [None] * tiles.num_blocks)


# --------------------------------------------------------------------------- Algorithm 2
class _LoadIndex:
    """Worker loads plus the workers sorted by (load, id), kept sorted under ``add``."""

    def __init__(self, num_workers: int) -> None:
        self.loads = [0] * num_workers
        self.sorted = [(0, w) for w in range(num_workers)]

    def add(self, worker: int, amount: int) -> None:
        old = (self.loads[worker], worker)
        del self.sorted[bisect.bisect_left(self.sorted, old)]
        self.loads[worker] += amount
        bisect.insort(self.sorted, (self.loads[worker], worker))


def _score_specials(st: _Static, block: int, home: int, qo: int, shared_res) -> Dict[int, int]:
    """Exact Eq. 8 for the home, the holders of any fragment of the tile's groups and -- when there
    are few -- the workers where a shared group is resident (else ``_scan_others`` finds those)."""
    full = st.full_bytes[block]
    base = st.base_scores[block]
    if base is None:  # shared by the H tiles of the block
        base = {w: full - v + qo for w, v in st.held_bytes[block].items()}
        base[home] = base.get(home, full + qo) - qo
        st.base_scores[block] = base
    scores = dict(base)
    if shared_res and sum(len(res) for _, res in shared_res) <= _FEW_RESIDENTS:
        for _, res in shared_res:
            for w in res:
                scores.setdefault(w, full + qo)
    for _, res in shared_res:
        for w in scores:
            scores[w] -= res.get(w, 0)
    return scores


def _has_non_special(res: Dict[int, int], specials) -> bool:
    return len(res) > len(specials) or any(w not in specials for w in res)


def _cost_floor(specials, shared_res, worst: int) -> int:
    """Least Eq. 8 cost any non-special worker can have: ``worst`` minus the shared groups resident on it."""
    if len(shared_res) == 1:  # the common case
        full, res = shared_res[0]
        return worst - full if _has_non_special(res, specials) else worst
    reach = [(full, res) for full, res in shared_res if _has_non_special(res, specials)]
    if len(reach) == 2:
        (full_a, res_a), (full_b, res_b) = sorted(reach, key=lambda item: len(item[1]))
        if any(w in res_b and w not in specials for w in res_a):
            return worst - full_a - full_b
    return worst - max((full for full, _ in reach), default=0)


def _scan_others(order, specials, shared_res, worst: int, f: int, cap: float):
    """Best non-special workers for both branches of Algorithm 2, scanning in (load, id) order.

    A non-special worker holds nothing of the tile, so its Eq. 8 cost is ``worst`` minus the full
    V_g of each shared group already resident there; ``floor`` is the least such cost. The scan stops
    once nothing later can win: a feasible worker at the floor, or the first infeasible load level.
    Returns (best feasible (c, L, w) or None, best fallback (L, c, w) or None).
    """
    floor = _cost_floor(specials, shared_res, worst) if shared_res else worst
    feasible = fallback = None
    for load, w in order:
        if w in specials:
            continue
        cost = worst
        for full, res in shared_res:  # empty for most tiles
            if w in res:
                cost -= full
        if fallback is None or (load, cost, w) < fallback:
            fallback = (load, cost, w)
        if load + f <= cap:
            if feasible is None or (cost, load, w) < feasible:
                feasible = (cost, load, w)
            if feasible[0] <= floor:
                break
        elif feasible is not None or load > fallback[0]:
            break
    return feasible, fallback


def _choose(specials: Dict[int, int], others, loads: List[int], f: int, cap: float):
    """Algorithm 2 lines 6-11: (worker, its Eq. 8 cost, fell_back)."""
    feasible, fallback = others
    for w, c in specials.items():
        if loads[w] + f <= cap and (feasible is None or (c, loads[w], w) < feasible):
            feasible = (c, loads[w], w)
    if feasible is not None:
        return feasible[2], feasible[0], False
    for w, c in specials.items():
        if fallback is None or (loads[w], c, w) < fallback:
            fallback = (loads[w], c, w)
    return fallback[2], fallback[1], True


def _place_alg2(tiles: TileSet, tau: float):
    """Algorithm 2 over the tiles in (-f_t, t) order. Returns (assignment, C, fallbacks, comm_bytes)."""
    f_all = tiles.tile_flops()
    W, H = tiles.num_workers, tiles.head_split
    cap = _capacity(f_all, W, tau)
    st = _static_data(tiles)
    homes = tiles.block_home.tolist()
    q_per_block = ((tiles.block_end - tiles.block_start) * tiles.heads.q_bytes_per_token()).tolist()
    index, resident = _LoadIndex(W), {}
    assignment, f_list = [0] * tiles.num_tiles, f_all.tolist()
    fallbacks = kv_bytes = q_bytes = 0
    for t in _tile_order(f_all).tolist():
        block, head = divmod(t, H)
        home, qo, f = homes[block], 2 * q_per_block[block], f_list[t]
        shared_res = [(st.sample_full[s], res) for s in st.shared[block] if (res := resident.get(s * H + head))]
        specials = _score_specials(st, block, home, qo, shared_res)
        others = _scan_others(index.sorted, specials, shared_res, st.full_bytes[block] + qo, f, cap)
        worker, cost, fell_back = _choose(specials, others, index.loads, f, cap)
        fallbacks += fell_back
        assignment[t] = worker
        index.add(worker, f)
        migrated = worker != home
        q_bytes += q_per_block[block] if migrated else 0
        kv_bytes += cost - (qo if migrated else 0)
        # C_r |= K(t); private groups are never referenced again, fully held ones never cost
        for s in st.shared[block] if migrated else st.home_partial[block]:
            missing = st.sample_full[s] - st.sample_held[s].get(worker, 0)
            if missing > 0:
                resident.setdefault(s * H + head, {}).setdefault(worker, missing)
    return np.asarray(assignment, dtype=np.int64), cap, fallbacks, (q_bytes, kv_bytes, q_bytes)


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


def _refine(tiles: TileSet, assignment: np.ndarray) -> np.ndarray:
    """Moves, then swaps, off the heaviest worker while they strictly lower its load below the old max."""
    f = tiles.tile_flops().astype(np.float64)
    assignment = assignment.copy()
    loads = worker_loads(tiles, assignment)
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
def _run_home(tiles: TileSet, tau: float):
    home = tiles.tile_home().astype(np.int64)
    cap = _capacity(tiles.tile_flops(), tiles.num_workers, tau)
    return home, cap, 0, assignment_comm_bytes(tiles, home)


def _run_refined(tiles: TileSet, tau: float):
    start, cap, fallbacks, comm = _place_alg2(tiles, tau)
    refined = _refine(tiles, start)
    if worker_loads(tiles, refined).max() <= worker_loads(tiles, start).max():
        return refined, cap, fallbacks, assignment_comm_bytes(tiles, refined)
    return start, cap, fallbacks, comm


_PLACERS: Dict[TilePlacement, Callable[[TileSet, float], tuple]] = {
    TilePlacement.HOME: _run_home,
    TilePlacement.ALG2: _place_alg2,
    TilePlacement.REFINED: _run_refined,
}


def place_tiles(tiles: TileSet, tau: float = 0.03, method=TilePlacement.ALG2) -> TilePlacementResult:
    """Assign every SH-Tile of the pool to one of its W = P*CP workers (Algorithm 2 by default).

    HOME: every tile at its Q-home. ALG2: Algorithm 2 exactly (ties as in the paper: feasible branch
    argmin (dcomm, L_r, r); fallback argmin (L_r, dcomm, r)). REFINED: ALG2, then moves/swaps off the
    heaviest worker; never a higher max load than ALG2 (comm is recomputed for the final assignment).
    """
    assignment, cap, fallbacks, comm = _PLACERS[TilePlacement(method)](tiles, tau)
    return TilePlacementResult(
        assignment=assignment,
        loads=worker_loads(tiles, assignment),
        capacity=cap,
        comm_bytes=tuple(int(x) for x in comm),
        num_fallback=int(fallbacks),
    )
