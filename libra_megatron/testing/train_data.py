"""The CPU training driver's corpus (``train_cpu``): built once in the parent, GPTDataset indices cached for the
ranks, token ids remapped to the tiny model's vocabulary."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import numpy as np

from ..plan.traces import find_trace

__all__ = ["PreparedData", "prepare_data", "open_dataset"]


@dataclass(frozen=True, eq=False)
class PreparedData:
    """Built once in the parent: the corpus on disk and the corpus-id -> model-id table (int64)."""

    info: object  # corpus.CorpusInfo
    remap: np.ndarray
    description: str


def prepare_data(cfg) -> PreparedData:
    """Build the corpus and the GPTDataset indices once (ranks then hit the caches); ids remapped to ``cfg.vocab``
    (the vocab-1 most frequent + UNK). ``cfg``: a ``train_cpu.RunConfig`` (its module docstring has ``cfg.data``)."""
    from ..megatron import corpus

    workdir = cfg.workdir or os.path.join(tempfile.gettempdir(), "libra_train_cpu")
    if cfg.data not in ("stdlib", "trace") or cfg.tokens not in ("stdlib", "synthetic"):
        raise ValueError(f"--data must be stdlib|trace and --tokens stdlib|synthetic, got {cfg.data!r}, {cfg.tokens!r}")
    if cfg.data == "stdlib" or cfg.tokens == "stdlib":
        stdlib = corpus.build_indexed_dataset_from_python_stdlib(os.path.join(workdir, "stdlib"),
                                                                 max_files=cfg.max_files)
    if cfg.data == "stdlib":
        info, what = stdlib, f"the first {cfg.max_files or 'all'} stdlib .py files (Qwen2 tokens)"
    else:
        info, what = _trace_corpus(cfg, workdir, stdlib if cfg.tokens == "stdlib" else None)
    open_dataset(cfg, info)
    return PreparedData(info, _vocab_remap(info, cfg.vocab), what)


def _trace_corpus(cfg, workdir: str, stdlib):
    """(CorpusInfo, description): the trace's first max_docs lengths x doc_scale, tokens per ``cfg.tokens``."""
    from ..megatron import corpus
    from ..plan.traces import load_trace

    path = cfg.trace if os.path.isfile(cfg.trace) else find_trace(cfg.trace)
    lengths = load_trace(path)[: cfg.max_docs]
    lengths = np.maximum(1, np.round(lengths * cfg.doc_scale)).astype(np.int64)
    name = os.path.splitext(os.path.basename(path))[0]
    if stdlib is None:
        vocab, eod, stream = cfg.vocab, cfg.vocab - 1, None
    else:
        vocab, eod, stream = stdlib.vocab_size, stdlib.eod, corpus.corpus_tokens(stdlib)
    prefix = os.path.join(workdir, f"trace-{name}-x{cfg.doc_scale:g}-{cfg.tokens}-v{vocab}")
    info = corpus.build_indexed_dataset_from_trace(lengths, prefix, vocab_size=vocab, eod=eod, seed=cfg.seed,
                                                   token_stream=stream)
    what = (f"{lengths.size} documents with the lengths of {os.path.basename(path)} x {cfg.doc_scale:g} "
            f"(median {int(np.median(lengths))}, max {int(lengths.max())} tokens), "
            f"{'stdlib Qwen2 tokens' if stream is not None else 'SYNTHETIC tokens'}")
    return info, what


def open_dataset(cfg, info):
    from ..megatron import corpus

    return corpus.build_gpt_dataset(info.prefix, cfg.seq_len, cfg.steps * cfg.global_batch, seed=cfg.seed,
                                    vocab_size=info.vocab_size, eod=info.eod)


def _vocab_remap(info, vocab: int) -> np.ndarray:
    """int64 lookup corpus id -> model id: the ``vocab-1`` most frequent corpus ids keep a rank, the rest UNK.

    Keeps the tiny model's embedding small while training on the real token stream; EOD is always kept.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if info.vocab_size <= vocab:
        return np.arange(info.vocab_size, dtype=np.int64)
    counts = np.zeros(info.vocab_size, dtype=np.int64)
    ds = IndexedDataset(info.prefix)
    for i in range(len(ds)):
        counts += np.bincount(np.asarray(ds[i], dtype=np.int64), minlength=info.vocab_size)
    counts[info.eod] = counts.max() + 1
    keep = np.argsort(-counts, kind="stable")[: vocab - 1]
    remap = np.full(info.vocab_size, vocab - 1, dtype=np.int64)
    remap[keep] = np.arange(keep.size, dtype=np.int64)
    return remap
