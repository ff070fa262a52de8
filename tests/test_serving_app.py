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
