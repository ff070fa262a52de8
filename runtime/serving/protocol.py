"""OpenAI-compatible request bodies (pydantic) and their translation to SamplingParams; OpenAI-style errors.

Unknown fields are ignored (as vLLM does); vLLM's extra sampling fields (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output, prompt_logprobs) are
accepted in the body (the openai client sends them through `extra_body`)."""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

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


_PARAMS = {f for f in SamplingParams.__dataclass_fields__} | {"prompt", "messages", "model", "stream_options"}
_ALIASES = {"prompt_token_ids": "prompt", "multi_modal_data": "messages", "mm_processor_kwargs": "messages"}


def param_of(message: str) -> Optional[str]:
    """The body field a validation message starts with ('top_p must be ...' -> 'top_p'); None if none."""
    m = _FIELD_RE.match(message)
    if not m:
        return None
    word = _ALIASES.get(m.group(1), m.group(1))
    return word if word in _PARAMS else None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
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

    def _num_logprobs(self) -> Optional[int]:
        raise NotImplementedError

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """SamplingParams of this body; APIError (400, naming the field) when a value is invalid."""
        kw: dict[str, Any] = {}
        for name in ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "seed", "min_tokens", "ignore_eos", "skip_special_tokens",
                     "include_stop_str_in_output", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        kw["max_tokens"] = self._max_tokens() if self._max_tokens() is not None else default_max_tokens
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
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            msg = str(e).replace("invalid SamplingParams: ", "")
            raise APIError(msg, param=param_of(msg)) from None

    def _max_tokens(self) -> Optional[int]:
        return self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def _num_logprobs(self) -> Optional[int]:
        return self.logprobs

    def prompts(self) -> list:
        """The prompts of this body: one per string or token list."""
        if self.echo:
            raise APIError("echo is not supported", param="echo")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError("best_of other than n is not supported", param="best_of")
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) for x in p):
            return [{"prompt_token_ids": list(x)} for x in p]
        raise APIError("prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                       param="prompt")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_Sampling):
    messages: List[ChatMessage] = Field(min_length=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    add_generation_prompt: Optional[bool] = True
    chat_template: Optional[str] = None
    tools: Optional[List[Any]] = None
    functions: Optional[List[Any]] = None
    response_format: Optional[Dict[str, Any]] = None

    def _max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _num_logprobs(self) -> Optional[int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.logprobs:
            return self.top_logprobs or 0
        return None

    def check_supported(self) -> None:
        if self.tools or self.functions:
            raise APIError("tools and function calling are not supported", param="tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise APIError("response_format other than text is not supported", param="response_format")
