"""Packing (plan/packing.py) against token-level brute force and best-fit-decreasing by exhaustive scan."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from libra_megatron.config import PackingMode
from libra_megatron.plan.packing import best_fit_padding, num_packed_upper_bound, pack_documents, packing_memory_bytes

doc_lists = st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=30)


def _megatron_brute_force(doc_lens, seq_len, seed):
    """Token-level GPTDataset: a stream of document ids, cut every seq_len tokens, run-length per cut."""
    lens = np.asarray(doc_lens, dtype=np.int64)
    lens = lens[lens > 0]
    perm = np.random.default_rng(seed).permutation(lens.size)
    stream = [doc for doc in perm.tolist() for _ in range(int(lens[doc]))]
    out = []
    for k in range(len(stream) // seq_len):
        piece = stream[k * seq_len:(k + 1) * seq_len]
        runs, count = [], 1
        for prev, cur in zip(piece, piece[1:]):
            if cur == prev:
                count += 1
            else:
                runs.append(count)
                count = 1
        runs.append(count)
        out.append(runs)
    return out


@settings(max_examples=60, deadline=None)
@given(doc_lens=doc_lists, seq_len=st.integers(min_value=1, max_value=50), seed=st.integers(0, 10))
def test_megatron_packing_matches_token_level_brute_force(doc_lens, seq_len, seed):
    got = pack_documents(doc_lens, seq_len, PackingMode.MEGATRON, seed)
    assert [g.tolist() for g in got] == _megatron_brute_force(doc_lens, seq_len, seed)
    assert all(int(g.sum()) == seq_len and g.min() > 0 for g in got)
    total = sum(doc_lens)
    assert len(got) == total // seq_len  # only the trailing partial sequence is dropped


def test_megatron_packing_is_deterministic_by_seed():
    docs = np.arange(1, 200) * 7 % 97 + 1
    a = pack_documents(docs, 256, "megatron", seed=3)
    b = pack_documents(docs, 256, "megatron", seed=3)
    c = pack_documents(docs, 256, "megatron", seed=4)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert [x.tolist() for x in a] != [x.tolist() for x in c]


def _bfd_brute_force(doc_lens, seq_len):
    """Exhaustive best-fit-decreasing: returns (sorted fill levels, pieces)."""
    pieces = []
    for length in doc_lens:
        while length > seq_len:
            pieces.append(seq_len)
            length -= seq_len
        if length > 0:
            pieces.append(length)
    fills = []
    for item in sorted(pieces, reverse=True):
        fits = [i for i, f in enumerate(fills) if f + item <= seq_len]
        if fits:
            best = min(fits, key=lambda i: seq_len - fills[i])
            fills[best] += item
        else:
            fills.append(item)
    return sorted(fills), sorted(pieces)


@settings(max_examples=60, deadline=None)
@given(doc_lens=doc_lists, seq_len=st.integers(min_value=1, max_value=50), seed=st.integers(0, 10))
def test_best_fit_packing_matches_exhaustive_bfd(doc_lens, seq_len, seed):
    got = pack_documents(doc_lens, seq_len, PackingMode.BEST_FIT, seed)
    fills, pieces = _bfd_brute_force(doc_lens, seq_len)
    assert len(got) == len(fills)
    assert all(int(g.sum()) == seq_len and (g.size == 0 or g.min() > 0) for g in got)
    fillers = sorted(seq_len - f for f in fills if f < seq_len)
    assert sorted(np.concatenate(got).tolist() if got else []) == sorted(pieces + fillers)
    assert best_fit_padding(doc_lens, seq_len) == sum(fillers)


def test_best_fit_is_deterministic_by_seed_and_shuffles_bins():
    docs = np.arange(1, 300) * 13 % 251 + 1
    a = pack_documents(docs, 300, "best_fit", seed=1)
    b = pack_documents(docs, 300, "best_fit", seed=1)
    c = pack_documents(docs, 300, "best_fit", seed=2)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert sorted(map(tuple, (x.tolist() for x in a))) == sorted(map(tuple, (x.tolist() for x in c)))
    assert [x.tolist() for x in a] != [x.tolist() for x in c]


@pytest.mark.parametrize("bad, match", [(([3, -1], 4, "megatron"), "document 1 has length -1"),
                                        (([3], 0, "megatron"), "--seq-len"),
                                        (([3], 4, "zigzag"), "--packing")])
def test_bad_packing_input_names_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        pack_documents(*bad)


@settings(max_examples=60, deadline=None)
@given(doc_lens=doc_lists, seq_len=st.integers(min_value=1, max_value=50), seed=st.integers(0, 10),
       max_sequences=st.integers(0, 12), mode=st.sampled_from(list(PackingMode)))
def test_max_sequences_keeps_exactly_the_first_sequences_of_the_full_packing(doc_lens, seq_len, seed, max_sequences,
                                                                             mode):
    full = pack_documents(doc_lens, seq_len, mode, seed)
    prefix = pack_documents(doc_lens, seq_len, mode, seed, max_sequences=max_sequences)
    assert [x.tolist() for x in prefix] == [x.tolist() for x in full[:max_sequences]]
    bound = num_packed_upper_bound(doc_lens, seq_len, mode)
    assert bound == len(full) if mode is PackingMode.MEGATRON else bound >= len(full)


@pytest.mark.parametrize("seq_len, mode", [(2048, "megatron"), (4096, "best_fit")])
def test_packing_memory_estimate_is_an_upper_bound_of_the_measured_peak(seq_len, mode):
    """tracemalloc peak of packing + the simulator's per-sequence arrays on real lengths (first 20K Linux docs)."""
    import tracemalloc

    from libra_megatron.plan.model import sequence_flops
    from libra_megatron.sim.baselines import sequence_pair_heads
    from libra_megatron.testing.traces import trace_lengths

    docs = trace_lengths("linux-6.12-files.qwen.txt")[:20000]
    tracemalloc.start()
    try:
        segments = pack_documents(docs, seq_len, mode, 3)
        sequence_flops(segments), sequence_pair_heads(segments, 8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    estimate = packing_memory_bytes(docs, seq_len, mode)
    assert len(segments) > 5000 and peak <= estimate <= 4 * peak, (peak, estimate)
    # with max_sequences, megatron's estimate (and its work) shrinks; best_fit's cannot
    assert packing_memory_bytes(docs, seq_len, mode, max_sequences=10) < estimate / 2 or mode == "best_fit"
