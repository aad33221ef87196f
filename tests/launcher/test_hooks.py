"""LibraHooks helpers that need no Megatron-LM: layout checks, pool metadata decoding, the TP broadcast."""
import argparse

import numpy as np
import pytest
import torch

from libra_megatron.config import LibraConfig
from libra_megatron.megatron.hooks import _pool_metadata, carrier_format, check_supported_layout
from libra_megatron.testing.dist import run_distributed

from .hooks_workers import broadcast_sample_body


def _args(**kw):
    base = dict(pipeline_model_parallel_size=1, dataloader_type="single", hybrid_context_parallel=False,
                attention_dropout=0.0, multi_latent_attention=False, spec=["libra_megatron.megatron.spec",
                                                                           "libra_te_spec"])
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("kw, pattern", [
    (dict(dataloader_type="external"), r"^--dataloader-type external"),
    (dict(hybrid_context_parallel=True), r"^--hybrid-context-parallel"),
    (dict(attention_dropout=0.1), r"^--attention-dropout 0.1: .*default is 0.1 .*pass --attention-dropout 0$"),
    (dict(multi_latent_attention=True), r"^--multi-latent-attention: .*not MLA"),
    (dict(spec=None), r"^--spec is not given: .*--spec libra_megatron.megatron.spec libra_gpt_spec"),
    (dict(context_parallel_size=2, reset_position_ids=True), r"^--reset-position-ids with --context-parallel-size 2"),
    (dict(dynamic_context_parallel=True), r"^--dynamic-context-parallel cannot be combined with Libra sequence pools"),
    (dict(dataloader_inter_document_masking=True), r"^--dataloader-inter-document-masking: .*drop the flag$"),
    (dict(attention_backend=type("AttnBackend", (), {"name": "local"})()), r"^--attention-backend local: "),
    (dict(attention_backend="local"), r"^--attention-backend local: "),
])
def test_unsupported_layouts_are_rejected_naming_the_flag(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_supported_layout(_args(**kw))


@pytest.mark.parametrize("kw", [dict(), dict(pipeline_model_parallel_size=2), dict(pipeline_model_parallel_size=8),
                                dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
                                dict(dataloader_type="cyclic"),
                                dict(dataloader_type=None), dict(attention_dropout=0.0, hidden_dropout=0.1),
                                dict(context_parallel_size=1, reset_position_ids=True),
                                dict(dataloader_inter_document_masking=False, dynamic_context_parallel=False),
                                dict(attention_backend=type("AttnBackend", (), {"name": "auto"})())])
def test_supported_layouts_pass(kw):
    check_supported_layout(_args(**kw))


@pytest.mark.parametrize("kw, layout, pattern", [
    (dict(context_parallel_size=2, reset_position_ids=True), "zigzag", r"--reset-position-ids with --context-parallel-size 2"),
    (dict(context_parallel_size=4), "contiguous", r"--libra-token-layout contiguous with --context-parallel-size 4"),
])
def test_rope_layouts_megatron_core_cannot_apply_are_rejected(kw, layout, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_supported_layout(_args(**kw), LibraConfig(token_layout=layout))


@pytest.mark.parametrize("kw, layout, expected_format", [
    (dict(context_parallel_size=1, reset_position_ids=True), "contiguous", "thd"),
    (dict(context_parallel_size=1), "contiguous", "sbhd"),
    (dict(context_parallel_size=8), "zigzag", "sbhd"),
])
def test_supported_rope_layouts_pick_the_carrier(kw, layout, expected_format):
    args = _args(**kw)
    check_supported_layout(args, LibraConfig(token_layout=layout))
    assert carrier_format(args) == expected_format


def test_pool_metadata_drops_padding_and_batch_dim():
    sample = {"libra_pool_segments": torch.tensor([[[3, 4, -1], [7, -1, -1], [1, 2, 4]]]),
              "libra_pool_position": torch.tensor([2])}
    segments, position = _pool_metadata(sample)
    assert position == 2
    assert [s.tolist() for s in segments] == [[3, 4], [7], [1, 2, 4]]
    assert all(s.dtype == np.int64 for s in segments)


def test_tp_broadcast_gives_every_rank_rank0s_sample():
    results = run_distributed(broadcast_sample_body, 2, timeout=120)
    assert results[0] == results[1]
    assert results[1]["tokens"] == [list(range(12))]
    assert results[1]["loss_mask"] == [[1.0] * 10 + [0.0] * 2]
    assert results[1]["libra_pool_segments"] == [[[5, 7, -1], [12, -1, -1]]]
    assert results[1]["libra_pool_position"] == [1]
    assert "unrelated_key" not in results[1]


class _FakeSampler:
    """The attributes of LibraGlobalBatchSampler that ``_window_metrics`` reads; windows of 4 samples."""

    pool_size = 2
    data_parallel_size = 4  # GBS 4 = one GA step: the two lanes are the two pool instances
    sequence_placement = "alg1"
    dataset = [[8], [6, 2], [3], [1, 1]]  # segment lengths of samples 0..3 -> Eq. 4 flops 64, 40, 9, 2

    def placement_order(self, segments):  # the sampler's: the window's document lengths in, its order out
        from libra_megatron.plan.model import sequence_flops
        from libra_megatron.plan.sequences import place_sequences

        return place_sequences(sequence_flops(segments), self.pool_size, self.sequence_placement)

    def window_indices(self, window):
        return np.arange(window * 4, window * 4 + 4)

    @staticmethod
    def segments_fn(dataset, index):
        return np.asarray(dataset[index % 4])


def test_window_metrics_are_inter_pool_r1_of_the_last_trained_window():
    from libra_megatron.megatron.hooks import _window_metrics

    args = argparse.Namespace(consumed_train_samples=8, global_batch_size=4)  # window 1 just trained
    values = _window_metrics(_FakeSampler(), args)
    # sampler order: pools {64, 40} = 104 and {9, 2} = 11 (mean 57.5); exact-cardinality LPT (Alg. 1):
    # 64 -> A, 40 -> B, 9 -> B (49, full), 2 -> A (66)
    assert values["inter_pool_r1_before"] == pytest.approx(104 / 57.5 - 1)
    assert values["inter_pool_r1_after"] == pytest.approx(66 / 57.5 - 1)
    assert values["lane_r1_before"] == pytest.approx(104 / 57.5 - 1)  # one GA step: lanes = instances
    assert values["lane_r1_after"] == pytest.approx(66 / 57.5 - 1)
    assert _window_metrics(_FakeSampler(), argparse.Namespace(consumed_train_samples=0, global_batch_size=4)) == {}
    assert _window_metrics(None, args) == {}
