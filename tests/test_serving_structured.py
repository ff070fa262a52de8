"""What applications call the server for, through the official openai client on a real server process (one per
module): structured outputs (response_format json_schema / json_object, structured_outputs json / regex /
choice / grammar in chat and completions), tool calls (tool_choice auto / none / required / named, streamed
and not, role "tool" turns through the template), reasoning split (qwen3 parser), chat_template_kwargs, and
400s naming bad schemas, grammars, tools and unknown fields. A random model writes garbage unless constrained,
so every structured check validates the output (and the unconstrained request does not validate)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from serving_util import ENGINE_MODES, ServerProcess, mode_args

pytestmark = pytest.mark.engine

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

TEMPLATE = Path(__file__).parent / "fixtures" / "qwen3_tools.jinja"
SERVER_ARGS = ("--block-size", "16", "--num-kv-blocks", "512", "--max-num-seqs", "16", "--tool-call-parser", "hermes",
               "--reasoning-parser", "qwen3", "--chat-template", str(TEMPLATE))

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit"],
          "properties": {"city": {"type": "string", "maxLength": 8},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                         "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["a", "b"],
             "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                            "b": {"type": "integer", "minimum": -999, "maximum": 999}}}}}]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny Qwen3 with a 2048-token context (tools in the system turn take ~900 tokens of its tokenizer)."""
    from fixtures.tiny_hf import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3_2k"), max_position_embeddings=2048, seed=0)


@pytest.fixture(scope="module", params=ENGINE_MODES)
def server(ckpt, request):
    srv = ServerProcess(ckpt, *SERVER_ARGS, *mode_args(request.param))
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _valid(text, schema=SCHEMA) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, TypeError, jsonschema.ValidationError):
        return False


def _rf(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}


def test_response_format_json_schema_greedy_and_sampled(client, model):
    free = client.chat.completions.create(model=model, messages=MSGS, max_tokens=48, temperature=0)
    assert not _valid(free.choices[0].message.content)
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=0.7, top_p=0.9, n=2)):
        r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=64, response_format=_rf(), **kw)
        for ch in r.choices:
            assert _valid(ch.message.content), ch.message.content
            assert ch.finish_reason == "stop"
    obj = client.chat.completions.create(model=model, messages=MSGS, max_tokens=96, temperature=0,
                                         response_format={"type": "json_object"}).choices[0]
    assert isinstance(json.loads(obj.message.content), dict), obj


def test_structured_outputs_in_completions_and_chat(client, model):
    choices = ["red", "green", "blue"]
    for so, check in (({"regex": r"\d{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2}", t)),
                      ({"choice": choices}, lambda t: t in choices),
                      ({"grammar": 'root ::= "(" ("x" | "y")+ ")"'}, lambda t: re.fullmatch(r"\((x|y)+\)", t)),
                      ({"json": SCHEMA}, _valid)):
        c = client.completions.create(model=model, prompt="Answer:", max_tokens=64, temperature=0,
                                      extra_body={"structured_outputs": so}).choices[0].text
        assert check(c), (so, c)
        m = client.chat.completions.create(model=model, messages=MSGS, max_tokens=64, temperature=1.0, seed=9,
                                           extra_body={"structured_outputs": so}).choices[0].message.content
        assert check(m), (so, m)
    plain = client.completions.create(model=model, prompt="Answer:", max_tokens=40, temperature=0).choices[0].text
    assert not re.fullmatch(r"\d{3}-[a-z]{2}", plain) and plain not in choices
    rf = client.completions.create(model=model, prompt="Answer:", max_tokens=64, temperature=0, n=2, seed=1,
                                   extra_body={"response_format": _rf()})
    assert all(_valid(c.text) for c in rf.choices)


def test_streamed_structured_output(client, model):
    s = client.chat.completions.create(model=model, messages=MSGS, max_tokens=64, temperature=0, stream=True,
                                       response_format=_rf())
    text = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
    assert _valid(text), text


