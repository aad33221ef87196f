"""Fork-free Megatron-LM launcher: ``python -m libra_megatron.launch [launcher flags] <pretrain_gpt flags>``.

What it does, in order, all before ``torch.distributed`` is initialised:

1. expands ``--megatron-args-file FILE`` (repeatable; shell-quoted tokens, ``#`` comments) in place, so a
   model config in ``configs/`` plus per-run flags form one Megatron command line. Relative paths given to
   ``--megatron-args-file`` and ``--libra-config`` *inside* an args file resolve against that file's folder;
   on the command line they resolve against the working directory (``--megatron-args-file`` also falls back
   to the repository root). Every other flag (``--data-path``, ``--save``, ...) is passed on unchanged, so
   relative paths resolve against the working directory, as with ``pretrain_gpt.py`` itself;
2. finds Megatron-LM: ``--megatron-lm-path``, else ``libra_megatron.megatron_lm.get_megatron_lm()``
   (``MEGATRON_LM_PATH``, the repository cache, the archive beside the checkout, a shallow clone) of the
   release ``--megatron-lm-release`` selects (core_v0.16.1 or core_v0.19.0; see that module);
3. checks that CUDA is available (the CPU test harness, ``scripts/cpu_pretrain.sh``, emulates it); with
   ``--check-only`` and no GPU visible it goes on and says that CUDA was not checked;
4. puts the tree on sys.path (after an installed megatron-core, which is then the one used), checks that the
   imported megatron-core and the tree are the same release line, and imports Megatron-LM's training
   package (a missing Python package is named, with its pip command);
5. parses the command line with Megatron-LM's own ``parse_args`` (with the ``--libra-*`` flags) and runs
   every Libra start-up check on what Megatron will use, defaults included
   (``libra_megatron.megatron.hooks.validate_run``), then what Megatron-LM would reject later: its own
   ``validate_args``, the full-size ``TransformerConfig``, the attention settings ``LibraCoreAttention`` does not
   implement and the ``--spec`` object (``libra_megatron.megatron.model_checks.check_model``; without a GPU,
   ``validate_args``' device queries are answered as ``--check-device-capability``);
6. verifies and installs every patch point (``libra_megatron.patches.install_all``) with a fresh
   ``LibraHooks`` and runs the program (default ``pretrain_gpt.py``) as ``__main__`` with
   ``sys.argv = [program, <remaining flags>]``.

``--check-only`` stops after step 6 (the patches are verified, then undone): the torchrun scripts run it once,
with ``WORLD_SIZE`` set, before starting the ranks, so a bad command line is one line, not one per rank
plus torchrun's report. It needs no GPU: a login node can check a 512-GPU config before submitting it.

Every user error of steps 1-5 is one line, ``libra_megatron.launch: error: ...``, exit status 2
(``libra_megatron.cli.run_cli``; ``--debug`` or ``LIBRA_DEBUG=1`` shows the traceback). ``--help`` prints
the launcher's flags, then Megatron-LM's (with ``--libra-*``) when Megatron-LM can be found.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .cli import add_debug_argument, run_cli
from .megatron_lm import (
    ENV_MEGATRON_LM_PATH,
    ENV_MEGATRON_LM_RELEASE,
    MEGATRON_LM_TAG,
    RELEASES,
    check_release_pairing,
    get_megatron_lm,
    missing_package_error,
    release_line,
    tree_version,
)

__all__ = ["LaunchPlan", "parse_launch_args", "expand_args_files", "resolve_megatron_lm", "import_patches",
           "import_megatron_training", "check_cuda",
           "cuda_visible", "parse_device_capability", "check_summary", "install_hooks", "run_program", "main", "TOOL"]

TOOL = "libra_megatron.launch"
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class LaunchPlan:
    """Resolved launch: the program file to run as __main__ and the argv Megatron will parse."""

    megatron_lm_path: Path
    program: Path
    megatron_argv: List[str]


def _launcher_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {TOOL}", allow_abbrev=False, add_help=False,
        description="Run Megatron-LM's pretrain_gpt.py with Libra attached (no fork). Every flag not listed "
                    "here goes to the program unchanged.",
    )
    parser.add_argument("-h", "--help", action="store_true",
                        help="show this help, then Megatron-LM's (with the --libra-* flags) when it is found")
    parser.add_argument("--megatron-lm-path", default=None,
                        help=f"Megatron-LM checkout (tag {' or '.join(RELEASES)}); default: ${ENV_MEGATRON_LM_PATH}, "
                             f"else the repository cache / the archive beside the checkout / a shallow clone "
                             f"(libra_megatron.megatron_lm) of --megatron-lm-release")
    parser.add_argument("--megatron-lm-release", default=None, choices=RELEASES,
                        help=f"which release the getter provides when no path is given; default: "
                             f"${ENV_MEGATRON_LM_RELEASE}, else the one pairing with the installed megatron-core, "
                             f"else {MEGATRON_LM_TAG}")
    parser.add_argument("--megatron-program", default="pretrain_gpt.py",
                        help="program inside Megatron-LM to run (default pretrain_gpt.py)")
    parser.add_argument("--megatron-args-file", action="append", default=[],
                        help="file of Megatron flags (shell quoting, # comments), expanded in place; repeatable. "
                             "Relative --megatron-args-file/--libra-config paths inside it resolve against its "
                             "folder")
    parser.add_argument("--check-only", action="store_true",
                        help="run every start-up check (Megatron-LM, CUDA, flags, validate_args, the full-size "
                             "TransformerConfig, --spec, patch targets) and exit; the scripts do this once before "
                             "torchrun (set WORLD_SIZE for the DP-dependent checks). Works without a GPU")
    parser.add_argument("--check-device-capability", default="9.0", metavar="MAJOR.MINOR",
                        help="with --check-only and no GPU visible: the compute capability validate_args' device "
                             "queries are answered with (default 9.0, Hopper; 10.0 for Blackwell)")
    add_debug_argument(parser)
    return parser


# ---------------------------------------------------------------------------------------- args files
def expand_args_files(argv: Sequence[str], _depth: int = 0, _base: Optional[Path] = None) -> List[str]:
    """Replace each ``--megatron-args-file FILE`` (or ``=FILE``) with the flags read from FILE, in place.

    Files may include other files the same way (a run config includes its model config), up to 8 deep.
    ``_base``: the folder of the file ``argv`` was read from (None: the command line).
    """
    if _depth > 8:
        raise ValueError("--megatron-args-file nesting deeper than 8: a file includes itself?")
    out: List[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        flag, value, width = _split_flag(items, i, "--megatron-args-file")
        if flag:
            if value is None:
                raise ValueError("--megatron-args-file needs a file path")
            path = _find_args_file(value, _base)
            out.extend(expand_args_files(read_args_file(path), _depth + 1, path.parent))
            i += width
            continue
        out.append(items[i])
        i += 1
    return out


def _split_flag(items: List[str], i: int, name: str) -> tuple:
    """(is ``name``, its value or None, tokens used) for ``name VALUE`` and ``name=VALUE`` at ``items[i]``."""
    item = items[i]
    if item == name:
        return True, (items[i + 1] if i + 1 < len(items) else None), 2
    if item.startswith(name + "="):
        return True, item.split("=", 1)[1], 1
    return False, None, 1


def _find_args_file(path: str, base: Optional[Path]) -> Path:
    """Inside an args file: relative to its folder. On the command line: the cwd, then the repository root."""
    candidate = Path(path).expanduser()
    if base is not None:
        found = candidate if candidate.is_absolute() else base / candidate
        if not found.is_file():
            raise ValueError(f"--megatron-args-file {path} (in {base}): no such file {found}")
        return found.resolve()
    for found in (candidate, REPO_ROOT / candidate):
        if found.is_file():
            return found.resolve()
    raise ValueError(f"--megatron-args-file {path}: no such file (also looked in {REPO_ROOT})")


def read_args_file(path: Path) -> List[str]:
    """Shell-split the flags in ``path`` (``#`` starts a comment); a relative ``--libra-config`` value becomes
    a path relative to the file's folder (nested ``--megatron-args-file``: see ``expand_args_files``)."""
    tokens = shlex.split(Path(path).read_text(encoding="utf-8"), comments=True)
    out: List[str] = []
    i = 0
    while i < len(tokens):
        flag, value, width = _split_flag(tokens, i, "--libra-config")
        if flag and value is not None:
            out.extend(["--libra-config", _against(Path(path).parent, value)])
        else:
            out.extend(tokens[i:i + width])
        i += width
    return out


def _against(folder: Path, value: str) -> str:
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (folder / path).resolve())


