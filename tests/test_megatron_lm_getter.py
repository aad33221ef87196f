"""The one Megatron-LM getter (``libra_megatron.megatron_lm``): its order of sources, its cache, its errors.

Fake trees and a fake archive in a temporary "clone" (``repo_root``); no network: cloning is disabled except
where a test replaces git with a fake that fails.
"""
import os
import tarfile

import pytest

from libra_megatron import megatron_lm
from libra_megatron.megatron_lm import (
    MegatronLMDependencyMissing,
    MegatronLMMismatch,
    MegatronLMNotFound,
    archive_path,
    cache_dir,
    check_release_pairing,
    get_megatron_lm,
    missing_package_error,
    select_release,
    tree_version,
)

TREE_FILES = ("megatron/training/__init__.py", "megatron/core/__init__.py", "pretrain_gpt.py")


def _tree(root, version="0.16.1"):
    for rel in TREE_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
    major, minor, patch = version.split(".")
    (root / "megatron/core/package_info.py").write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\n")
    return root


@pytest.fixture
def clone(tmp_path):
    """A checkout of this repository at tmp/work/clone, with tmp/work/shared beside it (empty)."""
    repo = tmp_path / "work" / "clone"
    (repo / "libra_megatron").mkdir(parents=True)
    (repo / "setup.py").write_text("")
    return repo


def _archive(clone, tmp_path, release="core_v0.16.1"):
    src = _tree(tmp_path / "src" / release / "Megatron-LM", release.split("_v")[1])
    path = archive_path(clone, release)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        tar.add(src, arcname="Megatron-LM")
    return path


def test_environment_variable_wins_and_is_used_as_it_is(clone, tmp_path):
    tree = _tree(tmp_path / "mine")
    _archive(clone, tmp_path)
    assert get_megatron_lm({"MEGATRON_LM_PATH": str(tree)}, repo_root=clone, allow_clone=False) == tree.resolve()
    assert not cache_dir(clone).exists()  # the archive was not touched


def test_a_bad_environment_variable_is_an_error_not_a_fallback(clone, tmp_path):
    _archive(clone, tmp_path)
    with pytest.raises(MegatronLMNotFound, match=r"^MEGATRON_LM_PATH=.*: not a Megatron-LM checkout \(.*"
                                                 r"megatron/training/__init__.py does not exist\)$"):
        get_megatron_lm({"MEGATRON_LM_PATH": str(tmp_path)}, repo_root=clone, allow_clone=False)


def test_the_archive_beside_the_checkout_is_unpacked_once_into_the_ignored_cache(clone, tmp_path):
    archive = _archive(clone, tmp_path)
    root = get_megatron_lm({}, repo_root=clone, allow_clone=False)
    assert root == cache_dir(clone) / "Megatron-LM" and root.is_relative_to(clone / ".cache")
    assert all((root / rel).is_file() for rel in TREE_FILES)
    os.remove(archive)  # the ready cache is used from now on
    assert get_megatron_lm({}, repo_root=clone, allow_clone=False) == root
    assert [p.name for p in cache_dir(clone).iterdir() if p.name.startswith(".partial-")] == []


def test_the_unpacked_megatron_package_is_byte_compiled_and_a_given_tree_is_not(clone, tmp_path):
    """Every module of the cached tree's ``megatron`` package has the bytecode file this interpreter's importer
    looks for (so ranks started under PYTHONDONTWRITEBYTECODE do not compile it at each start); a tree given by
    $MEGATRON_LM_PATH is used as it is, nothing written into it."""
    import importlib.util

    _archive(clone, tmp_path)
    root = get_megatron_lm({}, repo_root=clone, allow_clone=False)
    sources = sorted((root / "megatron").rglob("*.py"))
    assert len(sources) == 3 and all(os.path.isfile(importlib.util.cache_from_source(str(p))) for p in sources)
    mine = _tree(tmp_path / "mine")
    get_megatron_lm({"MEGATRON_LM_PATH": str(mine)}, repo_root=clone, allow_clone=False)
    assert list(mine.rglob("__pycache__")) == []


def test_nothing_found_names_every_source_tried(clone):
    with pytest.raises(MegatronLMNotFound) as info:
        get_megatron_lm({}, repo_root=clone, allow_clone=False)
    message = str(info.value)
    assert "MEGATRON_LM_PATH is not set" in message and f"no archive at {archive_path(clone)}" in message
    assert message.endswith("set MEGATRON_LM_PATH to a checkout of NVIDIA/Megatron-LM at tag core_v0.16.1")


