"""XML function calls (the `xml_function` parser), as some chat templates ask for them (family aliases:
xllm_gen/parser_aliases.py):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is text (one newline after its tag and one before the closing tag are layout); it is read by
the type its tool's `parameters` schema gives it, as vLLM's parser of this format reads it: a string as written,
integer / number / boolean as such, object / array as JSON, `null` as null; a value that does not read as its type,
or a parameter the schema does not type, stays a string. A call needs `<function=NAME>`; a missing
`</parameter>` / `</function>` at the end of the output is tolerated, as models drop them.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from xllm_gen.runtime.serving.tool_parsers import TaggedJSONToolParser, ToolCall, register

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def _type_of(schema) -> Optional[str]:
    """The JSON type a property schema gives (the first non-null one of a list / anyOf), or None."""
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), None)
    if t is None and "enum" in schema:
        return "string" if all(isinstance(v, str) for v in schema["enum"]) else None
    if t is None:
        for alt in schema.get("anyOf") or schema.get("oneOf") or ():
            t = _type_of(alt)
            if t not in (None, "null"):
                break
    return t.lower() if isinstance(t, str) else None


def read_value(raw: str, typ: Optional[str]):
    """A parameter's text read as `typ` (see the module doc)."""
    text = raw.strip()
    if text.lower() == "null":
        return None
    if typ is None or typ in _STRING_TYPES:
        return raw
    try:
        if typ in ("integer", "int"):
            return int(text)
        if typ in ("number", "float", "double"):
            v = float(text)
            return int(v) if v.is_integer() and re.fullmatch(r"-?\d+", text) else v
        if typ in ("boolean", "bool"):
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
            return raw
        return json.loads(text)                                 # object, array, anything else typed
    except (ValueError, OverflowError):
        return raw


@register("xml_function")
class XmlFunctionToolParser(TaggedJSONToolParser):
    start = "<tool_call>"
    end = "</tool_call>"

    def __init__(self, tools: Optional[list] = None):
        super().__init__(tools)
        self.types = {t["function"]["name"]: {k: _type_of(v) for k, v in
                                              ((t["function"].get("parameters") or {}).get("properties") or {}).items()}
                      for t in (tools or ())}

    def parse_call(self, body: str) -> Optional[ToolCall]:
        m = _FUNCTION.fullmatch(body)
        if m is None:
            return None
        name, inner = m.group(1).strip(), m.group(2)
        types = self.types.get(name, {})
        args = {}
        for p in _PARAMETER.finditer(inner):
            raw = p.group(2)
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            key = p.group(1).strip()
            args[key] = read_value(raw, types.get(key))
        if _PARAMETER.sub("", inner).strip():                   # text that is no parameter: not a call
            return None
        return ToolCall(name, json.dumps(args, ensure_ascii=False))

    def grammar(self, tools: list[dict]) -> str:
        """One call of one of `tools` in this form: every parameter of the schema in its order (the required ones
        always, the others optionally), each value in its type's form (a string without "</", within the schema's
        minLength / maxLength; JSON for the rest, valid against the property's schema)."""
        import xgrammar as xgr

        from xllm_gen.runtime.engine.structured_outputs import bounded_strings

        def lit(s: str):
            return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(s)}")

        def text(sub: dict):            # no "</" (it would close the parameter); the schema's length bounds
            lo, hi = sub.get("minLength"), sub.get("maxLength")
            rep = "*" if lo is None and hi is None else "{%d,%s}" % (lo or 0, "" if hi is None else hi)
            return xgr.Grammar.from_ebnf(f'root ::= ([^<] | "<" [^/]){rep}')

        calls = []
        for t in tools:
            fn = t["function"]
            params = fn.get("parameters") or {}
            required = set(params.get("required") or ())
            parts = [lit(f"{self.start}\n<function={fn['name']}>\n")]
            for key, sub in (params.get("properties") or {}).items():
                typ = _type_of(sub)
                value = text(sub) if typ is None or typ in _STRING_TYPES and "enum" not in sub else (
                    xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(v) for v in sub["enum"]))
                    if typ in _STRING_TYPES else
                    xgr.Grammar.from_json_schema(json.dumps(bounded_strings(sub)), any_whitespace=False,
                                                 strict_mode=True))
                piece = xgr.Grammar.concat(lit(f"<parameter={key}>\n"), value, lit("\n</parameter>\n"))
                parts.append(piece if key in required else xgr.Grammar.union(piece, lit("")))
            parts.append(lit(f"</function>\n{self.end}"))
            calls.append(xgr.Grammar.concat(*parts))
        return str(calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls))
