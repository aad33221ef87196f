"""Session fixtures: real megatron-core IndexedDatasets and GPTDatasets built once into a tmp dir.

Corpora (see ``libra_megatron.megatron.corpus``):
  trace_corpus   first 400 documents of the Linux trace (real lengths up to 41,356 tokens; SYNTHETIC tokens)
  wiki_corpus    first 1,000 documents of the Wikipedia trace (same vocab/EOD, for blends; SYNTHETIC tokens)
  stdlib_corpus  40 Python stdlib files tokenized with the Qwen2 BPE (real tokens)
Datasets (seq_length SEQ_LENGTH = 512, so many documents are longer than a sample):
  trace_gpt_dataset    GPTDataset, 16,384 samples (several epochs), 2,048 windows of GBS 8
  stdlib_gpt_dataset   GPTDataset, one epoch
  blended_gpt_dataset  BlendedDataset of trace + wiki, 2,048 samples
The trace EOD is vocab_size - 1 (never 0: megatron-core rewrites pad ids to 0).
"""
from __future__ import annotations

import pytest

from libra_megatron.plan.traces import find_trace

LINUX_TRACE = find_trace("linux-6.12-files.qwen.txt")
WIKI_TRACE = find_trace("wikipedia-flexsp.txt")
TRACE_VOCAB = 32000
TRACE_EOD = TRACE_VOCAB - 1
SEQ_LENGTH = 512


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("libra_corpora")


@pytest.fixture(scope="session")
def trace_corpus(corpus_dir):
    from libra_megatron.megatron.corpus import build_indexed_dataset_from_trace

    return build_indexed_dataset_from_trace(LINUX_TRACE, str(corpus_dir / "linux"), TRACE_VOCAB, TRACE_EOD,
                                            seed=7, max_docs=400)


@pytest.fixture(scope="session")
def wiki_corpus(corpus_dir):
    from libra_megatron.megatron.corpus import build_indexed_dataset_from_trace

    return build_indexed_dataset_from_trace(WIKI_TRACE, str(corpus_dir / "wiki"), TRACE_VOCAB, TRACE_EOD,
                                            seed=8, max_docs=1000)


@pytest.fixture(scope="session")
def stdlib_corpus(corpus_dir):
    from libra_megatron.megatron.corpus import build_indexed_dataset_from_python_stdlib

    return build_indexed_dataset_from_python_stdlib(str(corpus_dir / "stdlib"), max_files=40)


@pytest.fixture(scope="session")
def trace_gpt_dataset(trace_corpus):
    from libra_megatron.megatron.corpus import build_gpt_dataset

    return build_gpt_dataset(trace_corpus.prefix, SEQ_LENGTH, 16384, seed=11, vocab_size=TRACE_VOCAB,
                             eod=TRACE_EOD)


@pytest.fixture(scope="session")
def stdlib_gpt_dataset(stdlib_corpus):
    from libra_megatron.megatron.corpus import build_gpt_dataset

    return build_gpt_dataset(stdlib_corpus.prefix, SEQ_LENGTH, 1, seed=12, vocab_size=stdlib_corpus.vocab_size,
                             eod=stdlib_corpus.eod)


@pytest.fixture(scope="session")
def blended_gpt_dataset(trace_corpus, wiki_corpus):
    from libra_megatron.megatron.corpus import build_gpt_dataset

    return build_gpt_dataset([trace_corpus.prefix, wiki_corpus.prefix], SEQ_LENGTH, 2048, seed=13,
                             vocab_size=TRACE_VOCAB, eod=TRACE_EOD, weights=[0.6, 0.4])
