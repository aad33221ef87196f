"""VRSP global-batch sampler over real GPTDatasets: window multisets, cross-rank agreement, exact resume."""
from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_megatron.config import LibraConfig, SequencePlacement
from libra_megatron.megatron.sampler import (
    LibraGlobalBatchSampler,
    build_libra_data_loader,
    decode_pool_segments,
    encode_pool_segments,
)
from libra_megatron.megatron.segments import gpt_sample_segments, scan_eod_segments

from conftest import SEQ_LENGTH, TRACE_EOD

DP, POOL, GBS = 4, 2, 8


def _sampler(dataset, rank, consumed=0, total=None, placement=LibraConfig().sequence_placement, loader="single",
             dp=DP, pool=POOL, gbs=GBS):
    total = len(dataset) if total is None else total
    return LibraGlobalBatchSampler(dataset, total, consumed, 1, gbs, rank, dp, pool, placement, loader, seed=3)


def _all_ranks(dataset, **kw):
    return [[batch[0] for batch in _sampler(dataset, r, **kw)] for r in range(kw.get("dp", DP))]


def _pool_load_ratio(keys_by_rank, pool):
    """Mean over windows of max/mean pool load (Eq. 4: sum of squared segment lengths) from yielded metadata."""
    loads = defaultdict(dict)
    for rank, keys in enumerate(keys_by_rank):
        for key in keys:
            loads[key.window][(key.ga_index, rank // pool)] = sum(
                float(np.dot(row, row)) for row in map(np.asarray, key.pool_segments))
    return float(np.mean([max(v.values()) / np.mean(list(v.values())) for v in loads.values()]))


@pytest.fixture(scope="module")
def placed_run(trace_gpt_dataset):
    return _all_ranks(trace_gpt_dataset)


def test_every_window_is_its_gbs_indices_each_once_across_ranks(placed_run, trace_gpt_dataset):
    num_windows = len(trace_gpt_dataset) // GBS
    assert num_windows >= 2000
    by_window = defaultdict(list)
    for keys in placed_run:
        assert len(keys) == num_windows * GBS // DP
        for key in keys:
            by_window[key.window].append(key.sample_index)
    assert sorted(by_window) == list(range(num_windows))
    for v, indices in by_window.items():
        assert sorted(indices) == list(range(v * GBS, (v + 1) * GBS))


def test_pool_metadata_identical_on_every_rank_of_a_pool(placed_run, trace_gpt_dataset):
    rows = {}
    for rank, keys in enumerate(placed_run):
        for key in keys:
            assert key.pool_position == rank % POOL and len(key.pool_segments) == POOL
            rows.setdefault((key.window, key.ga_index, rank // POOL), {})[key.pool_position] = key
    assert len(rows) == (len(trace_gpt_dataset) // GBS) * (GBS // DP) * (DP // POOL)
    for members in rows.values():
        assert sorted(members) == list(range(POOL))
        first = members[0].pool_segments
        for p, key in members.items():
            assert key.pool_segments == first
            assert list(first[p]) == gpt_sample_segments(trace_gpt_dataset, key.sample_index).tolist()


def test_pool_segments_match_eod_scan_of_the_loaded_tokens(placed_run, trace_gpt_dataset):
    for key in placed_run[1][::97]:
        tokens = trace_gpt_dataset[key.sample_index]["tokens"].numpy()
        assert list(key.pool_segments[key.pool_position]) == scan_eod_segments(tokens, TRACE_EOD).tolist()


@pytest.fixture(scope="module")
def refined_run_800(trace_gpt_dataset):
    return _all_ranks(trace_gpt_dataset, total=800 * GBS, placement=SequencePlacement.REFINED)


def test_vrsp_lowers_pool_imbalance_versus_contiguous(placed_run, refined_run_800, trace_gpt_dataset):
    """Per instance for refined; per lane for the default (sync), which cuts a lane's pools like with like."""
    total = 800 * GBS
    contiguous = _all_ranks(trace_gpt_dataset, total=total, placement=SequencePlacement.CONTIGUOUS)
    placed = [[k for k in keys if k.window < 800] for keys in placed_run]
    def window_multisets(run):
        return sorted((k.window, k.sample_index) for keys in run for k in keys)

    assert window_multisets(contiguous) == window_multisets(refined_run_800) == window_multisets(placed)
    assert _pool_load_ratio(refined_run_800, POOL) < _pool_load_ratio(contiguous, POOL)
    assert _lane_load_ratio(placed, POOL) < _lane_load_ratio(contiguous, POOL)


def _lane_load_ratio(keys_by_rank, pool):
    """Mean over windows of max/mean lane load: a lane (ranks r // P) summed over its GA steps (Eq. 4)."""
    loads = defaultdict(lambda: defaultdict(float))
    for rank, keys in enumerate(keys_by_rank):
        for key in keys:
            row = np.asarray(key.pool_segments[key.pool_position], dtype=np.float64)
            loads[key.window][rank // pool] += float(np.dot(row, row))
    return float(np.mean([max(v.values()) / np.mean(list(v.values())) for v in loads.values()]))


def test_sync_placement_moves_sequences_between_ga_steps_and_balances_lane_totals(placed_run, refined_run_800):
    """The default (sync) at DP=4, P=2, GBS=8: 2 lanes x 2 GA steps. Its lanes are better balanced than the
    per-instance refined order's, and it runs sequences at other GA steps than the sampler order (which
    runs window position n at GA step n // DP)."""
    windows = 800
    placed = [[k for k in keys if k.window < windows] for keys in placed_run]
    assert _lane_load_ratio(placed, POOL) < _lane_load_ratio(refined_run_800, POOL)
    moved = sum(k.ga_index != (k.sample_index - k.window * GBS) // DP for keys in placed for k in keys)
    assert moved > 0.1 * windows * GBS


@pytest.fixture(scope="module")
def short_single_run(trace_gpt_dataset):
    return _all_ranks(trace_gpt_dataset, total=50 * GBS + 5)


@settings(max_examples=12, deadline=None)
@given(steps=st.integers(0, 50 * GBS // DP - 1), rank=st.integers(0, DP - 1))
def test_single_resume_yields_exact_suffix(short_single_run, trace_gpt_dataset, steps, rank):
    resumed = [b[0] for b in _sampler(trace_gpt_dataset, rank, consumed=steps * DP, total=50 * GBS + 5)]
    assert resumed == short_single_run[rank][steps:]


def _cyclic_run(dataset, rank, consumed, total, epochs_until):
    sampler = _sampler(dataset, rank, consumed=consumed, total=total, loader="cyclic")
    out = []
    while sampler.consumed_samples < epochs_until:
        out.extend(b[0] for b in sampler)
    return out, sampler.consumed_samples


CYCLIC_TOTAL = 101  # 12 windows of 8 per epoch, 5 samples dropped per epoch


def test_cyclic_epochs_are_permutations_and_windows_partition_across_ranks(trace_gpt_dataset):
    per_rank = [_cyclic_run(trace_gpt_dataset, r, 0, CYCLIC_TOTAL, 3 * 96) for r in range(DP)]
    assert all(consumed == 3 * 96 for _, consumed in per_rank)
    by_window = defaultdict(list)
    for keys, _ in per_rank:
        for key in keys:
            by_window[key.window].append(key.sample_index)
    assert sorted(by_window) == list(range(36))
    for epoch in range(3):  # the documented epoch permutation, cut into 12 windows of GBS
        perm = np.random.default_rng([3, epoch]).permutation(CYCLIC_TOTAL)
        seen = []
        for w in range(12):
            window = by_window[epoch * 12 + w]
            assert sorted(window) == sorted(perm[w * GBS:(w + 1) * GBS].tolist())
            seen.extend(window)
        assert len(set(seen)) == 96
    assert sorted(by_window[0]) != sorted(by_window[12])  # epochs reshuffle


@settings(max_examples=8, deadline=None)
@given(steps=st.integers(0, 3 * 96 // DP - 1), rank=st.integers(0, DP - 1))
def test_cyclic_resume_yields_exact_suffix(trace_gpt_dataset, steps, rank):
    full, _ = _cyclic_run(trace_gpt_dataset, rank, 0, CYCLIC_TOTAL, 3 * 96)
    resumed, _ = _cyclic_run(trace_gpt_dataset, rank, steps * DP, CYCLIC_TOTAL, 3 * 96)
    assert resumed == full[steps:]


@pytest.mark.parametrize(
    "kwargs,needle",
    [(dict(mbs=2), "--micro-batch-size 1"), (dict(gbs=10), "--global-batch-size 10 must be divisible by DP*mbs = 4*1"),
     (dict(pool=3), "--libra-pool-size 3 must divide the data-parallel size 4 (4 % 3 = 1)"),
     (dict(consumed=6), "consumed_samples 6 must be a non-negative multiple of DP*mbs = 4 (6 % 4 = 2)"),
     (dict(loader="external"), "--dataloader-type 'external'")],
)
def test_sampler_rejects_bad_arguments_naming_the_flag(trace_gpt_dataset, kwargs, needle):
    args = dict(mbs=1, gbs=GBS, pool=POOL, consumed=0, loader="single") | kwargs
    with pytest.raises(ValueError) as err:
        LibraGlobalBatchSampler(trace_gpt_dataset, 1000, args["consumed"], args["mbs"], args["gbs"], 0, DP,
                                args["pool"], dataloader_type=args["loader"])
    assert needle in str(err.value)


def test_pool_segments_encoding_round_trips():
    rows = [(5, 3), (8,), (1, 1, 6)]
    encoded = encode_pool_segments(rows)
    assert encoded.tolist() == [[5, 3, -1], [8, -1, -1], [1, 1, 6]]
    assert [r.tolist() for r in decode_pool_segments(encoded[None])] == [list(r) for r in rows]


def test_data_loader_yields_dataset_samples_with_pool_metadata(trace_gpt_dataset):
    from libra_megatron.megatron.sampler import pool_proxy_from_args, sync_layout_from_args

    args = argparse.Namespace(micro_batch_size=1, global_batch_size=GBS, dataloader_type="single", seed=3,
                              num_workers=0, seq_length=SEQ_LENGTH, num_attention_heads=4, hidden_size=64)
    config = LibraConfig(pool_size=POOL)
    loader = build_libra_data_loader(trace_gpt_dataset, 2 * GBS, args, config=config, data_parallel_rank=3,
                                     data_parallel_size=DP)
    # the loader's sampler: Megatron's layout (PP = 1, two lanes of GA = 2) and its pools priced by the proxy
    sampler = LibraGlobalBatchSampler(trace_gpt_dataset, len(trace_gpt_dataset), 2 * GBS, 1, GBS, 3, DP, POOL,
                                      config.sequence_placement, "single", 3,
                                      sync_layout=sync_layout_from_args(args, DP, POOL),
                                      pool_proxy=pool_proxy_from_args(args, POOL))
    keys = [b[0] for b in sampler][:5]
    for batch, key in zip(loader, keys):
        expected = trace_gpt_dataset[key.sample_index]
        assert batch["tokens"].shape == (1, expected["tokens"].numel())
        assert batch["tokens"][0].tolist() == expected["tokens"].tolist()
        assert [r.tolist() for r in decode_pool_segments(batch["libra_pool_segments"])] == [
            list(r) for r in key.pool_segments]
        assert batch["libra_pool_position"].tolist() == [3 % POOL] and batch["libra_window"].tolist() == [key.window]
        assert batch["libra_ga_index"].tolist() == [key.ga_index]


def test_sync_layout_from_megatron_args_places_ep_groups_by_rank_order():
    from libra_megatron.megatron.sampler import sync_layout_from_args

    moe = argparse.Namespace(global_batch_size=128, micro_batch_size=1, pipeline_model_parallel_size=2,
                             virtual_pipeline_model_parallel_size=None, tensor_model_parallel_size=4,
                             context_parallel_size=8, num_experts=128, expert_model_parallel_size=32,
                             expert_tensor_parallel_size=1)  # configs/qwen3-235b-a22b-256k.args at DP=8
    layout = sync_layout_from_args(moe, 8, 8)
    assert (layout.num_microbatches, layout.pipeline_parallel_size, layout.virtual_pipeline_size) == (16, 2, 1)
    assert (layout.expert_parallel_size, layout.tensor_parallel_size) == (32, 4) and not layout.ep_ties_lanes
    wide = argparse.Namespace(**{**vars(moe), "expert_model_parallel_size": 64, "context_parallel_size": 1,
                                 "tensor_model_parallel_size": 1, "expert_tensor_parallel_size": None})
    tied = sync_layout_from_args(wide, 128, 8)  # EP 64 over replicas of 1 GPU: 8 pools per EP group
    assert tied.expert_tensor_parallel_size == 1 and tied.ep_ties_lanes
    dense = argparse.Namespace(**{**vars(moe), "num_experts": None})
    assert sync_layout_from_args(dense, 8, 8).expert_parallel_size == 1  # no experts: EP does not tie anything


def test_pool_proxy_from_megatron_args_reads_heads_per_tp_rank():
    from libra_megatron.megatron.sampler import pool_proxy_from_args

    args = argparse.Namespace(tensor_model_parallel_size=4, num_attention_heads=64, group_query_attention=True,
                              num_query_groups=4, kv_channels=128, hidden_size=4096, bf16=True, fp16=False,
                              context_parallel_size=8, seq_length=262144)  # configs/qwen3-235b-a22b-256k.args
    proxy = pool_proxy_from_args(args, 8)
    assert (proxy.pool_size, proxy.context_parallel_size, proxy.seq_len, proxy.num_q_heads, proxy.num_kv_heads,
            proxy.head_dim, proxy.elem_bytes) == (8, 8, 262144, 16, 1, 128, 2)
    plain = argparse.Namespace(**{**vars(args), "group_query_attention": False, "kv_channels": None, "bf16": False,
                                  "tensor_model_parallel_size": 1})
    proxy = pool_proxy_from_args(plain, 2)  # no GQA: a kv head per query head; fp32; head dim = hidden / heads
    assert (proxy.num_q_heads, proxy.num_kv_heads, proxy.head_dim, proxy.elem_bytes) == (64, 64, 64, 4)
    wide = argparse.Namespace(**{**vars(args), "tensor_model_parallel_size": 8})  # 4 K/V groups over 8 TP ranks
    with pytest.raises(ValueError, match=r"--num-query-groups 4 must be divisible by --tensor-model-parallel-size 8"):
        pool_proxy_from_args(wide, 8)  # not one K/V head per rank, silently (Megatron-LM refuses it too)


def test_sampler_prices_candidate_pools_at_pp2(trace_gpt_dataset):
    """With a PP > 1 sync layout and a pool proxy, every window's order is ``place_sequences`` with the proxy's
    prices of that window's documents, on every rank alike; the multiset is kept."""
    from libra_megatron.plan.model import sequence_flops
    from libra_megatron.plan.sequences import PoolProxy, SequenceStats, SyncLayout, place_sequences

    dp, pool, gbs = 8, 2, 32  # 4 lanes x GA 4
    layout = SyncLayout(dp, pool, gbs // dp, pipeline_parallel_size=2)
    proxy = PoolProxy(pool, 2, 2048, 4, 2, 16)
    samplers = [LibraGlobalBatchSampler(trace_gpt_dataset, len(trace_gpt_dataset), 0, 1, gbs, rank, dp, pool,
                                        SequencePlacement.SYNC, "single", seed=3, sync_layout=layout, pool_proxy=proxy)
                for rank in (0, 5)]
    differs = 0
    for window in range(4):
        plans = [s.plan_window(window) for s in samplers]
        indices = samplers[0].window_indices(window)
        segments = [np.asarray(gpt_sample_segments(trace_gpt_dataset, int(i))) for i in indices]
        stats = SequenceStats.of(segments)
        expected = place_sequences(stats.flops, pool, SequencePlacement.SYNC, layout, proxy.pricer(stats))
        for plan in plans:
            assert plan.sample_indices.tolist() == indices[expected].tolist()
        assert sorted(plans[0].sample_indices.tolist()) == sorted(indices.tolist())
        f_only = place_sequences(sequence_flops(segments), pool, SequencePlacement.SYNC, layout)
        differs += not np.array_equal(f_only, expected)
    assert differs >= 1  # the prices change the order somewhere (the proxy is read, not ignored)
