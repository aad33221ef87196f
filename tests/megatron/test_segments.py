"""Segment recovery from GPTDataset index metadata vs. scanning the EOD tokens of the real samples."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_megatron.megatron.segments import gpt_sample_segments, scan_eod_segments

from conftest import LINUX_TRACE, SEQ_LENGTH, TRACE_EOD, TRACE_VOCAB


def _scan_reference(tokens, eod):
    """Brute-force loop: close a segment after every EOD and at the end."""
    out, run = [], 0
    for t in tokens:
        run += 1
        if t == eod:
            out.append(run)
            run = 0
    if run:
        out.append(run)
    return out


def test_scan_eod_segments_hand_cases():
    assert scan_eod_segments([4, 9, 4, 4, 9], 9).tolist() == [2, 3]
    assert scan_eod_segments([4, 9, 4], 9).tolist() == [2, 1]
    assert scan_eod_segments([9, 9], 9).tolist() == [1, 1]
    assert scan_eod_segments([], 9).tolist() == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40))
def test_scan_eod_segments_matches_loop(tokens):
    assert scan_eod_segments(np.asarray(tokens, dtype=np.int64), 0).tolist() == _scan_reference(tokens, 0)


def _assert_metadata_matches_tokens(dataset, indices, eod):
    long_docs = 0
    for i in indices:
        tokens = dataset[int(i)]["tokens"].numpy()
        segments = gpt_sample_segments(dataset, int(i))
        assert segments.tolist() == _scan_reference(tokens.tolist(), eod), f"sample {i}"
        assert int(segments.sum()) == SEQ_LENGTH and (segments > 0).all()
        long_docs += segments.size == 1 and tokens[-1] != eod  # a piece of a document longer than L
    return long_docs


def test_trace_corpus_has_the_trace_lengths_and_eod_only_at_document_ends(trace_corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from libra_megatron.plan.traces import load_trace

    indexed = IndexedDataset(trace_corpus.prefix)
    assert indexed.sequence_lengths.tolist() == load_trace(LINUX_TRACE)[:400].tolist()
    for doc in (0, 1, 57, 399):
        tokens = indexed.get(doc)
        assert np.flatnonzero(tokens == TRACE_EOD).tolist() == [tokens.size - 1]


def test_segments_from_metadata_equal_eod_scan_on_stdlib_corpus(stdlib_gpt_dataset, stdlib_corpus):
    assert not stdlib_corpus.synthetic_tokens
    long_docs = _assert_metadata_matches_tokens(stdlib_gpt_dataset, range(len(stdlib_gpt_dataset)),
                                                stdlib_corpus.eod)
    assert long_docs > 0


def test_segments_from_metadata_equal_eod_scan_on_trace_corpus_over_epochs(trace_gpt_dataset):
    indices = np.random.default_rng(0).choice(len(trace_gpt_dataset), size=1500, replace=False)
    assert len(trace_gpt_dataset) >= 16384  # several epochs of the 400-document corpus
    assert _assert_metadata_matches_tokens(trace_gpt_dataset, indices, TRACE_EOD) > 0


def test_segments_from_metadata_equal_eod_scan_on_blended_dataset(blended_gpt_dataset):
    assert hasattr(blended_gpt_dataset, "dataset_index")
    assert set(np.unique(blended_gpt_dataset.dataset_index).tolist()) == {0, 1}
    _assert_metadata_matches_tokens(blended_gpt_dataset, range(0, len(blended_gpt_dataset), 2), TRACE_EOD)


def test_segments_without_extra_token(trace_corpus):
    from libra_megatron.megatron.corpus import build_gpt_dataset

    dataset = build_gpt_dataset(trace_corpus.prefix, SEQ_LENGTH, 2000, seed=5, vocab_size=TRACE_VOCAB,
                                eod=TRACE_EOD, add_extra_token_to_sequence=False)
    assert not dataset.config.add_extra_token_to_sequence
    _assert_metadata_matches_tokens(dataset, range(0, len(dataset), 3), TRACE_EOD)
