"""``--libra-*`` command-line flags and the YAML config, for Megatron-LM's ``parse_args(extra_args_provider)``.

Precedence: ``LibraConfig`` defaults < ``--libra-config PATH`` (YAML) < explicit ``--libra-*`` flags <
the ablation switches ``--libra-disable-vrsp`` (sequence_placement=contiguous) and
``--libra-disable-tap`` (tile_placement=home), which are logged. Every flag defaults to None so an
override is detectable. An ablation switch that contradicts an explicit placement flag is an error.
``log_and_save_libra_config`` writes the effective config (``libra_config.yaml``) next to the run, so
the YAML shows what actually ran.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import re
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from ..config import (
    KernelBackendName,
    LibraConfig,
    PackingMode,
    SaveModeName,
    SequencePlacement,
    TilePlacement,
    TokenLayoutKind,
    TilingPolicy,
    KvFetch,
    KvRelay,
    chunks_value,
    flag_name,
    heads_per_tensor_parallel_rank,
)
from ..plan.model import saved_layers

__all__ = ["add_libra_args", "libra_config_from_args", "log_and_save_libra_config", "parse_megatron_args",
           "print_megatron_help", "saved_layers_of_stage", "attention_heads_of_rank", "activation_bytes",
           "CONFIG_FILE_NAME"]

logger = logging.getLogger(__name__)

CONFIG_FILE_NAME = "libra_config.yaml"

_FLAG_TYPES: Dict[str, Any] = {  # config key -> argparse type or enum (choices)
    "pool_size": int, "head_split": int, "block_size": int, "num_chunks": chunks_value, "tau": float,
    "sequence_placement": SequencePlacement, "tile_placement": TilePlacement, "packing": PackingMode,
    "kernel_backend": KernelBackendName, "token_layout": TokenLayoutKind,
    "save_mode": SaveModeName, "activation_budget_gb": float,
    "tiling": TilingPolicy, "kv_fetch": KvFetch, "kv_relay": KvRelay,
}
_HELP = {
    "pool_size": "P: DP replicas per sequence pool (P | DP); a pool has P*CP workers.",
    "head_split": "H: query-head shards per SH-Tile (H | num attention heads).",
    "block_size": "B: tokens per SH-Tile sequence block.",
    "num_chunks": "M: TAP Pipeliner head chunks per tile (M | heads/H), or auto: the K/V heads of a head shard.",
    "tau": "Load slack of Algorithm 2: target (1+tau) * mean worker load.",
    "sequence_placement": "VRSP placement of packed sequences into pools.",
    "tile_placement": "SH-Tile placement inside a pool.",
    "packing": "Packing of the simulator / synthetic corpora; Megatron-LM runs accept only 'megatron' "
               "(GPTDataset packs that way).",
    "kernel_backend": "Attention kernel of the Libra operator.",
    "token_layout": "CP token layout of each packed sequence.",
    "save_mode": "What the Libra operator keeps for backward; auto decides per pool plan against "
                 "--libra-activation-budget-gb.",
    "activation_budget_gb": "GiB per GPU that save_mode=auto lets kept attention tensors use for one microbatch "
                            "(summed over the stage's layers whose tensors are alive at once: all of them, or under "
                            "--recompute-granularity full the --recompute-num-layers being recomputed).",
    "tiling": "SH-Tile blocks: uniform (paper) or adaptive (heavy blocks halved).",
    "kv_fetch": "K/V fetched per document: group (paper, whole) or prefix (causal prefix only).",
    "kv_relay": "K/V relay between nodes: off (paper) or auto (one worker per node fetches K/V its node needs "
                "several times and forwards it; kept per pool plan when the Pipeliner timeline prices it no slower).",
}
_ABLATIONS = {  # switch -> (config key, value it forces)
    "libra_disable_vrsp": ("sequence_placement", SequencePlacement.CONTIGUOUS),
    "libra_disable_tap": ("tile_placement", TilePlacement.HOME),
}


def _dest(key: str) -> str:
    return flag_name(key)[2:].replace("-", "_")


def add_libra_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "libra" argument group; usable as (or chained into) Megatron's ``extra_args_provider``."""
    group = parser.add_argument_group(title="libra")
    for key, kind in _FLAG_TYPES.items():
        if isinstance(kind, type) and issubclass(kind, str):  # the str-valued enums
            group.add_argument(flag_name(key), dest=_dest(key), type=str, default=None,
                               choices=[m.value for m in kind], help=_HELP[key])
        else:
            group.add_argument(flag_name(key), dest=_dest(key), type=kind, default=None, help=_HELP[key])
    group.add_argument("--libra-config", dest="libra_config", type=str, default=None, metavar="PATH",
                       help="YAML file of Libra keys (under 'libra:' or at top level, not both; "
                            "not empty); --libra-* flags override it.")
    group.add_argument("--libra-disable-vrsp", dest="libra_disable_vrsp", action="store_true", default=None,
                       help="Ablation: sequence_placement=contiguous (no inter-pool balancing).")
    group.add_argument("--libra-disable-tap", dest="libra_disable_tap", action="store_true", default=None,
                       help="Ablation: tile_placement=home (no SH-Tile migration).")
    return parser


