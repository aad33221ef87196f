"""Shared fixtures of the launcher tests: Megatron-LM from the getter, and fake modules."""
import importlib
import sys
import textwrap

import pytest

from .megatron_lm import megatron_lm_path as _megatron_lm_path


@pytest.fixture(scope="session")
def megatron_lm_path():
    """Megatron-LM's root (``libra_megatron.megatron_lm``); FAILS under CI, skips elsewhere, if unavailable."""
    return _megatron_lm_path()


@pytest.fixture
def fake_module(tmp_path, monkeypatch):
    """``fake_module(name, source)`` writes ``source`` to a real file and imports it (so getsource works)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    created = []

    def make(name: str, source: str):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        sys.modules.pop(name, None)
        created.append(name)
        return importlib.import_module(name)

    yield make
    for name in created:
        sys.modules.pop(name, None)
