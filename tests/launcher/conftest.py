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


@pytest.fixture(scope="session")
def linux_corpus(tmp_path_factory):
    """A real Megatron indexed dataset (.bin/.idx prefix) with the document lengths of the first 400 files of
    the linux-6.12 trace (skewed: median 367 tokens, max 41,356), built once per session for every
    Megatron-LM loop test; synthetic tokens, vocabulary 256 with EOD 255."""
    from libra_megatron.megatron.corpus import build_indexed_dataset_from_trace

    from .megatron_lm import REPO

    folder = tmp_path_factory.mktemp("corpus")
    trace = REPO / "data" / "traces" / "linux-6.12-files.qwen.txt"
    build_indexed_dataset_from_trace(trace, str(folder / "linux"), vocab_size=256, eod=255, max_docs=400)
    return str(folder / "linux")


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
