"""Reading a Libra YAML file into ``({key: value}, {key: line})`` with every structural error at ``file:line``.

The format (``LibraConfig.to_yaml`` writes the first form)::

    libra:                 # or the same keys at top level, without 'libra:' -- not both
      pool_size: 8
      tau: 0.03

Errors (all ``ValueError``): a file that cannot be read or is not UTF-8; YAML syntax (``FILE:LINE: YAML
syntax error: ...``); more than one document; a top level that is not a mapping; top-level keys next to
``libra:``; a key given twice (YAML would silently keep the last); no keys at all (an empty file is an
error, not "all defaults": leave ``--libra-config`` out for that). Key names, non-finite numbers (``.inf``,
``.nan``) and value types are checked by ``LibraConfig.from_mapping`` with the lines found here.

Pure Python + pyyaml.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from .cli import one_line
from .paths import read_text

__all__ = ["read_libra_yaml", "NEST_KEY"]

NEST_KEY = "libra"
_NO_KEYS = ("no Libra keys; write them at top level or under 'libra:' (e.g. 'pool_size: 8'), "
            "or leave --libra-config out to run with every default")


def read_libra_yaml(path, flag: Optional[str] = None) -> Tuple[Dict[Any, Any], Dict[Any, int]]:
    """``(values, lines)`` of the Libra keys in YAML file ``path`` (1-based line of each key)."""
    import yaml

    path = os.fspath(path)
    text = read_text(path, f"{flag} {path}" if flag else path)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        raise ValueError(_syntax_message(path, err)) from None
    except yaml.YAMLError as err:  # pragma: no cover - pyyaml marks every parse error it raises
        raise ValueError(f"{path}: not valid YAML ({one_line(err)})") from None
    if root is None or data is None:
        raise ValueError(f"{path}: empty file: {_NO_KEYS}")
    entries, values = _mapping_entries(root, data, path, "the top level")
    nested = [e for e in entries if e[0] == NEST_KEY]
    if nested:
        entries, values = _nested_entries(nested[0], entries, values[NEST_KEY], path)
    if not entries:
        raise ValueError(f"{path}:{root.start_mark.line + 1}: {_NO_KEYS}")
    return dict(values), {key: line for key, line, _ in entries}


def _syntax_message(path: str, err) -> str:
    mark = err.problem_mark or err.context_mark
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
    problem = one_line(err.problem or err.context or "invalid YAML")
    context = ""
    if err.context and err.problem and err.context_mark is not None:
        context = f" ({one_line(err.context)} at line {err.context_mark.line + 1})"
    return f"{where}: YAML syntax error: {problem}{context}"


def _mapping_entries(node, data, path: str, what: str) -> Tuple[List[Tuple[Any, int, Any]], Any]:
    """[(key, line, value node)] of a mapping node whose constructed value is ``data``; errors otherwise."""
    import yaml

    line = node.start_mark.line + 1
    if not isinstance(node, yaml.MappingNode) or not isinstance(data, dict):
        kind = {"ScalarNode": "a single value", "SequenceNode": "a list"}.get(type(node).__name__, "not a mapping")
        raise ValueError(f"{path}:{line}: {what} must be a mapping of Libra keys ('key: value' lines), got {kind}")
    seen: Dict[Tuple[str, str], int] = {}
    for key_node, _ in node.value:
        ident = (key_node.tag, str(key_node.value))
        key_line = key_node.start_mark.line + 1
        if ident in seen:
            raise ValueError(f"{path}:{key_line}: duplicate key {key_node.value!r} (first at line {seen[ident]}); "
                             f"YAML would silently keep the last one")
        seen[ident] = key_line
    if len(data) != len(node.value):  # merge keys ('<<:') and the like: keys no longer map to lines one-to-one
        raise ValueError(f"{path}:{line}: YAML merge keys ('<<') are not supported in a Libra config")
    entries = [(key, k.start_mark.line + 1, v) for key, (k, v) in zip(data, node.value)]
    return entries, data


def _nested_entries(nested, entries, data, path: str):
    """The entries under ``libra:``; it must be the only top-level key and hold a non-empty mapping."""
    _, nest_line, node = nested
    others = [(key, line) for key, line, _ in entries if key != NEST_KEY]
    if others:
        key, line = others[0]
        raise ValueError(f"{path}:{line}: top-level key {key!r} next to 'libra:' (line {nest_line}); put every "
                         f"Libra key under 'libra:' (the format to_yaml writes) or all at top level, not both")
    if data is None or data == {}:
        raise ValueError(f"{path}:{nest_line}: 'libra:' holds {_NO_KEYS}")
    return _mapping_entries(node, data, path, "'libra:'")

