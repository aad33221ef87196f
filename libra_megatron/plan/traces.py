"""Document-length traces: plain UTF-8 text, ``#`` lines are comments, every other line is one length.

Pure Python + numpy. Blank lines are skipped. Every problem is a ``ValueError`` naming the file (as
``--trace PATH``) and, for content, the line: a line that is not one integer in [0, MAX_DOCUMENT_TOKENS],
bytes that are not UTF-8 (the byte offset too), a line over 4096 bytes, a file without any length, a
directory, a missing file.
Reading is streamed in bounded chunks into an int64 buffer (8 bytes per document), and ``max_documents``
stops it as soon as a run's document budget is exceeded, so no input can exhaust memory here.
"""

from __future__ import annotations

import os
from array import array
from typing import Optional, Sequence

import numpy as np

from ..paths import check_input_file, iter_text_lines

__all__ = ["load_trace", "load_traces", "find_trace", "trace_dirs", "MAX_DOCUMENT_TOKENS"]

MAX_DOCUMENT_TOKENS = 1 << 40  # ~1.1e12 tokens: far above any real document; keeps token sums inside int64


def _parse_line(text: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{where}: expected one integer document length, got {text[:60]!r}") from None
    if value < 0:
        raise ValueError(f"{where}: document length must be >= 0, got {value}")
    if value > MAX_DOCUMENT_TOKENS:
        raise ValueError(f"{where}: document length {value} is larger than {MAX_DOCUMENT_TOKENS} (2**40) tokens")
    return value


def load_trace(path, max_documents: Optional[int] = None, limit_reason: str = "") -> np.ndarray:
    """Document lengths in tokens of one trace file: int64 (num_documents,), in file order.

    ``max_documents``: raise (naming the line and ``limit_reason``) as soon as the file holds more documents.
    """
    path = os.fspath(path)
    what = f"--trace {path}"
    check_input_file(path, what)
    lengths = array("q")
    for line_no, raw in iter_text_lines(path, what):
        text = raw.strip()
        if text and not text.startswith("#"):
            lengths.append(_parse_line(text, f"{what}:{line_no}"))
            if max_documents is not None and len(lengths) > max_documents:
                raise ValueError(f"{what}:{line_no}: more than {max_documents} documents{limit_reason}")
    if not lengths:
        raise ValueError(f"{what}: no document lengths (the file is empty or holds only comments)")
    return np.frombuffer(lengths, dtype=np.int64).copy()


def load_traces(paths: Sequence, max_documents: Optional[int] = None, limit_reason: str = "") -> np.ndarray:
    """Documents of several traces pooled in the order given: int64 (sum of num_documents,).

    Every path is checked (exists, is a file) before any is read; ``max_documents`` bounds the total.
    """
    if not paths:
        raise ValueError("--trace: give at least one trace file")
    for p in paths:
        check_input_file(p, f"--trace {os.fspath(p)}")
    parts, left = [], max_documents
    for p in paths:
        parts.append(load_trace(p, left, limit_reason))
        left = None if left is None else left - parts[-1].size
    return np.concatenate(parts).astype(np.int64)


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
