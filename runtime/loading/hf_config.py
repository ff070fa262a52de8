"""Reading a checkpoint's config.json through the spec's declared mapping (rendered into Config.from_hf)."""
from __future__ import annotations

from typing import Any

_MISSING = object()


class ConfigError(ValueError):
    pass


def _lookup(cfg: dict, path: str) -> Any:
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node or node[part] is None:
            return _MISSING
        node = node[part]
    return node


def config_value(cfg: dict, *paths: str, default: Any = _MISSING) -> Any:
    """The first of `paths` (dotted, e.g. "rope_parameters.rope_theta") present in `cfg`, else `default`.

    A missing field without a default raises a ConfigError that names every path tried."""
    for path in paths:
        value = _lookup(cfg, path)
        if value is not _MISSING:
            return value
    if default is _MISSING:
        raise ConfigError(f"config.json: missing field {' or '.join(repr(p) for p in paths)}")
    return default
