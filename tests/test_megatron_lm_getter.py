"""The one Megatron-LM getter (``libra_megatron.megatron_lm``): its order of sources, its cache, its errors.

Fake trees and a fake archive in a temporary "clone" (``repo_root``); no network: cloning is disabled except
where a test replaces git with a fake that fails.
"""
import os
import tarfile

import pytest

from libra_megatron.megatron_lm import (
    MegatronLMDependencyMissing,
    MegatronLMNotFound,
    archive_path,
    cache_dir,
    get_megatron_lm,
    missing_package_error,
)

TREE_FILES = ("megatron/training/__init__.py", "megatron/core/__init__.py", "pretrain_gpt.py")


def _tree(root):
    for rel in TREE_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
    return root


@pytest.fixture
def clone(tmp_path):
    """A checkout of this repository at tmp/work/clone, with tmp/work/shared beside it (empty)."""
    repo = tmp_path / "work" / "clone"
    (repo / "libra_megatron").mkdir(parents=True)
    (repo / "setup.py").write_text("")
    return repo


def _archive(clone, tmp_path):
    src = _tree(tmp_path / "src" / "Megatron-LM")
    path = archive_path(clone)
    path.parent.mkdir(parents=True)
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