def test_a_failed_clone_is_reported_in_one_line(clone, tmp_path, monkeypatch):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "git").write_text("#!/bin/sh\necho 'fatal: unable to access: network is unreachable' >&2\nexit 128\n")
    (fake_bin / "git").chmod(0o755)
    monkeypatch.setenv("PATH", str(fake_bin))
    with pytest.raises(MegatronLMNotFound, match=r"git clone --branch core_v0.16.1 .* failed \(fatal: unable "
                                                 r"to access: network is unreachable\)"):
        get_megatron_lm({}, repo_root=clone, allow_clone=True)
    assert not (cache_dir(clone) / "Megatron-LM").exists()


@pytest.mark.parametrize("missing, package", [("six", "six"), ("yaml", "pyyaml"), ("triton.language", "triton")])
def test_a_missing_dependency_names_the_package_to_install(missing, package):
    error = missing_package_error(ModuleNotFoundError(f"No module named '{missing}'", name=missing))
    assert isinstance(error, MegatronLMDependencyMissing) and isinstance(error, ValueError)
    assert str(error).startswith(f"Megatron-LM needs the Python package '{package}' (pip install {package};")


def test_a_missing_megatron_module_means_an_incomplete_tree():
    error = missing_package_error(ModuleNotFoundError("No module named 'megatron.training'",
                                                      name="megatron.training"))
    assert isinstance(error, MegatronLMNotFound) and "incomplete" in str(error)


def test_each_release_is_unpacked_into_its_own_cache_folder(clone, tmp_path):
    """The release argument (the launcher's --megatron-lm-release) and LIBRA_MEGATRON_LM_RELEASE select it."""
    _archive(clone, tmp_path, "core_v0.16.1")
    _archive(clone, tmp_path, "core_v0.19.0")
    old = get_megatron_lm({}, release="core_v0.16.1", repo_root=clone, allow_clone=False)
    new = get_megatron_lm({"LIBRA_MEGATRON_LM_RELEASE": "core_v0.19.0"}, repo_root=clone, allow_clone=False)
    assert old == cache_dir(clone, "core_v0.16.1") / "Megatron-LM" and tree_version(old) == "0.16.1"
    assert new == cache_dir(clone, "core_v0.19.0") / "Megatron-LM" and tree_version(new) == "0.19.0"
    assert get_megatron_lm({}, release="core_v0.16.1", repo_root=clone, allow_clone=False) == old  # both kept


def test_an_unknown_release_names_the_variable_and_the_supported_tags():
    with pytest.raises(MegatronLMNotFound, match=r"^LIBRA_MEGATRON_LM_RELEASE core_v0.18.0: not a supported "
                                                 r"Megatron-LM release; choose one of core_v0.16.1, core_v0.19.0$"):
        select_release(None, {"LIBRA_MEGATRON_LM_RELEASE": "core_v0.18.0"})


@pytest.mark.parametrize("installed, expected", [("0.16.1", "core_v0.16.1"), ("0.19.2", "core_v0.19.0"),
                                                 (None, "core_v0.16.1"), ("0.20.0", "core_v0.16.1")])
def test_the_default_release_pairs_with_the_installed_megatron_core(monkeypatch, installed, expected):
    """Python 3.11 installs have megatron-core 0.16.1 (core_v0.16.1); 3.12+ with 0.19.x from the index get
    core_v0.19.0; an explicit choice always wins."""
    monkeypatch.setattr(megatron_lm, "_installed_megatron_core", lambda: installed)
    assert select_release(None, {}) == expected
    assert select_release("core_v0.19.0", {"LIBRA_MEGATRON_LM_RELEASE": "core_v0.16.1"}) == "core_v0.19.0"


def test_a_megatron_core_that_does_not_pair_with_the_tree_is_one_line(tmp_path):
    """The 3.12 situation faked with versions: megatron-core 0.16.1 imported beside a core_v0.19 tree."""
    tree = _tree(tmp_path / "Megatron-LM", "0.19.0")
    check_release_pairing("0.19.2", "/site-packages/megatron/core/__init__.py", tree)  # 0.19.x pairs with 0.19
    with pytest.raises(MegatronLMMismatch) as info:
        check_release_pairing("0.16.1", "/site-packages/megatron/core/__init__.py", tree)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, ValueError)
    assert message == (f"megatron-core 0.16.1 (/site-packages/megatron/core/__init__.py) does not pair with the "
                       f"Megatron-LM tree {tree} (version 0.19.0): install megatron-core 0.19.x, or use the tree "
                       f"of release core_v0.16.1")
