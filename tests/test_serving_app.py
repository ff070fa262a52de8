"""The server's app (runtime/serving/app.py) over a stub engine, without a model or a server process: a
non-streaming request is aborted as soon as its client goes away (the ASGI http.disconnect reaches the endpoint
through the middleware); an unexpected error is a 500 in OpenAI's shape (not a plain-text one)."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")


class StubEngine:
    """AsyncEngine's interface; `add` hands out queues that nothing fills (requests run until aborted)."""

    def __init__(self, tokenizer=None):
        self.engine = SimpleNamespace(tokenizer=tokenizer, max_model_len=64, model_dir="stub", vocab_size=100,
                                      structured=None)
        self.alive, self.error = True, None
        self.added: dict = {}
        self.aborted: list = []

    def start(self, loop):
        pass

    def stop(self):
        pass

    async def add(self, rid, prompt, params):
        self.added[rid] = asyncio.Queue()
        return self.added[rid]

    def abort(self, rid):
        self.aborted.append(rid)


def _app(stub):
    from xllm_gen.runtime.serving.app import build_app

    return build_app(stub, "stub", None, log_requests=False)


def test_unexpected_error_is_a_json_500():
    from fastapi.testclient import TestClient

    class Broken:
        def encode(self, text, add_special_tokens=True):
            raise TypeError("a bug")

    with TestClient(_app(StubEngine(Broken())), raise_server_exceptions=False) as client:
        r = client.post("/tokenize", json={"prompt": "x"})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "server_error" and "TypeError" in r.json()["error"]["message"]


def _asgi_post(app, path: str, body: dict, gone: asyncio.Event):
    """The app serving one POST whose client goes away (http.disconnect) once `gone` is set; the sent messages."""
    sent: list = []
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if pending:
            return pending.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"x"), (b"content-type", b"application/json"), (b"authorization", b"Bearer k")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    return app(scope, receive, send), sent


def test_non_streaming_request_aborted_when_the_client_goes_away():
    from xllm_gen.runtime.serving.app import build_app

    async def run():
        stub = StubEngine()
        app = build_app(stub, "stub", None, log_requests=True, api_key="k")
        gone = asyncio.Event()
        call, sent = _asgi_post(app, "/v1/completions", {"prompt": [[1, 2], [3]], "max_tokens": 5}, gone)
        task = asyncio.ensure_future(call)
        while len(stub.added) < 2:
            assert not task.done(), sent
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert not task.done() and not stub.aborted          # still waiting on the engine
        gone.set()
        t0 = time.monotonic()
        await asyncio.wait_for(task, 5)
        assert time.monotonic() - t0 < 1.0
        assert set(stub.aborted) == set(stub.added)
        assert sent[0]["status"] == 499

    asyncio.run(run())


# ------------------------------------------------------------------------------------ a stub that answers
class ScriptTokenizer:
    """A tokenizer whose chat template writes the roles, the tools and the template variables it got (recorded);
    its tags <think> / </think> are three tokens each (so a constraint holds from the reply's first token)."""

    def __init__(self, opens_thinking: bool = False):
        self.opens_thinking, self.kwargs = opens_thinking, {}

    def apply_chat_template(self, conv, chat_template=None, tokenize=False, add_generation_prompt=True, tools=None,
                            **kw):
        self.kwargs = kw
        text = "".join(f"<{m['role']}>{m['content']}" for m in conv) + (f"<tools>{tools}" if tools else "")
        return text + ("<assistant><think>\n" if self.opens_thinking else "<assistant>")

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) for ch in text][:3] if text in ("<think>", "</think>") else list(range(len(text)))


