"""Patch point: argument registration — every ``--libra-*`` flag reaches Megatron-LM's own ``parse_args``.

Megatron-LM accepts one ``extra_args_provider`` per program (``pretrain_gpt.py`` passes
``add_modelopt_args`` when ModelOpt is installed, else ``None``). Rather than replacing the program's
provider we wrap ``megatron.training.arguments.parse_args`` so that whatever provider the caller passes
is kept and ``add_libra_args`` is chained after it. Who calls it, per release:

* core_v0.16: ``initialize.py`` from-imports ``parse_args``, so the name is replaced there too;
  ``ft_integration`` and ``inprocess_restart`` call ``arguments.parse_args`` through the module attribute;
* core_v0.19: ``pretrain_gpt.py`` calls ``arguments.parse_and_validate_args``, which calls the module-level
  ``parse_args`` (verified); ``initialize.py`` no longer parses.
"""
from __future__ import annotations

import argparse
import importlib
from typing import Callable, Optional

from ._base import Patcher, TargetSpec, per_release, require_source_fragments, resolve_target, spec_for

__all__ = ["PARSE_ARGS", "CALLERS", "FROM_IMPORTERS", "merge_args_providers", "install"]

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

PARSE_ARGS = per_release("megatron.training.arguments", "parse_args", ("extra_args_provider", "ignore_unknown_args"),
                         ("parser = extra_args_provider(parser)",))
CALLERS = {
    "0.16": TargetSpec("megatron.training.initialize", "initialize_megatron",
                       ("extra_args_provider", "args_defaults", "ignore_unknown_args", "allow_no_cuda",
                        "skip_mpu_initialization", "get_embedding_ranks", "get_position_embedding_ranks",
                        "parsed_args", "store"),
                       ("args = parse_args(extra_args_provider, ignore_unknown_args)",), "0.16"),
    "0.19": TargetSpec("megatron.training.arguments", "parse_and_validate_args",
                       ("extra_args_provider", "ignore_unknown_args", "args_defaults"),
                       ("args = parse_args(extra_args_provider, ignore_unknown_args)",), "0.19"),
}
"""The Megatron function that calls ``parse_args`` by its module-level name, per release."""
FROM_IMPORTERS = {"0.16": ("megatron.training.initialize",), "0.19": ()}
"""Modules that from-import ``parse_args`` (their name is replaced too), per release."""


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
    """Wrap ``parse_args`` in ``megatron.training.arguments`` and in every module that from-imports it."""
    spec = spec_for(PARSE_ARGS)
    original = resolve_target(spec)
    resolve_target(spec_for(CALLERS))
    importers = spec_for(FROM_IMPORTERS)
    for name in importers:
        require_source_fragments(name, importlib.import_module(name),
                                 ("from megatron.training.arguments import parse_args",), spec.tag)

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        merged = merge_args_providers(extra_args_provider, libra_args_provider)
        return original(merged, ignore_unknown_args)

    parse_args.__wrapped_megatron__ = original  # type: ignore[attr-defined]
    patcher.replace(spec.module, "parse_args", parse_args)
    for name in importers:
        patcher.replace(name, "parse_args", parse_args)