def _flag_overrides(args: Any) -> Dict[str, Any]:
    overrides = {}
    for f in fields(LibraConfig):
        value = getattr(args, _dest(f.name), None)
        if value is not None:
            overrides[f.name] = value
    return overrides


def _apply_ablations(args: Any, overrides: Dict[str, Any]) -> Dict[str, Any]:
    for switch, (key, forced) in _ABLATIONS.items():
        if not getattr(args, switch, None):
            continue
        flag = "--" + switch.replace("_", "-")
        if key in overrides and type(forced)(overrides[key]) is not forced:
            raise ValueError(
                f"{flag} forces {key}={forced.value} but {flag_name(key)} {overrides[key]} was also given"
            )
        logger.warning("Libra ablation %s: %s=%s", flag, key, forced.value)
        overrides[key] = forced
    return overrides


def _data_parallel_size(args: Any) -> int:
    dp = getattr(args, "data_parallel_size", None)
    if dp:
        return int(dp)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    world = int(getattr(args, "world_size", None) or int(os.environ.get("WORLD_SIZE", "1")))
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} must be divisible by TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp} "
                         f"(the world size is $WORLD_SIZE: set it to the job's GPU count for --check-only)")
    return world // (tp * pp * cp)


def libra_config_from_args(args: Any) -> LibraConfig:
    """Defaults < YAML (``--libra-config``) < ``--libra-*`` flags < ablations; validated against the model/run.

    Reads ``num_attention_heads``, ``num_query_groups`` (only with ``group_query_attention``),
    ``tensor_model_parallel_size`` (the operator sees each TP rank's heads), ``data_parallel_size`` (else
    world_size / (TP*PP*CP)), ``context_parallel_size``, ``seq_length``, ``micro_batch_size`` and
    ``global_batch_size`` from ``args``. Raises ValueError naming the flag the user gave, or the YAML key and
    its ``file:line`` for a value read from ``--libra-config``.
    """
    path = getattr(args, "libra_config", None)
    base = LibraConfig.from_yaml(path, flag="--libra-config") if path is not None else LibraConfig()
    config = base.replace(**_apply_ablations(args, _flag_overrides(args)))
    _check_packing(config)
    heads, groups, tp = _heads_per_tensor_parallel_rank(args)
    gbs = getattr(args, "global_batch_size", None)
    data_parallel_size = _data_parallel_size(args)  # its error is about the world size, not the heads per TP rank
    try:
        return config.validate(
            num_attention_heads=heads,
            num_query_groups=groups,
            data_parallel_size=data_parallel_size,
            context_parallel_size=int(getattr(args, "context_parallel_size", 1) or 1),
            seq_length=getattr(args, "seq_length", None),
            micro_batch_size=int(getattr(args, "micro_batch_size", 1) or 1),
            global_batch_size=int(gbs) if gbs is not None else None,
        )
    except ValueError as err:
        if tp == 1:
            raise
        raise ValueError(f"{err} (heads per tensor-parallel rank: --num-attention-heads "
                         f"{args.num_attention_heads} / --tensor-model-parallel-size {tp})") from err


