"""Document pieces (segments) of a megatron-core GPTDataset sample, from index metadata only.

A GPTDataset sample ``idx`` is the token run ``sample_index[j] .. sample_index[j+1]`` (``j =
shuffle_index[idx]``) over the shuffled ``document_index``; each ``sample_index`` row is (position in
``document_index``, token offset in that document). With ``add_extra_token_to_sequence`` the run has
``seq_length + 1`` tokens, the input ``tokens`` are its first ``seq_length`` and consecutive samples
share one token. The segments of a sample are the lengths of the document pieces that make up its
``seq_length`` input tokens, in order: they sum to ``seq_length`` and every boundary except the last
is a document end (an EOD token in our corpora). A sample shorter than ``seq_length`` (the last one
of an epoch when partial samples are kept) ends with a padding segment.

``gpt_sample_segments`` reads only ``document_index``/``sample_index``/``shuffle_index`` and the
``.idx`` ``sequence_lengths`` -- no token reads -- so the sampler can run VRSP (Eq. 4 needs the
segment lengths) for a whole GBS window cheaply. ``scan_eod_segments`` is the independent reference
that cuts the actual tokens after every EOD.
"""
from __future__ import annotations

import weakref
from typing import Any, List

import numpy as np

__all__ = ["gpt_sample_segments", "scan_eod_segments", "num_input_tokens"]


def scan_eod_segments(tokens, eod: int) -> np.ndarray:
    """Segment lengths found by cutting ``tokens`` (1-D, any int dtype) right after every ``eod`` token.

    The last segment runs to the end of ``tokens`` whether or not it ends with EOD. int64 (num_segs,),
    all > 0, summing to ``len(tokens)``; empty for empty input.
    """
    tokens = np.asarray(tokens).reshape(-1)
    if tokens.size == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.flatnonzero(tokens == eod) + 1
    if ends.size == 0 or ends[-1] != tokens.size:
        ends = np.append(ends, tokens.size)
    return np.diff(np.concatenate([[0], ends])).astype(np.int64)


def num_input_tokens(dataset: Any) -> int:
    """Input tokens per sample of a GPTDataset or BlendedDataset (``config.sequence_length``)."""
    return int(dataset.config.sequence_length)


def gpt_sample_segments(dataset: Any, index: int) -> np.ndarray:
    """Segment lengths (int64, all > 0, summing to seq_length) of ``dataset[index]``'s input tokens.

    ``dataset`` is a megatron-core ``GPTDataset`` or a ``BlendedDataset`` of them (resolved through its
    ``dataset_index``/``dataset_sample_index``). Metadata only; equals ``scan_eod_segments`` of the
    sample's tokens when every document ends with (and holds no other) EOD.
    """
    if hasattr(dataset, "dataset_index") and hasattr(dataset, "datasets"):
        _ensure_blended_indices_loaded(dataset)
        which = int(dataset.dataset_index[index])
        return gpt_sample_segments(dataset.datasets[which], int(dataset.dataset_sample_index[index]))
    return _gpt_segments(dataset, int(index))


class _IndexViews:
    """Plain ndarray views of a GPTDataset's (memory-mapped) indices: memmap item access is ~5x slower."""

    def __init__(self, dataset: Any) -> None:
        _ensure_gpt_indices_loaded(dataset)
        self.shuffle = np.asarray(dataset.shuffle_index)
        self.sample = np.asarray(dataset.sample_index)
        self.document = np.asarray(dataset.document_index)
        self.lengths = np.asarray(dataset.dataset.sequence_lengths)
        self.seq_length = int(dataset.config.sequence_length)
        self.extra = int(bool(dataset.config.add_extra_token_to_sequence))


_VIEWS: "weakref.WeakKeyDictionary[Any, _IndexViews]" = weakref.WeakKeyDictionary()


def _views(dataset: Any) -> _IndexViews:
    views = _VIEWS.get(dataset)
    if views is None:
        views = _VIEWS[dataset] = _IndexViews(dataset)
    return views


def _gpt_segments(dataset: Any, index: int) -> np.ndarray:
    views = _views(dataset)
    j = int(views.shuffle[index])
    doc_beg, off_beg = views.sample[j].tolist()
    doc_end, off_end = views.sample[j + 1].tolist()
    pieces = _run_pieces(views, doc_beg, off_beg, doc_end, off_end + views.extra)
    return _cut_to_inputs(pieces, views.seq_length)


def _run_pieces(views: _IndexViews, doc_beg: int, off_beg: int, doc_end: int, end_exclusive: int) -> List[int]:
    """Piece lengths of the token run from (doc_beg, off_beg) to (doc_end, end_exclusive), like GPTDataset reads it."""
    if doc_beg == doc_end:
        return [end_exclusive - off_beg]
    lengths = views.lengths[views.document[doc_beg : doc_end + 1]].tolist()
    lengths[0] -= off_beg
    lengths[-1] = end_exclusive
    return lengths


def _cut_to_inputs(pieces: List[int], seq_length: int) -> np.ndarray:
    """Keep the first ``seq_length`` tokens (drops the shared extra token); pad a short run; drop empty pieces."""
    out, used = [], 0
    for piece in pieces:  # a handful of pieces: plain Python beats numpy here
        piece = min(piece, seq_length - used)
        if piece > 0:
            out.append(piece)
            used += piece
    if used < seq_length:
        out.append(seq_length - used)
    return np.asarray(out, dtype=np.int64)


def _ensure_gpt_indices_loaded(dataset: Any) -> None:
    """GPTDataset with ``defer_npy_index_mmap`` loads its indices on first access; do the same here."""
    if dataset.shuffle_index is None:
        dataset.shuffle_index = np.load(dataset.path_to_shuffle_index, allow_pickle=True, mmap_mode="r")
        dataset.sample_index = np.load(dataset.path_to_sample_index, allow_pickle=True, mmap_mode="r")
        dataset.document_index = np.load(dataset.path_to_document_index, allow_pickle=True, mmap_mode="r")


def _ensure_blended_indices_loaded(dataset: Any) -> None:
    if dataset.dataset_index is None:
        dataset.dataset_index = np.load(dataset.path_to_dataset_index, allow_pickle=True, mmap_mode="r")
        dataset.dataset_sample_index = np.load(
            dataset.path_to_dataset_sample_index, allow_pickle=True, mmap_mode="r"
        )
