"""LLM.chat: conversations rendered with the checkpoint's chat template (text, and images for Qwen3-VL)
give the same tokens as generate() on the rendered prompt, and those equal Hugging Face's. A conversation that
cannot be rendered fails alone; a template that does not compile is named (file and line) at load."""
from __future__ import annotations

import numpy as np
import pytest
from hf_ref import hf_tokenizer, hf_vl_greedy, hf_vl_inputs

pytestmark = pytest.mark.engine


def _sp():
    from xllm_gen import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_text_chat_equals_generate_on_the_template(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied)
    convs = [[{"role": "user", "content": "Tell me about the weather."}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon a time"}]]
    got = llm.chat(convs, _sp())
    tok = hf_tokenizer(qwen3_tied)
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    assert all(t.endswith("<|im_start|>assistant\n") for t in texts)
    want = llm.generate(texts, _sp())
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[0].prompt == texts[0]


def test_vl_chat_with_an_image_matches_hf(qwen3_vl_tied, make_llm):
    from PIL import Image

    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    llm = make_llm(qwen3_vl_tied)
    conv = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "What is it?"}]}]
    out = llm.chat(conv, _sp())[0].outputs[0].token_ids
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n"
    assert out == hf_vl_greedy(qwen3_vl_tied, hf_vl_inputs(qwen3_vl_tied, text, images=[img]), 12)
    with pytest.raises(ValueError, match="request 0: .*'image' content part"):
        llm.chat([{"role": "user", "content": [{"type": "image"}]}], _sp())


def test_a_bad_conversation_fails_alone(qwen3_tied, make_llm):
    """As a bad prompt in generate: the conversation that cannot be rendered is named by its index, the others are
    served (on_error "return" puts the error on its output, "raise" raises after serving them)."""
    llm = make_llm(qwen3_tied)
    ok = [{"role": "user", "content": "Tell me about the weather."}]
    want = llm.chat(ok, _sp())[0].outputs[0].token_ids
    outs = llm.chat([ok, [{"role": 5, "content": None}], "not a conversation", ok], _sp(), on_error="return")
    assert outs[0].outputs[0].token_ids == want and outs[3].outputs[0].token_ids == want
    assert outs[1].error.startswith("request 1: ") and not outs[1].outputs, outs[1]
    assert outs[2].error.startswith("request 2: a conversation is a list"), outs[2]
    with pytest.raises(ValueError, match="^request 1: ") as e:
        llm.chat([ok, [{"role": 5, "content": None}]], _sp())
    assert e.value.outputs[0].outputs[0].token_ids == want


def test_continue_final_message(qwen3_tied, make_llm):
    """vLLM's LLM.chat(continue_final_message=True): the last (assistant) message is left open for the reply to
    continue, the prompt as transformers' template renders it; with add_generation_prompt it is a ValueError, and an
    argument LLM.chat does not have is a TypeError naming LLM.chat (it named the private LLM._run)."""
    llm = make_llm(qwen3_tied)
    conv = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a"}]
    tok = hf_tokenizer(qwen3_tied)
    text = tok.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert text.endswith("Once upon a")
    out = llm.chat(conv, _sp(), add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt == text
    assert out.outputs[0].token_ids == llm.generate([text], _sp())[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(conv, _sp(), continue_final_message=True)
    with pytest.raises(TypeError, match="chat"):
        llm.chat(conv, _sp(), no_such_argument=True)


BROKEN = "{% for m in messages %}\n{{ m.content }\n{% endfor %}"


def test_a_broken_chat_template_is_named_at_load(qwen3_tied, make_llm, tmp_path, caplog):
    """A template that does not compile is found at load, naming the file and the line (logged); completions are
    served, chat is refused with that message unless a template is passed."""
    import logging
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(qwen3_tied, ckpt)
    (ckpt / "chat_template.jinja").write_text(BROKEN)
    with caplog.at_level(logging.WARNING, logger="xllm_gen"):
        llm = make_llm(ckpt)
    where = f"{ckpt / 'chat_template.jinja'}, line 2: unexpected '}}'"
    assert where in caplog.text and llm.engine.chat_template_error == where
    assert llm.generate(["Hello"], _sp())[0].outputs[0].token_ids
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat template does not compile: .*chat_template.jinja, line 2"):
        llm.chat(msgs, _sp())
    good = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert llm.chat(msgs, _sp(), chat_template=good)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="chat_template does not compile: line 1"):
        llm.chat(msgs, _sp(), chat_template="{% if %}")


def test_the_template_transformers_reads_is_the_one_named(tmp_path):
    """chat_template.jinja (and additional_chat_templates/*.jinja) win over tokenizer_config.json's chat_template,
    whose named list form is checked entry by entry."""
    import json

    from xllm_gen.runtime.engine.chat_template import checkpoint_template_problem

    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": [{"name": "default", "template": "{{ x }}"},
                                                 {"name": "tool_use", "template": "a\nb\n{% if %}"}]}))
    assert checkpoint_template_problem(tmp_path) == f"{cfg}'s chat_template 'tool_use', line 3: " \
                                                    "Expected an expression, got 'end of statement block'"
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert checkpoint_template_problem(tmp_path) is None            # the file wins: the config is not read
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "rag.jinja").write_text(BROKEN)
    assert checkpoint_template_problem(tmp_path).endswith("rag.jinja, line 2: unexpected '}'")


