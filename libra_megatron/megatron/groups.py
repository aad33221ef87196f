"""Sequence-pool process groups (§4.1, §5): the CP groups of P consecutive DP replicas at one TP rank and PP stage.

Megatron's ``RankGenerator`` numbers ranks in mixed radix over ``order`` (default ``tp-cp-ep-dp-pp``,
first name fastest); the dense (decoder) generator uses ep=1, so expert parallelism does not move
dense ranks. A pool at TP rank t, PP stage s and pool index k holds the ranks with DP index
``dp = k*P + p`` (p < P) and CP rank c (c < CP), listed so that pool-local worker id ``w = p*CP + c``
(``plan.layout`` relies on that order). There are ``TP * PP * DP/P`` pools of ``P*CP`` ranks.

Worked example, world 8, TP=2, CP=2, DP=2, P=2 (order tp-cp-ep-dp-pp: rank = t + 2*c + 4*dp):
pools = [[0, 2, 4, 6], [1, 3, 5, 7]] -- pool 0 is TP rank 0: (p0,c0)=0, (p0,c1)=2, (p1,c0)=4, (p1,c1)=6.

Groups live in this module's private state (created identically on every rank, torn down by
``destroy_pool_groups``); per-batch data never goes through module globals.
"""
from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

__all__ = [
    "pool_rank_lists",
    "initialize_pool_groups",
    "get_pool_group",
    "get_pool_check_group",
    "get_pool_relay_group",
    "get_pool_rank",
    "get_pool_size_workers",
    "get_pool_index",
    "get_pool_ranks",
    "pool_groups_initialized",
    "destroy_pool_groups",
]

_AXES = ("tp", "cp", "ep", "dp", "pp")


class _PoolState:
    group: Any = None
    check_group: Any = None  # gloo twin of ``group``: plan verification without reading device memory
    relay_group: Any = None  # twin of ``group`` (same backend): K/V relay exchanges beside the dispatches
    ranks: Optional[List[int]] = None
    pool_index: int = -1
    all_groups: List[Any] = []


_STATE = _PoolState()


