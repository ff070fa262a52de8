"""YAML loading that remembers where every node came from, and spec composition (`extends`).

`load_tree(path)` returns plain Python data (dicts, lists, scalars) plus a SourceMap from each node's
path (a tuple of keys and list indices) to its file:line:column, so that schema errors and cross-field
checks can point at the offending node. A spec may start with `extends: other.yaml`: the other spec is
loaded first and this one is deep-merged over it (mappings merge key by key, anything else replaces,
`null` deletes the key). Locations keep pointing at whichever file supplied each node.

Hostile or broken input gives one located SpecError, never a traceback, a hang or a large allocation:
the limits below bound the file size, the nesting depth, the number of aliases and of nodes after alias
expansion (an alias bomb stops at MAX_NODES), and the `extends` chain; an alias inside its own anchor, a
file that is not UTF-8 (Latin-1, UTF-16/32, binary) and control characters are located errors.
"""
from __future__ import annotations

import codecs
import copy
import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Tuple

import yaml

from .errors import Location, SpecError

PathT = Tuple[Any, ...]

# Limits on what one spec may be (docs/reliability.md). Real specs are a few KiB, nest about 8 deep, use no
# aliases and hold under 2,000 nodes; each limit is far above that and far below what hurts.
MAX_SPEC_BYTES = 1 << 20        # one file
MAX_DEPTH = 64                  # nested mappings / sequences, also after alias expansion
MAX_ALIASES = 256               # `*name` references in one file
MAX_NODES = 100_000             # nodes in one file after alias expansion (an alias bomb stops here)
MAX_EXTENDS = 32                # specs in one `extends` chain, the spec itself included


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as `1e-6` (PyYAML would make that a string), with
    limits on nesting depth, aliases and composed nodes, and a located error for an alias inside its own
    anchor (a recursive structure)."""

    def __init__(self, stream, name: str = "<spec>"):
        super().__init__(stream)
        self._name = name
        self._depth = 0
        self._aliases = 0
        self._nodes = 0
        self._open: set = set()            # anchors whose node is being composed

    def compose_node(self, parent, index):
        event = self.peek_event()
        where = _loc(event.start_mark, self._name)
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise SpecError(f"more than {MAX_ALIASES} aliases (`*name`) in one spec", where)
            if event.anchor in self._open:
                raise SpecError(f"alias *{event.anchor} refers to its own anchor &{event.anchor} "
                                f"(a recursive structure)", where)
            return super().compose_node(parent, index)
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise SpecError(f"the spec has more than {MAX_NODES} YAML nodes", where)
        if self._depth >= MAX_DEPTH:
            raise SpecError(f"nesting deeper than {MAX_DEPTH} levels", where)
        anchor = event.anchor
        self._depth += 1
        if anchor is not None:
            self._open.add(anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._open.discard(anchor)


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


class _Budget:
    """Nodes left to visit while converting (aliases re-visit their anchor's node)."""

    def __init__(self):
        self.nodes = MAX_NODES


def _construct(constructor, node, name: str) -> Any:
    try:
        return constructor.construct_object(node, deep=True)
    except yaml.YAMLError:
        raise
    except (ValueError, TypeError, OverflowError, ArithmeticError) as e:   # e.g. an int of 10,000 digits
        raise SpecError(f"bad scalar: {e}", _loc(node.start_mark, name)) from None


def _convert(node, path: PathT, smap: SourceMap, name: str, constructor, budget: _Budget = None) -> Any:
    budget = budget or _Budget()
    budget.nodes -= 1
    if budget.nodes < 0:
        raise SpecError(f"the spec expands to more than {MAX_NODES} YAML nodes (aliases that repeat large "
                        f"anchors, an 'alias bomb'?)", _loc(node.start_mark, name))
    if len(path) > MAX_DEPTH:
        raise SpecError(f"nesting deeper than {MAX_DEPTH} levels (after alias expansion)",
                        _loc(node.start_mark, name))
    smap.values[path] = _loc(node.start_mark, name)
    if isinstance(node, yaml.MappingNode):
        out: Dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise SpecError("mapping keys must be plain scalars", _loc(key_node.start_mark, name))
            key = _construct(constructor, key_node, name)
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise SpecError("YAML merge keys (<<) are not supported; use `extends`",
                                _loc(key_node.start_mark, name))
            if key in out:
                raise SpecError(f"duplicate key '{key}'", _loc(key_node.start_mark, name))
            smap.keys[path + (key,)] = _loc(key_node.start_mark, name)
            out[key] = _convert(value_node, path + (key,), smap, name, constructor, budget)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(item, path + (i,), smap, name, constructor, budget) for i, item in enumerate(node.value)]
    return _construct(constructor, node, name)


def display_path(path: Path) -> str:
    """The path shown in messages and banners: relative to the repository or the current directory."""
    path = Path(path).resolve()
    for base in (Path(__file__).resolve().parent.parent, Path.cwd().resolve()):
        try:
            return path.relative_to(base).as_posix()
        except ValueError:
            pass
    return path.as_posix()


