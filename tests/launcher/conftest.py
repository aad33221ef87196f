"""Shared helpers of the launcher tests: the repository root on sys.path (for ``patches``) and fake modules."""
import importlib
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))


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
