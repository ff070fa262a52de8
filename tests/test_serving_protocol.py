"""The server's request bodies without a server (runtime/serving/protocol.py): JSON types are strict as the Python
API's (a boolean is no integer, "3" no number) while an integer still serves as a float; a validation error names the
field as written (messages[0].content) and the value sent, and of a union the member that got furthest."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from xllm_gen.runtime.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    validation_error,
)

USER = [{"role": "user", "content": "hi"}]


def _refused(cls, body):
    with pytest.raises(ValidationError) as e:
        cls.model_validate(body)
    err = validation_error(e.value.errors())
    return err.message, err.param


@pytest.mark.parametrize("cls,body,param,where", [
    (CompletionRequest, {"prompt": "x", "max_tokens": True}, "max_tokens", "max_tokens: "),
    (CompletionRequest, {"prompt": "x", "max_tokens": "3"}, "max_tokens", "max_tokens: "),
    (CompletionRequest, {"prompt": "x", "max_tokens": 3.0}, "max_tokens", "max_tokens: "),
    (CompletionRequest, {"prompt": "x", "top_k": True}, "top_k", "top_k: "),
    (CompletionRequest, {"prompt": "x", "n": False}, "n", "n: "),
    (CompletionRequest, {"prompt": "x", "temperature": True}, "temperature", "temperature: "),
    (CompletionRequest, {"prompt": "x", "temperature": "0.5"}, "temperature", "temperature: "),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"5": True}}, "logit_bias", "logit_bias.5: "),
    (CompletionRequest, {"prompt": "x", "logprobs": True}, "logprobs", "logprobs: "),
    (CompletionRequest, {"prompt": "x", "echo": 1}, "echo", "echo: "),
    (CompletionRequest, {"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids", "stop_token_ids[0]: "),
    (ChatCompletionRequest, {"messages": USER, "logprobs": 1}, "logprobs", "logprobs: "),
    (ChatCompletionRequest, {"messages": USER, "max_completion_tokens": True}, "max_completion_tokens",
     "max_completion_tokens: "),
    (ChatCompletionRequest, {"messages": USER, "stream_options": {"include_usage": 1}}, "stream_options",
     "stream_options.include_usage: "),
    (DetokenizeRequest, {"tokens": [True]}, "tokens", "tokens[0]: "),
    (DetokenizeRequest, {"tokens": ["5"]}, "tokens", "tokens[0]: "),
    (TokenizeRequest, {"prompt": "x", "add_special_tokens": 0}, "add_special_tokens", "add_special_tokens: "),
])
def test_json_types_are_strict(cls, body, param, where):
    msg, got = _refused(cls, body)
    assert got == param and msg.startswith(where) and ", got " in msg, msg


def test_what_clients_send_still_validates():
    """Integers where floats are meant (temperature 0, logit_bias 100), bools, nulls for optional fields."""
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 0, "top_p": 1, "presence_penalty": 0,
                                            "logit_bias": {"5": 100, "6": -1.5}, "max_tokens": 4, "seed": None,
                                            "stream": False, "echo": True, "stop": ["a"]})
    params = req.sampling_params(16)
    assert params.temperature == 0.0 and params.logit_bias == {5: 100.0, 6: -1.5} and params.max_tokens == 4
    chat = ChatCompletionRequest.model_validate({"messages": USER, "logprobs": True, "top_logprobs": 2,
                                                 "tool_choice": "none", "response_format": {"type": "text"}})
    assert chat.sampling_params(16).logprobs == 2


@pytest.mark.parametrize("cls,body,message", [
    (CompletionRequest, {"prompt": "x", "stop": 5}, "stop: Input should be str or list[str], got 5"),
    (CompletionRequest, {"prompt": "x", "stop": ["a", 5]}, "stop[1]: Input should be a valid string, got 5"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content: Input should be str or list[dict[str,any]], got 5"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [5]}]},
     "messages[0].content[0]: Input should be a valid dictionary, got 5"),
    (CompletionRequest, {"prompt": "x", "foo": 1, "bar": 2}, "unknown field(s) bar, foo: not supported"),
])
def test_messages_name_the_field_as_written(cls, body, message):
    assert _refused(cls, body)[0].startswith(message)


@pytest.mark.parametrize("prompt,message", [
    ([True, False, True], "prompt[0]: a prompt is a string, a list of strings, a list of token ids or a list of "
                          "token-id lists, got true"),
    ([[1, 2], [3.5]], "prompt[1][0]: a token id is an integer, got 3.5"),
    ([[1, 2], [3, True]], "prompt[1][1]: a token id is an integer, got true"),
    (["ok", [1]], "prompt[1]: a list of prompts is all strings or all token-id lists, got [1]"),
    ([[1], "x"], "prompt[1]: a list of prompts is all strings or all token-id lists, got \"x\""),
    ([1, "x"], "prompt[1]: a token id is an integer, got \"x\""),
    (5, "prompt: a prompt is a string"),
    (None, "prompt: a prompt is a string"),
    ([], "prompt must not be empty"),
])
def test_malformed_prompts_name_the_element(prompt, message):
    from xllm_gen.runtime.serving.protocol import APIError

    req = CompletionRequest.model_validate({"prompt": prompt})
    with pytest.raises(APIError) as e:
        req.prompts()
    assert e.value.message.startswith(message) and e.value.param == "prompt", e.value.message


def test_prompt_forms():
    forms = {"x": ([{"prompt": "x", "add_special_tokens": True}], False),
             ("a", "b"): ([{"prompt": "a", "add_special_tokens": True}, {"prompt": "b", "add_special_tokens": True}],
                          True),
             (1, 2): ([{"prompt_token_ids": [1, 2]}], False),
             ((1, 2), (3,)): ([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}], True)}
    as_json = lambda v: [as_json(x) for x in v] if isinstance(v, tuple) else v     # noqa: E731
    for prompt, (want, batched) in forms.items():
        req = CompletionRequest.model_validate({"prompt": as_json(prompt)})
        assert (req.prompts(), req.batched) == (want, batched)


@pytest.mark.parametrize("cls,body,message,param", [
    (TokenizeRequest, {"prompt": "a\ud800"}, "prompt: not valid Unicode (a lone surrogate at character 1)", "prompt"),
    (TokenizeRequest, {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content: ", "messages"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages[0].content[0].text: ", "messages"),
    (CompletionRequest, {"prompt": ["ok", "日本\ud800"]}, "prompt[1]: not valid Unicode (a lone surrogate at "
                                                          "character 2)", "prompt"),
    (CompletionRequest, {"prompt": "x", "stop": ["a", "\ud800"]}, "stop[1]: ", "stop"),
    (CompletionRequest, {"prompt": "x", "chat_template_kwargs": {"\ud800": 1}}, "chat_template_kwargs: not valid "
     "Unicode (a lone surrogate at character 0 of a key)", "chat_template_kwargs"),
    (DetokenizeRequest, {"tokens": [1], "model": "\ud800"}, "model: ", "model"),
])
def test_lone_surrogates_refused_in_every_body(cls, body, message, param):
    """One check of every request body (_Request) before its fields are read: no endpoint's tokenizer or template
    meets a lone surrogate (/tokenize answered a bare 500)."""
    msg, got = _refused(cls, body)
    assert msg.startswith(message) and "not valid Unicode" in msg and got == param, msg
    msg.encode("utf-8")                                     # the message itself is printable


def test_valid_unicode_passes():
    assert TokenizeRequest.model_validate({"prompt": "日本語 🎉 \u00e9"}).prompt == "日本語 🎉 é"
