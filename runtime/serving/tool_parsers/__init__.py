"""Tool-call parsers, one small file per format, chosen with `xllm-gen-serve --tool-call-parser NAME`.

A parser knows how a model family writes a tool call in its output text. It gives:
- `extract(text)` -> (content or None, [ToolCall]): the calls of a finished output and the text around them;
- `streamer()`: an object whose `feed(delta)` / `finish()` return (content delta, [ToolCall]) as text arrives,
  holding back text that may begin a call;
- `grammar(tools)`: an EBNF grammar (xgrammar's dialect) that forces one call of one of `tools`, its
  arguments valid against the function's `parameters` schema (tool_choice "required" or a named function).

Adding a format: a file here with a subclass (most are `TaggedJSONToolParser` with other tags) decorated with
`@register("name")`, and its import in `_BUILTIN` below. Parsers are named by their output format; the names of
model families that use a format are aliases kept outside the runtime (xllm_gen/parser_aliases.py)."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Optional

from xllm_gen.runtime.serving.parser_registry import ParserRegistry

_BUILTIN = {"hermes": "xllm_gen.runtime.serving.tool_parsers.hermes",
            "xml_function": "xllm_gen.runtime.serving.tool_parsers.xml_function"}
_REGISTRY = ParserRegistry("tool-call parser", _BUILTIN, "TOOL_CALL_PARSERS")
register, names, get = _REGISTRY.register, _REGISTRY.names, _REGISTRY.get


@dataclass
class ToolCall:
    name: str
    arguments: str                                  # JSON text of the arguments object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: Optional[int] = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


class ToolParser:
    """One request's parser; `tools`: the request's (checked) tools, for formats whose calls are read by their
    parameters' types."""
    name = ""

    def __init__(self, tools: Optional[list] = None):
        self.tools = list(tools or ())

    def extract(self, text: str, truncated: bool = False) -> tuple[Optional[str], list[ToolCall]]:
        """(content, calls) of a finished output; `truncated`: it was cut short (an unfinished call is dropped)."""
        raise NotImplementedError

    def streamer(self):
        raise NotImplementedError

    def grammar(self, tools: list[dict]) -> str:
        raise NotImplementedError


def _call_schema(tool: dict, at: str = "") -> dict:
    """The JSON schema of one call of `tool` ({"name": ..., "arguments": ...}); `at`: the JSON pointer of this schema
    within the whole grammar's schema ("" at its root, "/anyOf/1" as a branch), so that the parameters' own local
    $refs ("#/$defs/Place", what Pydantic writes for nested models) still resolve within them there."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             "arguments": rebase_refs(params, f"{at}/properties/arguments")},
            "required": ["name", "arguments"], "additionalProperties": False}


_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples"})     # values of the instance, never subschemas
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})  # name ->


def rebase_refs(schema, prefix: str):
    """A copy of `schema` to be placed at the JSON pointer `prefix` of a larger schema: its local $refs ("#",
    "#/$defs/X") point at the same subschemas there ("#" + prefix, "#" + prefix + "/$defs/X"); other refs as they
    are."""
    if isinstance(schema, list):
        return [rebase_refs(x, prefix) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = "#" + prefix + v[1:]
        elif k in _SCHEMA_MAPS and isinstance(v, dict):       # (a property may be called "default")
            out[k] = {name: rebase_refs(sub, prefix) for name, sub in v.items()}
        elif k in _NOT_SCHEMAS:
            out[k] = v
        else:
            out[k] = rebase_refs(v, prefix)
    return out


class TaggedJSONToolParser(ToolParser):
    """Calls written as START {"name": ..., "arguments": {...}} END (hermes: <tool_call> ... </tool_call>);
    a call whose JSON does not parse stays in the content."""
    start = ""
    end = ""
    sep = "\n"                                      # between a tag and the JSON in the forced form

    def parse_call(self, body: str) -> Optional[ToolCall]:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))

    def extract(self, text: str, truncated: bool = False) -> tuple[Optional[str], list[ToolCall]]:
        s = self.streamer()
        content, calls = s.feed(text)
        more, last = s.finish(truncated)
        content += more
        return (content if content.strip() else None), calls + last

    def streamer(self) -> "_TagStream":
        return _TagStream(self)

    def grammar(self, tools: list[dict]) -> str:
        import xgrammar as xgr

        from xllm_gen.runtime.engine.structured_outputs import bounded_strings

        schemas = [bounded_strings(_call_schema(t, "" if len(tools) == 1 else f"/anyOf/{i}"))
                   for i, t in enumerate(tools)]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        lit = xgr.Grammar.from_ebnf
        g = xgr.Grammar.concat(lit(f"root ::= {json.dumps(self.start + self.sep)}"),
                               xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                            strict_mode=True),
                               lit(f"root ::= {json.dumps(self.sep + self.end)}"))
        return str(g)


class _TagStream:
    def __init__(self, parser: TaggedJSONToolParser):
        self.p = parser
        self.buf = ""
        self.in_call = False

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        p = self.p
        self.buf += delta
        out, calls = "", []
        while True:
            if not self.in_call:
                i = self.buf.find(p.start)
                if i >= 0:
                    out += self.buf[:i]
                    self.buf, self.in_call = self.buf[i + len(p.start):], True
                    continue
                k = _held(self.buf, p.start)         # a suffix that may begin a call waits
                out += self.buf[:len(self.buf) - k]
                self.buf = self.buf[len(self.buf) - k:]
                return out, calls
            j = self.buf.find(p.end)
            if j < 0:
                return out, calls
            body, self.buf, self.in_call = self.buf[:j], self.buf[j + len(p.end):], False
            call = p.parse_call(body.strip())
            if call is None:
                out += p.start + body + p.end
            else:
                calls.append(call)

    def finish(self, truncated: bool = False) -> tuple[str, list[ToolCall]]:
        """The end of the output: an unterminated call is parsed if its JSON is complete; `truncated` (the output
        was cut by max_tokens / the context): an unterminated call is dropped, neither a call nor content."""
        rest, self.buf = self.buf, ""
        if not self.in_call:
            return rest, []
        self.in_call = False
        if truncated:
            return "", []
        call = self.p.parse_call(rest.strip())
        return ("", [call]) if call is not None else (self.p.start + rest, [])


def _held(buf: str, tag: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `tag`."""
    for k in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-k:]):
            return k
    return 0


def check_tools(tools: list) -> list[dict]:
    """OpenAI's tools list, validated: [{"type": "function", "function": {"name", "description"?, "parameters"?,
    "strict"?}}]; ValueError naming tools[i]."""
    from xllm_gen.runtime.engine.structured_outputs import GrammarError, _check_schema

    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ValueError(f"{where}: a tool is {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                             f"...}}}}")
        extra = set(t) - {"type", "function"}
        fn = t["function"]
        extra |= {f"function.{k}" for k in set(fn) - {"name", "description", "parameters", "strict"}}
        if extra:
            raise ValueError(f"{where}: unknown field(s) {sorted(extra)}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name must be a non-empty string")
        if name in seen:
            raise ValueError(f"{where}.function.name: {name!r} is given twice")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise ValueError(f"{where}.function.parameters must be a JSON schema object")
            try:
                _check_schema(params, f"{where}.function.parameters")
            except GrammarError as e:
                raise ValueError(str(e)) from None
            if params and params.get("type") != "object":      # OpenAI's rule: the arguments are an object
                raise ValueError(f"{where}.function.parameters must be a JSON Schema of 'type: object' (the call's "
                                 f"arguments are a JSON object), got 'type': {json.dumps(params.get('type'))}")
        out.append(t)
    return out