# ---------------------------------------------------------------------------------------- Megatron-LM
def resolve_megatron_lm(flag_value: Optional[str], program: str, environ: Optional[dict] = None,
                        getter: Callable[..., Path] = get_megatron_lm, release: Optional[str] = None) -> tuple:
    """(Megatron-LM root, program path): ``--megatron-lm-path`` if given, else ``getter(environ)``
    (the one getter: ``$MEGATRON_LM_PATH``, the cache, the archive, a clone) of ``release``
    (``--megatron-lm-release``; None: the getter's choice). ValueError naming the source."""
    if flag_value:
        root = Path(flag_value).expanduser().resolve()
        if not (root / "megatron" / "training").is_dir():
            raise ValueError(f"--megatron-lm-path={flag_value}: {root}/megatron/training does not exist; "
                             f"not a Megatron-LM checkout")
    else:
        environ = os.environ if environ is None else environ
        root = Path(getter(environ) if release is None else getter(dict(environ, **{ENV_MEGATRON_LM_RELEASE: release})))
    version = tree_version(root)
    if release is not None and (version is None or release_line(version) != release_line(release)):
        raise ValueError(f"--megatron-lm-release {release}, but the Megatron-LM tree {root} (from "
                         f"{'--megatron-lm-path' if flag_value else '$' + ENV_MEGATRON_LM_PATH}) is version "
                         f"{version or 'unknown (no megatron/core/package_info.py)'}; drop one of them")
    program_path = root / program
    if not program_path.is_file():
        raise ValueError(f"--megatron-program {program}: {program_path} does not exist")
    return root, program_path


