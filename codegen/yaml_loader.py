"""YAML loading that remembers where every node came from, and spec composition (`extends`).

`load_tree(path)` returns plain Python data (dicts, lists, scalars) plus a SourceMap from each node's
path (a tuple of keys and list indices) to its file:line:column, so that schema errors and cross-field
checks can point at the offending node. A spec may start with `extends: other.yaml`: the other spec is
loaded first and this one is deep-merged over it (mappings merge key by key, anything else replaces,
`null` deletes the key). Locations keep pointing at whichever file supplied each node.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Tuple

import yaml

from .errors import Location, SpecError

PathT = Tuple[Any, ...]


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as `1e-6` (PyYAML would make that a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                  |\.[0-9_]+(?:[eE][-+][0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


@dataclass
class SourceMap:
    values: Dict[PathT, Location] = field(default_factory=dict)
    keys: Dict[PathT, Location] = field(default_factory=dict)

    def value(self, path: PathT) -> Location:
        """Location of the node at `path`, or of its closest existing ancestor."""
        path = tuple(path)
        while path not in self.values and path:
            path = path[:-1]
        return self.values.get(path) or next(iter(self.values.values()))

    def key(self, path: PathT) -> Location:
        """Location of the mapping key that names `path` (falls back to the value)."""
        path = tuple(path)
        return self.keys.get(path) or self.value(path)

    def drop(self, prefix: PathT) -> None:
        n = len(prefix)
        for table in (self.values, self.keys):
            for p in [p for p in table if p[:n] == prefix]:
                del table[p]


def _loc(mark, name: str) -> Location:
    return Location(name, mark.line + 1, mark.column + 1)


def _convert(node, path: PathT, smap: SourceMap, name: str, constructor) -> Any:
    smap.values[path] = _loc(node.start_mark, name)
    if isinstance(node, yaml.MappingNode):
        out: Dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise SpecError("mapping keys must be plain scalars", _loc(key_node.start_mark, name))
            key = constructor.construct_object(key_node)
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise SpecError("YAML merge keys (<<) are not supported; use `extends`",
                                _loc(key_node.start_mark, name))
            if key in out:
                raise SpecError(f"duplicate key '{key}'", _loc(key_node.start_mark, name))
            smap.keys[path + (key,)] = _loc(key_node.start_mark, name)
            out[key] = _convert(value_node, path + (key,), smap, name, constructor)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(item, path + (i,), smap, name, constructor) for i, item in enumerate(node.value)]
    return constructor.construct_object(node, deep=True)


def display_path(path: Path) -> str:
    """The path shown in messages and banners: relative to the repository or the current directory."""
    path = Path(path).resolve()
    for base in (Path(__file__).resolve().parent.parent, Path.cwd().resolve()):
        try:
            return path.relative_to(base).as_posix()
        except ValueError:
            pass
    return path.as_posix()


def load_yaml(path: Path) -> Tuple[Any, SourceMap]:
    """One YAML file -> (data, SourceMap). Malformed YAML raises one SpecError at the problem mark."""
    name = display_path(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(f"cannot read spec: {e.strerror or e}", None) from None
    smap = SourceMap()
    try:
        loader = _Loader(text)
        try:
            root = loader.get_single_node()
        finally:
            loader.dispose()
        if root is None:
            raise SpecError("the spec is empty", Location(name, 1, 1))
        data = _convert(root, (), smap, name, _Loader(""))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        msg = " ".join(x for x in (e.context, e.problem) if x) or str(e)
        raise SpecError(f"malformed YAML: {msg}", _loc(mark, name) if mark else Location(name, 1, 1)) from None
    except yaml.YAMLError as e:
        raise SpecError(f"malformed YAML: {e}", Location(name, 1, 1)) from None
    if not isinstance(data, dict):
        raise SpecError("the spec must be a mapping at the top level", smap.value(()))
    return data, smap


@dataclass
class SpecTree:
    data: dict
    smap: SourceMap
    files: List[Path]      # the spec and every spec it extends, the spec itself first

    def digest(self) -> str:
        h = hashlib.sha256()
        for f in self.files:
            h.update(display_path(f).encode() + b"\0" + f.read_bytes() + b"\0")
        return h.hexdigest()


def _merge(base: Any, over: Any, path: PathT, bmap: SourceMap, omap: SourceMap) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            sub = path + (key,)
            if value is None:          # `key: null` (or `key: ~`) removes an inherited entry
                out.pop(key, None)
                bmap.drop(sub)
                continue
            if key in out:
                out[key] = _merge(out[key], value, sub, bmap, omap)
            else:
                bmap.drop(sub)
                _copy_locations(omap, bmap, sub)
                out[key] = value
            if sub in omap.keys:
                bmap.keys[sub] = omap.keys[sub]
        bmap.values[path] = omap.values.get(path, bmap.values.get(path))
        shared = [k for k in over if k in base and k in out]
        if shared != [k for k in base if k in shared]:
            # the child relists inherited keys in another order (fused segments, steps): its order wins, so
            # the order checks see what the child wrote
            out = {**{k: out[k] for k in over if k in out}, **out}
        return out
    bmap.drop(path)
    _copy_locations(omap, bmap, path)
    return over


def _copy_locations(src: SourceMap, dst: SourceMap, prefix: PathT) -> None:
    n = len(prefix)
    for table_src, table_dst in ((src.values, dst.values), (src.keys, dst.keys)):
        for p, loc in table_src.items():
            if p[:n] == prefix:
                table_dst[p] = loc


def load_tree(path: Path, _seen: Tuple[Path, ...] = ()) -> SpecTree:
    """Loads a spec and, recursively, the specs it extends; returns the merged tree."""
    path = Path(path).resolve()
    data, smap = load_yaml(path)
    base_ref = data.pop("extends", None)
    if base_ref is None:
        return SpecTree(data, smap, [path])
    if not isinstance(base_ref, str):
        raise SpecError("`extends` takes the path of another spec (relative to this one)", smap.value(("extends",)))
    base_path = (path.parent / base_ref).resolve()
    if base_path == path or base_path in _seen:
        raise SpecError(f"`extends` cycle: {base_ref}", smap.value(("extends",)))
    if not base_path.is_file():
        raise SpecError(f"`extends`: no such spec '{base_ref}'", smap.value(("extends",)))
    base = load_tree(base_path, _seen + (path,))
    merged = _merge(base.data, data, (), base.smap, smap)
    return SpecTree(merged, base.smap, [path] + base.files)
