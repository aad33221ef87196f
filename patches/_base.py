"""Shared machinery of the patch points: target verification and reversible attribute replacement.

A patch point replaces one named attribute of a Megatron-LM module (a function such as
``megatron.training.arguments.parse_args``) with a wrapper. Before anything is replaced the target is
verified against what we read in Megatron-LM ``core_v0.16.1``:

* the module imports and the attribute exists and is callable;
* its parameter names, in order, are exactly the expected ones;
* its source (and, where our wrapper relies on a caller, the caller's source) contains the fragments the
  wrapper depends on (for example that ``training.py`` from-imports ``build_pretraining_data_loader``).

Any mismatch raises ``PatchTargetChanged`` naming the target, what we expected, what we found and the
version we support, so an upgraded Megatron-LM fails at start-up instead of silently training without
Libra. There is no switch to skip the checks: a changed target needs a reviewed patch. A target module that
cannot be imported because a *third-party* package is missing is not a changed target: that raises
``MegatronLMDependencyMissing`` naming the package (``libra_megatron.megatron_lm.missing_package_error``).
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, List, Tuple

from libra_megatron.megatron_lm import missing_package_error

__all__ = [
    "PatchTargetChanged",
    "SUPPORTED_MEGATRON_CORE",
    "TargetSpec",
    "Patcher",
    "check_megatron_core_version",
    "resolve_target",
    "require_source_fragments",
]

SUPPORTED_MEGATRON_CORE = "0.16."
"""Version prefix of megatron-core (and the Megatron-LM tag core_v0.16.x) every patch was written for."""


class PatchTargetChanged(RuntimeError):
    """A Megatron-LM function we patch is missing or no longer looks like core_v0.16.x."""


@dataclass(frozen=True)
class TargetSpec:
    """One attribute a patch point replaces or relies on.

    ``params`` are the parameter names in declaration order; ``source_fragments`` must each occur in
    ``inspect.getsource`` of the target (whitespace-sensitive, kept short and specific).
    """

    module: str
    attr: str
    params: Tuple[str, ...]
    source_fragments: Tuple[str, ...] = ()

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.attr}"


def check_megatron_core_version(version: str) -> None:
    """Raise ``PatchTargetChanged`` unless ``version`` is a megatron-core 0.16.x version string."""
    if not str(version).startswith(SUPPORTED_MEGATRON_CORE):
        raise PatchTargetChanged(
            f"megatron-core {version} is installed, but the Libra patch points were written and verified "
            f"against {SUPPORTED_MEGATRON_CORE}x (Megatron-LM tag core_v0.16.1); re-verify every target "
            f"listed in patches/__init__.py:PATCH_POINTS before using another version"
        )


def resolve_target(spec: TargetSpec) -> Callable[..., Any]:
    """Import ``spec.module``, fetch ``spec.attr`` and verify its signature and source; return it."""
    try:
        module = importlib.import_module(spec.module)
    except ModuleNotFoundError as err:
        if err.name and not _is_module_or_parent(err.name, spec.module):
            raise missing_package_error(err) from err  # a dependency of Megatron-LM, not the target, is missing
        raise PatchTargetChanged(f"patch target module {spec.module} cannot be imported: {err}") from err
    except ImportError as err:
        raise PatchTargetChanged(f"patch target module {spec.module} cannot be imported: {err}") from err
    target = getattr(module, spec.attr, None)
    if target is None or not callable(target):
        raise PatchTargetChanged(
            f"patch target {spec.qualname} does not exist (or is not callable) in this Megatron-LM; "
            f"it exists in core_v0.16.1"
        )
    _require_params(spec, inspect.unwrap(target))
    require_source_fragments(spec.qualname, inspect.unwrap(target), spec.source_fragments)
    return target


def _is_module_or_parent(name: str, module: str) -> bool:
    return module == name or module.startswith(name + ".")


def _require_params(spec: TargetSpec, target: Callable[..., Any]) -> None:
    found = tuple(inspect.signature(target).parameters)
    if found != spec.params:
        raise PatchTargetChanged(
            f"patch target {spec.qualname} changed its signature: expected parameters {list(spec.params)} "
            f"(core_v0.16.1), found {list(found)}"
        )


def require_source_fragments(where: str, obj: Any, fragments: Tuple[str, ...]) -> None:
    """Raise ``PatchTargetChanged`` unless every fragment occurs in the source of ``obj``."""
    if not fragments:
        return
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError) as err:
        raise PatchTargetChanged(f"cannot read the source of {where} to verify it: {err}") from err
    missing = [frag for frag in fragments if frag not in source]
    if missing:
        raise PatchTargetChanged(
            f"patch target {where} no longer matches core_v0.16.1: its source lacks {missing}; "
            f"the Libra patch relies on that code"
        )


class Patcher:
    """Replaces module attributes and remembers the originals so ``undo()`` restores them (LIFO)."""

    def __init__(self) -> None:
        self._undo: List[Tuple[Any, str, Any]] = []

    def replace(self, module_name: str, attr: str, new: Any) -> Any:
        """Set ``module.attr = new``; return the previous value."""
        module = importlib.import_module(module_name)
        old = getattr(module, attr)
        self._undo.append((module, attr, old))
        setattr(module, attr, new)
        return old

    def undo(self) -> None:
        while self._undo:
            module, attr, old = self._undo.pop()
            setattr(module, attr, old)

    @property
    def num_replaced(self) -> int:
        return len(self._undo)