def test_messages_a_template_cannot_take_are_named(qwen3_tied, make_llm):
    """A null or missing content is refused where OpenAI refuses it (a user / system / tool turn), a role must be a
    non-empty string; any role name passes to the template (templates define roles, as in transformers and vLLM),
    and an assistant turn may carry no content."""
    llm = make_llm(qwen3_tied)
    outs = llm.chat([[{"role": "user", "content": None}], [{"role": "system", "content": "x"}, {"role": "user"}],
                     [{"role": "", "content": "x"}], [{"role": "user", "content": {"a": 1}}],
                     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                      {"role": "wizard", "content": "abracadabra"}]], _sp(), on_error="return")
    assert outs[0].error == ("request 0: messages[0].content is null: a 'user' turn needs content (a string or a "
                             "list of content parts); only an assistant turn may leave it out")
    assert outs[1].error.startswith("request 1: messages[1].content is missing: a 'user' turn needs content")
    assert outs[2].error.startswith("request 2: messages[0].role must be a non-empty string")
    assert outs[3].error.startswith("request 3: messages[0].content must be a string or a list")
    assert outs[4].error is None and "<|im_start|>wizard\nabracadabra" in outs[4].prompt


def test_bad_text_and_tool_calls_are_named_by_their_message(qwen3_tied, make_llm):
    """A lone surrogate is named by its message (it was "lone surrogate at character 17" of the rendered prompt);
    malformed tool_calls of an assistant turn by their index; each conversation fails alone."""
    llm = make_llm(qwen3_tied)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    outs = llm.chat([[{"role": "user", "content": "ok \ud800"}],
                     [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "\udc00"}]}],
                     [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call, {"id": "d"}]}],
                     [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call]},
                      {"role": "tool", "content": "1"}]], _sp(), on_error="return")
    assert outs[0].error == "request 0: messages[0].content: not valid Unicode (a lone surrogate at character 3)"
    assert outs[1].error.startswith("request 1: messages[0].content[1].text: not valid Unicode")
    assert outs[2].error.startswith("request 2: messages[1].tool_calls[1]: a tool call is")
    assert outs[3].error is None and outs[3].outputs[0].token_ids


# A template that takes content as a string, as Qwen3's does: a list of parts would render as nothing
_STRING_TEMPLATE = ("{%- for message in messages %}{%- if message.content is string %}{%- set content = message.content "
                    "%}{%- else %}{%- set content = '' %}{%- endif %}{{- '<|im_start|>' + message.role + '\\n' + content "
                    "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                    "{%- endif %}")


def test_content_format_of_templates():
    """vLLM's content formats: a template that loops over a message's content takes OpenAI's list of parts
    ("openai"), any other takes a string ("string"), whatever names the loops use."""
    from xllm_gen.runtime.engine.chat_template import takes_content_parts

    loops = ["{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
             "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
             "{{ p.text }}{% endfor %}{% endif %}{% endfor %}",
             "{% set msgs = messages[1:] %}{% for m in msgs %}{% set c = m.content %}{% for p in c %}{{ p.text }}"
             "{% endfor %}{% endfor %}"]
    strings = [_STRING_TEMPLATE, "{% for m in messages %}{{ m.content }}{% endfor %}",
               "{% for m in messages %}{% for t in m.tool_calls %}{{ t }}{% endfor %}{% endfor %}", "{% for"]
    assert [takes_content_parts(t) for t in loops] == [True] * 3
    assert [takes_content_parts(t) for t in strings] == [False] * 4


def test_text_parts_reach_a_string_template_joined(qwen3_tied, make_llm):
    """A message whose content is a list of text parts: a template that takes content as a string gets their text
    joined by newlines (vLLM's "string" format: Qwen3's template renders a list as nothing, the user's words
    dropped), one that loops over the parts gets the list (the tiny checkpoint's own template)."""
    llm = make_llm(qwen3_tied)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "input_text", "text": "more."}]}]
    joined = [{"role": "user", "content": "Tell me\nmore."}]
    sp = _sp()
    got = llm.chat(parts, sp, chat_template=_STRING_TEMPLATE)[0]
    assert got.prompt == llm.chat(joined, sp, chat_template=_STRING_TEMPLATE)[0].prompt
    assert "Tell me\nmore." in got.prompt
    own = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "more."}]}],
                   sp)[0]
    assert own.prompt == llm.chat([{"role": "user", "content": "Tell me more."}], sp)[0].prompt
