"""``plan.exchange.pool_sizes``: every rank's sizes read at once from a plan's pool-wide tables are, field for field,
what ``rank_sizes`` reads of that rank's RankPlan (issue 25), and the op lists built from them are the same."""
from __future__ import annotations

import numpy as np
import pytest

from libra_megatron.config import KvFetch, TilePlacement, TilingPolicy, TokenLayoutKind
from libra_megatron.plan.exchange import RankSizes, build_exchange_plan, layer_ops, rank_layer_ops, rank_sizes
from libra_megatron.plan.exchange.pool_sizes import pool_rank_sizes, sizes_key
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.model import StepTimeModel
from libra_megatron.plan.tiles import build_tiles, place_tiles
from libra_megatron.testing.traces import packed_trace_segments

from .test_rank_tables import HEADS, _plan, assert_size_fields


def _assert_same_sizes(got: RankSizes, want: RankSizes) -> set:
    """Field for field (entry sets by their lengths); returns the entry sets present."""
    return assert_size_fields(got, want, RankSizes.__dataclass_fields__)


@pytest.mark.parametrize("hq, hkv, H, M", HEADS)
@pytest.mark.parametrize("kv_fetch, relay", [("group", False), ("prefix", False), ("prefix", True)])
def test_pool_sizes_are_every_ranks_sizes_on_random_assignments(hq, hkv, H, M, kv_fetch, relay):
    _, plan = _plan(hq, hkv, H, M, kv_fetch, relay=relay)
    pooled = pool_rank_sizes(plan)
    assert len(pooled) == plan.num_workers
    for r, sizes in enumerate(pooled):
        _assert_same_sizes(sizes, rank_sizes(plan.for_rank(r)))
        assert (sizes.relay_splits is None) == (not relay)


def _real_plans():
    """Real wikipedia and linux pools (2 x 32K, CP 4, two 4-GPU nodes, relay allowed) placed by Algorithm 2 and
    by the dense placement: local, remote and split entries, relays, several chunks."""
    heads = HeadLayout(16, 2, 64, head_split=2, num_chunks=2, elem_bytes=2)
    model = StepTimeModel(64, gpus_per_node=4, kv_relay=True)
    for name, seed in (("wikipedia-flexsp.txt", 11), ("linux-6.12-files.qwen.txt", 5)):
        segs = packed_trace_segments(np.random.default_rng(seed), 2, 32768, name=name)
        tiles = build_tiles(segs, TokenLayout(TokenLayoutKind.ZIGZAG, 32768, 4), heads, 1024,
                            tiling=TilingPolicy.ADAPTIVE, tau=0.03, kv_fetch=KvFetch.PREFIX)
        for method in (TilePlacement.ALG2, TilePlacement.DENSE):
            placed = place_tiles(tiles, 0.03, method, timing=model if method is TilePlacement.DENSE else None)
            yield model, placed.exchange or build_exchange_plan(tiles, placed.assignment, model)


def test_pool_sizes_and_their_op_lists_are_the_ranks_own_on_real_pools():
    present, relayed, keys = set(), False, set()
    for _, plan in _real_plans():
        ops = layer_ops(plan)
        for r, sizes in enumerate(pool_rank_sizes(plan)):
            rank_plan = plan.for_rank(r)
            present |= _assert_same_sizes(sizes, rank_sizes(rank_plan))
            relayed |= sizes.relay_splits is not None
            keys.add(sizes_key(sizes))
            assert (ops.forward[r], ops.backward[r]) == rank_layer_ops(rank_plan)
    assert present == {"local", "remote", "heads"} and relayed  # every entry set and a relay were compared
    assert len(keys) > 8  # the ranks differ


def test_the_sizes_key_sees_each_field_the_op_lists_read():
    import dataclasses

    _, plan = next(_real_plans())
    sizes = next(s for s in pool_rank_sizes(plan) if s.local is not None and s.remote is not None)
    base = sizes_key(sizes)
    lens = dataclasses.replace(sizes.local, q_lens=sizes.local.q_lens + (1,), k_lens=sizes.local.k_lens + (1,))
    for change in (dict(q_lens=sizes.q_lens + (1,)), dict(k_lens=sizes.k_lens[:-1]), dict(kv_target_len=0),
                   dict(kv_rows_read=not sizes.kv_rows_read), dict(local=lens), dict(remote=None),
                   dict(kv_splits=sizes.q_splits), dict(q_splits=sizes.kv_splits)):
        assert sizes_key(dataclasses.replace(sizes, **change)) != base, change
