"""OpenAI-compatible request bodies (pydantic) and their translation to SamplingParams (errors: api_errors.py).

Unknown fields are refused with a 400 naming them (never silently dropped); vLLM's extra sampling fields (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output, prompt_logprobs,
structured_outputs, chat_template_kwargs) are accepted in the body (the openai client sends them through
`extra_body`). OpenAI's `response_format` (json_schema, json_object) and vLLM's `structured_outputs` (json,
regex, choice, grammar, json_object) become SamplingParams.structured_outputs."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from xllm_gen.runtime.engine.sampling_params import SamplingParams
from xllm_gen.runtime.engine.structured_outputs import StructuredOutputsParams
from xllm_gen.runtime.serving.api_errors import (  # noqa: F401 - APIError and the error helpers: re-exported
    APIError,
    _json_text,
    _where,
    body_parse_error,
    param_of,
    validation_error,
)
from xllm_gen.runtime.serving.request_fields import (  # noqa: F401 - response_format_constraint: re-exported
    ChatExtras,
    SamplingExtras,
    response_format_constraint,
    unsupported,
)


class _Body(BaseModel):
    """A request body or a part of one: unknown fields refused, and strict types as the Python API has them (a JSON
    true is not the integer 1, nor "3" the integer 3, nor 3.0 an integer; an integer is a valid float)."""
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


def _surrogate_at(text: str) -> Optional[int]:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _bad_unicode(value) -> Optional[tuple]:
    """(loc, character, in a key) of the first string or object key in a JSON value that is not valid Unicode: a
    lone surrogate, which JSON's \\ud800 escapes can carry and no tokenizer takes; None if there is none."""
    stack = [((), value)]
    while stack:
        loc, v = stack.pop()
        if isinstance(v, str):
            at = _surrogate_at(v)
            if at is not None:
                return loc, at, False
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                at = _surrogate_at(k) if isinstance(k, str) else None
                if at is not None:              # the key is not printable: the object that holds it is named
                    return loc, at, True
                stack.append(((*loc, k), x))
        elif isinstance(v, list):                   # only what can hold text (a prompt's 1k token ids cannot)
            stack.extend(((*loc, i), x) for i, x in reversed(list(enumerate(v))) if isinstance(x, (str, dict, list)))
    return None


