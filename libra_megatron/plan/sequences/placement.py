"""Which placer VRSP runs (``SequencePlacement``), and where each position of its order runs (§4.2, Fig. 7).

``place_sequences`` is the one entry point: CONTIGUOUS / ALG1 / REFINED (``vrsp``) or SYNC (``lanes``).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import numpy as np

from ...config import SequencePlacement
from ..model import check_pool_split
from .lanes import place_for_sync, priced_lanes_apply
from .priced_lanes import PoolSeconds, balance_lane_seconds, place_for_pipelines
from .vrsp import _as_flops, place_alg1, place_contiguous, place_refined

__all__ = ["place_sequences", "assign_to_ranks"]


_PLACERS: Dict[SequencePlacement, Callable[[np.ndarray, int], np.ndarray]] = {
    SequencePlacement.CONTIGUOUS: place_contiguous,
    SequencePlacement.ALG1: place_alg1,
    SequencePlacement.REFINED: place_refined,
    SequencePlacement.SYNC: place_refined,  # without a layout: one GA step, lanes are the instances
}


def place_sequences(flops, pool_size: int, method=SequencePlacement.REFINED, layout=None,
                    pool_seconds: Optional[PoolSeconds] = None) -> np.ndarray:
    """VRSP: a permutation of ``range(GBS)`` in GA-major, pool-minor order (pool k = order[k*P:(k+1)*P]).

    ``flops``: float64 (GBS,) Eq. 4 workloads. ``pool_size``: P, must divide GBS. ``layout``: the step's
    ``plan.sequences.sync.SyncLayout`` (read by SYNC only; its pool size must be P). ``pool_seconds`` (SYNC with a
    layout whose lanes run apart, ``lanes.priced_lanes_apply``): pools [n, P] of window positions -> their
    (forward, backward) layer seconds (``pool_proxy.PoolProxy.pricer``); at PP > 1 the order is then the fastest of
    ``priced_lanes.place_for_pipelines``' candidates under it, at PP = 1 the F-balanced lanes' pools are swapped
    until the lanes' priced totals are even (``priced_lanes.balance_lane_seconds``). Deterministic. Returns int64 (GBS,).
    """
    flops = _as_flops(flops)
    check_pool_split(flops.size, pool_size)
    method = SequencePlacement(method)
    if method is SequencePlacement.SYNC and layout is not None:
        if layout.pool_size != pool_size:
            raise ValueError(f"the sync layout's pool size {layout.pool_size} differs from pool_size (P) {pool_size}")
        priced = pool_seconds is not None and priced_lanes_apply(layout)
        if priced and layout.pipeline_parallel_size > 1:
            return place_for_pipelines(flops, layout, pool_seconds)[0]
        order = place_for_sync(flops, layout)
        return balance_lane_seconds(order, layout, pool_seconds) if priced else order
    return _PLACERS[method](flops, pool_size)


def assign_to_ranks(order, data_parallel_size: int, pool_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Where each position of ``order`` runs: (ga_index, dp_rank), both int64 (GBS,).

    Position n runs at GA index ``n // DP`` on DP rank ``n % DP`` (mbs = 1). Pool k of the order then
    occupies GA index ``k*P // DP`` and the consecutive DP ranks ``(k % (DP/P))*P + j``, j < P (Fig. 7).
    """
    order = np.asarray(order, dtype=np.int64).reshape(-1)
    gbs = order.size
    if pool_size < 1 or data_parallel_size < 1:
        raise ValueError(f"pool_size (P) and data_parallel_size (DP) must be >= 1, got {pool_size}, {data_parallel_size}")
    if data_parallel_size % pool_size:
        raise ValueError(
            f"pool_size (P) {pool_size} must divide data_parallel_size (DP) {data_parallel_size} "
            f"({data_parallel_size} % {pool_size} = {data_parallel_size % pool_size})"
        )
    if gbs % data_parallel_size:
        raise ValueError(
            f"data_parallel_size (DP) {data_parallel_size} must divide the global batch size (GBS) {gbs} "
            f"({gbs} % {data_parallel_size} = {gbs % data_parallel_size})"
        )
    positions = np.arange(gbs, dtype=np.int64)
    return positions // data_parallel_size, positions % data_parallel_size
