"""Patch point: argument registration — every ``--libra-*`` flag reaches Megatron-LM's own ``parse_args``.

Megatron-LM accepts one ``extra_args_provider`` per program (``pretrain_gpt.py`` passes
``add_modelopt_args`` when ModelOpt is installed, else ``None``). Rather than replacing the program's
provider we wrap ``megatron.training.arguments.parse_args`` so that whatever provider the caller passes
is kept and ``add_libra_args`` is chained after it. ``initialize.py`` from-imports ``parse_args``, so the
name is replaced there too; ``ft_integration`` and ``inprocess_restart`` call ``arguments.parse_args``
through the module attribute and therefore see the wrapper as well.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

from ._base import Patcher, TargetSpec, require_source_fragments, resolve_target

__all__ = ["PARSE_ARGS", "INITIALIZE_IMPORT", "merge_args_providers", "install"]

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

PARSE_ARGS = TargetSpec(
    module="megatron.training.arguments",
    attr="parse_args",
    params=("extra_args_provider", "ignore_unknown_args"),
    source_fragments=("parser = extra_args_provider(parser)",),
)
INITIALIZE_IMPORT = "from megatron.training.arguments import parse_args"


def merge_args_providers(*providers: Optional[ArgsProvider]) -> Optional[ArgsProvider]:
    """One ``extra_args_provider`` that applies each non-None provider once, in order.

    A provider that appears twice (for example a program that already passes ``add_libra_args``) is
    applied once: argparse would otherwise reject the duplicate flags.
    """
    unique = []
    for provider in providers:
        if provider is not None and provider not in unique:
            unique.append(provider)
    if not unique:
        return None
    if len(unique) == 1:
        return unique[0]

    def merged(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for provider in unique:
            parser = provider(parser)
            if parser is None:
                raise TypeError(f"extra_args_provider {provider!r} returned None; it must return the parser")
        return parser

    merged.providers = tuple(unique)  # type: ignore[attr-defined]
    return merged


def install(patcher: Patcher, libra_args_provider: ArgsProvider) -> None:
    """Wrap ``parse_args`` in ``megatron.training.arguments`` and ``megatron.training.initialize``."""
    original = resolve_target(PARSE_ARGS)
    import megatron.training.initialize as initialize_module

    require_source_fragments("megatron.training.initialize", initialize_module, (INITIALIZE_IMPORT,))

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        merged = merge_args_providers(extra_args_provider, libra_args_provider)
        return original(merged, ignore_unknown_args)

    parse_args.__wrapped_megatron__ = original  # type: ignore[attr-defined]
    patcher.replace(PARSE_ARGS.module, "parse_args", parse_args)
    patcher.replace("megatron.training.initialize", "parse_args", parse_args)