def parse_launch_args(argv: Sequence[str], environ: Optional[dict] = None,
                      getter: Callable[..., Path] = get_megatron_lm) -> LaunchPlan:
    """Split ``argv`` into launcher flags and the Megatron command line."""
    known, rest = _launcher_parser().parse_known_args(expand_args_files(argv))
    root, program = resolve_megatron_lm(known.megatron_lm_path, known.megatron_program, environ, getter,
                                        known.megatron_lm_release)
    return LaunchPlan(megatron_lm_path=root, program=program, megatron_argv=list(rest))


def _put_on_path(path: Path) -> None:
    """The tree on sys.path, where it is already or else: after site-packages when megatron-core is installed
    (the installed megatron-core is used, e.g. 0.19.2 from the package index on Python 3.12+), first when not
    (the tree's own ``megatron/core``)."""
    text = str(path)
    if text in sys.path:
        return
    if _megatron_core_importable():
        sys.path.append(text)
    else:
        sys.path.insert(0, text)


def _megatron_core_importable() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no "megatron" package at all
        return False


def import_megatron_training(megatron_lm_path: Path) -> None:
    """Megatron-LM on sys.path (``_put_on_path``), the pairing of the imported megatron-core with the tree
    checked, then its training package imported by name (the launcher only checks that it imports;
    ``libra_megatron.megatron`` and the patch points use it); a missing package is named."""
    _put_on_path(Path(megatron_lm_path))
    try:
        core = importlib.import_module("megatron.core")
    except ModuleNotFoundError as err:
        raise missing_package_error(err, f"Megatron-LM ({megatron_lm_path})") from err
    check_release_pairing(core.__version__, getattr(core, "__file__", "?"), Path(megatron_lm_path))
    for name in ("megatron.training.arguments", "megatron.training.training"):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            raise missing_package_error(err, f"Megatron-LM ({megatron_lm_path})") from err