def test_unconstrained_request_unchanged_beside_constrained_ones(client, model):
    """Requests sent together share batches; the unconstrained one's greedy text is what it is alone."""
    import concurrent.futures as cf

    kw = dict(model=model, prompt="Once upon a time", max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    alone = client.completions.create(**kw).choices[0].text

    def constrained(i):
        return client.completions.create(model=model, prompt=f"Item {i}", max_tokens=64, temperature=0,
                                         extra_body={"structured_outputs": {"json": SCHEMA}}).choices[0].text

    with cf.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(constrained, i) for i in range(4)] + [ex.submit(lambda: client.completions.create(**kw))]
        outs = [f.result() for f in futs]
    assert all(_valid(t) for t in outs[:4]), outs
    assert outs[4].choices[0].text == alone


@pytest.mark.parametrize("body,param,words", [
    # the schema's own field (it read response_format.json_schema.schema.json)
    ({"response_format": _rf({"type": "objec"})}, "response_format",
     ["response_format.json_schema.schema: invalid JSON schema", "objec"]),
    ({"response_format": _rf({"type": "object", "properties": {"a": {"minimum": "x"}}})}, "response_format",
     ["properties/a/minimum"]),
    ({"response_format": {"type": "xml"}}, "response_format", ["text, json_object, json_schema"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", ["name"]),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs", ["structured_outputs.regex", "invalid regex"]),
    # what the grammar would not enforce, and grammars that match nothing: 400 at admission, never served
    ({"response_format": _rf({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}})},
     "response_format", ["does not enforce", "'multipleOf' at /properties/n/multipleOf"]),
    ({"structured_outputs": {"json": {"not": {}}}}, "structured_outputs", ["'not' at /not"]),
    ({"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}}, "structured_outputs", ["accepts no token at the start"]),
    ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs", ["accepts no token at the start"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"}, "tools",
     ["tools[0].function.parameters", "'uniqueItems' at /properties/a/uniqueItems"]),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", ["invalid EBNF"]),
    ({"structured_outputs": {"choice": "abc"}}, "structured_outputs", ["choice"]),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs", ["exactly one"]),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", ["unknown field", "jsn"]),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format",
     ["not both"]),
    ({"guided_json": {}}, "guided_json", ["unknown field", "guided_json"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     ["'nope'", "get_weather"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}], "tool_choice": "required"},
     "tools", ["tools[0].function.parameters"]),
    ({"tools": [{"type": "function"}]}, "tools", ["tools[0]"]),
    ({"tool_choice": "required"}, "tool_choice", ["needs tools"]),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ["'sometimes'"]),
    ({"tools": TOOLS, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}, "tools",
     ["does not render tools"]),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     ["cannot be combined"]),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", ["tools"]),
    # a pattern feature the grammar would drop is refused as structured_outputs.regex refuses it
    ({"response_format": _rf({"type": "string", "pattern": "^(?!b)[ab]{3}$"})}, "response_format",
     ["'pattern' at /pattern", "Lookahead"]),
    ({"structured_outputs": {"regex": "^(?!b)[ab]{3}$"}}, "structured_outputs", ["Lookahead"]),
    # what would compile for minutes (and nest past the limit) is refused before any compile
    ({"response_format": _rf({"type": "string", "pattern": "^[a-z]{0,30000}[0-9]{0,30000}$"})}, "response_format",
     ["unrolls to 60000", "at most 4096"]),
    ({"structured_outputs": {"regex": "(a{0,100}){0,100}"}}, "structured_outputs", ["unrolls to 10000"]),
    ({"response_format": _rf({"type": "string", "maxLength": 100000})}, "response_format", ["'maxLength'", "4096"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(?i)abc"}}}}}], "tool_choice": "required"}, "tools",
     ["tools[0].function.parameters", "/properties/a/pattern"]),
    ({"response_format": _rf(json.loads('{"type": "array", "items": ' * 300 + '{}' + '}' * 300))},
     "response_format", ["nested more than 128 levels"]),
])
def test_bad_bodies_name_the_problem(server, body, param, words):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert all(w in err["message"] for w in words), err["message"]


def test_unknown_fields_refused_everywhere(server):
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2, "foo": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "colour": 1}]}),
                       ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usge": True}})):
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 400 and "unknown field" in r.json()["error"]["message"], r.text


# ------------------------------------------------------------------------------------ tools
def _check_call(call, tools=TOOLS):
    fn = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in fn
    jsonschema.validate(json.loads(call.function.arguments), fn[call.function.name])


