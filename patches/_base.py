"""Shared machinery of the patch points: target verification and reversible attribute replacement.

A patch point replaces one named attribute of a Megatron-LM module (a function such as
``megatron.training.arguments.parse_args``) with a wrapper. Before anything is replaced the target is
verified against what we read in the running release (``RELEASE_TAGS``: core_v0.16.1 and core_v0.19.0; each
patch module keeps one ``TargetSpec`` per release line, chosen by ``spec_for`` from the imported
megatron-core's version):

* the module imports and the attribute exists and is callable;
* its parameter names, in order, are exactly the expected ones;
* its source (and, where our wrapper relies on a caller, the caller's source) contains the fragments the
  wrapper depends on (for example that ``training.py`` from-imports ``build_pretraining_data_loader``).

Any mismatch raises ``PatchTargetChanged`` naming the target, what we expected, what we found and the
release it was verified against, so an upgraded Megatron-LM fails at start-up instead of silently training without
Libra. There is no switch to skip the checks: a changed target needs a reviewed patch. A target module that
cannot be imported because a *third-party* package is missing is not a changed target: that raises
``MegatronLMDependencyMissing`` naming the package (``libra_megatron.megatron_lm.missing_package_error``).
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from libra_megatron.megatron_lm import RELEASES, missing_package_error, release_line

__all__ = [
    "PatchTargetChanged",
    "RELEASE_TAGS",
    "TargetSpec",
    "Patcher",
    "active_release",
    "check_megatron_core_version",
    "spec_for",
    "per_release",
    "resolve_target",
    "require_source_fragments",
]

RELEASE_TAGS = {release_line(tag): tag for tag in RELEASES}
"""Release line ("0.16", "0.19") -> the Megatron-LM tag every patch point was verified against."""


class PatchTargetChanged(RuntimeError):
    """A Megatron-LM function we patch is missing or no longer looks like the release it was verified on."""


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
    release: str = "0.16"  # the release line this spec was read from (named in every error)

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.attr}"

    @property
    def tag(self) -> str:
        return RELEASE_TAGS.get(self.release, f"core_v{self.release}")


def per_release(module: str, attr: str, params: Tuple[str, ...], source_fragments: Tuple[str, ...] = (),
                lines: Tuple[str, ...] = tuple(RELEASE_TAGS)) -> Dict[str, TargetSpec]:
    """One ``TargetSpec`` per release line in ``lines``, for a target that reads the same in each of them."""
    return {line: TargetSpec(module, attr, params, source_fragments, line) for line in lines}


def check_megatron_core_version(version: str) -> None:
    """Raise ``PatchTargetChanged`` unless ``version`` is a megatron-core version of a supported release line."""
    if release_line(version) not in RELEASE_TAGS:
        lines = ", ".join(f"{line}.x (Megatron-LM tag {tag})" for line, tag in RELEASE_TAGS.items())
        raise PatchTargetChanged(
            f"megatron-core {version} is installed, but the Libra patch points were written and verified "
            f"against {lines}; re-verify every target listed in patches/__init__.py:PATCH_POINTS before "
            f"using another version"
        )


def active_release() -> str:
    """The release line of the imported megatron-core (``"0.16"`` / ``"0.19"``); PatchTargetChanged if other."""
    import megatron.core

    check_megatron_core_version(megatron.core.__version__)
    return release_line(megatron.core.__version__)


def spec_for(specs: Mapping[str, Any], release: Optional[str] = None) -> Any:
    """``specs[release]`` (default: ``active_release()``): the per-release table entry of a patch point."""
    release = active_release() if release is None else release
    if release not in specs:
        raise PatchTargetChanged(f"no verified patch target for Megatron-LM {RELEASE_TAGS.get(release, release)} "
                                 f"in this table (verified: {', '.join(RELEASE_TAGS[r] for r in specs)})")
    return specs[release]


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
            f"it exists in {spec.tag}"
        )
    _require_params(spec, inspect.unwrap(target))
    require_source_fragments(spec.qualname, inspect.unwrap(target), spec.source_fragments, spec.tag)
    return target


def _is_module_or_parent(name: str, module: str) -> bool:
    return module == name or module.startswith(name + ".")


def _require_params(spec: TargetSpec, target: Callable[..., Any]) -> None:
    found = tuple(inspect.signature(target).parameters)
    if found != spec.params:
        raise PatchTargetChanged(
            f"patch target {spec.qualname} changed its signature: expected parameters {list(spec.params)} "
            f"({spec.tag}), found {list(found)}"
        )


def require_source_fragments(where: str, obj: Any, fragments: Tuple[str, ...], tag: str) -> None:
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
            f"patch target {where} no longer matches {tag}: its source lacks {missing}; "
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
