"""Spec file -> validated `Spec` model; pydantic errors mapped back to file:line:column."""
from __future__ import annotations

import re
import typing
from dataclasses import dataclass
from inspect import isclass
from pathlib import Path
from typing import Any, List, Tuple

from pydantic import BaseModel, ValidationError

from .errors import SpecError, SpecErrors, did_you_mean
from .schema import BLOCK_KINDS, Spec
from .yaml_loader import SpecTree, load_tree


@dataclass
class LoadedSpec:
    spec: Spec
    tree: SpecTree

    @property
    def path(self) -> Path:
        return self.tree.files[0]


def load_spec(path) -> LoadedSpec:
    tree = load_tree(Path(path))
    try:
        spec = Spec.model_validate(tree.data)
    except ValidationError as e:
        raise SpecErrors(_map_errors(e, tree)) from None
    return LoadedSpec(spec, tree)


# ---- pydantic error -> SpecError ---------------------------------------------------------------------

_TYPE_WORDS = {
    "int": "an integer", "float": "a number", "bool": "true or false", "str": "a string (config symbol name)",
    "list[int]": "a list of integers", "list[str]": "a list of strings", "dict[str,str]": "a mapping",
}


def _dotted(path) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<spec>"


def _data_path(data: Any, loc: Tuple) -> Tuple[Tuple, List]:
    """Splits a pydantic `loc` into the path of a real data node and the union tags in between."""
    path, tags, node = [], [], data
    for elem in loc:
        if isinstance(node, dict) and elem in node:
            node = node[elem]
            path.append(elem)
        elif isinstance(node, list) and isinstance(elem, int) and 0 <= elem < len(node):
            node = node[elem]
            path.append(elem)
        else:
            tags.append(elem)
    return tuple(path), tags


def _unwrap(tp):
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _union_members(tp):
    origin = typing.get_origin(tp)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        # flattened: an optional discriminated union (a `weights` layout) is Optional[Annotated[Union[...], ...]]
        return [m for a in typing.get_args(tp) for m in (_union_members(_unwrap(a)) or [_unwrap(a)])]
    return None


def _type_at(loc: Tuple):
    """The schema type at a pydantic `loc` (with its union tags), or None when it cannot be followed."""
    tp = Spec
    for elem in loc:
        tp = _unwrap(tp)
        members = _union_members(tp)
        if members is not None:
            match = None
            for m in members:
                if isclass(m) and issubclass(m, BaseModel):
                    kind = m.model_fields.get("kind")
                    if elem == m.__name__ or (kind and typing.get_args(kind.annotation) == (elem,)):
                        match = m
                elif m is type(None):
                    continue
                elif str(elem) == getattr(m, "__name__", str(m)):
                    match = m
            if match is None:
                non_none = [m for m in members if m is not type(None)]
                if len(non_none) != 1:
                    return None
                tp = non_none[0]
                # elem not consumed as a tag: fall through to treat it as a key of the member
                tp = _unwrap(tp)
            else:
                tp = match
                continue
        if isclass(tp) and issubclass(tp, BaseModel):
            fields = {(f.alias or n): f for n, f in tp.model_fields.items()}
            if elem not in fields:
                return None
            tp = fields[elem].annotation
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        elif typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
        else:
            return None
    tp = _unwrap(tp)
    members = _union_members(tp)
    if members:
        non_none = [m for m in members if m is not type(None)]
        if len(non_none) == 1:
            tp = non_none[0]
    return tp


def _keys_of(tp) -> List[str]:
    if isclass(tp) and issubclass(tp, BaseModel):
        return [(f.alias or n) for n, f in tp.model_fields.items()]
    return []


def _got(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{value!r} ({type(value).__name__})"


def _map_errors(exc: ValidationError, tree: SpecTree) -> List[SpecError]:
    data, smap = tree.data, tree.smap
    groups: dict = {}
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        path, tags = _data_path(data, loc)
        if err["type"] in ("missing", "extra_forbidden"):
            # the last loc element is a key that is absent from (missing) / not allowed in (extra) the data
            if err["type"] == "missing":
                path = path[:-1] if path and path[-1] == loc[-1] else path
            groups.setdefault((path, err["type"], loc[-1]), []).append((err, loc, tags))
        else:
            groups.setdefault((path, "value", None), []).append((err, loc, tags))

    out: List[SpecError] = []
    for (path, what, key), errs in groups.items():
        err, loc, tags = errs[0]
        where = _dotted(path)
        if what == "missing":
            out.append(SpecError(f"{where}: missing required key '{key}'", smap.key(path)))
        elif what == "extra_forbidden":
            allowed = _keys_of(_type_at(loc[:-1]))
            hint = did_you_mean(key, allowed)
            if not hint and allowed:
                hint = f" (allowed: {', '.join(allowed)})"
            out.append(SpecError(f"{where[: -len(str(key)) - 1] or '<spec>'}: unknown key '{key}'{hint}",
                                 smap.key(path)))
        else:
            out.append(_value_error(path, errs, data, smap))
    return out


def _value_error(path, errs, data, smap) -> SpecError:
    err, loc, tags = errs[0]
    where = _dotted(path)
    value = err.get("input")
    etype = err["type"]
    if value is None and len(path) == 2 and path[0] == "variants":
        # `~` deletes an inherited entry (under `extends`); here nothing was inherited under that name
        return SpecError(f"{where}: is null: `~` deletes a variant inherited through `extends`, and no spec this one "
                         f"extends has a variant '{path[1]}'; give its config values, or remove the entry",
                         smap.value(path))
    if etype in ("union_tag_invalid", "union_tag_not_found"):
        kinds = re.findall(r"'([^']+)'", str(err.get("ctx", {}).get("expected_tags", "")))
        if etype == "union_tag_not_found":
            return SpecError(f"{where}: missing required key 'kind' (one of: {', '.join(kinds)})", smap.key(path))
        tag = err.get("ctx", {}).get("tag")
        extra = "" if tag in BLOCK_KINDS else did_you_mean(tag, kinds)
        msg = (f"{where}: block kind '{tag}' is not allowed here (allowed: {', '.join(kinds)})" if tag in BLOCK_KINDS
               else f"{where}: unknown block kind '{tag}'{extra}; known kinds here: {', '.join(kinds)}")
        return SpecError(msg, smap.value(path + ("kind",)))
    if etype == "literal_error":
        expected = re.findall(r"'([^']*)'|(\d+)", str(err.get("ctx", {}).get("expected", "")))
        expected = [a or b for a, b in expected]
        hint = did_you_mean(value, expected) if isinstance(value, str) else ""
        return SpecError(f"{where}: {_got(value)} is not allowed{hint}; expected one of: {', '.join(expected)}",
                         smap.value(path))
    if len(errs) > 1 or tags:
        # a union (int | symbol, ...): say what would be accepted, once
        words = []
        for e, _, t in errs:
            word = _TYPE_WORDS.get(str(t[-1]) if t else "", None) if t else None
            if word is None:
                word = e["msg"].replace("Input should be ", "")
            if word not in words:
                words.append(word)
        return SpecError(f"{where}: expected {' or '.join(words)}, got {_got(value)}", smap.value(path))
    msg = err["msg"].replace("Input should be", "expected")
    return SpecError(f"{where}: {msg}, got {_got(value)}", smap.value(path))
