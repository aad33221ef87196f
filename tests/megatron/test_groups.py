"""Pool process groups: rank lists against brute force from rank coordinates, and real gloo groups."""
from __future__ import annotations

import itertools

import pytest

from libra_megatron.megatron.groups import pool_rank_lists

SHAPES = [  # (tp, cp, dp, pp, P)
    (1, 1, 8, 1, 2), (1, 2, 4, 1, 2), (2, 2, 2, 1, 2), (2, 1, 4, 2, 4), (1, 4, 4, 2, 1),
    (2, 2, 6, 1, 3), (4, 1, 2, 3, 2), (1, 2, 8, 1, 8), (1, 1, 2, 4, 2), (2, 1, 2, 8, 2),
]  # PP=4/8: each stage's pools hold only that stage's ranks


def _coords(rank: int, sizes: dict, order: str) -> dict:
    """Mixed-radix decode, first axis of ``order`` fastest (Megatron's RankGenerator convention)."""
    out = {}
    for name in order.split("-"):
        out[name] = rank % sizes[name]
        rank //= sizes[name]
    return out


def _brute_force_pools(tp, cp, dp, pp, pool, order):
    sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    world = tp * cp * dp * pp
    members = {}
    for rank in range(world):
        c = _coords(rank, sizes, order)
        key = (c["pp"], c["tp"], c["dp"] // pool)
        members.setdefault(key, []).append((c["dp"] % pool, c["cp"], rank))
    return {key: [r for _, _, r in sorted(v)] for key, v in members.items()}


@pytest.mark.parametrize("tp,cp,dp,pp,pool", SHAPES)
@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-dp-cp-pp", "tp-pp-cp-dp"])
def test_pool_rank_lists_match_brute_force_coordinates(tp, cp, dp, pp, pool, order):
    got = pool_rank_lists(tp * cp * dp * pp, tp, pp, cp, dp, pool, order=order)
    expected = _brute_force_pools(tp, cp, dp, pp, pool, order)
    assert got == [expected[key] for key in sorted(expected)]
    assert sorted(itertools.chain.from_iterable(got)) == list(range(tp * cp * dp * pp))


@pytest.mark.parametrize("tp,cp,dp,pp", [(1, 2, 4, 1), (2, 2, 2, 2), (2, 1, 4, 1), (1, 1, 2, 4)])
def test_pool_of_whole_dp_equals_megatron_dp_cp_group(tp, cp, dp, pp):
    from megatron.core.parallel_state import RankGenerator

    generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    megatron_groups = sorted(generator.get_ranks("cp-dp"))
    assert sorted(pool_rank_lists(tp * cp * dp * pp, tp, pp, cp, dp, dp)) == megatron_groups


@pytest.mark.parametrize(
    "args,needle",
    [((8, 1, 1, 2, 4, 3), "--libra-pool-size 3 must divide the data-parallel size 4 (4 % 3 = 1)"),
     ((8, 2, 1, 2, 4, 2), "world size 8 must equal TP*PP*CP*DP = 2*1*2*4 = 16"),
     ((8, 1, 1, 1, 8, 0), "--libra-pool-size must be a positive integer")],
)
def test_pool_rank_lists_rejects_bad_sizes_with_arithmetic(args, needle):
    with pytest.raises(ValueError) as err:
        pool_rank_lists(*args)
    assert needle in str(err.value)


def _pool_groups_on_gloo(rank, world_size, shapes):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from libra_megatron.megatron import groups

    results = []
    for tp, cp, pool in shapes:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        dp = ps.get_data_parallel_world_size()
        try:
            groups.initialize_pool_groups(dp + 1)
        except ValueError as err:
            bad_pool_message = str(err)
        assert not groups.pool_groups_initialized()
        relay = tp == 1  # the second shape makes no relay twin
        groups.initialize_pool_groups(pool, relay=relay)
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=groups.get_pool_group())
        pool_sum = float(value.item())
        twin = groups.get_pool_relay_group()
        twin_ranks = dist.get_process_group_ranks(twin) if twin is not None else None
        if twin is not None:
            dist.all_reduce(value, group=twin)  # a working group over the same ranks
        results.append(dict(
            ranks=groups.get_pool_ranks(), pool_rank=groups.get_pool_rank(), index=groups.get_pool_index(),
            workers=groups.get_pool_size_workers(), pool_sum=pool_sum, bad=bad_pool_message,
            dp_rank=ps.get_data_parallel_rank(), cp_rank=ps.get_context_parallel_rank(),
            tp_rank=ps.get_tensor_model_parallel_rank(), dp=dp, relay=relay, twin_ranks=twin_ranks,
            twin_sum=float(value.item()),
        ))
        groups.destroy_pool_groups()
        ps.destroy_model_parallel()
    return results


def test_pool_groups_on_gloo_match_parallel_state_and_all_reduce_within_pool():
    from libra_megatron.testing.dist import run_distributed

    shapes = [(1, 2, 2), (2, 2, 2)]  # (TP, CP, P) on 8 ranks: DP = 4, then DP = 2
    per_rank = run_distributed(_pool_groups_on_gloo, 8, shapes, timeout=240)
    for s, (tp, cp, pool) in enumerate(shapes):
        dp = 8 // (tp * cp)
        lists = pool_rank_lists(8, tp, 1, cp, dp, pool)
        for rank, results in enumerate(per_rank):
            got = results[s]
            assert got["dp"] == dp
            assert f"--libra-pool-size {dp + 1} must divide the data-parallel size {dp}" in got["bad"]
            assert got["ranks"] in lists and got["ranks"][got["pool_rank"]] == rank
            assert got["pool_rank"] == (got["dp_rank"] % pool) * cp + got["cp_rank"]
            assert got["index"] == got["dp_rank"] // pool
            assert got["workers"] == pool * cp
            assert got["pool_sum"] == float(sum(got["ranks"]))
            if got["relay"]:  # kv_relay auto: a twin of the pool group, its own communicator over the same ranks
                assert got["twin_ranks"] == got["ranks"] and got["twin_sum"] == len(got["ranks"]) * got["pool_sum"]
            else:
                assert got["twin_ranks"] is None
            # every member of the pool shares this rank's TP rank and DP block
            for other in got["ranks"]:
                mate = per_rank[other][s]
                assert mate["tp_rank"] == got["tp_rank"] and mate["dp_rank"] // pool == got["index"]
