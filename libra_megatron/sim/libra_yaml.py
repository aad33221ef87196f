"""``--libra-config FILE``: the simulator reads a Libra YAML (``LibraConfig.from_yaml``) as its defaults.

The knobs a run trains with become the simulator's defaults, so what a user simulates is what they train:
every ``LibraConfig`` field the simulator prices (below) takes the file's value, or ``LibraConfig``'s own
default where the file leaves the key out (the runtime would run that default too). An explicit flag on the
command line overrides the file. Fields the simulator does not price (``kernel_backend``) are read and
checked, not used.

    YAML key              simulator flag              note
    pool_size             --pool-size                 one value (flags may sweep a list instead)
    head_split            --head-split
    block_size            --block-size
    num_chunks            --num-chunks
    tau                   --tau
    tiling                --tiling
    kv_fetch              --kv-fetch
    sequence_placement    --sequence-placement
    tile_placement        --tile-placement
    token_layout          --token-layout
    packing               --packing
    kv_relay              --kv-relay                  off | auto (``--no-kv-relay`` = ``--kv-relay off``)
    save_mode             --save-mode                 arranged | refetch | auto
    activation_budget_gb  --activation-budget-gb

A bad file (syntax, unknown key, bad value) is a ``ValueError`` naming the file, the line and the key
(``LibraConfig.from_yaml``). So is a YAML (H, M) pair the model's heads cannot run, or a YAML P that does not
divide ``--dp``, when no flag overrides them (``LibraConfig.validate``, naming ``head_split (FILE:LINE)``);
an overridden value is checked under its flag's name by ``SimSpec.validate``.
"""
from __future__ import annotations

import argparse
import enum
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from ..config import KvRelay, LibraConfig

__all__ = ["LIBRA_CONFIG_FLAG", "YAML_DESTS", "yaml_defaults", "parse_with_libra_config", "check_yaml_knobs", "relay_on"]

LIBRA_CONFIG_FLAG = "--libra-config"


def _value(v: Any) -> Any:
    return v.value if isinstance(v, enum.Enum) else v


_GRID = lambda v: [_value(v)]  # noqa: E731  (a swept flag: a one-value list)
_ONE = _value

YAML_DESTS: Dict[str, Tuple[str, Callable[[Any], Any]]] = {  # LibraConfig field -> (argparse dest, value)
    "pool_size": ("pool_size", _GRID), "head_split": ("head_split", _GRID), "block_size": ("block_size", _GRID),
    "num_chunks": ("num_chunks", _GRID), "tau": ("tau", _GRID), "tiling": ("tiling", _GRID),
    "kv_fetch": ("kv_fetch", _GRID), "sequence_placement": ("sequence_placement", _ONE),
    "tile_placement": ("tile_placement", _ONE), "token_layout": ("token_layout", _ONE), "packing": ("packing", _ONE),
    "kv_relay": ("kv_relay", _ONE), "save_mode": ("save_mode", _ONE),
    "activation_budget_gb": ("activation_budget_gb", _ONE),
}


def yaml_defaults(config: LibraConfig) -> Dict[str, Any]:
    """argparse defaults (dest -> value, as a flag would set it) of every field the simulator prices."""
    return {dest: convert(getattr(config, key)) for key, (dest, convert) in YAML_DESTS.items()}


def parse_with_libra_config(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]
                            ) -> Tuple[argparse.Namespace, Optional[LibraConfig]]:
    """Parse ``argv`` twice: once for ``--libra-config`` alone, then with the file's knobs as ``parser``'s
    defaults (explicit flags win). Returns (args, the config or None); ``args.yaml_keys`` = the fields whose
    value is the file's (not overridden)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument(LIBRA_CONFIG_FLAG, default=None)
    known, _ = pre.parse_known_args(argv)
    config = None
    if known.libra_config is not None:
        config = LibraConfig.from_yaml(known.libra_config, flag=LIBRA_CONFIG_FLAG)
        defaults = yaml_defaults(config)
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    args.yaml_keys = () if config is None else tuple(
        key for key, (dest, convert) in YAML_DESTS.items() if getattr(args, dest) == convert(getattr(config, key)))
    return args, config


def check_yaml_knobs(config: Optional[LibraConfig], args: argparse.Namespace, num_q_heads: int,
                     num_kv_heads: int) -> None:
    """The file's own (H, M) against the model's heads and its P against ``--dp`` (``LibraConfig.validate``,
    errors name ``key (FILE:LINE)``), for the values no flag overrode."""
    if config is None:
        return
    kept = set(args.yaml_keys)
    if {"head_split", "num_chunks"} <= kept:
        config.validate(num_attention_heads=num_q_heads, num_query_groups=num_kv_heads,
                        data_parallel_size=args.dp if "pool_size" in kept else config.pool_size)
    elif "pool_size" in kept and args.dp % config.pool_size:  # only P: heads that every (H, M) divides
        config.validate(num_attention_heads=config.head_split * config.chunks_for(config.head_split),
                        data_parallel_size=args.dp)


def relay_on(kv_relay: str) -> bool:
    """``--kv-relay`` auto prices plans with the K/V relay (the runtime's ``kv_relay: auto``), off without."""
    return KvRelay(kv_relay) is KvRelay.AUTO
