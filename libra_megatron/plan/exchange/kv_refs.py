"""Which K/V rows a tile assignment makes each destination fetch, and from whom (§4.3.3, Eq. 7-8).

Pure numpy, one rule shared by the placer's Eq. 8 totals, the exchange plan, its validation and the
simulator's traffic. A tile needs rows ``[0, kv_end)`` of every KV group it references
(``TileSet.frag_kv_end``: the whole document for ``KvFetch.GROUP``, the causal prefix for ``PREFIX``).
A destination fetches each referenced group once, up to the largest ``kv_end`` of its tiles, and only
the rows it does not hold itself; the rows come from the workers that hold them (the doc-home runs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["FetchedGroups", "fetched_groups", "held_rows", "home_runs_in_prefix", "expand_ranges"]


def expand_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of range(starts[i], starts[i] + counts[i]), int64."""
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + np.arange(total, dtype=np.int64) - offsets


def home_runs_in_prefix(tiles, docs: np.ndarray, ends: np.ndarray):
    """The doc-home runs of ``docs[i]`` clipped to rows [0, ends[i]), empty ones dropped.

    Returns int64 arrays (row i of the query, home entry index into the doc-home CSR, rows in the prefix).
    """
    ptr = tiles.doc_home_ptr
    per_doc = ptr[docs + 1] - ptr[docs]
    entry = expand_ranges(ptr[docs], per_doc)
    row = np.repeat(np.arange(docs.size, dtype=np.int64), per_doc)
    count = np.clip(ends[row] - tiles.doc_home_offset[entry], 0, tiles.doc_home_count[entry])
    keep = count > 0
    return row[keep], entry[keep], count[keep]


def held_rows(tiles, docs, workers, ends) -> np.ndarray:
    """int64 [n]: rows of ``docs[i]`` in [0, ends[i]) that ``workers[i]`` holds locally."""
    docs, workers, ends = (np.asarray(x, dtype=np.int64).reshape(-1) for x in (docs, workers, ends))
    row, entry, count = home_runs_in_prefix(tiles, docs, ends)
    mine = tiles.doc_home_worker[entry] == workers[row]
    return np.bincount(row[mine], weights=count[mine], minlength=docs.size).astype(np.int64)


@dataclass(frozen=True)
class FetchedGroups:
    """Distinct (group, destination) pairs of an assignment, sorted by ``group * W + dst``.

    group, dst  int64 [n]   KV group id (doc * G + KV class) and the destination worker
    end         int64 [n]   rows [0, end) of the group the destination needs (max kv_end of its tiles)
    remote      int64 [n]   rows of those it does not hold (what it receives)
    """

    group: np.ndarray
    dst: np.ndarray
    end: np.ndarray
    remote: np.ndarray

    def kv_bytes(self, heads) -> int:
        return int(self.remote.sum()) * heads.kv_bytes_per_token()


def fetched_groups(tiles, assignment) -> FetchedGroups:
    """Every KV group a destination of ``assignment`` fetches, deduplicated, with its prefix (Eq. 7)."""
    assignment = np.asarray(assignment, dtype=np.int64)
    H, G, W = tiles.head_split, tiles.num_kv_classes, tiles.num_workers
    frag_block = np.repeat(np.arange(tiles.num_blocks, dtype=np.int64), np.diff(tiles.frag_ptr))
    dst = assignment[(frag_block[:, None] * H + np.arange(H)[None, :]).reshape(-1)]
    group = (tiles.frag_doc[:, None] * G + tiles.heads.kv_class_of_shard()[None, :]).reshape(-1)
    kv_end = np.repeat(tiles.frag_kv_end, H)
    keys, inverse = np.unique(group * W + dst, return_inverse=True)
    end = np.zeros(keys.size, dtype=np.int64)
    np.maximum.at(end, inverse.reshape(-1), kv_end)
    group, dst = np.divmod(keys, W)
    remote = end - held_rows(tiles, group // G, dst, end)
    return FetchedGroups(group=group, dst=dst, end=end, remote=remote)