def test_agent_loop_sends_the_reply_back(client, model):
    """The usual agent loop: the assistant message object of a tool-call reply goes back as it is, followed by
    the tool's result; the server takes it (fields like refusal / annotations included) and renders both."""
    r = client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, temperature=0)
    msg = r.choices[0].message
    conv = MSGS + [msg, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"ok": true}'}]
    again = client.chat.completions.create(model=model, messages=conv, tools=TOOLS, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens > r.usage.prompt_tokens + len(r.choices[0].message.tool_calls[0].function.name)


def test_named_and_required_tool_calls(client, model):
    named = {"type": "function", "function": {"name": "add"}}
    for choice, kw in ((named, dict(temperature=0)), (named, dict(temperature=1.0, seed=4)),
                       ("required", dict(temperature=0)), ("required", dict(temperature=1.0, seed=8))):
        r = client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, tool_choice=choice,
                                           max_tokens=200, **kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", repr(ch.message.content)
        assert len(ch.message.tool_calls) == 1
        _check_call(ch.message.tool_calls[0])
        if choice is named:
            assert ch.message.tool_calls[0].function.name == "add"


# a Pydantic-style schema: nested models under $defs (draft 2020-12) or definitions (draft 7), reached by $ref; the
# two tools name a different "Place" each
_PLACE = {"type": "object", "additionalProperties": False, "required": ["city"],
          "properties": {"city": {"type": "string", "maxLength": 6}}}
REF_TOOLS = [
    {"type": "function", "function": {"name": "visit", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["place"],
        "properties": {"place": {"$ref": "#/$defs/Place"}}, "$defs": {"Place": _PLACE}}}},
    {"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["place", "n"],
        "properties": {"place": {"$ref": "#/definitions/Place"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "definitions": {"Place": {"enum": ["home", "work"]}}}}}]


def test_forced_calls_take_schemas_with_refs(client, model):
    """tool_choice required / named with parameters that reach $defs / definitions by $ref (what Pydantic writes
    for nested models): the call is forced and its arguments validate; the refs resolve within their own tool."""
    for choice in ("required", {"type": "function", "function": {"name": "visit"}},
                   {"type": "function", "function": {"name": "count"}}):
        for seed in (1, 2):
            r = client.chat.completions.create(model=model, messages=MSGS, tools=REF_TOOLS, tool_choice=choice,
                                               max_tokens=120, temperature=1.0, seed=seed)
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
            _check_call(ch.message.tool_calls[0], REF_TOOLS)


def test_call_grammar_keeps_recursive_refs_within_the_tool():
    """A recursive model ("#/$defs/Node" inside Node, or "#": the parameters themselves) forced beside another tool:
    each tool's refs resolve within its own parameters (not the grammar's root), nested calls are accepted."""
    import xgrammar as xgr

    from xllm_gen.runtime.serving import tool_parsers

    node = {"type": "object", "additionalProperties": False, "properties": {"child": {"$ref": "#/$defs/Node"}},
            "$defs": {"Node": {"type": "object", "additionalProperties": False,
                               "properties": {"child": {"$ref": "#/$defs/Node"}}}}}
    self_ref = {"type": "object", "additionalProperties": False, "properties": {"up": {"$ref": "#"}}}
    tools = [{"type": "function", "function": {"name": "tree", "parameters": node}},
             {"type": "function", "function": {"name": "loop", "parameters": self_ref}}]
    call = lambda n, a: '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (n, json.dumps(a))  # noqa: E731
    for forced in (tools, tools[:1], tools[1:]):
        g = xgr.Grammar.from_ebnf(tool_parsers.get("hermes")(forced).grammar(forced))
        ok = lambda text: xgr.testing._is_grammar_accept_string(g, text)  # noqa: E731
        if forced[0] is tools[0]:
            assert ok(call("tree", {"child": {"child": {}}})) and not ok(call("tree", {"child": {"up": {}}}))
        if forced[-1] is tools[1]:
            assert ok(call("loop", {"up": {"up": {}}})) and not ok(call("loop", {"up": {"child": {}}}))