class _Request(_Body):
    """A whole request body: its text is valid Unicode everywhere (prompt, messages, stop, tools, ...), checked here
    for every endpoint before any field is read, so that no tokenizer or template meets a lone surrogate."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        bad = _bad_unicode(data)
        if bad is not None:
            loc, at, key = bad
            raise PydanticCustomError("unicode_invalid", "{where}: not valid Unicode (a lone surrogate at character "
                                      "{at}{key})", {"where": _where(loc), "param": str(loc[0]) if loc else None,
                                                     "at": at, "key": " of a key" if key else ""})
        return data


class _Sampling(_Request, SamplingExtras):
    model: Optional[str] = None
    n: Optional[int] = 1
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, float]] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[int] = None
    skip_special_tokens: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    prompt_logprobs: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    response_format: Optional[Dict[str, Any]] = None
    structured_outputs: Optional[Dict[str, Any]] = None

    def _num_logprobs(self) -> Optional[int]:
        raise NotImplementedError

    def sampling_params(self, default_max_tokens: int, defaults: Optional[dict] = None) -> SamplingParams:
        """SamplingParams of this body; APIError (400, naming the field) when a value is invalid. `defaults`: the
        model's sampling defaults (sampling_params.generation_defaults), for the fields the body leaves unset."""
        bad = unsupported(self)
        if bad is not None:
            raise APIError(bad[0], param=bad[1])
        mt = self._max_tokens()
        if mt is not None and mt < 1:
            raise APIError(f"{self._max_tokens_field()} must be an integer >= 1, got {mt}",
                           param=self._max_tokens_field())
        kw: dict[str, Any] = {}
        for name in ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "seed", "min_tokens", "ignore_eos", "skip_special_tokens",
                     "include_stop_str_in_output", "prompt_logprobs"):
            v = getattr(self, name)
            if v is None and defaults:
                v = defaults.get(name)
            if v is not None:
                kw[name] = v
        kw["max_tokens"] = self._max_tokens()
        if kw["max_tokens"] is None:
            kw["max_tokens"] = min(default_max_tokens, (defaults or {}).get("max_tokens") or default_max_tokens)
        if self.stop is not None:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids is not None:
            kw["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias:
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    bias[int(k)] = float(v)
                except ValueError:
                    raise APIError(f"logit_bias keys must be token ids, got {k!r}", param="logit_bias") from None
            kw["logit_bias"] = bias
        lp = self._num_logprobs()
        if lp is not None:
            kw["logprobs"] = lp
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream: true", param="stream_options")
        so = self.structured()
        if so is not None:
            kw["structured_outputs"] = so
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            msg = str(e).replace("invalid SamplingParams: ", "")
            raise APIError(msg, param=param_of(msg)) from None

    def _max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def _max_tokens_field(self) -> str:
        return "max_tokens"

    def structured(self) -> Optional[StructuredOutputsParams]:
        """The constraint of `response_format` or `structured_outputs` (not both); APIError naming the field."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and so is not None:
            raise APIError("give either response_format or structured_outputs, not both", param="response_format")
        if so is not None:
            try:
                out = StructuredOutputsParams.from_dict(so)
            except (TypeError, ValueError) as e:
                raise APIError(str(e), param="structured_outputs") from None
            problems = out.problems()
            if problems:
                raise APIError("; ".join(problems), param="structured_outputs")
            return out
        return response_format_constraint(rf)

    def structured_where(self) -> tuple[str, str]:
        """(the body field that holds this body's constraint, the param) that a compile error of it names."""
        if self.response_format is not None:
            kind = self.response_format.get("type")
            return ("response_format.json_schema.schema" if kind == "json_schema" else "response_format",
                    "response_format")
        return "structured_outputs", "structured_outputs"


class CompletionRequest(_Sampling):
    prompt: Any = Field()      # a string, strings, token ids or token-id lists: prompts() names a bad element
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    add_special_tokens: bool = True          # vLLM's: the tokenizer's special tokens (BOS) around a text prompt

    def _num_logprobs(self) -> Optional[int]:
        return self.logprobs

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated (lm-eval's loglikelihood)."""
        return bool(self.echo) and self.max_tokens == 0

    def _max_tokens(self) -> Optional[int]:
        return 1 if self.echo_only else self.max_tokens       # one step computes the prompt's logprobs

    def sampling_params(self, default_max_tokens: int, defaults: Optional[dict] = None) -> SamplingParams:
        params = super().sampling_params(default_max_tokens, defaults)
        if self.echo and self.logprobs is not None:    # echoed prompt tokens carry logprobs too
            params = dataclasses.replace(params, prompt_logprobs=max(params.prompt_logprobs or 0, self.logprobs))
        return params

    @property
    def batched(self) -> bool:
        """The prompt is a list of prompts (strings or token-id lists): their errors name the index, prompt[1]."""
        return isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], (str, list))

    def prompts(self) -> list:
        """The prompts of this body: one per string or token list; APIError naming the element (prompt[1][0]) of a
        malformed one. The first element says which of the four forms the list is."""
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError("best_of other than n is not supported", param="best_of")
        p = self.prompt
        if isinstance(p, str):
            return [{"prompt": p, "add_special_tokens": self.add_special_tokens}]
        if not isinstance(p, list):
            raise APIError(f"prompt: {_PROMPT_FORMS}, got {_json_text(p)}", param="prompt")
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        if _is_token_id(p[0]):
            _check_token_ids("prompt", p, "prompt is a list of token ids")
            return [{"prompt_token_ids": list(p)}]
        if isinstance(p[0], str):
            bad = next((i for i, x in enumerate(p) if not isinstance(x, str)), None)
            if bad is not None:
                raise APIError(f"prompt[{bad}]: a list of prompts is all strings or all token-id lists, got "
                               f"{_json_text(p[bad])} after a string", param="prompt")
            return [{"prompt": x, "add_special_tokens": self.add_special_tokens} for x in p]
        if isinstance(p[0], list):
            for i, x in enumerate(p):
                if not isinstance(x, list):
                    raise APIError(f"prompt[{i}]: a list of prompts is all strings or all token-id lists, got "
                                   f"{_json_text(x)} after a list", param="prompt")
                _check_token_ids(f"prompt[{i}]", x, "a token-id list")
            return [{"prompt_token_ids": list(x)} for x in p]
        raise APIError(f"prompt[0]: {_PROMPT_FORMS}, got {_json_text(p[0])} as the first element", param="prompt")


_PROMPT_FORMS = "a prompt is a string, a list of strings, a list of token ids or a list of token-id lists"


def _is_token_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)       # JSON true is no token id


