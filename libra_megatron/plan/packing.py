"""Packing documents into fixed-token sequences (pure numpy).

A packed sequence is represented by the lengths of its segments (documents or document pieces), in
tokens, in order; every returned array sums to exactly ``seq_len``. Two modes (``PackingMode``):

MEGATRON  GPTDataset style. Documents are shuffled with ``seed`` and concatenated; the stream is cut
          every ``seq_len`` tokens. A document crossing a cut (or longer than ``seq_len``) is split
          into several segments. The trailing partial sequence is DROPPED (as GPTDataset does), so
          the multiset of tokens kept is the first ``num_seq * seq_len`` tokens of the shuffled stream.
BEST_FIT  Best-fit-decreasing. Documents longer than ``seq_len`` are first cut into ``seq_len``
          pieces plus a remainder; pieces are placed, largest first, into the open bin with the least
          room that still fits them (a new bin otherwise). A bin that is not full is PADDED with one
          synthetic filler segment of the missing length, appended last, so sum == seq_len still
          holds (the runtime attends over the filler like any document, so its cost is counted).
          Bins are then shuffled with ``seed``: BFD emits bins in decreasing order of their first
          piece, which would put all the long documents into the first global batches.

Zero-length documents are dropped (they carry no tokens); negative lengths raise ``ValueError``.

Bounded work. ``max_sequences`` keeps only the first N packed sequences. MEGATRON then cuts only the
shuffled prefix those N sequences need (the result is exactly the first N of the full packing, at
O(num_docs + N) cost). BEST_FIT cannot stop early: the bin order is a shuffle of ALL bins, so even the
first window depends on every document; it packs everything and then keeps N. ``packing_memory_bytes``
estimates (from the document count and token total alone, before anything is allocated) the peak
memory of packing plus the simulator's per-sequence arrays; callers refuse runs above their limit.
"""

from __future__ import annotations

import bisect
from typing import Callable, Dict, List, Optional

import numpy as np

from ..config import PackingMode

__all__ = ["pack_documents", "best_fit_padding", "packing_memory_bytes", "num_packed_upper_bound"]

# Peak bytes per packed sequence / per segment, measured with tracemalloc on the Linux trace (L = 1K..64K:
# about 211 and 71) and rounded up, so the estimate is an upper bound; per document: lengths, shuffle, cumsum.
BYTES_PER_SEQUENCE = 256
BYTES_PER_SEGMENT = 96
BYTES_PER_DOCUMENT = 32


def _check_inputs(doc_lens, seq_len: int) -> np.ndarray:
    lens = np.asarray(doc_lens, dtype=np.int64).reshape(-1)
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"--seq-len must be a positive integer, got {seq_len!r}")
    if lens.size and lens.min() < 0:
        bad = int(np.argmin(lens))
        raise ValueError(f"document lengths must be >= 0; document {bad} has length {int(lens[bad])}")
    return lens[lens > 0]


def _pack_megatron(lens: np.ndarray, seq_len: int, seed: int, max_sequences: Optional[int]) -> List[np.ndarray]:
    """Shuffle, concatenate, cut every seq_len tokens; drop the trailing partial sequence; first max_sequences."""
    shuffled = lens[np.random.default_rng(seed).permutation(lens.size)]
    num_seq = int(shuffled.sum()) // seq_len
    if max_sequences is not None:
        num_seq = min(num_seq, max_sequences)
    if num_seq == 0:
        return []
    used = num_seq * seq_len
    doc_ends = np.cumsum(shuffled)
    doc_ends = doc_ends[doc_ends < used]
    cuts = np.arange(1, num_seq + 1, dtype=np.int64) * seq_len
    ends = np.union1d(doc_ends, cuts)  # sorted, unique segment end positions
    seg_lens = np.diff(ends, prepend=0)
    seq_last = np.searchsorted(ends, cuts)  # index of the segment ending at each cut
    return [a.copy() for a in np.split(seg_lens, seq_last[:-1] + 1)]


def _cut_long_documents(lens: np.ndarray, seq_len: int) -> np.ndarray:
    """Split every document > seq_len into full seq_len pieces and a (nonzero) remainder."""
    full, rem = np.divmod(lens, seq_len)
    pieces = np.repeat(np.int64(seq_len), int(full.sum()))
    return np.concatenate([pieces, rem[rem > 0]])


def _best_fit_bins(items_desc: np.ndarray, seq_len: int) -> List[List[int]]:
    """Best-fit over items in the given (decreasing) order. Returns per-bin item lists."""
    bins: List[List[int]] = []
    open_room: List[int] = []  # sorted remaining capacities of non-full bins
    open_ids: List[int] = []  # parallel to open_room
    for item in items_desc.tolist():
        k = bisect.bisect_left(open_room, item)
        if k < len(open_room):
            room, bin_id = open_room.pop(k), open_ids.pop(k)
        else:
            room, bin_id = seq_len, len(bins)
            bins.append([])
        bins[bin_id].append(item)
        room -= item
        if room > 0:
            k = bisect.bisect_left(open_room, room)
            open_room.insert(k, room)
            open_ids.insert(k, bin_id)
    return bins