def test_streamed_tool_call_deltas(client, model):
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        s = client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, tool_choice=choice,
                                           max_tokens=200, temperature=0, stream=True)
        calls, finish, content = {}, None, ""
        for chunk in s:
            for ch in chunk.choices:
                content += ch.delta.content or ""
                for tc in ch.delta.tool_calls or []:
                    c = calls.setdefault(tc.index, {"id": tc.id, "name": "", "args": ""})
                    c["name"] += tc.function.name or ""
                    c["args"] += tc.function.arguments or ""
                finish = ch.finish_reason or finish
        assert finish == "tool_calls" and list(calls) == [0] and "<tool_call>" not in content
        c = calls[0]
        ref = client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, tool_choice=choice,
                                             max_tokens=200, temperature=0).choices[0].message.tool_calls[0]
        assert (c["name"], json.loads(c["args"])) == (ref.function.name, json.loads(ref.function.arguments))
        assert c["id"].startswith("call_")


def test_auto_parses_calls_the_model_writes(client, model):
    """tool_choice auto: calls the model writes are parsed out of the reply (a choice constraint makes the random
    model write text, then two calls), streamed and not; malformed call JSON stays in the content."""
    call = lambda n, a: '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (n, json.dumps(a))  # noqa: E731
    text = "Let me check.\n" + call("add", {"a": 1, "b": 2}) + "\n" + call("get_weather", {"city": "Oslo", "days": 2,
                                                                                         "unit": "celsius"})
    so = {"structured_outputs": {"choice": [text]}}
    r = client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, max_tokens=200, temperature=0,
                                       extra_body=so).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content.strip() == "Let me check."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in r.message.tool_calls]
    assert got == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "days": 2, "unit": "celsius"})]
    s = client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, max_tokens=200, temperature=0,
                                       stream=True, extra_body=so)
    calls, content, finish = {}, "", None
    for chunk in s:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                calls[tc.index] = (tc.function.name, json.loads(tc.function.arguments))
            finish = ch.finish_reason or finish
    assert [calls[i] for i in sorted(calls)] == got and content.strip() == "Let me check." and finish == "tool_calls"
    bad = "<tool_call>\n{not json}\n</tool_call>"
    r = client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, max_tokens=60, temperature=0,
                                       extra_body={"structured_outputs": {"choice": [bad]}}).choices[0]
    assert r.finish_reason == "stop" and not r.message.tool_calls and r.message.content == bad


def test_tool_choice_auto_and_none(client, model, server):
    auto = client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, max_tokens=24, temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length") and not auto.choices[0].message.tool_calls
    none = client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, tool_choice="none",
                                          max_tokens=4, temperature=0)
    plain = client.chat.completions.create(model=model, messages=MSGS, max_tokens=4, temperature=0)
    # none: the tools are not shown to the model (the prompt is the one without tools)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens


def test_text_parts_reach_a_string_template_joined(server, model):
    """This server's template takes content as a string (as Qwen3's): a message's text parts reach it joined by
    newlines (vLLM's "string" content format), not glued together nor failing the template."""
    def ids(content):
        r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": content}]}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert ids([{"type": "text", "text": "Tell me"}, {"type": "input_text", "text": "more."}]) == ids("Tell me\nmore.")
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids("hi")), r.text


def test_tool_results_go_through_the_template(client, model):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 1, "unit": "celsius"}'}}
    conv = MSGS + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    r = client.chat.completions.create(model=model, messages=conv, tools=TOOLS, max_tokens=2, temperature=0)
    base = client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens > base.usage.prompt_tokens + 20


def test_render_chat_tool_turns(ckpt):
    """The rendered prompt holds the earlier call and the tool's answer, as the Qwen3 template writes them."""
    from transformers import AutoTokenizer

    from xllm_gen.runtime.serving.chat import render_chat
    from xllm_gen.runtime.serving.protocol import ChatMessage

    class _E:
        mm_processor = None
        tokenizer = AutoTokenizer.from_pretrained(ckpt)

    msgs = [ChatMessage(**m) for m in MSGS + [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "3"}]]
    text = render_chat(_E, msgs, TEMPLATE.read_text(), True, TOOLS, {"enable_thinking": False})["prompt"]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<tool_response>\n3\n</tool_response>" in text and '"name": "get_weather"' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ------------------------------------------------------------------------------------ reasoning
THINK = {"regex": r"<think>[a-z ]{4,16}</think>[a-z ]{4,16}"}


