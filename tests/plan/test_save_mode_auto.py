"""save_mode=auto (issue 24): the budget covers the layers whose tensors are alive at once, and arranged -- what auto
keeps whenever it fits -- is never slower than refetch under the whole-step model on real pools."""
from __future__ import annotations

import numpy as np
import pytest

from libra_megatron.config import KvFetch, SaveModeName, TilePlacement, TilingPolicy, TokenLayoutKind
from libra_megatron.plan.exchange import plan_layer_timing
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.model import StepTimeModel, choose_save_mode, saved_layers
from libra_megatron.plan.model.memory import GIB
from libra_megatron.plan.tiles import build_tiles, place_tiles
from libra_megatron.testing.traces import packed_trace_segments


@pytest.mark.parametrize("granularity, method, n, stage, want", [
    (None, None, None, 48, 48),  # no recompute: every layer of the stage keeps its tensors
    ("selective", None, None, 24, 24),
    ("full", "uniform", 1, 48, 1),  # the shipped configs: one layer recomputed at a time
    ("full", None, 4, 48, 4),  # Megatron-LM's default method is uniform
    ("full", "uniform", 64, 12, 12),  # no more than the stage has
    ("full", "block", 6, 24, 19),  # 18 layers keep theirs, plus the one being recomputed
    ("full", "block", 24, 24, 1),
])
def test_saved_layers_follows_megatron_recompute(granularity, method, n, stage, want):
    assert saved_layers(stage, granularity, method, n) == want


@pytest.mark.parametrize("args, flag", [((0,), "layers per pipeline stage"),
                                        ((8, "full", "uniform", 0), "--recompute-num-layers 0"),
                                        ((8, "full", "interleaved", 1), "--recompute-method 'interleaved'"),
                                        ((8, "partial"), "--recompute-granularity 'partial'")])
def test_saved_layers_rejects_bad_flags_by_name(args, flag):
    with pytest.raises(ValueError, match=flag):
        saved_layers(*args)


def test_full_recompute_turns_a_refetch_budget_into_arranged():
    """The case the 16 GiB default got wrong on every shipped config: 0.6 GiB per layer x 48 layers does not fit,
    one recomputed layer does."""
    per_layer = np.array([int(0.6 * GIB), int(0.5 * GIB)])
    assert choose_save_mode("auto", per_layer, 16.0, saved_layers(48)) is SaveModeName.REFETCH
    assert choose_save_mode("auto", per_layer, 16.0, saved_layers(48, "full", "uniform", 1)) is SaveModeName.ARRANGED


def test_the_relay_inverse_buffer_counts_once_on_top_of_the_saved_layers():
    """7 layers x 2 GiB = 14 GiB fits 16 GiB; the backward's one transient 3 GiB (a dK|dV kept for its relay inverse,
    ``deferred_relay_bytes``) on the same rank does not (17 GiB), on another rank it does (1 x 7 + 3 = 10)."""
    per_layer = np.array([1 * int(GIB), 2 * int(GIB)])
    assert choose_save_mode("auto", per_layer, 16.0, 7) is SaveModeName.ARRANGED
    assert choose_save_mode("auto", per_layer, 16.0, 7, np.array([0, 3 * int(GIB)])) is SaveModeName.REFETCH
    assert choose_save_mode("auto", per_layer, 16.0, 7, np.array([3 * int(GIB), 0])) is SaveModeName.ARRANGED


def _real_pools(name, seq_len, cp, num_pools, seed):
    rng = np.random.default_rng(seed)
    segs = packed_trace_segments(rng, 2 * num_pools, seq_len, name=name)
    return [segs[2 * i:2 * i + 2] for i in range(num_pools)]


@pytest.mark.parametrize("trace", ["linux-6.12-files.qwen.txt", "wikipedia-flexsp.txt"])
def test_arranged_backward_is_never_slower_than_refetch_on_real_pools(trace):
    """Why auto keeps the arranged tensors whenever they fit: priced as the runtime runs both (every rank's op list,
    peers coupled), arranged's backward is no slower on any rank's finish, and strictly faster where anything
    moves (refetch re-sends Q, K|V and O). Pools of 2 packed 32K sequences x CP 4 on two 4-GPU nodes."""
    heads = HeadLayout(16, 2, 64, head_split=2, num_chunks=2, elem_bytes=2)
    layout = TokenLayout(TokenLayoutKind.ZIGZAG, 32768, 4)
    model = StepTimeModel(64, gpus_per_node=4, kv_relay=True)
    for pool in _real_pools(trace, 32768, 4, 3, seed=7):
        tiles = build_tiles(pool, layout, heads, 1024, tiling=TilingPolicy.ADAPTIVE, tau=0.03,
                            kv_fetch=KvFetch.PREFIX)
        plan = place_tiles(tiles, 0.03, TilePlacement.DENSE, timing=model).exchange
        arranged = plan_layer_timing(plan, model, "arranged").backward
        refetch = plan_layer_timing(plan, model, "refetch").backward
        assert arranged.seconds.max() < refetch.seconds.max(), (trace, arranged.seconds.max(), refetch.seconds.max())
        assert np.all(arranged.seconds <= refetch.seconds * (1 + 1e-12)), trace
        assert arranged.link.sum() < refetch.link.sum()
