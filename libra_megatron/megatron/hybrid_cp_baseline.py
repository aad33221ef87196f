"""Megatron-LM's own hybrid-CP balancer as a simulator baseline (issue 14).

Runs ``megatron.core.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler.get_groups_and_subsamples``
-- Megatron-LM's code, unchanged -- on the documents of each GBS window, the way
``megatron.core.datasets.data_schedule.HybridCPDataLoaderWrapper`` calls it for ``--hybrid-context-parallel``:
every non-empty sub-sample (document piece of a packed sequence) of the global batch, as (id, length), over
the DP x CP ranks, with ``--max-seqlen-per-dp-cp-rank``. The only stand-in is the process group: the scheduler
reads nothing from it but ``size()``.

The simulator (which must not import torch or megatron) runs this module in a subprocess
(``python -m libra_megatron.megatron.hybrid_cp_baseline``): JSON on stdin
``{"dp_cp": int, "max_seqlen_per_rank": int, "windows": [[doc lengths], ...]}``, JSON on stdout
``{"schedules": [window -> [group -> [gpu -> [document index]]]]}`` (a document's CP group in a group is
the set of GPUs listing it). ``sim.hybrid_cp`` prices the schedules.
"""
from __future__ import annotations

import json
import sys
from typing import List, Sequence

from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

__all__ = ["schedule_window", "main"]


class _GroupSize:
    """What BalancedCPScheduler reads from its ``dp_cp_group``: ``size()`` only."""

    def __init__(self, size: int):
        self._size = int(size)

    def size(self) -> int:
        return self._size


def schedule_window(doc_lens: Sequence[int], dp_cp: int, max_seqlen_per_rank: int) -> List[List[List[int]]]:
    """Megatron's schedule of one window: groups (run one after another, barrier between) x GPUs x document
    indices into ``doc_lens`` (zero lengths are dropped first, as the data loader wrapper does)."""
    scheduler = BalancedCPScheduler(max_seq_len_per_rank=int(max_seqlen_per_rank), dp_cp_group=_GroupSize(dp_cp))
    samples = [(i, int(n)) for i, n in enumerate(doc_lens) if int(n) > 0]
    _, sample_id_groups = scheduler.get_groups_and_subsamples(samples, config=None)
    return [[[int(i) for i in gpu] for gpu in group] for group in sample_id_groups]


def main() -> None:
    request = json.load(sys.stdin)
    schedules = [schedule_window(lens, request["dp_cp"], request["max_seqlen_per_rank"])
                 for lens in request["windows"]]
    json.dump({"schedules": schedules}, sys.stdout)


if __name__ == "__main__":
    main()