def import_patches() -> Any:
    """``libra_megatron.patches`` (the repository's ``patches/`` folder), installed or from this checkout."""
    try:
        return importlib.import_module("libra_megatron.patches")
    except ModuleNotFoundError as err:
        if err.name != "libra_megatron.patches":
            raise
    init = REPO_ROOT / "patches" / "__init__.py"
    if not init.is_file():
        raise RuntimeError(f"libra_megatron.patches is not installed and {init} does not exist")
    spec = importlib.util.spec_from_file_location("libra_megatron.patches", init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def check_cuda() -> None:
    """Megatron-LM's pretrain() needs CUDA; say so before any distributed start-up."""
    if not cuda_visible():
        raise ValueError(
            "no CUDA device is visible (torch.cuda.is_available() is False): Megatron-LM's pretrain() needs "
            "GPUs. On a CPU machine, run the test harness: bash scripts/cpu_pretrain.sh <the same flags>; to "
            "check a command line without a GPU, add --check-only"
        )


def parse_device_capability(text: str) -> Tuple[int, int]:
    """``"9.0"`` -> (9, 0); ValueError naming the flag otherwise."""
    match = re.fullmatch(r"(\d+)\.(\d+)", text.strip())
    if match is None:
        raise ValueError(f"--check-device-capability {text}: give MAJOR.MINOR, e.g. 9.0 (H100) or 10.0 (B200)")
    return int(match.group(1)), int(match.group(2))


def install_hooks(megatron_lm_path: Path) -> Any:
    """Megatron-LM importable, every patch point verified and installed with ``LibraHooks``; the Patcher."""
    import_megatron_training(megatron_lm_path)
    patches = import_patches()

    from .megatron.hooks import LibraHooks

    return patches.install_all(LibraHooks())


# ---------------------------------------------------------------------------------------- help
def _print_help(argv: Sequence[str], before_megatron_import: Optional[Callable[[LaunchPlan], None]] = None) -> None:
    """The launcher's help, then Megatron-LM's with --libra-* (never clones; a note if it cannot be found)."""
    _launcher_parser().print_help()
    try:
        known, _ = _launcher_parser().parse_known_args(expand_args_files(argv))
        root, program = resolve_megatron_lm(known.megatron_lm_path, known.megatron_program,
                                            getter=lambda env: get_megatron_lm(env, allow_clone=False),
                                            release=known.megatron_lm_release)
        if before_megatron_import is not None:
            before_megatron_import(LaunchPlan(root, program, []))
        import_megatron_training(root)
    except ValueError as err:
        print(f"\n(Megatron-LM's own flags are not shown: {err})")
        return
    print(f"\nMegatron-LM's {program.name} flags ({root}), with the --libra-* flags:\n", flush=True)
    from .megatron.args import print_megatron_help

    print_megatron_help(program)


# ---------------------------------------------------------------------------------------- main
def _main(argv: List[str], on_megatron_ready: Optional[Callable[[LaunchPlan], None]],
          before_megatron_import: Optional[Callable[[LaunchPlan], None]] = None) -> int:
    known, _ = _launcher_parser().parse_known_args(argv)
    if known.help:
        _print_help(argv, before_megatron_import)
        return 0
    plan = parse_launch_args(argv)
    capability = None  # None: validate_args asks the GPU
    if not known.check_only:
        check_cuda()
    elif not cuda_visible():
        capability = parse_device_capability(known.check_device_capability)
    if before_megatron_import is not None:
        before_megatron_import(plan)
    import_megatron_training(plan.megatron_lm_path)
    from .megatron.args import parse_megatron_args
    from .megatron.hooks import validate_run
    from .megatron.model_checks import check_model

    args = parse_megatron_args(plan.program, plan.megatron_argv)
    validate_run(args)
    model_config = check_model(args, capability)
    patcher = install_hooks(plan.megatron_lm_path)
    if known.check_only:
        patcher.undo()
        print(f"{TOOL}: start-up checks passed ({check_summary(args, model_config, capability)}; Megatron-LM "
              f"{plan.megatron_lm_path})", file=sys.stderr, flush=True)
        return 0
    if on_megatron_ready is not None:
        on_megatron_ready(plan)
    if os.environ.get("RANK", "0") == "0":
        print(f"{TOOL}: verified and installed {patcher.num_replaced} Megatron-LM attributes "
              f"({plan.megatron_lm_path}); running {plan.program.name}", file=sys.stderr, flush=True)
    run_program(plan)
    return 0


def check_summary(args: Any, model_config: Any, capability: Optional[Tuple[int, int]]) -> str:
    """What --check-only checked, in one line: layout, model, spec, and whether CUDA was checked."""
    layout = (f"world size {args.world_size} = TP {args.tensor_model_parallel_size} x PP "
              f"{args.pipeline_model_parallel_size} x CP {args.context_parallel_size} x DP {args.data_parallel_size}")
    experts = f", {model_config.num_moe_experts} experts" if model_config.num_moe_experts else ""
    model = (f"full-size TransformerConfig: {model_config.num_layers} layers, hidden {model_config.hidden_size}, "
             f"{model_config.num_attention_heads} heads{experts}, recompute {model_config.recompute_granularity}")
    cuda = ("CUDA checked" if capability is None else
            f"CUDA not checked (no GPU visible; validate_args' device queries answered as compute capability "
            f"{capability[0]}.{capability[1]}, --check-device-capability)")
    return f"{layout}; {model}; --spec {' '.join(args.spec)}; {cuda}"


def run_program(plan: LaunchPlan) -> None:
    """The program as ``__main__``; a package it imports lazily that is missing is named in one line."""
    sys.argv = [str(plan.program)] + plan.megatron_argv
    try:
        runpy.run_path(str(plan.program), run_name="__main__")
    except ModuleNotFoundError as err:
        raise missing_package_error(err, f"Megatron-LM's {plan.program.name}") from err


def main(argv: Optional[Sequence[str]] = None, *,
         on_megatron_ready: Optional[Callable[[LaunchPlan], None]] = None,
         before_megatron_import: Optional[Callable[[LaunchPlan], None]] = None) -> None:
    """Entry point of ``python -m libra_megatron.launch`` and ``scripts/pretrain_gpt_libra.py``.

    ``before_megatron_import(plan)`` runs before Megatron-LM is imported and ``on_megatron_ready(plan)`` after
    the patch points are installed, before the program (the CPU test harness sets up its imports and applies
    its Megatron-level shims there).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    run_cli(TOOL, lambda a: _main(a, on_megatron_ready, before_megatron_import), args)


if __name__ == "__main__":
    main()
