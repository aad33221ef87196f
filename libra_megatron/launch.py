"""Fork-free Megatron-LM launcher: ``python -m libra_megatron.launch [launcher flags] <pretrain_gpt flags>``.

What it does, in order:

1. finds Megatron-LM (``--megatron-lm-path`` or the ``MEGATRON_LM_PATH`` environment variable; the flag
   wins) and checks it holds the program (default ``pretrain_gpt.py``) and ``megatron/training``;
2. expands ``--megatron-args-file FILE`` (repeatable; shell-quoted tokens, ``#`` comments) in place, so a
   model config in ``configs/`` plus per-run flags form one Megatron command line;
3. puts Megatron-LM and this repository's root on ``sys.path`` (the ``patches/`` package lives at the
   repository root), verifies and installs every patch point (``patches.install_all``) with a fresh
   ``LibraHooks``;
4. runs the program as ``__main__`` with ``sys.argv = [program, <remaining flags>]``: Megatron-LM's own
   ``parse_args`` then sees the ``--libra-*`` flags through the chained ``extra_args_provider``.

Launcher flags are consumed here and never reach Megatron; every other flag is passed through unchanged.
Nothing else about the program changes: ``torchrun ... -m libra_megatron.launch <your usual flags>
--libra-config configs/libra/256k.yaml`` is the whole integration.
"""
from __future__ import annotations

import argparse
import os
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence

__all__ = ["LaunchPlan", "parse_launch_args", "expand_args_files", "resolve_megatron_lm", "install_hooks", "main"]

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_MEGATRON_LM_PATH = "MEGATRON_LM_PATH"


@dataclass(frozen=True)
class LaunchPlan:
    """Resolved launch: the program file to run as __main__ and the argv Megatron will parse."""

    megatron_lm_path: Path
    program: Path
    megatron_argv: List[str]


def _launcher_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m libra_megatron.launch", allow_abbrev=False, add_help=False,
        description="Run Megatron-LM's pretrain_gpt.py with Libra attached (no fork).",
    )
    parser.add_argument("--megatron-lm-path", default=None,
                        help=f"Megatron-LM checkout (tag core_v0.16.x); default ${ENV_MEGATRON_LM_PATH}")
    parser.add_argument("--megatron-program", default="pretrain_gpt.py",
                        help="program inside Megatron-LM to run (default pretrain_gpt.py)")
    parser.add_argument("--megatron-args-file", action="append", default=[],
                        help="file of Megatron flags (shell quoting, # comments), expanded in place; repeatable")
    parser.add_argument("--libra-launch-help", action="help", help="show the launcher flags and exit")
    return parser


def expand_args_files(argv: Sequence[str], _depth: int = 0) -> List[str]:
    """Replace each ``--megatron-args-file FILE`` (or ``=FILE``) with the flags read from FILE, in place.

    Files may include other files the same way (a run config includes its model config), up to 8 deep.
    """
    if _depth > 8:
        raise ValueError("--megatron-args-file nesting deeper than 8: a file includes itself?")
    out: List[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        if item == "--megatron-args-file":
            if i + 1 >= len(items):
                raise ValueError("--megatron-args-file needs a file path")
            out.extend(expand_args_files(read_args_file(items[i + 1]), _depth + 1))
            i += 2
            continue
        if item.startswith("--megatron-args-file="):
            out.extend(expand_args_files(read_args_file(item.split("=", 1)[1]), _depth + 1))
        else:
            out.append(item)
        i += 1
    return out


def read_args_file(path: str) -> List[str]:
    """Shell-split the flags in ``path``; ``#`` starts a comment. Relative paths resolve against cwd, then the repo."""
    candidates = [Path(path), REPO_ROOT / path]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        raise ValueError(f"--megatron-args-file {path}: no such file (also looked in {REPO_ROOT})")
    return shlex.split(found.read_text(encoding="utf-8"), comments=True)


def resolve_megatron_lm(flag_value: Optional[str], program: str, environ: Optional[dict] = None) -> tuple:
    """(Megatron-LM root, program path); ValueError naming the flag / variable when either is missing."""
    environ = os.environ if environ is None else environ
    raw = flag_value or environ.get(ENV_MEGATRON_LM_PATH)
    if not raw:
        raise ValueError(
            f"Megatron-LM not found: pass --megatron-lm-path PATH or set {ENV_MEGATRON_LM_PATH} "
            f"(a checkout of NVIDIA/Megatron-LM at tag core_v0.16.1)"
        )
    root = Path(raw).expanduser().resolve()
    source = "--megatron-lm-path" if flag_value else ENV_MEGATRON_LM_PATH
    if not (root / "megatron" / "training").is_dir():
        raise ValueError(f"{source}={raw}: {root}/megatron/training does not exist; not a Megatron-LM checkout")
    program_path = root / program
    if not program_path.is_file():
        raise ValueError(f"--megatron-program {program}: {program_path} does not exist")
    return root, program_path


def parse_launch_args(argv: Sequence[str], environ: Optional[dict] = None) -> LaunchPlan:
    """Split ``argv`` into launcher flags and the Megatron command line."""
    expanded = expand_args_files(argv)
    known, rest = _launcher_parser().parse_known_args(expanded)
    root, program = resolve_megatron_lm(known.megatron_lm_path, known.megatron_program, environ)
    return LaunchPlan(megatron_lm_path=root, program=program, megatron_argv=list(rest))


def _put_first_on_path(path: Path) -> None:
    text = str(path)
    if text in sys.path:
        sys.path.remove(text)
    sys.path.insert(0, text)


def install_hooks(megatron_lm_path: Path) -> Any:
    """Put Megatron-LM and the repository root on sys.path, install all patch points; return the Patcher."""
    _put_first_on_path(Path(megatron_lm_path))
    if not (REPO_ROOT / "patches" / "__init__.py").is_file():
        raise RuntimeError(
            f"the patches/ package is not next to libra_megatron ({REPO_ROOT}); run from a checkout of the "
            f"repository or install it with patches/ packaged"
        )
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))
    import patches

    from libra_megatron.megatron.hooks import LibraHooks

    return patches.install_all(LibraHooks())


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``python -m libra_megatron.launch`` and ``scripts/pretrain_gpt_libra.py``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        plan = parse_launch_args(argv)
    except ValueError as err:
        _launcher_parser().print_usage(sys.stderr)
        raise SystemExit(f"libra_megatron.launch: error: {err}") from None
    patcher = install_hooks(plan.megatron_lm_path)
    if os.environ.get("RANK", "0") == "0":
        print(f"libra_megatron.launch: verified and installed {patcher.num_replaced} Megatron-LM attributes "
              f"({plan.megatron_lm_path}); running {plan.program.name}", file=sys.stderr, flush=True)
    sys.argv = [str(plan.program)] + plan.megatron_argv
    runpy.run_path(str(plan.program), run_name="__main__")


if __name__ == "__main__":
    main()
