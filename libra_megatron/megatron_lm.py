"""The one way this project finds Megatron-LM's training code (``megatron/training``, ``pretrain_gpt.py``).

Megatron-LM's training package is not on PyPI. Every script, the launcher and every test call
``get_megatron_lm()``, which tries, in order:

1. ``$MEGATRON_LM_PATH`` (a checkout of a supported tag), when set: used as it is, never modified;
2. the repository's ignored cache ``.cache/megatron-lm/<tag>/Megatron-LM``, when already there;
3. ``../shared/third_party/megatron-lm-<tag>.tar.gz`` beside the checkout (the unmodified upstream tag; CI
   has both), unpacked into that cache;
4. ``git clone --depth 1 --branch <tag> https://github.com/NVIDIA/Megatron-LM`` into that cache (users with
   network access).

``<tag>`` is one of ``RELEASES`` (core_v0.16.1, core_v0.19.0): the ``release`` argument (the launcher's
``--megatron-lm-release``), else ``$LIBRA_MEGATRON_LM_RELEASE``, else the release that pairs with the
installed megatron-core (0.19.x -> core_v0.19.0; read from package metadata, nothing is imported), else
core_v0.16.1 (Python 3.11: the package index serves megatron-core >= 0.17 only for Python >= 3.12). Each
release has its own cache folder, so both can be unpacked side by side.

Nothing of Megatron-LM is committed: the cache folder is in ``.gitignore``. Unpacking and cloning happen
under a file lock into a temporary folder that is renamed into place, so concurrent callers never see a
half-written tree. A tree placed in the cache has its ``megatron`` package byte-compiled once
(``compileall``, this interpreter): every rank of every run then imports it from ``__pycache__`` instead of
compiling it again, which it would do at every start under ``PYTHONDONTWRITEBYTECODE``. Failure raises
``MegatronLMNotFound`` (a ``ValueError``) saying what was tried.

Megatron-LM's Python dependencies are the ``megatron-lm`` extra of ``setup.py`` (pinned; installed by
``scripts/setup_env.sh``). ``missing_package_error`` turns the ``ModuleNotFoundError`` of an import of
Megatron-LM into a ``MegatronLMDependencyMissing`` that names the package to install.

Command line: ``python -m libra_megatron.megatron_lm [--megatron-lm-release TAG]`` prints the path; the scripts
run ``python -m libra_megatron.megatron_lm --from-launcher-args <their command line>`` (only its
``--megatron-lm-release`` is read).
Pure Python: this module locates files and never imports megatron.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import List, Optional

__all__ = ["get_megatron_lm", "check_megatron_lm_tree", "MegatronLMNotFound", "MegatronLMDependencyMissing",
           "missing_package_error", "MEGATRON_LM_TAG", "RELEASES", "ENV_MEGATRON_LM_PATH",
           "ENV_MEGATRON_LM_RELEASE", "select_release", "check_release_pairing", "MegatronLMMismatch", "release_line", "tree_version", "cache_dir",
           "archive_path"]

RELEASES = ("core_v0.16.1", "core_v0.19.0")
"""Megatron-LM tags every patch point is verified against (patches/_base.py keys its tables by release line)."""
MEGATRON_LM_TAG = RELEASES[0]  # the default where nothing selects another (Python 3.11 installs)
ENV_MEGATRON_LM_PATH = "MEGATRON_LM_PATH"
ENV_MEGATRON_LM_RELEASE = "LIBRA_MEGATRON_LM_RELEASE"
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


def release_line(version: str) -> str:
    """``"0.19"`` for megatron-core/Megatron-LM version ``0.19.1`` or tag ``core_v0.19.0``."""
    match = re.search(r"(\d+)\.(\d+)", str(version))
    if match is None:
        raise ValueError(f"cannot read a major.minor version from {version!r}")
    return f"{match.group(1)}.{match.group(2)}"


def _installed_megatron_core() -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def select_release(release: Optional[str] = None, environ: Optional[dict] = None) -> str:
    """The tag to get: ``release``, else ``$LIBRA_MEGATRON_LM_RELEASE``, else the one pairing with the installed
    megatron-core, else ``MEGATRON_LM_TAG``. ``MegatronLMNotFound`` naming the source for an unknown tag."""
    environ = os.environ if environ is None else environ
    chosen, source = release, "--megatron-lm-release"
    if not chosen:
        chosen, source = environ.get(ENV_MEGATRON_LM_RELEASE), ENV_MEGATRON_LM_RELEASE
    if not chosen:
        installed = _installed_megatron_core()
        paired = [tag for tag in RELEASES if installed and release_line(tag) == release_line(installed)]
        return paired[0] if paired else MEGATRON_LM_TAG
    if chosen not in RELEASES:
        raise MegatronLMNotFound(f"{source} {chosen}: not a supported Megatron-LM release; choose one of "
                                 f"{', '.join(RELEASES)}")
    return chosen


def tree_version(root: Path) -> Optional[str]:
    """The version a Megatron-LM tree declares in ``megatron/core/package_info.py`` (read, not imported);
    None when the tree has no such file (then there is nothing to pair or select by)."""
    info = Path(root) / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        return None
    text = info.read_text(encoding="utf-8")
    parts = [re.search(rf"^{name}\s*=\s*(\d+)", text, re.M) for name in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise MegatronLMNotFound(f"{root}/megatron/core/package_info.py declares no MAJOR/MINOR/PATCH version")
    return ".".join(part.group(1) for part in parts)


class MegatronLMMismatch(ValueError):
    """The imported megatron-core and the Megatron-LM tree are different releases."""


def check_release_pairing(core_version: str, core_file: str, root: Path) -> None:
    """One-line ``MegatronLMMismatch`` unless megatron-core ``core_version`` (imported from ``core_file``) and
    the tree at ``root`` are the same major.minor (which lines are supported is ``patches/_base.py``'s check)."""
    tree = tree_version(root)
    supported = {release_line(tag): tag for tag in RELEASES}
    if tree is not None and release_line(core_version) != release_line(tree):
        raise MegatronLMMismatch(
            f"megatron-core {core_version} ({core_file}) does not pair with the Megatron-LM tree {root} (version "
            f"{tree}): install megatron-core {release_line(tree)}.x, or use the tree of release "
            f"{supported.get(release_line(core_version), 'core_v' + release_line(core_version))}")


def cache_dir(repo_root: Path = REPO_ROOT, release: str = MEGATRON_LM_TAG) -> Path:
    """Where the archive is unpacked or the tag cloned: ``<repo>/.cache/megatron-lm/<tag>`` in a checkout,
    else ``$XDG_CACHE_HOME/libra_megatron/megatron-lm/<tag>`` (an installed, non-editable package)."""
    if (repo_root / "setup.py").is_file() and (repo_root / "libra_megatron").is_dir():
        base = repo_root / ".cache"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "libra_megatron"
    return base / "megatron-lm" / release


def archive_path(repo_root: Path = REPO_ROOT, release: str = MEGATRON_LM_TAG) -> Path:
    """The shared archive beside the checkout: ``../shared/third_party/megatron-lm-<tag>.tar.gz``."""
    return repo_root.parent / "shared" / "third_party" / f"megatron-lm-{release}.tar.gz"


def check_megatron_lm_tree(root: Path) -> Optional[str]:
    """None if ``root`` looks like a Megatron-LM checkout, else what is missing."""
    for rel in ("megatron/training/__init__.py", "megatron/core/__init__.py", "pretrain_gpt.py"):
        if not (root / rel).is_file():
            return f"{root / rel} does not exist"
    return None


def get_megatron_lm(environ: Optional[dict] = None, *, release: Optional[str] = None,
                    repo_root: Path = REPO_ROOT, allow_clone: bool = True) -> Path:
    """The Megatron-LM root to use (see the module docstring for the order and the release). Raises
    ``MegatronLMNotFound``."""
    environ = os.environ if environ is None else environ
    explicit = environ.get(ENV_MEGATRON_LM_PATH)
    if explicit:
        root = Path(explicit).expanduser().resolve()
        problem = check_megatron_lm_tree(root)
        if problem:
            raise MegatronLMNotFound(f"{ENV_MEGATRON_LM_PATH}={explicit}: not a Megatron-LM checkout ({problem})")
        return root
    tag = select_release(release, environ)
    target = cache_dir(repo_root, tag) / "Megatron-LM"
    if (target / _READY_MARKER).is_file():
        return target
    tried: List[str] = [f"${ENV_MEGATRON_LM_PATH} is not set"]
    with _locked(cache_dir(repo_root, tag)):
        if (target / _READY_MARKER).is_file():  # another process finished while we waited
            return target
        archive = archive_path(repo_root, tag)
        if archive.is_file():
            _install(target, tag, lambda tmp: _unpack(archive, tmp))
            return target
        tried.append(f"no archive at {archive}")
        if allow_clone:
            error = _try_install_clone(target, tag)
            if error is None:
                return target
            tried.append(error)
    raise MegatronLMNotFound(
        "Megatron-LM not found (" + "; ".join(tried) + f"): set {ENV_MEGATRON_LM_PATH} to a checkout of "
        f"NVIDIA/Megatron-LM at tag {tag}"
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


def _install(target: Path, tag: str, fill) -> None:
    """Run ``fill(tmp)`` to produce a tree in a temporary folder, then move it to ``target`` atomically."""
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=target.parent))
    try:
        root = fill(tmp)
        problem = check_megatron_lm_tree(root)
        if problem:
            raise MegatronLMNotFound(f"the Megatron-LM tree obtained is incomplete: {problem}")
        _byte_compile(root)
        (root / _READY_MARKER).write_text(tag + "\n")
        if target.exists():
            shutil.rmtree(target)
        root.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _byte_compile(root: Path) -> None:
    """Write ``__pycache__`` for the tree's ``megatron`` package (best effort: a file this interpreter cannot
    compile is left to fail, or not, where it is imported, exactly as without this step)."""
    import compileall

    compileall.compile_dir(str(root / "megatron"), quiet=2)


