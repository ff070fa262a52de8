"""Which JSON-schema keywords the grammar backend (xgrammar 0.2.x) enforces, and where: `unenforced(schema)` lists
every use of a keyword the grammar would silently ignore, so that such a schema is refused at admission instead of
producing output that does not validate (as vLLM refuses xgrammar-unsupported features).

An allow-list, checked by what xgrammar's grammar accepts (the instance violating only that keyword is refused by
the compiled grammar), not by its docs: a keyword not listed here (a new draft's, a typo, `nullable`) is refused.
Annotations (title, description, default, examples, ...) never constrain and pass. Where xgrammar enforces a
keyword only in some combinations, the others are refused too:
- number / string / array / object keywords only act beside a `type` naming that kind (or where xgrammar infers it:
  properties / additionalProperties / unevaluatedProperties -> object, items / prefixItems -> array);
- multipleOf only on integers, by a whole divisor (xgrammar ignores it on `number`);
- pattern, format and min/maxLength: one of them per string (pattern, then format, wins; the other is dropped);
- format only among the formats xgrammar writes (others accept any string; a date's day is 01-31 whatever the
  month);
- $ref, anyOf / oneOf / allOf: their sibling constraints are dropped; allOf of one schema only;
- oneOf is written as anyOf: its branches must be provably disjoint (distinct types or const / enum values, or an
  object property required by both with distinct const / enum values);
- enum / const values are written as they are: each must satisfy the sibling keywords;
- `required` names only properties that `properties` defines (others are dropped);
- propertyNames not beside patternProperties, and every name in properties must satisfy it.
Never enforced: not, if / then / else, dependentRequired / dependentSchemas / dependencies, contains / minContains /
maxContains, uniqueItems: true, additionalItems, $dynamicRef and the like."""
from __future__ import annotations

import json
from typing import Any, Optional