def _pack_best_fit(lens: np.ndarray, seq_len: int, seed: int, max_sequences: Optional[int]) -> List[np.ndarray]:
    rng = np.random.default_rng(seed)
    items = _cut_long_documents(lens, seq_len)
    items = items[rng.permutation(items.size)]  # seed decides the order among equal lengths
    items = items[np.argsort(-items, kind="stable")]
    bins = _best_fit_bins(items, seq_len)
    packed = []
    for content in bins:
        fill = seq_len - sum(content)
        packed.append(np.asarray(content + ([fill] if fill else []), dtype=np.int64))
    order = rng.permutation(len(packed))[:max_sequences]  # every bin is shuffled before keeping the first N
    return [packed[i] for i in order]


_PACKERS: Dict[PackingMode, Callable[[np.ndarray, int, int, Optional[int]], List[np.ndarray]]] = {
    PackingMode.MEGATRON: _pack_megatron,
    PackingMode.BEST_FIT: _pack_best_fit,
}


def _mode(mode) -> PackingMode:
    try:
        return PackingMode(mode)
    except ValueError:
        choices = ", ".join(m.value for m in PackingMode)
        raise ValueError(f"--packing must be one of {choices}, got {mode!r}") from None


def pack_documents(doc_lens, seq_len: int, mode=PackingMode.MEGATRON, seed: int = 1234,
                   max_sequences: Optional[int] = None) -> List[np.ndarray]:
    """Pack documents into sequences of exactly ``seq_len`` tokens.

    Args:
        doc_lens: (num_docs,) integer document lengths in tokens (zeros dropped, negatives rejected).
        seq_len: L, tokens per packed sequence.
        mode: ``PackingMode`` or its string value (``"megatron"`` | ``"best_fit"``); see module doc.
        seed: shuffling seed; the result is a deterministic function of (doc_lens, seq_len, mode, seed).
        max_sequences: keep only the first N sequences of that result (see "Bounded work" above).

    Returns:
        list of (num_segments,) int64 arrays, each summing to ``seq_len``. MEGATRON drops the trailing
        partial sequence; BEST_FIT pads each non-full bin with one trailing filler segment.
    """
    mode = _mode(mode)
    lens = _check_inputs(doc_lens, seq_len)
    if max_sequences is not None and (isinstance(max_sequences, bool) or max_sequences < 0):
        raise ValueError(f"max_sequences must be >= 0, got {max_sequences!r}")
    return _PACKERS[mode](lens, int(seq_len), int(seed), max_sequences)


def num_packed_upper_bound(doc_lens, seq_len: int, mode=PackingMode.MEGATRON) -> int:
    """Packed sequences of the whole corpus: exact for MEGATRON (tokens // L), an upper bound for BEST_FIT
    (one bin per piece: sum of ceil(len / L)). O(num_docs), allocates nothing per sequence."""
    lens = _check_inputs(doc_lens, seq_len)
    if _mode(mode) is PackingMode.MEGATRON:
        return int(lens.sum()) // int(seq_len)
    return int((-(-lens // int(seq_len))).sum())


def packing_memory_bytes(doc_lens, seq_len: int, mode=PackingMode.MEGATRON, max_sequences: Optional[int] = None) -> int:
    """Upper estimate of the peak bytes of ``pack_documents`` plus per-sequence arrays, before packing.

    MEGATRON packs min(tokens // L, max_sequences) sequences with at most docs + sequences segments;
    BEST_FIT packs every piece (max_sequences does not bound it) with at most 2 segments per bin.
    """
    lens = _check_inputs(doc_lens, seq_len)
    num_docs = int(lens.size)
    bound = num_packed_upper_bound(lens, seq_len, mode)
    if _mode(mode) is PackingMode.MEGATRON:
        num_seq = bound if max_sequences is None else min(bound, max_sequences)
        num_seg = num_docs + num_seq
    else:
        num_seq, num_seg = bound, 2 * bound
    return BYTES_PER_DOCUMENT * num_docs + BYTES_PER_SEQUENCE * num_seq + BYTES_PER_SEGMENT * num_seg


def best_fit_padding(doc_lens, seq_len: int) -> int:
    """Total filler tokens BEST_FIT adds for these documents (independent of the seed)."""
    lens = _check_inputs(doc_lens, seq_len)
    items = np.sort(_cut_long_documents(lens, seq_len))[::-1]
    return len(_best_fit_bins(items, int(seq_len))) * int(seq_len) - int(items.sum())
