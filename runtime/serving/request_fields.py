"""The fields of OpenAI's and vLLM's request bodies that are not sampling parameters: declared here (so that they
are not refused as unknown; a field neither API has still is) and sorted by what they do.

- No effect on the output (bookkeeping, routing, caching hints): accepted, null or not: store, metadata,
  service_tier, prompt_cache_key, safety_identifier, user, prediction (a latency hint; the output is the model's
  either way), parallel_tool_calls.
- Served: reasoning_effort (reaches the chat template, as vLLM's), include_reasoning (false: no reasoning_content),
  continue_final_message (the last assistant message is continued, not closed), request_id (the response is
  chatcmpl-ID / cmpl-ID),
  return_token_ids (prompt_token_ids and each choice's token_ids), modalities ["text"].
- Would change the output and are not implemented: a 400 saying so (never "unknown", never ignored), unless null /
  their no-op value: audio, modalities other than ["text"], verbosity, function_call (deprecated: use tool_choice),
  chat `echo: true`, truncate_prompt_tokens, bad_words, allowed_token_ids, priority other than 0,
  return_tokens_as_token_ids, cache_salt (this server's prefix cache is not salted)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

from pydantic import BaseModel

if TYPE_CHECKING:
    from xllm_gen.runtime.engine.structured_outputs import StructuredOutputsParams


class SamplingExtras(BaseModel):
    """vLLM's fields of both /v1/completions and /v1/chat/completions."""
    truncate_prompt_tokens: Optional[int] = None
    bad_words: Optional[List[str]] = None
    allowed_token_ids: Optional[List[int]] = None
    priority: Optional[int] = None
    request_id: Optional[str] = None
    return_tokens_as_token_ids: Optional[bool] = None
    return_token_ids: Optional[bool] = None
    cache_salt: Optional[str] = None


class ChatExtras(BaseModel):
    """OpenAI's chat fields beyond sampling, and vLLM's chat-only ones."""
    store: Optional[bool] = None
    metadata: Optional[Dict[str, Any]] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    prediction: Optional[Dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    modalities: Optional[List[str]] = None
    audio: Optional[Dict[str, Any]] = None
    verbosity: Optional[str] = None
    function_call: Optional[Union[str, Dict[str, Any]]] = None
    include_reasoning: Optional[bool] = None
    echo: Optional[bool] = None
    continue_final_message: Optional[bool] = None


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def unsupported(body) -> Optional[tuple]:
    """(message, param) of the first field of `body` that would change the output and is not implemented; None."""
    def no(field: str, why: str = "") -> tuple:
        return f"{field} is not supported by this server{': ' + why if why else ''}", field

    get = lambda name: getattr(body, name, None)       # noqa: E731 - completions bodies lack the chat fields
    if get("truncate_prompt_tokens") is not None:
        return no("truncate_prompt_tokens", "send a prompt that fits max_model_len")
    if get("bad_words"):
        return no("bad_words")
    if get("allowed_token_ids") is not None:
        return no("allowed_token_ids", "use structured_outputs (choice / regex / grammar) to restrict the output")
    if get("priority") not in (None, 0):
        return no("priority", "requests are served first come, first served (priority 0)")
    if get("return_tokens_as_token_ids"):
        return no("return_tokens_as_token_ids")
    if get("cache_salt") is not None:
        return no("cache_salt", "the prefix cache is not salted")
    if get("audio") is not None:
        return no("audio", "the output is text")
    if get("modalities") not in (None, ["text"]):
        return no("modalities", "the only output modality is [\"text\"]")
    if get("verbosity") is not None:
        return no("verbosity")
    if get("function_call") is not None:
        return no("function_call", "it is deprecated; use tool_choice")
    if isinstance(body, ChatExtras) and body.echo:
        return no("echo", "in chat completions (it is served in /v1/completions)")
    effort = get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        return f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}", "reasoning_effort"
    if get("continue_final_message") and get("add_generation_prompt"):
        return ("continue_final_message and add_generation_prompt cannot both be true (send "
                "add_generation_prompt: false)", "continue_final_message")
    return None


def response_format_constraint(rf: Optional[dict]) -> Optional[StructuredOutputsParams]:
    """OpenAI's response_format: {"type": "text"} | {"type": "json_object"} |
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}."""
    from xllm_gen.runtime.engine.structured_outputs import StructuredOutputsParams
    from xllm_gen.runtime.serving.protocol import APIError

    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        extra = set(rf) - {"type"}
        if extra:
            raise APIError(f"response_format: unknown field(s) {sorted(extra)}", param="response_format")
        return None
    if kind == "json_object":
        extra = set(rf) - {"type"}
        if extra:
            raise APIError(f"response_format: unknown field(s) {sorted(extra)}", param="response_format")
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        extra = set(rf) - {"type", "json_schema"}
        if extra:
            raise APIError(f"response_format: unknown field(s) {sorted(extra)}", param="response_format")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not js["name"] or "schema" not in js:
            raise APIError("response_format.json_schema needs a 'name' (a non-empty string) and a 'schema'",
                           param="response_format")
        bad = set(js) - {"name", "schema", "strict", "description"}
        if bad:
            raise APIError(f"response_format.json_schema: unknown field(s) {sorted(bad)}", param="response_format")
        schema = js["schema"]
        if not isinstance(schema, dict):
            raise APIError("response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        if js.get("strict") not in (None, True, False):
            raise APIError("response_format.json_schema.strict must be a bool", param="response_format")
        return StructuredOutputsParams(json=schema)
    raise APIError(f"response_format.type must be one of text, json_object, json_schema, got {kind!r}",
                   param="response_format")