def _check_sizes(world_size: int, tp: int, pp: int, cp: int, dp: int, pool_size: int, ep: int) -> None:
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("dp", dp), ("ep", ep),
                        ("--libra-pool-size", pool_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if tp * pp * cp * dp != world_size:
        raise ValueError(
            f"world size {world_size} must equal TP*PP*CP*DP = {tp}*{pp}*{cp}*{dp} = {tp * pp * cp * dp}"
        )
    if dp % pool_size:
        raise ValueError(
            f"--libra-pool-size {pool_size} must divide the data-parallel size {dp} "
            f"({dp} % {pool_size} = {dp % pool_size})"
        )


def _parse_order(order: str) -> List[str]:
    names = order.lower().split("-")
    if sorted(names) != sorted(set(names)) or not set(names) <= set(_AXES):
        raise ValueError(f"parallel order {order!r} must list distinct axes out of {'-'.join(_AXES)}")
    return names + [a for a in _AXES if a not in names]  # RankGenerator appends missing size-1 axes


def pool_rank_lists(world_size: int, tp: int, pp: int, cp: int, dp: int, pool_size: int, ep: int = 1,
                    order: str = "tp-cp-ep-dp-pp") -> List[List[int]]:
    """Global ranks of every pool: ``TP*PP*(DP/P)`` lists of ``P*CP`` ranks, pool-local order w = p*CP + c.

    Pools are listed PP-major, then TP rank, then pool index k (the same on every rank). ``ep`` is
    accepted for signature parity with Megatron and does not change dense ranks (see module doc).
    """
    _check_sizes(world_size, tp, pp, cp, dp, pool_size, ep)
    names = _parse_order(order)
    sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    # rank = sum coord_i * stride_i with the first axis fastest: reshape with the slowest axis first.
    grid = np.arange(world_size).reshape([sizes[n] for n in reversed(names)])
    grid = grid.transpose([list(reversed(names)).index(n) for n in ("pp", "tp", "ep", "dp", "cp")])
    grid = grid[:, :, 0]  # [pp, tp, dp, cp]
    pools = grid.reshape(pp, tp, dp // pool_size, pool_size * cp)
    return pools.reshape(-1, pool_size * cp).tolist()


def initialize_pool_groups(pool_size: int, order: str = "tp-cp-ep-dp-pp", timeout=None, relay: bool = False) -> None:
    """Create every pool group (same order on all ranks); call right after ``initialize_model_parallel``.
    ``relay``: also a twin of every pool group, for K/V relay exchanges (``kv_relay: auto``).

    Reads TP/PP/CP/DP sizes from ``parallel_state`` and checks that this rank's pool lies inside its
    DP x CP group in pool-local order (so ``order`` must be the one Megatron was initialised with).
    Raises ValueError when P does not divide DP.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if pool_groups_initialized():
        raise RuntimeError("Libra pool groups are already initialised; call destroy_pool_groups() first")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    dp = ps.get_data_parallel_world_size()
    pools = pool_rank_lists(world, tp, pp, cp, dp, pool_size, order=order)
    groups = [ps.create_group(ranks, timeout=timeout, group_desc="LIBRA_POOL") for ranks in pools]
    gloo = [ps.create_group(ranks, timeout=timeout, backend="gloo", group_desc="LIBRA_POOL_GLOO") for ranks in pools]
    twins = [ps.create_group(ranks, timeout=timeout, group_desc="LIBRA_POOL_RELAY") for ranks in pools] if relay else None
    mine = [i for i, ranks in enumerate(pools) if rank in ranks]
    assert len(mine) == 1, f"rank {rank} must be in exactly one pool, found {mine}"
    ranks = pools[mine[0]]
    _check_against_parallel_state(ranks, rank, pool_size, cp, order)
    _STATE.group, _STATE.ranks, _STATE.all_groups = groups[mine[0]], ranks, groups
    _STATE.check_group = gloo[mine[0]]
    _STATE.relay_group = twins[mine[0]] if twins else None
    _STATE.pool_index = mine[0] % (dp // pool_size)


def _check_against_parallel_state(ranks: List[int], rank: int, pool_size: int, cp: int, order: str) -> None:
    from megatron.core import parallel_state as ps

    import torch.distributed as dist

    dp_cp_ranks = set(dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True)))
    expected_w = (ps.get_data_parallel_rank() % pool_size) * cp + ps.get_context_parallel_rank()
    if not set(ranks) <= dp_cp_ranks or ranks.index(rank) != expected_w:
        raise ValueError(
            f"Libra pool {ranks} of rank {rank} does not match megatron's DP x CP group "
            f"{sorted(dp_cp_ranks)} under order {order!r}: pass the order given to initialize_model_parallel"
        )


def _require() -> None:
    if not pool_groups_initialized():
        raise RuntimeError("Libra pool groups are not initialised: call initialize_pool_groups(pool_size)")


def get_pool_group():
    """This rank's pool process group (P*CP ranks)."""
    _require()
    return _STATE.group


def get_pool_relay_group():
    """Twin of ``get_pool_group()`` for the K/V relay's exchanges (so they do not queue behind the dispatches on
    one communicator); None when the pool groups were made without ``relay`` (the relay then uses the pool group)."""
    _require()
    return _STATE.relay_group


def get_pool_check_group():
    """Gloo group over the same ranks as ``get_pool_group()``: the once-per-plan verification gathers over it
    with CPU tensors, so it never reads device memory (``runtime.checks``)."""
    _require()
    return _STATE.check_group


def get_pool_rank() -> int:
    """This rank's pool-local worker id w = p*CP + c (= its rank in the pool group)."""
    _require()
    import torch.distributed as dist

    return _STATE.ranks.index(dist.get_rank())


def get_pool_size_workers() -> int:
    """W = P*CP, the number of workers in every pool."""
    _require()
    return len(_STATE.ranks)


def get_pool_index() -> int:
    """k: which of the DP/P pools at this TP rank and PP stage (pool k holds DP indices [k*P, (k+1)*P))."""
    _require()
    return _STATE.pool_index


def get_pool_ranks() -> List[int]:
    """Global ranks of this rank's pool in pool-local order."""
    _require()
    return list(_STATE.ranks)


def pool_groups_initialized() -> bool:
    return _STATE.group is not None


def destroy_pool_groups() -> None:
    """Forget the pool groups, like ``parallel_state.destroy_model_parallel`` forgets its own. Idempotent."""
    _STATE.group, _STATE.ranks, _STATE.pool_index, _STATE.all_groups = None, None, -1, []
    _STATE.check_group = _STATE.relay_group = None