def _check_token_ids(where: str, ids: list, what: str) -> None:
    bad = next((i for i, x in enumerate(ids) if not _is_token_id(x)), None)
    if bad is not None:
        raise APIError(f"{where}[{bad}]: a token id is an integer, got {_json_text(ids[bad])} ({what})",
                       param="prompt")


ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ChatMessage(_Body):
    role: str
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None       # an assistant turn's calls (OpenAI's shape)
    tool_call_id: Optional[str] = None                       # a role "tool" message: the call it answers
    reasoning_content: Optional[str] = None
    # fields of a reply that clients send back with it (e.g. messages.append(choice.message)); not rendered
    refusal: Optional[str] = None
    annotations: Optional[List[Any]] = None
    audio: Optional[Dict[str, Any]] = None
    function_call: Optional[Dict[str, Any]] = None


class ChatCompletionRequest(_Sampling, ChatExtras):
    messages: List[ChatMessage] = Field(min_length=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    add_generation_prompt: Optional[bool] = True
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None     # extra template variables (enable_thinking, ...)
    add_special_tokens: bool = False         # vLLM's: the template writes them; True adds the tokenizer's too
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[List[Any]] = None

    def _max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def _num_logprobs(self) -> Optional[int]:
        from xllm_gen.runtime.engine.sampling_params import MAX_LOGPROBS
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                           param="top_logprobs")
        if self.logprobs:
            return self.top_logprobs or 0
        return None

    def check_supported(self) -> None:
        if self.functions:
            raise APIError("functions (deprecated) is not supported; use tools", param="functions")
        for i, m in enumerate(self.messages):
            if m.role not in ROLES:
                raise APIError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.role!r}",
                               param="messages")
            if m.role == "tool" and not m.tool_call_id:
                raise APIError(f"messages[{i}].tool_call_id is required: a role 'tool' message answers the tool "
                               "call of that id", param="messages")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError("continue_final_message needs the last message to be the assistant's (the one to "
                           "continue)", param="continue_final_message")
        if self.chat_template_kwargs is not None:
            reserved = {"messages", "tools", "add_generation_prompt", "chat_template"} & set(self.chat_template_kwargs)
            if reserved:
                raise APIError(f"chat_template_kwargs must not set {sorted(reserved)} (they have their own fields)",
                               param="chat_template_kwargs")


class TokenizeRequest(_Request):
    """vLLM's POST /tokenize: a text `prompt` (with the tokenizer's special tokens unless add_special_tokens is
    false) or chat `messages` rendered by the chat template (without them by default), exactly as a completion or
    chat request would be tokenized."""
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    """vLLM's POST /detokenize: token ids -> text."""
    model: Optional[str] = None
    tokens: List[int]
