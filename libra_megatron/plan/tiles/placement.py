"""Communication-aware SH-Tile placement inside one sequence pool (§4.3.2, Algorithm 2, Eq. 8).

Pure Python + numpy. Inputs come from ``TileSet`` (``build_tiles``): tile loads ``f_t`` are Eq. 6
(``tiles.tile_flops()``, int64 pair-heads) unless ``place_tiles(tile_cost=...)`` passes another work
vector (e.g. calibrated seconds from ``plan.model.kernel_cost.TileCostModel.tile_costs``, review objection 2); byte
volumes are per layer forward, in bytes.

Eq. 8 prices the KV a tile makes its destination fetch the way the exchange plan fetches it
(``tiles.kv_fetch``): the whole group (the paper) or only the causal prefix a tile needs, minus rows the
destination holds or has already selected (``plan.tiles.alg2`` has the formula and the fast exact Algorithm 2).

``comm_bytes`` is recomputed from the final assignment by ``assignment_comm_bytes``: Q and O once per
migrated tile, KV once per (group, destination) up to the largest prefix the destination needs
(``plan.exchange.kv_refs.fetched_groups``) -- which is what an exchange plan built from the assignment moves, and
equals the sum of Eq. 8 along Algorithm 2.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from ...config import TilePlacement
from ..gc_pause import paused_gc
from .alg2 import capacity, place_alg2, tile_loads
from ..exchange import RELAY_STRIPE_UNITS, LayerPricing, build_exchange_plan, fetched_groups, plan_worker_seconds
from ..model import StepTimeModel, kernel_floor_per_pair
from .node_export import even_heaviest, export_dense_first
from .tiles import TileSet
from .timeaware import DENSE_TIME_ROUNDS, DENSE_WIDTH, refine_for_time, time_moves

__all__ = ["TilePlacementResult", "place_tiles", "reads_timing", "assignment_comm_bytes", "worker_loads",
           "fastest_layer"]

_MAX_REFINE_STEPS_PER_WORKER = 4  # REFINED stops after 4*W accepted moves/swaps


@dataclass(frozen=True, eq=False)
class TilePlacementResult:
    """One pool's tile assignment.

    assignment   int64 [num_tiles]  destination worker (pool-local id w = p*CP + c) of every tile
    loads        float64 [W]        sum of tile loads f_t per worker (Eq. 6, or the ``tile_cost`` given)
    capacity     float              C = (1 + tau) * sum(f) / W (Algorithm 2, line 3)
    comm_bytes   (q, kv, o) ints    Eq. 8 total of the assignment split by kind (bytes per layer forward)
    num_fallback int                tiles placed by the fallback branch (no worker had headroom)
    exchange     ExchangePlan|None  the plan of ``assignment`` when the placer built it (DENSE prices its
                                    candidates with their plans; ``plan_pool`` reuses it instead of rebuilding)
    """

    assignment: np.ndarray
    loads: np.ndarray
    capacity: float
    comm_bytes: Tuple[int, int, int]
    num_fallback: int = 0
    exchange: object = None

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


def worker_loads(tiles: TileSet, assignment: np.ndarray, tile_cost=None) -> np.ndarray:
    """float64 [W]: sum of the tile loads hosted by each worker (Eq. 6, or ``tile_cost`` [num_tiles])."""
    f = tiles.tile_flops() if tile_cost is None else tile_cost
    return np.bincount(assignment, weights=np.asarray(f, dtype=np.float64), minlength=tiles.num_workers)


def assignment_comm_bytes(tiles: TileSet, assignment) -> Tuple[int, int, int]:
    """(q, kv, o) bytes an exchange plan for ``assignment`` moves per layer forward (Eq. 8 summed).

    q = o = sum over migrated tiles of tokens * q_bytes_per_token; kv = sum over distinct
    (group, destination) pairs of the rows of the destination's prefix it does not hold * kv bytes per row.
    """
    assignment = np.asarray(assignment, dtype=np.int64)
    heads = tiles.heads
    moved_tokens = int(tiles.tile_tokens()[assignment != tiles.tile_home()].sum())
    kv_bytes = fetched_groups(tiles, assignment).kv_bytes(heads)
    return moved_tokens * heads.q_bytes_per_token(), kv_bytes, moved_tokens * heads.o_bytes_per_token()


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
    f = tile_loads(tiles, tile_cost).astype(np.float64)
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
    cap = capacity(tile_loads(tiles, tile_cost), tiles.num_workers, tau)
    return home, cap, 0, assignment_comm_bytes(tiles, home)


def _run_refined(tiles: TileSet, tau: float, tile_cost=None):
    start, cap, fallbacks, comm = place_alg2(tiles, tau, tile_cost)
    refined = _refine(tiles, start, tile_cost)
    if worker_loads(tiles, refined, tile_cost).max() <= worker_loads(tiles, start, tile_cost).max():
        return refined, cap, fallbacks, assignment_comm_bytes(tiles, refined)
    return start, cap, fallbacks, comm


def _run_time(tiles: TileSet, tau: float, tile_cost=None, timing=None):
    start, cap, fallbacks, comm = place_alg2(tiles, tau, tile_cost)
    timed = refine_for_time(tiles, start, timing or StepTimeModel(tiles.heads.head_dim))
    return timed, cap, fallbacks, assignment_comm_bytes(tiles, timed)


def _run_dense(tiles: TileSet, tau: float, tile_cost=None, timing=None):
    """ALG2, its ``plan.tiles.node_export.export_dense_first`` over the nodes of ``timing``, ``DENSE_TIME_ROUNDS``
    rounds of time-aware moves from the export (``plan.tiles.timeaware.time_moves``, ``DENSE_WIDTH``) and the export
    with its busiest worker evened down to Algorithm 2's cap (``node_export.even_heaviest``: 1M exports leave
    it up to 10% above): of the four, the one whose whole layer is fastest (``fastest_layer``), ties keeping the
    earlier. Returns the placer tuple plus the winner's plan.

    Issue 24: the candidates were kept by the forward-only timeline (``plan_worker_seconds``), which underprices
    the coupled forward (1M pools: it kept Algorithm 2 where the runtime's forward is 30% slower than the
    export's) and cannot see the backward, where its moves often cost more than they saved."""
    with paused_gc():  # the search and the pricing allocate much and free it all (plan.gc_pause)
        return _dense_candidates(tiles, tau, tile_cost, timing or StepTimeModel(tiles.heads.head_dim))


def _dense_candidates(tiles: TileSet, tau: float, tile_cost, timing: StepTimeModel):
    start, cap, fallbacks, comm = place_alg2(tiles, tau, tile_cost)
    loads, nodes = tile_loads(tiles, tile_cost), timing.nodes(tiles.num_workers)
    exported = export_dense_first(tiles, start, loads, nodes)
    moved = time_moves(tiles, exported, timing, DENSE_TIME_ROUNDS, DENSE_WIDTH)
    evened = even_heaviest(tiles, exported, loads, nodes, cap)  # the export itself where nothing moves (deduplicated)
    assignment, plan = fastest_layer(tiles, (start, exported, moved, evened), timing)
    if assignment is not start:
        comm = assignment_comm_bytes(tiles, assignment)
    return assignment, cap, fallbacks, comm, plan


PRICE_FIRST = 1  # the candidate priced first: the node export, fastest on 23 of 24 real pools (docs/exchange.md)
RELAY_RECHECK = 1.10  # the direct plan of a relaying winner is priced within this Pipeliner ratio of it
_BOUND_MARGIN = 1e-9  # a bound rules a candidate out only above the best by more than rounding


def fastest_layer(tiles: TileSet, candidates, timing: StepTimeModel, price_first: int = PRICE_FIRST,
                  relay_check: bool = True):
    """(assignment, its plan) of the candidate whose whole layer is fastest, ties the earliest in ``candidates``. The
    whole layer: the slowest worker's forward plus the slowest worker's backward, every rank's op list priced with
    peers coupled (``plan.exchange.LayerPricing``, save mode ARRANGED: what ``save_mode=auto`` keeps whenever it
    fits), the figure the simulator reports per pool. Equal candidates are priced once. ``candidates[price_first]``
    is priced first; every other is priced only as far as it can still win (the same choice as pricing all,
    cheaper): it is ruled out, unpriced, when its kernels alone -- the busiest worker's hosted pair-heads at
    ``plan.model.kernel_floor_per_pair``, no plan built -- take longer than the best layer so far, and after its
    forward when that forward plus its backward kernels do. A rank's seconds in a phase are never below its kernels
    (``kernel_floor_per_pair``), so a candidate ruled out is slower than the one kept; under a calibration nothing is
    ruled out.

    The relay, too, is kept by the whole layer: when the kept plan relays K/V (``timing.kv_relay``, chosen by the
    forward Pipeliner per worker in ``plan.exchange.relay.choose_relay``), the same assignment's direct plan
    replaces it if its layer is faster; it is priced only when the Pipeliner prices it within ``RELAY_RECHECK`` of
    the relay plan (docs/exchange.md: beyond that the layer never preferred it). Then the same assignment's plan
    with the relay striped over each node's fetchers (``plan.exchange.relay``, ``RELAY_STRIPE_UNITS``) replaces the
    kept one if its layer is faster (the Pipeliner cannot tell the two layouts apart: it sums bytes per link
    class); ties keep the single relay, then the direct plan. ``relay_check=False``: the candidates' plans as
    built."""
    distinct = []  # the first of equal candidates
    for i, candidate in enumerate(candidates):
        if not any(np.array_equal(candidate, candidates[j]) for j in distinct):
            distinct.append(i)
    first = next(j for j in distinct if np.array_equal(candidates[j], candidates[price_first]))
    floor = kernel_floor_per_pair(timing)
    ops_cache = {}  # the candidates share most ranks' plans: each distinct rank plan's op lists built once
    best = None  # (layer seconds, rank for ties, assignment, plan)

    def consider(rank: tuple, candidate, plan=None) -> None:
        nonlocal best
        fwd_floor = bwd_floor = 0.0
        if floor is not None:
            busiest = float(worker_loads(tiles, candidate).max())
            fwd_floor, bwd_floor = busiest * floor[0], busiest * floor[1]
        if best is not None and fwd_floor + bwd_floor > best[0] * (1 + _BOUND_MARGIN):
            return
        plan = build_exchange_plan(tiles, candidate, timing) if plan is None else plan
        pricing = LayerPricing(plan, timing, "arranged", cache=ops_cache)
        forward = pricing.phase("forward").seconds.max()
        if best is not None and forward + bwd_floor > best[0] * (1 + _BOUND_MARGIN):
            return
        seconds = float(forward + pricing.phase("backward").seconds.max())
        if best is None or (seconds, rank) < best[:2]:
            best = (seconds, rank, candidate, plan)

    for i in [first] + [j for j in distinct if j != first]:
        consider((i, 0), candidates[i])
    if relay_check and timing.kv_relay and best[3].relay_units is not None:  # ties keep the relay (fewer bytes)
        direct = build_exchange_plan(tiles, best[2], dataclasses.replace(timing, kv_relay=False))
        if plan_worker_seconds(direct, timing).max() <= RELAY_RECHECK * plan_worker_seconds(best[3], timing).max():
            consider((best[1][0], 1), best[2], direct)
    if relay_check and timing.kv_relay:
        striped = build_exchange_plan(tiles, best[2], timing, relay_stripe=RELAY_STRIPE_UNITS)
        if striped.relay_units is not None:
            consider((best[1][0], 2), best[2], striped)
    return best[2], best[3]


_PLACERS: Dict[TilePlacement, Callable[..., tuple]] = {
    TilePlacement.HOME: _run_home,
    TilePlacement.ALG2: place_alg2,
    TilePlacement.REFINED: _run_refined,
    TilePlacement.TIME: _run_time,
    TilePlacement.DENSE: _run_dense,
}
_TIMED = (TilePlacement.TIME, TilePlacement.DENSE)  # the placers that read a timing model


def reads_timing(method) -> bool:
    """Whether tile placement ``method`` places by a ``StepTimeModel`` (its nodes and rates)."""
    return TilePlacement(method) in _TIMED


def place_tiles(tiles: TileSet, tau: float = 0.03, method=TilePlacement.ALG2, *,
                tile_cost=None, timing: Optional[StepTimeModel] = None) -> TilePlacementResult:
    """Assign every SH-Tile of the pool to one of its W = P*CP workers (Algorithm 2 by default).

    HOME: every tile at its Q-home. ALG2: Algorithm 2 exactly (ties as in the paper: feasible branch
    argmin (dcomm, L_r, r); fallback argmin (L_r, dcomm, r)). REFINED: ALG2, then moves/swaps off the
    heaviest worker; never a higher max load than ALG2 (comm is recomputed for the final assignment).
    tile_cost: optional float64 [num_tiles] (>= 0, any unit, e.g. seconds from
    ``plan.model.kernel_cost.TileCostModel.tile_costs``) used as f_t instead of Eq. 6 ``tiles.tile_flops()``; C, the
    order and Eq. 8 ties are unchanged. None (default) gives exactly the Eq. 6 placement.
    TIME: ALG2, then ``plan.tiles.timeaware.refine_for_time`` under ``timing`` (default ``StepTimeModel`` rates,
    the pool's worker 0 on a node boundary); never slower than ALG2 under that model.
    DENSE: ALG2, its dense-first node export (``plan.tiles.node_export``) over ``timing``'s nodes,
    ``DENSE_TIME_ROUNDS`` rounds of TIME's moves from the export, and the export evened (``even_heaviest``): the one
    whose whole layer (forward + backward, peers coupled: ``fastest_layer``) is fastest under ``timing``; never
    slower than ALG2 under that model.
    """
    method = TilePlacement(method)
    if timing is not None and method not in _TIMED:
        raise ValueError(f"place_tiles: a timing model is only read by tile placement 'time' or 'dense', "
                         f"not {method.value!r}")
    extra = (timing,) if method in _TIMED else ()
    assignment, cap, fallbacks, comm, *planned = _PLACERS[method](tiles, tau, tile_cost, *extra)
    return TilePlacementResult(
        assignment=assignment,
        loads=worker_loads(tiles, assignment, tile_cost),
        capacity=cap,
        comm_bytes=tuple(int(x) for x in comm),
        num_fallback=int(fallbacks),
        exchange=planned[0] if planned else None,
    )