def attention_heads_of_rank(args: Any) -> Tuple[int, int, int]:
    """(query heads, K/V heads, head dim) one tensor-parallel rank of a Megatron-LM run attends with: what its
    planner plans and its sampler's pool proxy prices. ``--num-attention-heads`` and ``--num-query-groups`` (a K/V
    head per query head without ``--group-query-attention``) over ``--tensor-model-parallel-size``, as Megatron-LM
    splits them (ValueError names the flags when TP does not divide them); ``--kv-channels``, else hidden / heads."""
    heads, groups, _ = _heads_per_tensor_parallel_rank(args)
    head_dim = int(getattr(args, "kv_channels", None) or int(args.hidden_size) // int(args.num_attention_heads))
    return heads, groups or heads, head_dim


def activation_bytes(args: Any) -> int:
    """Bytes of one activation element of a Megatron-LM run: 2 under ``--bf16`` / ``--fp16``, else 4 (fp32)."""
    return 2 if (getattr(args, "bf16", False) or getattr(args, "fp16", False)) else 4


def _heads_per_tensor_parallel_rank(args: Any) -> tuple:
    """(query heads, kv groups or None, TP) of one TP rank: what the Libra operator plans over."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    hq = int(args.num_attention_heads)
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", True) else None

    def split(count, name: str) -> int:
        return heads_per_tensor_parallel_rank(int(count), name, tp, "--tensor-model-parallel-size")

    return split(hq, "--num-attention-heads"), (split(groups, "--num-query-groups") if groups else None), tp


def _check_packing(config: LibraConfig) -> None:
    """``packing`` cannot change how GPTDataset packs, so anything but 'megatron' is refused (not ignored)."""
    if config.packing is not PackingMode.MEGATRON:
        raise ValueError(
            f"{config._name('packing')} = {config.packing.value} has no effect in Megatron-LM runs: GPTDataset "
            f"packs megatron-style (concatenate documents, cut every --seq-length tokens). Use packing: megatron "
            f"here; other packings drive the simulator and synthetic corpora only"
        )


def _describe_sources(config: LibraConfig, args: Any) -> str:
    flags = sorted(_flag_overrides(args))
    ablations = [("--" + s.replace("_", "-")) for s in _ABLATIONS if getattr(args, s, None)]
    return (f"# Effective Libra config. YAML: {getattr(args, 'libra_config', None)}; "
            f"flag overrides: {flags or 'none'}; ablations: {ablations or 'none'}\n")


def log_and_save_libra_config(config: LibraConfig, args: Any, save_dir: Optional[str] = None) -> str:
    """Log the effective config and write ``libra_config.yaml`` (rank 0) to ``save_dir`` / ``args.save`` /
    ``args.tensorboard_dir`` (the first set; nothing is written when none is). Returns the YAML text.
    """
    text = _describe_sources(config, args) + config.to_yaml()
    logger.info("Libra effective config:\n%s", text)
    directory = save_dir or getattr(args, "save", None) or getattr(args, "tensorboard_dir", None)
    if directory is not None and _is_rank_zero():
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, CONFIG_FILE_NAME), "w", encoding="utf-8") as handle:
            handle.write(text)
    return text


def _is_rank_zero() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return True
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def parse_megatron_args(program: Path, megatron_argv: Sequence[str]) -> argparse.Namespace:
    """Megatron-LM's own ``parse_args`` (``--libra-*`` added) on ``megatron_argv``, quietly: the launcher's
    view of what Megatron will use, defaults included, before anything starts.

    Unknown flags are left to the program's real parse (its ``extra_args_provider`` may add some). An
    argparse error becomes a one-line ValueError carrying argparse's message.
    """
    from megatron.training.arguments import parse_args

    err = io.StringIO()
    saved = sys.argv
    sys.argv = [str(program)] + list(megatron_argv)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parse_args(add_libra_args, ignore_unknown_args=True)
    except SystemExit as exit_:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        raise ValueError(lines[-1].split("error: ", 1)[-1] if lines else f"argparse exited with {exit_.code}")
    finally:
        sys.argv = saved


def print_megatron_help(program: Path) -> None:
    """Megatron-LM's ``--help`` for ``program``, with the ``--libra-*`` flags."""
    from megatron.training.arguments import parse_args

    saved = sys.argv
    sys.argv = [str(program), "--help"]
    try:
        with contextlib.suppress(SystemExit):
            parse_args(lambda parser: _escape_bare_percent_signs(add_libra_args(parser)))
    finally:
        sys.argv = saved


_PERCENT = re.compile(r"%%|%\(|%")  # an escaped '%%', a '%(name)s' field, or a bare '%'


def _escape_bare_percent_signs(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse %-formats every help string; core_v0.19 has help text with a bare '%' (a TransformerConfig
    docstring's '10%)'), on which its own ``--help`` stops with a ValueError. Only ``--help`` uses this."""
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = _PERCENT.sub(lambda m: m.group(0) if len(m.group(0)) == 2 else "%%", action.help)
    return parser


def saved_layers_of_stage(args: Any) -> int:
    """Layers of this pipeline stage whose Libra saved tensors are alive at once for one microbatch, from Megatron-LM's
    ``--num-layers``, ``--pipeline-model-parallel-size`` and recompute flags (``plan.model.memory.saved_layers``):
    what ``save_mode=auto``'s ``--libra-activation-budget-gb`` is summed over."""
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    stage = -(-int(getattr(args, "num_layers", 1) or 1) // pp)
    return saved_layers(stage, *(getattr(args, f"recompute_{k}", None) for k in ("granularity", "method", "num_layers")))
