"""Libra batch construction: CP shards vs TokenLayout and megatron-core, per-segment positions, cu_seqlens."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_megatron.config import TokenLayoutKind
from libra_megatron.megatron.batch import (
    LibraPackedSeqParams,
    build_libra_batch,
    cp_shard_indices,
    segment_position_ids,
)
from libra_megatron.megatron.segments import gpt_sample_segments


@settings(max_examples=60, deadline=None)
@given(cp=st.integers(1, 8), per_chunk=st.integers(1, 9), kind=st.sampled_from(list(TokenLayoutKind)))
def test_cp_shard_indices_are_the_contiguous_or_zigzag_chunks(cp, per_chunk, kind):
    zigzag = kind is TokenLayoutKind.ZIGZAG and cp > 1
    size = per_chunk if zigzag else 2 * per_chunk
    seq_len = size * (2 * cp if zigzag else cp)
    for c in range(cp):
        want = list(range(c * size, (c + 1) * size))
        if zigzag:  # hand reference of Megatron's split: chunks c and 2*CP-1-c
            want += list(range((2 * cp - 1 - c) * size, (2 * cp - c) * size))
        assert cp_shard_indices(seq_len, cp, c, kind).tolist() == want


def test_cp_shard_indices_error_names_the_flags():
    with pytest.raises(ValueError, match=r"--seq-length 12 must be divisible by 8 CP chunks \(--libra-token-layout=zigzag"):
        cp_shard_indices(12, 4, 0, "zigzag")


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_shards_match_megatron_get_batch_on_this_cp_rank(monkeypatch, cp):
    import megatron.core.utils as mcore_utils

    seq_len = 8 * cp
    tokens = torch.arange(seq_len)[None] * 10
    for rank in range(cp):
        monkeypatch.setattr(mcore_utils.parallel_state, "get_context_parallel_world_size", lambda: cp)
        monkeypatch.setattr(mcore_utils.parallel_state, "get_context_parallel_rank", lambda r=rank: r)
        reference = mcore_utils.get_batch_on_this_cp_rank({"tokens": tokens.clone()})["tokens"]
        ours = tokens[0, torch.from_numpy(cp_shard_indices(seq_len, cp, rank, "zigzag"))][None]
        assert torch.equal(ours, reference)


def test_segment_position_ids_hand_case():
    assert segment_position_ids([3, 2, 1]).tolist() == [0, 1, 2, 0, 1, 0]


def test_batch_from_real_samples_matches_gptdataset_positions_and_reassembles(trace_gpt_dataset):
    # trace_gpt_dataset is built with reset_position_ids=True: its position_ids restart after every EOD,
    # an independent reference for positions derived from the metadata segments.
    for index in (0, 5, 123, 4000, 16000):
        sample = trace_gpt_dataset[index]
        segments = gpt_sample_segments(trace_gpt_dataset, index)
        for layout, cp in ((TokenLayoutKind.ZIGZAG, 4), (TokenLayoutKind.CONTIGUOUS, 2), (TokenLayoutKind.ZIGZAG, 1)):
            parts = [build_libra_batch(sample, segments, cp, c, layout) for c in range(cp)]
            cu = parts[0]["cu_seqlens"]
            assert cu.dtype == torch.int32 and np.diff(cu.numpy()).tolist() == segments.tolist()
            assert int(cu[0]) == 0 and int(cu[-1]) == sample["tokens"].numel()
            assert parts[0]["max_seqlen"] == int(segments.max())
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                whole = torch.empty_like(sample[key] if key != "position_ids" else sample["tokens"])
                for part in parts:
                    assert part[key].shape == (1, sample["tokens"].numel() // cp)
                    whole[part["local_to_global"]] = part[key][0].to(whole.dtype)
                assert torch.equal(whole, sample[key]), key


def test_batch_accepts_collated_samples_and_rejects_inconsistent_segments():
    sample = {"tokens": torch.arange(8)[None], "labels": torch.arange(1, 9)[None], "loss_mask": torch.ones(1, 8)}
    out = build_libra_batch(sample, [5, 3], 2, 1, "zigzag")
    assert out["tokens"].tolist() == [[2, 3, 4, 5]] and out["position_ids"].tolist() == [[2, 3, 4, 0]]
    with pytest.raises(ValueError, match="sum to the sample length 8, got 2 segments summing to 7"):
        build_libra_batch(sample, [5, 2], 2, 0, "zigzag")
    with pytest.raises(ValueError, match=r"--seq-length 8 must be divisible by 6 CP chunks .*8 % 6 = 2"):
        build_libra_batch(sample, [5, 3], 3, 0, "zigzag")


def test_packed_seq_params_subclass_carries_the_plan_explicitly():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    params = LibraPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5,
                                  max_seqlen_kv=5, libra_plan="plan", libra_pool_segments=[np.array([5, 3])],
                                  libra_position=1)
    assert isinstance(params, PackedSeqParams) and params.libra_plan == "plan" and params.libra_position == 1
    assert LibraPackedSeqParams().libra_plan is None
