"""The server's app (runtime/serving/app.py) over a stub engine, without a model or a server process: an unexpected
error is a 500 in OpenAI's shape (not a plain-text one)."""
from __future__ import annotations

import asyncio
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
