"""One error style for every command-line entry point of the project (simulator, launcher, scripts).

A *user error* is a ``ValueError`` (our convention: bad flags, bad files, bad YAML; ``PlanError`` and
``MegatronLMNotFound`` are ``ValueError`` too). It prints exactly one line, ``<tool>: error: <message>``, to
stderr and exits 2, like argparse. Anything else is an internal error and keeps its traceback. ``--debug``
on the command line or ``LIBRA_DEBUG=1`` in the environment shows the traceback of user errors as well.

Usage::

    def _main(argv): ...            # raises ValueError for bad input, returns an exit code or None

    def main(argv=None):
        run_cli("libra-sim", _main, argv)

Pure Python (no torch, no megatron): the simulator imports it.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, NoReturn, Optional, Sequence

__all__ = ["run_cli", "add_debug_argument", "debug_requested", "one_line", "USER_ERROR_EXIT"]

USER_ERROR_EXIT = 2  # argparse's exit status for usage errors
DEBUG_FLAG = "--debug"
DEBUG_ENV = "LIBRA_DEBUG"


def debug_requested(argv: Sequence[str] = (), environ: Optional[dict] = None) -> bool:
    """True if ``--debug`` is among ``argv`` or ``LIBRA_DEBUG`` is set to a true value."""
    environ = os.environ if environ is None else environ
    flag = environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
    return flag or DEBUG_FLAG in argv


def add_debug_argument(parser: argparse.ArgumentParser) -> None:
    """Register ``--debug`` (show tracebacks of user errors) so argparse accepts it."""
    parser.add_argument(DEBUG_FLAG, action="store_true",
                        help=f"show the Python traceback of user errors too (or set {DEBUG_ENV}=1)")


def one_line(message: object) -> str:
    """``message`` with every run of whitespace (newlines included) collapsed to one space."""
    return " ".join(str(message).split())


def run_cli(tool: str, main: Callable[[List[str]], Optional[int]], argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Run ``main(argv)`` and exit: its return code, 2 with one line for a ``ValueError``, 130 on Ctrl-C.

    ``SystemExit`` raised inside (argparse's own usage errors and ``--help``) passes through unchanged.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        code = main(args)
    except ValueError as err:
        if debug_requested(args):
            raise
        print(f"{tool}: error: {one_line(err) or type(err).__name__}", file=sys.stderr, flush=True)
        raise SystemExit(USER_ERROR_EXIT) from None
    except KeyboardInterrupt:
        print(f"{tool}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    raise SystemExit(int(code or 0))
