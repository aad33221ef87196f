"""A fresh clone needs nothing beside it: traces ship in data/traces, and only the Megatron-LM getter may look
at the ``shared`` folder next to the checkout (for the Megatron-LM archive)."""
import re
from pathlib import Path

import numpy as np

from libra_megatron.plan.traces import find_trace, load_trace, trace_dirs

REPO = Path(__file__).resolve().parents[1]
GETTER = REPO / "libra_megatron" / "megatron_lm.py"
# a path into the sibling folder: "../shared", "/shared/", or a "shared" path component in a join
SHARED_PATH = re.compile(r"\.\./shared\b|/shared/|[\"']shared[\"']")


def test_trace_search_stays_inside_the_checkout(monkeypatch):
    monkeypatch.delenv("LIBRA_TRACE_DIR", raising=False)
    assert [Path(d).resolve() for d in trace_dirs()] == [REPO / "data" / "traces"]
    for name in ("linux-6.12-files.qwen.txt", "wikipedia-flexsp.txt"):
        assert Path(find_trace(name)).resolve() == REPO / "data" / "traces" / name


def test_only_the_megatron_lm_getter_refers_to_the_shared_folder():
    code = [p for top in ("libra_megatron", "tests", "benchmarks", "scripts", "patches")
            for ext in ("*.py", "*.sh") for p in (REPO / top).rglob(ext)]
    offenders = [f"{p.relative_to(REPO)}:{i}" for p in code if p != GETTER
                 for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
                 if SHARED_PATH.search(line) and p != Path(__file__).resolve()]
    assert offenders == []
    assert SHARED_PATH.search(GETTER.read_text()), "the scan must be able to see the getter's own reference"


def test_shipped_traces_match_their_provenance_table():
    """data/traces/README.md: documents, tokens, median and max of every row, recomputed from the files."""
    rows = [r for r in (REPO / "data" / "traces" / "README.md").read_text().splitlines() if r.startswith("| `")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        lengths = load_trace(REPO / "data" / "traces" / cells[0].strip("`"))
        numbers = [int(c.replace(",", "")) for c in cells[1:6]]
        assert numbers[:2] == [lengths.size, int(lengths.sum())], cells[0]
        assert numbers[2] == int(np.median(lengths)) and numbers[4] == int(lengths.max()), cells[0]
        assert numbers[3] == round(float(lengths.mean())), cells[0]
