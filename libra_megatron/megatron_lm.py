"""The one way this project finds Megatron-LM's training code (``megatron/training``, ``pretrain_gpt.py``).

Megatron-LM's training package is not on PyPI. Every script, the launcher and every test call
``get_megatron_lm()``, which tries, in order:

1. ``$MEGATRON_LM_PATH`` (a checkout of tag ``core_v0.16.1``), when set: used as it is, never modified;
2. the repository's ignored cache ``.cache/megatron-lm/core_v0.16.1/Megatron-LM``, when already there;
3. ``../shared/third_party/megatron-lm-core_v0.16.1.tar.gz`` beside the checkout (the unmodified upstream
   tag; CI has it), unpacked into that cache;
4. ``git clone --depth 1 --branch core_v0.16.1 https://github.com/NVIDIA/Megatron-LM`` into that cache
   (users with network access).

Nothing of Megatron-LM is committed: the cache folder is in ``.gitignore``. Unpacking and cloning happen
under a file lock into a temporary folder that is renamed into place, so concurrent callers never see a
half-written tree. Failure raises ``MegatronLMNotFound`` (a ``ValueError``) saying what was tried.

Megatron-LM's Python dependencies are the ``megatron-lm`` extra of ``setup.py`` (pinned; installed by
``scripts/setup_env.sh``). ``missing_package_error`` turns the ``ModuleNotFoundError`` of an import of
Megatron-LM into a ``MegatronLMDependencyMissing`` that names the package to install.

Command line (for shell scripts): ``python -m libra_megatron.megatron_lm`` prints the path.
Pure Python: this module locates files and never imports megatron.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import List, Optional

__all__ = ["get_megatron_lm", "check_megatron_lm_tree", "MegatronLMNotFound", "MegatronLMDependencyMissing",
           "missing_package_error", "MEGATRON_LM_TAG", "ENV_MEGATRON_LM_PATH", "cache_dir", "archive_path"]

MEGATRON_LM_TAG = "core_v0.16.1"
ENV_MEGATRON_LM_PATH = "MEGATRON_LM_PATH"
ARCHIVE_NAME = f"megatron-lm-{MEGATRON_LM_TAG}.tar.gz"
CLONE_URL = "https://github.com/NVIDIA/Megatron-LM"
REPO_ROOT = Path(__file__).resolve().parents[1]
_READY_MARKER = ".libra-megatron-lm-ready"


class MegatronLMNotFound(ValueError):
    """No usable Megatron-LM tree: none of the sources in the module docstring worked."""


class MegatronLMDependencyMissing(ValueError):
    """Megatron-LM imports a Python package that is not installed (an environment problem, not a patch one)."""


# import name -> distribution name, where they differ
_PIP_NAMES = {"yaml": "pyyaml", "google": "protobuf", "PIL": "pillow", "sklearn": "scikit-learn"}


def missing_package_error(err: ModuleNotFoundError, what: str = "Megatron-LM") -> ValueError:
    """The one-line error for ``err`` raised while importing ``what``.

    A missing third-party package becomes ``MegatronLMDependencyMissing`` naming it and the pip command;
    a missing ``megatron.*`` module means the tree itself is incomplete (``MegatronLMNotFound``).
    """
    name = (err.name or str(err)).split(".")[0]
    if name == "megatron":
        return MegatronLMNotFound(f"{what} is incomplete or not on sys.path: {err}")
    package = _PIP_NAMES.get(name, name)
    return MegatronLMDependencyMissing(
        f"{what} needs the Python package '{package}' (pip install {package}; "
        f"`pip install -e .[megatron-lm]` installs every package Megatron-LM imports, pinned)"
    )


def cache_dir(repo_root: Path = REPO_ROOT) -> Path:
    """Where the archive is unpacked or the tag cloned: ``<repo>/.cache/megatron-lm/<tag>`` in a checkout,
    else ``$XDG_CACHE_HOME/libra_megatron/megatron-lm/<tag>`` (an installed, non-editable package)."""
    if (repo_root / "setup.py").is_file() and (repo_root / "libra_megatron").is_dir():
        base = repo_root / ".cache"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "libra_megatron"
    return base / "megatron-lm" / MEGATRON_LM_TAG


def archive_path(repo_root: Path = REPO_ROOT) -> Path:
    """The shared archive beside the checkout: ``../shared/third_party/megatron-lm-core_v0.16.1.tar.gz``."""
    return repo_root.parent / "shared" / "third_party" / ARCHIVE_NAME


def check_megatron_lm_tree(root: Path) -> Optional[str]:
    """None if ``root`` looks like a Megatron-LM checkout, else what is missing."""
    for rel in ("megatron/training/__init__.py", "megatron/core/__init__.py", "pretrain_gpt.py"):
        if not (root / rel).is_file():
            return f"{root / rel} does not exist"
    return None


def get_megatron_lm(environ: Optional[dict] = None, *, repo_root: Path = REPO_ROOT,
                    allow_clone: bool = True) -> Path:
    """The Megatron-LM root to use (see the module docstring for the order). Raises ``MegatronLMNotFound``."""
    environ = os.environ if environ is None else environ
    explicit = environ.get(ENV_MEGATRON_LM_PATH)
    if explicit:
        root = Path(explicit).expanduser().resolve()
        problem = check_megatron_lm_tree(root)
        if problem:
            raise MegatronLMNotFound(f"{ENV_MEGATRON_LM_PATH}={explicit}: not a Megatron-LM checkout ({problem})")
        return root
    target = cache_dir(repo_root) / "Megatron-LM"
    if (target / _READY_MARKER).is_file():
        return target
    tried: List[str] = [f"${ENV_MEGATRON_LM_PATH} is not set"]
    with _locked(cache_dir(repo_root)):
        if (target / _READY_MARKER).is_file():  # another process finished while we waited
            return target
        archive = archive_path(repo_root)
        if archive.is_file():
            _install(target, lambda tmp: _unpack(archive, tmp))
            return target
        tried.append(f"no archive at {archive}")
        if allow_clone:
            error = _try_install_clone(target)
            if error is None:
                return target
            tried.append(error)
    raise MegatronLMNotFound(
        "Megatron-LM not found (" + "; ".join(tried) + f"): set {ENV_MEGATRON_LM_PATH} to a checkout of "
        f"NVIDIA/Megatron-LM at tag {MEGATRON_LM_TAG}"
    )


@contextlib.contextmanager
def _locked(folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as handle:
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - no fcntl (Windows): best effort without a lock
            pass
        yield


def _install(target: Path, fill) -> None:
    """Run ``fill(tmp)`` to produce a tree in a temporary folder, then move it to ``target`` atomically."""
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=target.parent))
    try:
        root = fill(tmp)
        problem = check_megatron_lm_tree(root)
        if problem:
            raise MegatronLMNotFound(f"the Megatron-LM tree obtained is incomplete: {problem}")
        (root / _READY_MARKER).write_text(MEGATRON_LM_TAG + "\n")
        if target.exists():
            shutil.rmtree(target)
        root.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _unpack(archive: Path, tmp: Path) -> Path:
    with tarfile.open(archive, "r:gz") as tar:
        try:
            tar.extractall(tmp, filter="data")
        except TypeError:  # pragma: no cover - Python without extraction filters
            tar.extractall(tmp)
    return tmp / "Megatron-LM"


def _try_install_clone(target: Path) -> Optional[str]:
    """Shallow-clone the tag into ``target``; None on success, else why it failed (one line)."""
    if shutil.which("git") is None:
        return "git is not installed, so the tag could not be cloned"

    def clone(tmp: Path) -> Path:
        dest = tmp / "Megatron-LM"
        subprocess.run(["git", "clone", "--quiet", "--depth", "1", "--branch", MEGATRON_LM_TAG, CLONE_URL, str(dest)],
                       check=True, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, GIT_TERMINAL_PROMPT="0"))
        return dest

    try:
        _install(target, clone)
    except subprocess.CalledProcessError as err:
        detail = " ".join((err.stderr or "").split())[-200:]
        return f"git clone --branch {MEGATRON_LM_TAG} {CLONE_URL} failed ({detail or err.returncode})"
    except subprocess.TimeoutExpired:
        return f"git clone of {CLONE_URL} timed out"
    return None


def _main(argv: List[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    print(get_megatron_lm())
    return 0


if __name__ == "__main__":
    from .cli import run_cli

    run_cli("libra_megatron.megatron_lm", _main, sys.argv[1:])
