"""The planner of a Megatron-LM run, from its arguments: layouts, this rank's pool worker and nodes, the run's
shared plan directory (``plan_store``), and a ``planner.BackgroundPlanner`` in its own process."""
from __future__ import annotations

from typing import Optional

from ..config import LibraConfig
from ..plan.layout import HeadLayout, TokenLayout
from .args import activation_bytes, attention_heads_of_rank, saved_layers_of_stage
from .planner import BackgroundPlanner

__all__ = ["build_planner_from_args"]


def build_planner_from_args(config: LibraConfig, args) -> BackgroundPlanner:
    """The planner of a Megatron-LM run: layouts from ``--seq-length``, CP and one TP rank's heads
    (``args.attention_heads_of_rank``);
    this rank's pool worker id (its RankPlan is materialised by the planner) and its stage's layers alive at once
    (``args.saved_layers_of_stage``: one under the shipped full recompute), what auto's budget covers. It plans
    in its own process (``LIBRA_PLANNER_MODE=thread``: in a thread of the trainer).

    Its capacity holds two windows of plans (GBS / (mbs * DP) each, at least 64 plans): the sampler submits a
    whole window ahead (``LibraHooks`` plan-ahead), and the DataLoader may start the next one early.
    """
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    hq, hkv, kv_channels = attention_heads_of_rank(args)
    elem_bytes = activation_bytes(args)
    layout = TokenLayout(config.token_layout, args.seq_length, cp)
    heads = HeadLayout(hq, hkv, kv_channels, config.head_split, config.num_chunks, elem_bytes)
    dp = int(getattr(args, "data_parallel_size", 1) or 1)
    ga_per_window = int(args.global_batch_size) // (int(getattr(args, "micro_batch_size", 1) or 1) * dp)
    import os

    mode = os.environ.get("LIBRA_PLANNER_MODE", "process")  # "thread": plan in this interpreter (debugging)
    share_dir = _share_dir() if mode == "process" else None
    return BackgroundPlanner(config, layout, heads, capacity=max(64, 2 * ga_per_window), worker=_pool_worker(),
                             num_layers=saved_layers_of_stage(args), timing=_pool_timing(kv_channels), mode=mode,
                             pools_per_window=ga_per_window, share_dir=share_dir)


def _share_dir() -> Optional[str]:
    """The run's shared plan directory (``plan_store``): ``$LIBRA_PLAN_SHARE_DIR/<run id>`` when that is set
    (a filesystem every node mounts: each pool planned once per job), else ``/dev/shm/libra-plans-<run id>`` (or
    the temp directory without /dev/shm: once per node). ``LIBRA_PLAN_SHARE_DIR=off``: every rank plans its own
    pools. The run id is rank 0's random token, broadcast once at start-up (a collective outside any step), so a
    restarted job never reads a crashed run's claims."""
    import os
    import tempfile
    import uuid

    base = os.environ.get("LIBRA_PLAN_SHARE_DIR", "")
    if base.lower() == "off":
        return None
    token = [uuid.uuid4().hex]
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    given = base
    if not base:
        shm = "/dev/shm"
        base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
    path = os.path.join(base, f"libra-plans-{token[0]}")
    try:  # here, at start-up, not in the planner process, whose death would only surface at the first get
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"LIBRA_PLAN_SHARE_DIR={given!r}: cannot create the run's plan directory {path} "
                         f"({exc.strerror}); set it to a writable directory, or to 'off'") from exc
    return path


def _pool_timing(head_dim: int):
    """The step-time model of this rank's pool: its workers' nodes = pool ranks // GPUs per node (torchrun's
    LOCAL_WORLD_SIZE, else the visible CUDA devices, else 8); None before the pool groups exist (the placers
    then assume consecutive GPUs from a node boundary). The same on every rank of a pool: same ranks, same env."""
    import os

    from ..plan.model import StepTimeModel
    from . import groups

    if not groups.pool_groups_initialized():
        return None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if per_node < 1:
        import torch

        per_node = torch.cuda.device_count() if torch.cuda.is_available() else 8
    nodes = tuple(int(r) // per_node for r in groups.get_pool_ranks())
    return StepTimeModel(head_dim, gpus_per_node=per_node, worker_nodes=nodes)


def _pool_worker() -> Optional[int]:
    """This rank's pool-local worker id p*CP + c, when the pool groups exist (they do in the launcher)."""
    from . import groups

    return groups.get_pool_rank() if groups.pool_groups_initialized() else None