class ScriptedEngine(StubEngine):
    """Each request's reply is `reply` (one step of `steps` deltas), finished with `finish`; the sampling params
    of the last request are kept. The deltas are queued one at a time, each once the reader has taken the one
    before (a reader that keeps up: request_results.results would merge deltas queued together)."""

    def __init__(self, reply: str, finish: str = "stop", steps: int = 1, tokenizer=None):
        super().__init__(tokenizer or ScriptTokenizer())
        self.engine.structured = SimpleNamespace(compile=lambda so, where: None)
        self.engine.mm_processor = None
        self.reply, self.finish, self.steps, self.params = reply, finish, steps, None

    async def add(self, rid, prompt, params):
        from xllm_gen.runtime.engine.outputs import CompletionOutput, RequestOutput

        self.params = params
        q = asyncio.Queue()
        cut = [len(self.reply) * k // self.steps for k in range(self.steps + 1)]
        outs = [RequestOutput(rid, None, [1, 2, 3], [CompletionOutput(
            0, self.reply[cut[k]:cut[k + 1]], [10 + k], self.finish if k == self.steps - 1 else None)],
            finished=k == self.steps - 1) for k in range(self.steps)]

        async def feed():
            for out in outs:
                while not q.empty():
                    await asyncio.sleep(0)
                q.put_nowait(out)

        q.put_nowait(outs.pop(0))
        self.feeders = [*getattr(self, "feeders", []), asyncio.ensure_future(feed())]    # kept referenced
        return q


def _client(stub, **kw):
    from fastapi.testclient import TestClient

    from xllm_gen.runtime.serving.app import build_app
    return TestClient(build_app(stub, "stub", None, log_requests=False, **kw))


def _chunks(r) -> list:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


USER = [{"role": "user", "content": "hi"}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_cut_tool_call_is_length_and_never_content():
    """max_tokens cutting a second call: finish_reason "length" (OpenAI's), the complete call kept, the unfinished
    one neither a call nor content, streamed or not."""
    stub = ScriptedEngine(CALL + "\n" + CALL[:30], finish="length", steps=4)
    body = {"messages": USER, "tools": WEATHER, "max_tokens": 9}
    with _client(stub, tool_parser="hermes") as c:
        msg = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        chunks = _chunks(c.post("/v1/chat/completions", json={**body, "stream": True}))
        whole = _client(ScriptedEngine(CALL), tool_parser="hermes").__enter__().post(
            "/v1/chat/completions", json=body).json()["choices"][0]
    assert msg["finish_reason"] == "length" and len(msg["message"]["tool_calls"]) == 1, msg
    assert "<tool_call" not in (msg["message"]["content"] or "")
    streamed = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    calls = [t for ch in chunks if ch["choices"] for t in ch["choices"][0]["delta"].get("tool_calls") or []]
    assert "<tool_call" not in streamed and len(calls) == 1
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "length"
    assert whole["finish_reason"] == "tool_calls"            # a reply that ended on its own


def test_constraint_from_the_first_token_is_content_not_reasoning():
    """A template that opens the thinking, tags that are not single tokens: the constraint holds from token 0, so
    a forced call / JSON reply is read as content (it was all filed as reasoning_content)."""
    tok = ScriptTokenizer(opens_thinking=True)
    with _client(ScriptedEngine(CALL, tokenizer=tok), tool_parser="hermes", reasoning_parser="think") as c:
        r = c.post("/v1/chat/completions", json={"messages": USER, "tools": WEATHER, "tool_choice": "required"})
        msg = r.json()["choices"][0]
        assert msg["finish_reason"] == "tool_calls" and msg["message"]["tool_calls"], r.text
        chunks = _chunks(c.post("/v1/chat/completions", json={"messages": USER, "tools": WEATHER, "stream": True,
                                                              "tool_choice": "required"}))
        assert any(ch["choices"] and ch["choices"][0]["delta"].get("tool_calls") for ch in chunks)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    with _client(ScriptedEngine('{"a": 1}', tokenizer=tok), reasoning_parser="think") as c:
        msg = c.post("/v1/chat/completions", json={"messages": USER, "response_format": schema}).json()
        assert msg["choices"][0]["message"]["content"] == '{"a": 1}'
        free = c.post("/v1/chat/completions", json={"messages": USER}).json()      # unconstrained: reasoning
        assert free["choices"][0]["message"]["reasoning_content"] == '{"a": 1}'


def test_openai_and_vllm_fields():
    """OpenAI's bookkeeping fields and nulls are accepted; reasoning_effort reaches the template; request_id,
    return_token_ids, include_reasoning and continuous_usage_stats are served; system_fingerprint everywhere;
    fields that would change the output unimplemented are a 400 saying so; unknown ones stay a 400."""
    tok = ScriptTokenizer()
    stub = ScriptedEngine("<think>r</think>answer", steps=3, tokenizer=tok)
    with _client(stub, reasoning_parser="think") as c:
        post = lambda **kw: c.post("/v1/chat/completions", json={"messages": USER, **kw})     # noqa: E731
        r = post(store=False, metadata={"k": "v"}, service_tier="auto", prompt_cache_key="k", safety_identifier="s",
                 user="u", prediction=None, function_call=None, audio=None, modalities=["text"], verbosity=None,
                 reasoning_effort="low", request_id="mine", return_token_ids=True, include_reasoning=False)
        assert r.status_code == 200, r.text
        out = r.json()
        assert tok.kwargs.get("reasoning_effort") == "low" and out["id"] == "chatcmpl-mine"
        assert out["prompt_token_ids"] == [1, 2, 3] and out["choices"][0]["token_ids"] == [10, 11, 12]
        assert "reasoning_content" not in out["choices"][0]["message"]
        assert out["choices"][0]["message"]["content"] == "answer" and out["system_fingerprint"].startswith("fp_")
        chunks = _chunks(post(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
        assert all(ch["usage"] and ch["system_fingerprint"] for ch in chunks), chunks
        used = [ch["usage"]["completion_tokens"] for ch in chunks]     # a step whose text is held back: no chunk
        assert used[0] == 0 and used == sorted(used) and used[-2:] == [3, 3], used
        assert all(ch["usage"]["prompt_tokens"] == 3 for ch in chunks)
        cmpl = _chunks(c.post("/v1/completions", json={"prompt": "x", "stream": True,
                                                       "stream_options": {"continuous_usage_stats": True}}))
        assert [ch["usage"]["completion_tokens"] for ch in cmpl] == [1, 2, 3]
        for field, value in (("verbosity", "low"), ("truncate_prompt_tokens", 5), ("bad_words", ["x"]),
                             ("allowed_token_ids", [1]), ("priority", 2), ("cache_salt", "s"), ("echo", True),
                             ("audio", {"voice": "x"}), ("return_tokens_as_token_ids", True),
                             ("function_call", "auto"), ("modalities", ["audio"])):
            r = post(**{field: value})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == field and "not supported" in err["message"], r.text
        r = post(colour=1)
        assert r.status_code == 400 and "unknown field" in r.json()["error"]["message"]
        r = post(messages=[{"role": "assistant", "content": "The answ"}], continue_final_message=True,
                 add_generation_prompt=False)
        assert r.status_code == 200 and tok.kwargs.get("continue_final_message") is True, r.text


@pytest.mark.parametrize("body,param,words", [
    ({"logprobs": True, "top_logprobs": 25}, "top_logprobs", ["top_logprobs", "[0, 20]"]),
    ({"max_tokens": -1}, "max_tokens", ["max_tokens must be"]),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", ["messages[0].role", "'robot'"]),
    ({"messages": [{"role": "tool", "content": "r"}]}, "messages", ["messages[0].tool_call_id"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", ["'schema'"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     ["type: object"]),
    ({"reasoning_effort": "max"}, "reasoning_effort", ["low"]),
    # an assistant turn's tool_calls sent back malformed: named (a template failed on "'dict object' has no
    # attribute 'name'", or rendered it)
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"bogus": 1}]}, *USER]}, "messages",
     ["messages[0].tool_calls[0]: a tool call is"]),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]},
                   *USER]}, "messages", ["messages[0].tool_calls[0].function.name"]),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": 5}}]}, *USER]}, "messages", ["messages[0].tool_calls[0].function.arguments"]),
])
def test_bad_fields_name_themselves(body, param, words):
    with _client(ScriptedEngine("x"), tool_parser="hermes") as c:
        r = c.post("/v1/chat/completions", json={"messages": USER, **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and all(w in err["message"] for w in words), r.text
    assert "min_tokens" not in err["message"]


def test_unreadable_bodies_say_why():
    """Bodies FastAPI cannot read as JSON get a 400 saying why (they got "There was an error parsing the body", or
    "Input should be a valid dictionary" for JSON sent without its Content-Type); a schema's compile error names
    response_format.json_schema.schema (it read ...schema.json)."""
    stub = ScriptedEngine("x")

    def compile(so, where):
        raise ValueError(f"{where}.{so.kind}: invalid JSON schema at type: 'objec' is not valid")

    stub.engine.structured = SimpleNamespace(compile=compile)
    ok = json.dumps({"prompt": "x"}).encode()
    cases = [(b'{"prompt": "\xff"}', "application/json", "not valid UTF-8 (byte 12"),
             (b"[" * 100000 + b"]" * 100000, "application/json", "nested too deeply"),
             (b"", "application/json", "the request body is empty"),
             (ok, "text/plain", "Content-Type: application/json, got Content-Type 'text/plain'"),
             (ok, None, "got no Content-Type header")]
    with _client(stub) as c:
        for raw, ctype, words in cases:
            r = c.post("/v1/completions", content=raw, headers={"content-type": ctype} if ctype else {})
            assert r.status_code == 400 and words in r.json()["error"]["message"], (raw[:20], r.text)
        assert c.post("/v1/completions", content=ok, headers={"content-type": "application/json; charset=utf-8"}
                      ).status_code == 200
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}
        for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": USER})):
            err = c.post(path, json={**body, "response_format": rf}).json()["error"]
            assert err["message"].startswith("response_format.json_schema.schema: invalid JSON schema"), err
            err = c.post(path, json={**body, "structured_outputs": {"json": {"type": "objec"}}}).json()["error"]
            assert err["message"].startswith("structured_outputs.json: invalid"), err


def test_a_batch_larger_than_the_server_admits_is_a_400():
    """More prompts in one body than --max-num-seqs + --max-queue: it could never be admitted whole, so a 400
    naming the limit (it was a 503 "retry later", on an idle server too)."""
    stub = ScriptedEngine("x")
    stub.max_active = 2
    with _client(stub) as c:
        assert c.post("/v1/completions", json={"prompt": ["a", "b"]}).status_code == 200
        r = c.post("/v1/completions", json={"prompt": [[1], [2], [3]]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and "3 prompts" in err["message"], r.text


def test_slow_compile_is_a_400_and_never_starves_chat():
    """A constraint that compiles past the limit is a 400 naming its field; the compiles run on their own daemon
    threads, so chat rendering (asyncio's default pool) goes on meanwhile and the process can exit."""
    import threading

    stub = ScriptedEngine("x")
    release = threading.Event()
    stub.engine.structured = SimpleNamespace(compile=lambda so, where: release.wait(5))
    with _client(stub, grammar_timeout_s=0.3) as c:
        t0 = time.monotonic()
        for k in range(4):                          # more than the pool's threads
            r = c.post("/v1/chat/completions", json={"messages": USER, "structured_outputs": {"regex": f"a{k}"}})
            assert r.status_code in (400, 503) and "0.3 s" in r.json()["error"]["message"], r.text
        assert r.status_code == 503                 # the compilers are still busy: retry later
        assert time.monotonic() - t0 < 3
        r = c.post("/tokenize", json={"messages": USER})       # chat rendering is not starved
        assert r.status_code == 200
        assert all(t.daemon for t in threading.enumerate() if t.name.startswith("xllm-grammar"))
        release.set()


def test_a_prompt_far_past_the_context_is_refused_before_the_engine():
    """A text prompt many times the context's length in characters is tokenized in a worker thread of the API
    process and refused there (the engine's message, naming prompt[i] / messages): the engine, which tokenizes
    what it admits on its step loop, never sees it, so a multi-megabyte prompt cannot stall the other requests'
    steps. A batch with one such prompt admits none of them; a short prompt goes to the engine untouched."""
    where: list = []

    class Tok(ScriptTokenizer):
        def encode(self, text, add_special_tokens=False):
            try:
                asyncio.get_running_loop()
                where.append("event loop")
            except RuntimeError:
                where.append("worker")
            return super().encode(text, add_special_tokens)

    stub = ScriptedEngine("x", tokenizer=Tok())
    added: list = []
    scripted = stub.add

    async def add(rid, prompt, params):
        added.append(prompt)
        return await scripted(rid, prompt, params)

    stub.add = add
    huge = "x" * 5000                                # the stub's context: 64 tokens
    with _client(stub) as c:
        for path, body, param, start in (
                ("/v1/completions", {"prompt": huge}, "prompt", "prompt of 5000 tokens does not fit the model's"),
                ("/v1/completions", {"prompt": ["ok", huge]}, "prompt", "prompt[1]: prompt of 5000 tokens"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages",
                 "messages: the conversation, rendered by the chat template: prompt of 50")):
            r = c.post(path, json=body)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and err["message"].startswith(start), r.text
        assert added == [] and where and set(where) == {"worker"}, (added, where)
        where.clear()
        assert c.post("/v1/completions", json={"prompt": "ok"}).status_code == 200
        assert [p["prompt"] for p in added] == ["ok"] and where == []


def test_top_logprobs_of_tokens_that_decode_alike():
    """/v1/completions' top_logprobs is keyed by the token's text, and distinct ids can decode alike (byte tokens
    of a split character all read "\\ufffd"): the entry keeps the likeliest of them, so it holds the sampled token's
    own logprob (top_logprobs[i][tokens[i]] == token_logprobs[i]), generated or echoed."""
    from xllm_gen.runtime.engine.outputs import CompletionOutput, Logprob
    from xllm_gen.runtime.serving import shaping as S

    for order in ((116, 139, 209), (139, 209, 116)):      # the sampled token's entry first or last
        table = {116: Logprob(-0.8, 1, "\ufffd"), 139: Logprob(-2.25, 2, "\ufffd"), 209: Logprob(-2.7, 3, "x")}
        entry = {t: table[t] for t in order}
        lp = S.completion_logprobs(CompletionOutput(0, "", [116], "length", [entry]), None, 0)
        assert lp["top_logprobs"] == [{"\ufffd": -0.8, "x": -2.7}] and lp["token_logprobs"] == [-0.8]
        echoed = S.echoed_logprobs([5, 116], [None, entry], SimpleNamespace(decode_text=lambda ids: "five"))
        assert echoed["top_logprobs"] == [None, {"\ufffd": -0.8, "x": -2.7}]
        assert echoed["top_logprobs"][1][echoed["tokens"][1]] == echoed["token_logprobs"][1]
