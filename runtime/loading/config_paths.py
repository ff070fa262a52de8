"""Paths into a checkpoint's config.json as a spec names them (runtime/loading/hf_config.py reads through these):
dotted mapping keys, a `*` part for every key of a mapping (one value they all hold), a `name[*]` part for every
element of a list of mappings (a per-element read into a tuple), and the flattened field list the config guard
walks."""
from __future__ import annotations

import re
from typing import Any, Iterable, Optional

MISSING = object()


class ConfigError(ValueError):
    pass


class WildcardConflict(ValueError):
    """A path with a `*` part matched values that differ."""


def _lookup(cfg: Any, path: str) -> Any:
    node: Any = cfg
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part == "*":      # every key of a mapping (transformers' per_layer_config): the one value they all hold
            if not isinstance(node, dict):
                return MISSING
            rest = ".".join(parts[i + 1:])
            found = {k: v for k, v in ((k, _lookup(sub, rest) if rest else sub) for k, sub in node.items())
                     if v is not MISSING}
            if not found:
                return MISSING
            if len({repr(v) for v in found.values()}) > 1:
                raise WildcardConflict(f"config.json field '{path}' differs between keys: "
                                       + ", ".join(f"{'.'.join(parts[:i])}.{k}: {v!r}" for k, v in found.items()))
            return next(iter(found.values()))
        if not isinstance(node, dict) or part not in node or node[part] is None:
            return MISSING
        node = node[part]
    return node


EACH = "[*]"     # a path part `name[*]`: every element of the list `name` (a per-element read into a tuple)


def each_split(path: str) -> Optional[tuple[str, str]]:
    """`block_configs[*].attention.no_op` -> ('block_configs', 'attention.no_op'); None for a path without `[*]`."""
    if EACH not in path:
        return None
    head, rest = path.split(EACH, 1)
    return head, rest[1:] if rest.startswith(".") else rest


def each_path(path: str) -> str:
    """A config.json path with list indices (`block_configs[3].attention.no_op`) as a spec names it (`[*]`)."""
    return re.sub(r"\[\d+\]", EACH, path)


def _present_null(cfg: Any, path: str) -> bool:
    """The field is written in config.json with the value null (transformers then holds None, not its class
    default: what an `optional` symbol with a default reads as None)."""
    node: Any = cfg
    parts = path.split(".")
    for part in parts[:-1]:
        if not isinstance(node, dict) or node.get(part) is None:
            return False
        node = node[part]
    return isinstance(node, dict) and parts[-1] in node and node[parts[-1]] is None


def config_value(cfg: dict, *paths: str, default: Any = MISSING) -> Any:
    """The first of `paths` present in `cfg`, else `default` (a missing field without one raises)."""
    for path in paths:
        value = _lookup(cfg, path)
        if value is not MISSING:
            return value
    if default is MISSING:
        raise ConfigError(f"config.json: missing field {' or '.join(repr(p) for p in paths)}")
    return default


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _flatten(node: Any, prefix: str = "", lists: frozenset = frozenset()) -> Iterable[tuple[str, Any]]:
    """(dotted path, leaf value) of every field; a list that a spec reads per element (its path, indices as `[*]`, in
    `lists`) is descended into, its elements' fields named `list[i].field`."""
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k), lists)
    elif isinstance(node, list) and node and prefix and each_path(prefix) in lists:
        for i, v in enumerate(node):
            yield from _flatten(v, f"{prefix}[{i}]", lists)
    elif prefix:
        yield prefix, node
