"""A streamed request whose consumer falls behind gets its waiting deltas coalesced into one SSE chunk
(request_results.results / merge_deltas), and one that keeps up gets a chunk per token: both streams say the same
(text concatenated, logprobs concatenated in order, the finish reason on the last chunk). Through the real app
(build_app) over a stub engine whose request queue is filled before the stream reads it (slow consumer) or one
delta at a time as the stream takes them (fast consumer)."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from xllm_gen.runtime.engine.outputs import CompletionOutput, Logprob, RequestOutput
from xllm_gen.runtime.serving.request_results import merge_deltas, results

TEXTS = ["Hel", "lo", ",", " wor", "ld", "!"]


def deltas(n: int = 1, logprobs: bool = True) -> list:
    """A request's per-step deltas: one token per completion per step, the last one finished ("length")."""
    outs = []
    for k, t in enumerate(TEXTS):
        last = k == len(TEXTS) - 1
        comps = [CompletionOutput(i, t + str(i) * (i > 0), [100 + k + 10 * i], "length" if last else None,
                                  [{100 + k + 10 * i: Logprob(-0.1 * (k + 1), 1, t + str(i) * (i > 0)),
                                    7: Logprob(-2.0 - k, 2, "x")}] if logprobs else None,
                                  None, None) for i in range(n)]
        outs.append(RequestOutput("r", "hi", [1, 2, 3], comps, last, None, None, 0))
    return outs


def test_merge_concatenates_and_keeps_the_last_finish():
    ds = deltas(n=2)
    m = ds[0]
    for d in ds[1:]:
        m = merge_deltas(m, d)
    assert m.finished and [c.index for c in m.outputs] == [0, 1]
    for c in m.outputs:
        assert c.text == "".join(d.outputs[c.index].text for d in ds)
        assert c.token_ids == [t for d in ds for t in d.outputs[c.index].token_ids]
        assert c.logprobs == [e for d in ds for e in d.outputs[c.index].logprobs]
        assert c.finish_reason == "length"
    assert ds[0].outputs[0].text == "Hel" and ds[0].outputs[0].token_ids == [100]      # inputs left as they were


def test_results_coalesce_only_what_is_waiting():
    async def go():
        slow = asyncio.Queue()
        for d in deltas():
            slow.put_nowait(d)
        got_slow = [o async for o in results("r", slow)]
        fast = asyncio.Queue()
        got_fast = []
        ds = deltas()
        fast.put_nowait(ds[0])
        async for o in results("r", fast):
            got_fast.append(o)
            if len(got_fast) < len(ds):
                fast.put_nowait(ds[len(got_fast)])
        # a failure after waiting deltas: the deltas first, then the error
        failing = asyncio.Queue()
        for d in deltas()[:3]:
            failing.put_nowait(d)
        failing.put_nowait(RuntimeError("boom"))
        seen, err = [], None
        try:
            async for o in results("r", failing):
                seen.append(o)
        except Exception as e:               # APIError
            err = e
        return got_slow, got_fast, seen, err

    got_slow, got_fast, seen, err = asyncio.run(go())
    assert len(got_slow) == 1 and got_slow[0].outputs[0].text == "".join(TEXTS)
    assert len(got_fast) == len(TEXTS) and [o.outputs[0].text for o in got_fast] == TEXTS
    assert len(seen) == 1 and seen[0].outputs[0].text == "".join(TEXTS[:3]) and "boom" in str(err)


class StubEngine:
    """What build_app reads of an async engine: `add` hands out a queue that is either full already (slow) or fed
    one delta each time the stream has taken the previous one (fast)."""

    def __init__(self, slow: bool, n: int = 1):
        from xllm_gen.runtime.cli import default_checkpoint
        from xllm_gen.runtime.loading.checkpoint_files import load_tokenizer

        self.slow, self.n = slow, n
        tokenizer = load_tokenizer(default_checkpoint(), required=True)       # chat renders its template
        self.engine = SimpleNamespace(tokenizer=tokenizer, max_model_len=4096, model_dir=Path("stub"),
                                      default_sampling=None, vocab_size=1000, mm_processor=None,
                                      chat_template=None, decode_text=lambda ids, skip_special_tokens=True: "")
        self.alive, self.error, self.max_active = True, None, 100
        self.tasks = []

    def start(self, loop):
        pass

    def stop(self):
        pass

    def abort(self, rid):
        pass

    async def add(self, rid, prompt, params):
        q = asyncio.Queue()
        ds = deltas(self.n)
        if self.slow:
            for d in ds:
                q.put_nowait(d)
            return q

        async def feed():
            for d in ds:
                while not q.empty():
                    await asyncio.sleep(0)
                for _ in range(5):           # the stream is waiting on the queue by now
                    await asyncio.sleep(0)
                q.put_nowait(d)

        self.tasks.append(asyncio.ensure_future(feed()))
        return q


def sse_chunks(text: str) -> list:
    lines = [ln[6:] for ln in text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def stream(slow: bool, path: str, body: dict, n: int = 1) -> list:
    from xllm_gen.runtime.serving.app import build_app

    app = build_app(StubEngine(slow, n), "stub", None, log_requests=False)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post(path, json={**body, "model": "stub", "stream": True})
            assert r.status_code == 200, r.text
            return sse_chunks(r.text)

    return asyncio.run(go())


@pytest.mark.parametrize("n", [1, 2])
def test_completions_stream_coalesced_equals_per_token(n):
    body = {"prompt": "hi", "max_tokens": len(TEXTS), "logprobs": 1, "n": n}
    fast, slow = stream(False, "/v1/completions", body, n), stream(True, "/v1/completions", body, n)
    assert len(fast) == n * len(TEXTS) and len(slow) == n        # a chunk per token, one chunk per choice
    for i in range(n):
        f = [c["choices"][0] for c in fast if c["choices"][0]["index"] == i]
        s = [c["choices"][0] for c in slow if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in f) == "".join(c["text"] for c in s) == \
            "".join(t + str(i) * (i > 0) for t in TEXTS)
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for c in f for x in c["logprobs"][key]] == [x for c in s for x in c["logprobs"][key]], key
        assert [c["finish_reason"] for c in f] == [None] * (len(TEXTS) - 1) + ["length"]
        assert [c["finish_reason"] for c in s] == ["length"]


def test_chat_stream_coalesced_equals_per_token():
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": len(TEXTS), "logprobs": True,
            "top_logprobs": 1}
    fast = stream(False, "/v1/chat/completions", body)
    slow = stream(True, "/v1/chat/completions", body)

    def content(chunks):
        return [c["choices"][0] for c in chunks if c["choices"] and "content" in c["choices"][0]["delta"]
                and c["choices"][0]["delta"].get("role") is None]

    f, s = content(fast), content(slow)
    assert len(f) == len(TEXTS) and len(s) == 1
    assert "".join(c["delta"]["content"] for c in f) == s[0]["delta"]["content"] == "".join(TEXTS)
    assert [x for c in f for x in c["logprobs"]["content"]] == s[0]["logprobs"]["content"]
    assert f[-1]["finish_reason"] == s[0]["finish_reason"] == "length"