def test_reasoning_split_streamed_and_not(client, model):
    """The grammar makes the random model write a think block; the qwen3 parser splits it off."""
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=64, temperature=0,
                                       extra_body={"structured_outputs": THINK}).choices[0].message
    reasoning = r.model_extra.get("reasoning_content")
    assert reasoning and re.fullmatch("[a-z ]{4,16}", reasoning) and re.fullmatch("[a-z ]{4,16}", r.content)
    assert "<think>" not in r.content
    s = client.chat.completions.create(model=model, messages=MSGS, max_tokens=64, temperature=0, stream=True,
                                       extra_body={"structured_outputs": THINK})
    rs, cs = "", ""
    for chunk in s:
        for ch in chunk.choices:
            rs += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            cs += ch.delta.content or ""
    assert (rs, cs) == (reasoning, r.content)
    plain = client.chat.completions.create(model=model, messages=MSGS, max_tokens=8, temperature=0).choices[0]
    assert plain.message.model_extra.get("reasoning_content") is None


def test_reasoning_opened_by_the_template(client, model):
    """A template that opens the thinking itself (Qwen3-*-Thinking-2507, DeepSeek-R1, QwQ: the prompt ends with
    <think>): the reply starts inside the reasoning, only </think> closes it; streamed and not agree. Without the
    opened prompt the same text would be all content (the parser must read the prompt)."""
    opener = TEMPLATE.read_text() + "{%- if add_generation_prompt %}{{- '<think>\\n' }}{%- endif %}"
    closed = {"regex": r"[a-z ]{4,16}</think>[a-z ]{4,16}"}
    kw = dict(model=model, messages=MSGS, max_tokens=64, temperature=0,
              extra_body={"structured_outputs": closed, "chat_template": opener})
    r = client.chat.completions.create(**kw).choices[0].message
    reasoning = r.model_extra.get("reasoning_content")
    assert reasoning and re.fullmatch("[a-z ]{4,16}", reasoning) and re.fullmatch("[a-z ]{4,16}", r.content), r
    rs, cs = "", ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            rs += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            cs += ch.delta.content or ""
    assert (rs, cs) == (reasoning, r.content)


def test_regex_limits():
    from xllm_gen.runtime.engine.regex_limits import expanded_size, schema_patterns
    assert [expanded_size(r) for r in ("abc", "[a-z]{0,10}", "(ab){3}", "(a{2}|b){4}", r"\d{5,}", "x{,7}")] == \
        [3, 10, 6, 12, 5, 7]
    found = {(at, k) for at, k, _ in schema_patterns({"properties": {"a": {"pattern": "x", "maxLength": 3}},
                                                      "patternProperties": {"^p": {"minLength": 1}},
                                                      "enum": [{"pattern": "not a schema"}]})}
    assert found == {("/properties/a/pattern", "pattern"), ("/properties/a/maxLength", "maxLength"),
                     ("/patternProperties/^p", "patternProperties"), ("/patternProperties/^p/minLength", "minLength")}


def test_think_parser_opened_state():
    from xllm_gen.runtime.serving.reasoning_parsers import get
    p = get("think")()
    assert p.opened_by("<|im_start|>assistant\n<think>\n") and not p.opened_by("assistant\n<think>\n\n</think>\n\n")
    assert p.extract("a b</think>answer", opened=True) == ("a b", "answer")
    assert p.extract("a b</think>answer") == (None, "a b</think>answer")          # not opened: all content
    assert p.extract("still thinking", opened=True) == ("still thinking", None)    # cut before </think>
    s = p.streamer(True)
    parts = [s.feed(d) for d in ("thin", "king</th", "ink>the ", "answer")] + [s.finish()]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == ("thinking", "the answer")


def test_chat_template_kwargs_reach_the_template(client, model, ckpt, make_llm):
    on = client.chat.completions.create(model=model, messages=MSGS, max_tokens=2, temperature=0)
    off = client.chat.completions.create(model=model, messages=MSGS, max_tokens=2, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    from xllm_gen import SamplingParams

    llm = make_llm(ckpt)
    sp = SamplingParams(max_tokens=2, temperature=0)
    a = llm.chat(MSGS, sp, chat_template=TEMPLATE.read_text())[0]
    b = llm.chat(MSGS, sp, chat_template=TEMPLATE.read_text(), chat_template_kwargs={"enable_thinking": False})[0]
    assert a.prompt.endswith("assistant\n") and b.prompt.endswith("<think>\n\n</think>\n\n")
    assert len(b.prompt_token_ids) == off.usage.prompt_tokens