def _unpack(archive: Path, tmp: Path) -> Path:
    with tarfile.open(archive, "r:gz") as tar:
        try:
            tar.extractall(tmp, filter="data")
        except TypeError:  # pragma: no cover - Python without extraction filters
            tar.extractall(tmp)
    return tmp / "Megatron-LM"


def _try_install_clone(target: Path, tag: str) -> Optional[str]:
    """Shallow-clone the tag into ``target``; None on success, else why it failed (one line)."""
    if shutil.which("git") is None:
        return "git is not installed, so the tag could not be cloned"

    def clone(tmp: Path) -> Path:
        dest = tmp / "Megatron-LM"
        subprocess.run(["git", "clone", "--quiet", "--depth", "1", "--branch", tag, CLONE_URL, str(dest)],
                       check=True, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, GIT_TERMINAL_PROMPT="0"))
        return dest

    try:
        _install(target, tag, clone)
    except subprocess.CalledProcessError as err:
        detail = " ".join((err.stderr or "").split())[-200:]
        return f"git clone --branch {tag} {CLONE_URL} failed ({detail or err.returncode})"
    except subprocess.TimeoutExpired:
        return f"git clone of {CLONE_URL} timed out"
    return None


def _main(argv: List[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[:1] == ["--from-launcher-args"]:  # the scripts: their whole command line follows
        argv = argv[1:]
    print(get_megatron_lm(release=release_flag(argv)))
    return 0


def release_flag(argv: List[str]) -> Optional[str]:
    """The value of ``--megatron-lm-release TAG`` / ``=TAG`` anywhere in ``argv`` (a launcher command line), or
    None; the scripts hand their whole command line to ``python -m libra_megatron.megatron_lm``."""
    for i, token in enumerate(argv):
        if token == "--megatron-lm-release":
            if i + 1 >= len(argv):
                raise ValueError("--megatron-lm-release needs a tag: " + ", ".join(RELEASES))
            return argv[i + 1]
        if token.startswith("--megatron-lm-release="):
            return token.split("=", 1)[1]
    return None


if __name__ == "__main__":
    from .cli import run_cli

    run_cli("libra_megatron.megatron_lm", _main, sys.argv[1:])
