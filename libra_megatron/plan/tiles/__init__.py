"""SH-Tiles and their placement (§4.3): cut every packed sequence into tiles, place them on the pool's workers.

    tiles        ``TileSet``, ``build_tiles``: SH-Tiles (Eq. 5), their causal-pair FLOPs (Eq. 6), KV groups (Eq. 7)
    alg2         Algorithm 2: the greedy communication-aware placer under the (1 + tau) * mean target (Eq. 8)
    node_export  dense-first export of whole tiles off over-full nodes (multi-node pools)
    timeaware    time-aware moves: refine a placement by the Pipeliner timeline of its exchange plan
    placement    ``place_tiles`` (the one entry point: every ``--libra-tile-placement``) and its result

Imports ``plan.exchange`` (a time-aware placement prices the exchange plan it would build) and ``plan.model``.
"""
from .placement import TilePlacementResult, assignment_comm_bytes, place_tiles, reads_timing, worker_loads
from .tiles import TileSet, build_tiles

__all__ = ["TilePlacementResult", "assignment_comm_bytes", "place_tiles", "reads_timing", "worker_loads", "TileSet",
           "build_tiles"]
