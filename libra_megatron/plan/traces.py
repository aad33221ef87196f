"""Document-length traces: plain text, ``#`` lines are comments, every other line is one length.

Pure Python + numpy. Blank lines are skipped. A line that is not a non-negative integer raises
``ValueError`` naming the file, the line number and the offending text.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

__all__ = ["load_trace", "load_traces", "find_trace", "trace_dirs"]


def _parse_line(text: str, path: str, line_no: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{path}:{line_no}: expected one integer document length, got {text[:60]!r}") from None
    if value < 0:
        raise ValueError(f"{path}:{line_no}: document length must be >= 0, got {value}")
    return value


def load_trace(path) -> np.ndarray:
    """Document lengths in tokens of one trace file: int64 (num_documents,), in file order."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"--trace {path}: no such file")
    lengths = []
    with open(path, "r", encoding="utf-8") as handle:
        for line_no, raw in enumerate(handle, start=1):
            text = raw.strip()
            if text and not text.startswith("#"):
                lengths.append(_parse_line(text, path, line_no))
    return np.asarray(lengths, dtype=np.int64)


def load_traces(paths: Sequence) -> np.ndarray:
    """Documents of several traces pooled in the order given: int64 (sum of num_documents,)."""
    if not paths:
        raise ValueError("--trace: give at least one trace file")
    return np.concatenate([load_trace(p) for p in paths]).astype(np.int64)


_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def trace_dirs() -> list:
    """Folders searched by ``find_trace``, in order: $LIBRA_TRACE_DIR (your own traces), then the
    repository's ``data/traces``, which ships every trace the tests, benchmarks and main job use. Nothing
    outside the checkout is searched: a fresh clone behaves the same everywhere."""
    dirs = [os.environ.get("LIBRA_TRACE_DIR", ""), os.path.join(_REPO_ROOT, "data", "traces")]
    return [d for d in dirs if d]


def find_trace(name: str) -> str:
    """Path of the trace file ``name`` (e.g. ``"wikipedia-flexsp.txt"``) in the first of ``trace_dirs()``
    that has it; ValueError listing the folders searched otherwise."""
    for folder in trace_dirs():
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    raise ValueError(f"trace {name!r} not found in {trace_dirs()} (set LIBRA_TRACE_DIR)")
