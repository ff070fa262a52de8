"""OpenAI-style API errors: APIError (status, type, the request field it names as `param`), the field an engine
or SamplingParams message is about (param_of), and pydantic's validation errors as one located 400."""
from __future__ import annotations

import re
from typing import Optional

from xllm_gen.runtime.engine.sampling_params import SamplingParams


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.type = message, status, param, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


_FIELD_RE = re.compile(r"^(?:request \S+: )?(?:invalid SamplingParams: )?([a-z_]+)\b")


_PARAMS = {f for f in SamplingParams.__dataclass_fields__} | {"prompt", "messages", "model", "stream_options",
                                                               "response_format", "tools", "tool_choice",
                                                               "max_completion_tokens"}
_ALIASES = {"prompt_token_ids": "prompt", "multi_modal_data": "messages", "mm_processor_kwargs": "messages"}


def param_of(message: str) -> Optional[str]:
    """The body field a validation message starts with ('top_p must be ...' -> 'top_p'); None if none."""
    m = _FIELD_RE.match(message)
    if not m:
        return None
    word = _ALIASES.get(m.group(1), m.group(1))
    return word if word in _PARAMS else None


# the loc component pydantic gives a union's member (e.g. "str", "list[int]"); never a field name of these bodies
_UNION_MEMBER = re.compile(r"^(?:str|int|float|bool|none|(?:list|dict|tuple|set)\[.*\]|[a-z-]+\[.*\])$")


def _where(loc) -> str:
    """A body location as written in messages: messages[0].content."""
    return "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") or "body"


def _json_text(value, limit: int = 40) -> str:
    """A sent value as JSON, cut to `limit` characters (for error messages)."""
    import json

    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def validation_error(errors: list, content_type: Optional[str] = None) -> "APIError":
    """The 400 of a body that fails its model (pydantic's errors, FastAPI's "body" loc prefix or not): the first
    problem, its field named as written (messages[0].content) and, for a wrong JSON type, the value sent. Of a union
    (stop: a string or a list of strings) the member that got furthest speaks; if none got past the value's type,
    the message lists the members. An empty body, or one that was not read as JSON (`content_type`: the request's
    Content-Type header; FastAPI reads JSON only under application/json), says so."""
    errs = [dict(e, loc=tuple(x for x in e.get("loc", ()) if x != "body")) for e in errors]
    if not errs:
        return APIError("invalid request body")
    first = errs[0]
    loc = first["loc"]
    param = str(loc[0]) if loc else None
    if not loc and first.get("type") == "missing":
        return APIError("the request body is empty: send a JSON object (Content-Type: application/json)")
    if not loc and isinstance(first.get("input"), (bytes, bytearray)):       # the body was not parsed as JSON
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type header"
        return APIError(f"the request body must be a JSON object sent with Content-Type: application/json, got {got}")
    if first.get("type") == "extra_forbidden":          # never silently dropped
        unknown = sorted(_where(e["loc"]) for e in errs if e.get("type") == "extra_forbidden")
        return APIError(f"unknown field(s) {', '.join(unknown)}: not supported by this server", param=param)
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return APIError(f"the request body is not valid JSON: {ctx.get('error', 'decode error')} "
                        f"at character {loc[-1] if loc else '?'}")
    if first.get("type") == "unicode_invalid":          # _Request's check: it names the field itself
        return APIError(first.get("msg", "not valid Unicode"), param=(first.get("ctx") or {}).get("param"))
    at = next((i for i, x in enumerate(loc) if i and isinstance(x, str) and _UNION_MEMBER.match(x)), None)
    if at is not None:                                   # a union's member: the one that got furthest
        members = [e for e in errs if e["loc"][:at] == loc[:at] and len(e["loc"]) > at]
        first = max(members, key=lambda e: len(e["loc"]))
        if len(first["loc"]) == at + 1:                  # none did: the value is of none of the members' types
            kinds = " or ".join(dict.fromkeys(str(e["loc"][at]) for e in members))
            return APIError(f"{_where(loc[:at])}: Input should be {kinds}, got {_json_text(first.get('input'))}",
                            param=param)
        loc = tuple(x for i, x in enumerate(first["loc"]) if i != at)
    msg = first.get("msg", "invalid request body")
    if str(first.get("type", "")).endswith("_type") and "input" in first:    # a wrong JSON type: say which
        msg += f", got {_json_text(first['input'])}"
    return APIError(f"{_where(loc)}: {msg}", param=param)


def body_parse_error(cause: BaseException) -> "APIError":
    """The 400 of a body that could not be read as JSON for a reason other than its syntax (FastAPI answers those
    with a bare "There was an error parsing the body"): bytes that are not UTF-8, nesting too deep to parse."""
    if isinstance(cause, UnicodeDecodeError):
        return APIError(f"the request body is not valid UTF-8 (byte {cause.start}: {cause.reason}); send JSON "
                        "encoded as UTF-8")
    if isinstance(cause, RecursionError):
        return APIError("the request body is nested too deeply to parse (arrays / objects inside each other)")
    return APIError(f"the request body cannot be parsed as JSON ({type(cause).__name__}: {cause})")