# keywords that never constrain an instance
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "$schema", "$id", "$anchor", "$vocabulary",
    "deprecated", "readOnly", "writeOnly", "contentEncoding", "contentMediaType", "contentSchema",
    "discriminator",          # OpenAPI's hint beside oneOf: the branches' const values do the work
})
CONTAINERS = frozenset({"$defs", "definitions"})      # hold subschemas, constrain nothing themselves
# enforced keywords and the kind of instance each applies to (None: any)
ENFORCED: dict = {
    "type": None, "enum": None, "const": None, "$ref": None, "anyOf": None, "oneOf": None, "allOf": None,
    "minimum": "number", "maximum": "number", "exclusiveMinimum": "number", "exclusiveMaximum": "number",
    "multipleOf": "number",
    "minLength": "string", "maxLength": "string", "pattern": "string", "format": "string",
    "items": "array", "prefixItems": "array", "minItems": "array", "maxItems": "array", "unevaluatedItems": "array",
    "uniqueItems": "array",   # false only (a no-op)
    "properties": "object", "required": "object", "additionalProperties": "object", "patternProperties": "object",
    "propertyNames": "object", "minProperties": "object", "maxProperties": "object", "unevaluatedProperties": "object",
}
FORMATS = frozenset({"date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
_INFERRED = {"properties": "object", "additionalProperties": "object", "unevaluatedProperties": "object",
             "items": "array", "prefixItems": "array"}
_KIND_OF_TYPE = {"integer": "number", "number": "number", "string": "string", "array": "array", "object": "object",
                 "boolean": "boolean", "null": "null"}
_COMBINATORS = ("anyOf", "oneOf", "allOf")
_SUBSCHEMA = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAX_REPORTED = 8


def unenforced(schema: Any) -> list[str]:
    """"'keyword' at /json/pointer: why" for every keyword use the backend would not enforce (empty: all enforced).
    `schema` has passed the meta-schema check (structurally valid)."""
    out: list[str] = []
    _Walk(schema, out).node(schema, "")
    if len(out) > _MAX_REPORTED:
        out[_MAX_REPORTED:] = [f"and {len(out) - _MAX_REPORTED} more"]
    return out


def _ptr(path: str, key: Any) -> str:
    return f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"


def _is_whole(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


def _canon(v: Any) -> str:
    """A value's identity as JSON Schema compares them (1 == 1.0; true != 1)."""
    def norm(x):
        if isinstance(x, float) and x.is_integer():
            return int(x)
        if isinstance(x, list):
            return [norm(y) for y in x]
        if isinstance(x, dict):
            return {k: norm(y) for k, y in x.items()}
        return x
    return json.dumps(norm(v), sort_keys=True)


def _json_kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(v), "object")


class _Walk:
    def __init__(self, root: Any, out: list):
        self.root, self.out = root, out
        self._validator = None

    def bad(self, path: str, key: str, why: str) -> None:
        self.out.append(f"'{key}' at {_ptr(path, key)}: {why}")

    # ---- one schema node ------------------------------------------------------------------------
    def node(self, s: Any, path: str, implied: Optional[str] = None) -> None:
        """`implied`: the kind every instance has here (a property name is a string)."""
        if not isinstance(s, dict):
            return                                  # true / false (xgrammar refuses false itself)
        types = s.get("type")
        types = [types] if isinstance(types, str) else (types if isinstance(types, list) else None)
        kinds = {_KIND_OF_TYPE.get(t, t) for t in types} if types is not None else \
            {_INFERRED[k] for k in _INFERRED if k in s} | ({implied} if implied else set())
        constraining = [k for k in s if k not in ANNOTATIONS and k not in CONTAINERS]
        # where the values are fixed (enum / const) or written elsewhere ($ref, branches), the other rules judge
        standalone = not any(k in s for k in ("enum", "const", "$ref", *_COMBINATORS))
        for key in s:
            if key in ANNOTATIONS or key in CONTAINERS or (key == "uniqueItems" and s[key] is False):
                continue
            if key not in ENFORCED or key == "uniqueItems":
                self.bad(path, key, "not enforced by the grammar backend (it would be ignored)")
                continue
            kind = ENFORCED[key]
            if kind is not None and not kinds and standalone:
                self.bad(path, key, f"enforced only beside a \"type\" that includes "
                                    f"{'integer or number' if kind == 'number' else kind}")
            elif key == "multipleOf" and kind in kinds and ("number" in (types or ()) or not _is_whole(s[key])):
                self.bad(path, key, "enforced only on \"type\": \"integer\" by a whole divisor (ignored on "
                                    "\"number\")")
            elif key == "format" and s[key] not in FORMATS:
                self.bad(path, key, f"format {s[key]!r} is not enforced (enforced: {', '.join(sorted(FORMATS))})")
        if "string" in kinds:
            self._string_rules(s, path)
        self._sibling_rules(s, path, constraining)
        if "object" in kinds:
            self._object_rules(s, path)
        for key in ("const", "enum"):
            if key in s:
                self._values_fit(s, path, key)
        if isinstance(s.get("oneOf"), list):
            self._disjoint(s["oneOf"], _ptr(path, "oneOf"))
        for key in _SUBSCHEMA:
            if isinstance(s.get(key), dict):
                self.node(s[key], _ptr(path, key), "string" if key == "propertyNames" else None)
        for key in _SUBSCHEMA_MAPS:
            if isinstance(s.get(key), dict):
                for name, sub in s[key].items():
                    self.node(sub, _ptr(_ptr(path, key), name))
        for key in _SUBSCHEMA_LISTS:
            if isinstance(s.get(key), list):
                for i, sub in enumerate(s[key]):
                    self.node(sub, _ptr(_ptr(path, key), i))

    def _string_rules(self, s: dict, path: str) -> None:
        # xgrammar writes a string by its pattern, else its format, else its length bounds: one of them only
        if "pattern" in s:
            for key in ("format", "minLength", "maxLength"):
                if key in s:
                    self.bad(path, key, "ignored beside 'pattern' (fold it into the pattern)")
        elif "format" in s:
            for key in ("minLength", "maxLength"):
                if key in s:
                    self.bad(path, key, "ignored beside 'format'")

    def _sibling_rules(self, s: dict, path: str, constraining: list) -> None:
        # $ref and the combinators stand alone: xgrammar writes only the referenced schema / the branches
        for key in ("$ref", *_COMBINATORS):
            if key not in s:
                continue
            others = [k for k in constraining if k != key]
            if others:
                self.bad(path, others[0] if others[0] not in ("$ref", *_COMBINATORS) else key,
                         f"ignored beside '{key}' (siblings {others} of '{key}' are not enforced: move them into "
                         f"{'the referenced schema' if key == '$ref' else 'each branch'})")
                return
        if isinstance(s.get("allOf"), list) and len(s["allOf"]) > 1:
            self.bad(path, "allOf", "allOf of several schemas is not enforced (merge them into one schema)")

    def _object_rules(self, s: dict, path: str) -> None:
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        for name in s.get("required") or ():
            if name not in props:
                self.bad(path, "required", f"required property {name!r} is not defined in 'properties' (the "
                                           "backend enforces required properties only there)")
        if "propertyNames" in s:
            if "patternProperties" in s:
                self.bad(path, "propertyNames", "ignored beside 'patternProperties'")
            v = self.validator(s["propertyNames"])
            for name in props:
                if v is not None and not v.is_valid(name):
                    self.bad(path, "propertyNames", f"property {name!r} of 'properties' does not satisfy it "
                                                    "(the backend writes the properties as defined)")

    def _values_fit(self, s: dict, path: str, key: str) -> None:
        """enum / const values are written as they are: each must satisfy the node's other keywords."""
        rest = {k: v for k, v in s.items() if k != key and k not in ANNOTATIONS and k not in CONTAINERS}
        if not rest:
            return
        values = [s[key]] if key == "const" else (s[key] if isinstance(s[key], list) else [])
        v = self.validator(rest)
        for value in values:
            if v is None or not v.is_valid(value):
                self.bad(path, key, f"value {_canon(value)[:60]} does not satisfy the sibling keywords "
                                    f"{sorted(rest)} (the backend writes {key} values as they are)")
                return

    def validator(self, sub: Any):
        """A format-asserting validator of `sub` whose $refs resolve against the root schema (None: jsonschema
        is not installed; callers then refuse)."""
        try:
            import jsonschema
        except ImportError:
            return None
        if self._validator is None:
            cls = jsonschema.validators.validator_for(self.root, default=jsonschema.Draft202012Validator)
            self._validator = cls(self.root, format_checker=cls.FORMAT_CHECKER)
        return self._validator.evolve(schema=sub)

    # ---- oneOf ------------------------------------------------------------------------------------
    def _disjoint(self, branches: list, path: str) -> None:
        sigs = [self._signature(b) for b in branches]
        for i in range(len(sigs)):
            for j in range(i + 1, len(sigs)):
                if not _provably_disjoint(sigs[i], sigs[j]):
                    self.out.append(f"'oneOf' at {path}: branches {i} and {j} may both match an instance (the "
                                    "backend enforces oneOf as anyOf): use anyOf, or make the branches provably "
                                    "distinct (different types or const / enum values, or a property required by "
                                    "both with different const / enum values)")
                    return

    def _resolve(self, s: Any, depth: int = 0) -> Any:
        while isinstance(s, dict) and isinstance(s.get("$ref"), str) and s["$ref"].startswith("#") and depth < 16:
            target = self.root
            for part in s["$ref"][1:].split("/")[1:]:
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(target, dict) and part in target:
                    target = target[part]
                elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                    target = target[int(part)]
                else:
                    return None
            s, depth = target, depth + 1
        return s

    def _signature(self, s: Any) -> Optional[dict]:
        """What a branch admits, as far as can be told: {"kinds": set or None, "values": set or None,
        "tags": {required property: set of its const / enum values}}; None: anything."""
        s = self._resolve(s)
        if not isinstance(s, dict):
            return None if s is not False else {"kinds": set(), "values": set(), "tags": {}}
        values = None
        if "const" in s:
            values = {_canon(s["const"])}
        elif isinstance(s.get("enum"), list):
            values = {_canon(v) for v in s["enum"]}
        t = s.get("type")
        types = [t] if isinstance(t, str) else (t if isinstance(t, list) else None)
        if values is not None:
            kinds = {_json_kind(json.loads(v)) for v in values}
        elif types is not None:
            kinds = {_KIND_OF_TYPE.get(x, x) for x in types}
        elif any(k in s for k in _COMBINATORS):
            subs = [self._signature(b) for k in ("anyOf", "oneOf") for b in (s.get(k) or ())]
            kinds = None if not subs or any(x is None or x["kinds"] is None for x in subs) else \
                set().union(*(x["kinds"] for x in subs))
        else:
            inferred = {_INFERRED[k] for k in _INFERRED if k in s}
            kinds = inferred or None
        tags = {}
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        for name in s.get("required") or ():
            sub = self._resolve(props.get(name))
            if isinstance(sub, dict) and "const" in sub:
                tags[name] = {_canon(sub["const"])}
            elif isinstance(sub, dict) and isinstance(sub.get("enum"), list):
                tags[name] = {_canon(v) for v in sub["enum"]}
        return {"kinds": kinds, "values": values, "tags": tags}


def _provably_disjoint(a: Optional[dict], b: Optional[dict]) -> bool:
    if a is None or b is None:
        return False
    if a["kinds"] is not None and b["kinds"] is not None and not a["kinds"] & b["kinds"]:
        return True
    if a["values"] is not None and b["values"] is not None and not a["values"] & b["values"]:
        return True
    # a property both require, with distinct values, tells objects apart (a non-object matches no tag)
    objects = a["kinds"] is not None and b["kinds"] is not None and a["kinds"] | b["kinds"] <= {"object"}
    return objects and any(name in b["tags"] and not vals & b["tags"][name] for name, vals in a["tags"].items())
