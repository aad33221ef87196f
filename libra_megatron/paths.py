"""Checks of user-given files, run before any work starts: every failure is a ``ValueError`` naming the file.

``what`` is how the message names the input: the flag and its value (``"--trace data/x.txt"``) or just the
path. Input files must exist and be regular files (or FIFOs, so ``--trace <(zcat x.gz)`` works); text must be
UTF-8, and a file that is not names the line and the byte offset of the first bad byte. Output paths are
checked by creating (and at once removing) a probe file or folder next to them, which is the only test
that also holds for root, read-only mounts and ``/proc``; nothing is left behind.

Pure Python (no numpy, no torch): the config loader, ``plan/`` and ``sim/`` import it.
"""
from __future__ import annotations

import codecs
import os
import stat
import tempfile
from typing import Iterator, Tuple

__all__ = ["check_input_file", "read_text", "read_json", "iter_text_lines", "check_output_file", "check_output_dir",
           "decode_error"]

_PROBE_PREFIX = ".libra-write-probe-"


def check_input_file(path, what: str) -> str:
    """``path`` as a string after checking it names a readable regular file (or FIFO); ValueError else."""
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ValueError(f"{what}: no such file") from None
    except OSError as err:
        raise ValueError(f"{what}: cannot read ({err.strerror})") from None
    if stat.S_ISDIR(mode):
        raise ValueError(f"{what}: is a directory, expected a file")
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise ValueError(f"{what}: is not a regular file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{what}: permission denied (not readable)")
    return path


def decode_error(what: str, data: bytes, err: UnicodeDecodeError, line_no: int = 0, file_offset: int = 0) -> ValueError:
    """A ValueError for the first undecodable byte of ``data`` (a chunk starting at ``file_offset``, line ``line_no``+1)."""
    line = line_no + data.count(b"\n", 0, err.start) + 1
    offset = file_offset + err.start
    return ValueError(f"{what}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x} at byte offset {offset}); "
                      f"is this a binary file?")


def read_text(path, what: str, max_bytes: int = 1 << 20) -> str:
    """The whole UTF-8 text of a small input file (a config); ValueError naming the file otherwise."""
    path = check_input_file(path, what)
    try:
        with open(path, "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as err:
        raise ValueError(f"{what}: cannot read ({err.strerror})") from None
    if len(data) > max_bytes:
        raise ValueError(f"{what}: larger than {max_bytes} bytes; not a config file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise decode_error(what, data, err) from None


def read_json(path, what: str, max_bytes: int = 64 << 20):
    """The parsed JSON of an input file; a syntax error names ``what:line:column``."""
    import json

    text = read_text(path, what, max_bytes)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})") from None


def iter_text_lines(path, what: str, max_line_bytes: int = 4096, chunk_bytes: int = 1 << 20) -> Iterator[Tuple[int, str]]:
    """(1-based line number, line without its newline) of a UTF-8 text file, read in bounded chunks.

    Memory stays O(chunk_bytes) whatever the file holds: a line longer than ``max_line_bytes`` (a binary or
    minified file) raises ValueError naming the line instead of being read whole.
    """
    path = check_input_file(path, what)
    try:
        handle = open(path, "rb")
    except OSError as err:
        raise ValueError(f"{what}: cannot read ({err.strerror})") from None
    with handle:
        yield from _split_chunks(handle, what, max_line_bytes, chunk_bytes)


def _split_chunks(handle, what: str, max_line_bytes: int, chunk_bytes: int) -> Iterator[Tuple[int, str]]:
    pending, line_no, offset = b"", 0, 0  # offset: file offset of pending[0]; line_no: lines yielded
    while True:
        chunk = handle.read(chunk_bytes)
        data = pending + chunk
        end = len(data) if not chunk else data.rfind(b"\n") + 1  # decode complete lines only, until EOF
        try:
            if len(data) - end > max_line_bytes:
                codecs.getincrementaldecoder("utf-8")().decode(data)  # binary? say so rather than "too long"
                line = line_no + data.count(b"\n", 0, end) + 1
                raise ValueError(f"{what}:{line}: line longer than {max_line_bytes} bytes; "
                                 f"is this a text file of one value per line?")
            text = data[:end].decode("utf-8")
        except UnicodeDecodeError as err:
            raise decode_error(what, data, err, line_no, offset) from None
        lines = text.split("\n")
        if lines[-1] == "":
            lines.pop()  # text ended with a newline (or was empty)
        for line in lines:
            line_no += 1
            yield line_no, line
        pending, offset = data[end:], offset + end
        if not chunk:
            return


def check_output_file(path, what: str) -> str:
    """``path`` after checking a file can be written there (its folder exists and takes a new file).

    An existing file will be overwritten; an existing folder is an error. Creates nothing.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{what}: is a directory, expected a file path")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ValueError(f"{what}: permission denied (the existing file is not writable)")
        if not os.path.isfile(path):
            return path  # /dev/stdout, a FIFO: writable, nothing to probe
    _probe_folder(os.path.dirname(os.path.abspath(path)), what, make=tempfile.mkstemp)
    return path


def check_output_dir(path, what: str) -> str:
    """``path`` after checking files can be written into it; a missing folder may be created (its parent
    must exist, as for ``mkdir``), but is not created here."""
    path = os.fspath(path)
    if os.path.isdir(path):
        _probe_folder(path, what, make=tempfile.mkstemp)
    elif os.path.exists(path):
        raise ValueError(f"{what}: exists and is not a directory")
    else:
        _probe_folder(os.path.dirname(os.path.abspath(path)), what, make=tempfile.mkdtemp)
    return path


def _probe_folder(folder: str, what: str, make) -> None:
    """Create and remove a probe (``make`` = ``tempfile.mkstemp`` or ``mkdtemp``) in ``folder``; ValueError if it fails."""
    if not os.path.isdir(folder):
        kind = "is not a directory" if os.path.exists(folder) else "does not exist"
        raise ValueError(f"{what}: the folder {folder} {kind}")
    try:
        made = make(dir=folder, prefix=_PROBE_PREFIX)
    except OSError as err:
        raise ValueError(f"{what}: cannot write into {folder} ({err.strerror})") from None
    if isinstance(made, tuple):  # mkstemp: (fd, path)
        os.close(made[0])
        os.unlink(made[1])
    else:
        os.rmdir(made)