def _byte_location(raw: bytes, offset: int, name: str) -> Location:
    """file:line:column of byte `offset` (the column counts characters of the decodable prefix)."""
    line_start = raw.rfind(b"\n", 0, offset) + 1
    column = len(raw[line_start:offset].decode("utf-8", errors="replace")) + 1
    return Location(name, raw.count(b"\n", 0, offset) + 1, column)


_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
         (codecs.BOM_UTF16_BE, "UTF-16"))


def read_spec_text(path: Path, name: str) -> str:
    """The spec's text: at most MAX_SPEC_BYTES of UTF-8 (a UTF-8 BOM is dropped), else a located SpecError."""
    start = Location(name, 1, 1)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except (OSError, ValueError) as e:
        raise SpecError(f"cannot read spec: {getattr(e, 'strerror', None) or e}", start) from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"the spec is larger than {MAX_SPEC_BYTES // 1024} KiB (the limit for one file)", start)
    for bom, enc in _BOMS:
        if raw.startswith(bom):
            raise SpecError(f"the spec is {enc} encoded (byte order mark); specs are UTF-8", start)
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
    nul = raw.find(b"\0")
    if nul >= 0:
        raise SpecError("NUL byte: a spec is UTF-8 text (is this file binary, or UTF-16/32 encoded?)",
                        _byte_location(raw, nul, name))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"not UTF-8: byte 0x{raw[e.start]:02x} cannot be decoded ({e.reason}); save the spec as "
                        f"UTF-8 (Latin-1 or another 8-bit encoding?)", _byte_location(raw, e.start, name)) from None


def _text_location(text: str, index: int, name: str) -> Location:
    index = max(0, min(index, len(text)))
    return Location(name, text.count("\n", 0, index) + 1, index - (text.rfind("\n", 0, index) + 1) + 1)


# (display name, text) -> (data, SourceMap) of files parsed in this process, returned as deep copies: the
# line-tracking loader is pure Python (~0.1 s a spec), and a compile of all specs, the tests' collection and `extends`
# chains parse the same files many times. Keyed by the text, so an edited file is parsed again; bounded (fuzzers).
_PARSED: "OrderedDict[tuple, tuple]" = OrderedDict()
_PARSED_MAX = 512


def load_yaml(path: Path) -> Tuple[Any, SourceMap]:
    """One YAML file -> (data, SourceMap). Malformed YAML raises one SpecError at the problem mark."""
    name = display_path(path)
    text = read_spec_text(Path(path), name)
    key = (name, text)
    if key in _PARSED:
        _PARSED.move_to_end(key)
        return copy.deepcopy(_PARSED[key])
    data, smap = _parse(text, name)
    _PARSED[key] = copy.deepcopy((data, smap))
    if len(_PARSED) > _PARSED_MAX:
        _PARSED.popitem(last=False)
    return data, smap


def _parse(text: str, name: str) -> Tuple[Any, SourceMap]:
    smap = SourceMap()
    try:
        loader = _Loader(text, name)
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
    except yaml.reader.ReaderError as e:
        what = f"character #x{e.character:04x}" if isinstance(e.character, int) else repr(e.character)
        raise SpecError(f"malformed YAML: unacceptable {what}: control characters are not allowed",
                        _text_location(text, e.position, name)) from None
    except yaml.YAMLError as e:
        raise SpecError(f"malformed YAML: {e}", Location(name, 1, 1)) from None
    except RecursionError:       # not expected within MAX_DEPTH; never a traceback
        raise SpecError(f"nesting too deep (the limit is {MAX_DEPTH} levels)", Location(name, 1, 1)) from None
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
    where = smap.value(("extends",))
    if not isinstance(base_ref, str) or not base_ref.strip():
        raise SpecError("`extends` takes the path of another spec (relative to this one)", where)
    bad = next((c for c in base_ref if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise SpecError(f"`extends`: the path contains the control character {bad!r}", where)
    if len(base_ref) > 1024:
        raise SpecError("`extends`: the path is longer than 1024 characters", where)
    if len(_seen) + 1 >= MAX_EXTENDS:
        raise SpecError(f"`extends` chain longer than {MAX_EXTENDS} specs", where)
    try:
        base_path = (path.parent / base_ref).resolve()
        exists = base_path.is_file()
    except (OSError, ValueError, RuntimeError) as e:
        raise SpecError(f"`extends`: cannot use the path '{base_ref}': {e}", where) from None
    if base_path == path or base_path in _seen:
        raise SpecError(f"`extends` cycle: {base_ref}", where)
    if not exists:
        raise SpecError(f"`extends`: no such spec '{base_ref}'", where)
    base = load_tree(base_path, _seen + (path,))
    merged = _merge(base.data, data, (), base.smap, smap)
    return SpecTree(merged, base.smap, [path] + base.files)
