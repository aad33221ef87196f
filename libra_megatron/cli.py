"""One error style for every command-line entry point of the project (simulator, launcher, scripts).

A *user error* is a ``ValueError`` (our convention: bad flags, bad files, bad YAML; ``PlanError`` and
``MegatronLMNotFound`` are ``ValueError`` too). It prints exactly one line, ``<tool>: error: <message>``, to
stderr and exits 2, like argparse. Anything else is an internal error and keeps its traceback. ``--debug``
on the command line or ``LIBRA_DEBUG=1`` in the environment shows the traceback of user errors as well.

Two ``ValueError`` subclasses are *not* user errors, because their messages cannot say which input was
wrong: ``UnicodeError`` (a decode error names a byte offset but no file) and ``json.JSONDecodeError`` (a
line but no file). Readers of user files must catch them and raise a ``ValueError`` naming the file
(``libra_megatron.paths`` does); one that escapes is a bug and shows its traceback.

``ArgumentParser`` is argparse's parser whose usage errors (unknown flag, ``invalid int value``, missing
required flag, bad choice) raise ``UsageError`` instead of printing the usage block, so they come out as
the same one line; ``--help`` is unchanged.

Usage::

    def run(argv): ...              # raises ValueError for bad input, returns an exit code or None

    def main(argv=None):
        run_cli("libra-sim", run, argv)

Pure Python (no torch, no numpy, no megatron): the simulator and the config loader import it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, List, NoReturn, Optional, Sequence

__all__ = ["run_cli", "add_debug_argument", "debug_requested", "one_line", "is_user_error", "ArgumentParser",
           "DefaultsHelpFormatter", "UsageError", "USER_ERROR_EXIT"]

USER_ERROR_EXIT = 2  # argparse's exit status for usage errors
DEBUG_FLAG = "--debug"
DEBUG_ENV = "LIBRA_DEBUG"
_NOT_USER_ERRORS = (UnicodeError, json.JSONDecodeError)  # ValueErrors whose message names no file


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with ``(default: VALUE)`` written as the user would type it: enum values, lists space-joined;
    nothing for required flags, switches and options without a default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if action.required or default in (None, False, argparse.SUPPRESS) or "%(default)" in text:
            return text
        shown = " ".join(map(_plain, default)) if isinstance(default, (list, tuple)) else _plain(default)
        return f"{text} (default: {shown})".replace("%", "%%")


def _plain(value: object) -> str:
    return str(getattr(value, "value", value))


class UsageError(ValueError):
    """A command-line usage error found by ``ArgumentParser`` (its message names the flag)."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors raise ``UsageError`` (one line via ``run_cli``)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see --help)")


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


def is_user_error(err: BaseException) -> bool:
    """A ``ValueError`` whose message describes the bad input (see the module docstring)."""
    return isinstance(err, ValueError) and not isinstance(err, _NOT_USER_ERRORS)


def _silence_stdout() -> None:
    """After a broken pipe (``tool | head``): point stdout at /dev/null so the exit flush cannot fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # pragma: no cover - stdout without a file descriptor
        pass


def run_cli(tool: str, main: Callable[[List[str]], Optional[int]], argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Run ``main(argv)`` and exit: its return code, 2 with one line for a user error, 130 on Ctrl-C.

    ``SystemExit`` raised inside (``--help``) passes through unchanged. A closed stdout pipe exits 1 quietly.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        code = main(args)
    except ValueError as err:
        if not is_user_error(err) or debug_requested(args):
            raise
        print(f"{tool}: error: {one_line(err) or type(err).__name__}", file=sys.stderr, flush=True)
        raise SystemExit(USER_ERROR_EXIT) from None
    except KeyboardInterrupt:
        print(f"{tool}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except BrokenPipeError:
        _silence_stdout()
        raise SystemExit(1) from None
    raise SystemExit(int(code or 0))
