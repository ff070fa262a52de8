"""One request's results as the routes of app.py consume them: its deltas from the engine's queue (`results`), all of
them accumulated for a non-streaming reply (`collect`), and a request's work cancelled as soon as its client goes
away (`unless_disconnected`)."""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from xllm_gen.runtime.serving import shaping as S
from xllm_gen.runtime.serving.protocol import APIError


def _failed(item: BaseException) -> APIError:
    return APIError(f"the engine failed: {type(item).__name__}: {item}", status=500, type="server_error")


def merge_deltas(a, b):
    """One delta of a request that says what its consecutive deltas `a` then `b` say: each completion's text and
    token ids concatenated, its logprobs lists too, the finish and stop reasons (and `finished`, `error`) of the
    later one, the prompt logprobs of the one that has them. A new RequestOutput (`a` and `b` are left as they
    are)."""
    from dataclasses import replace

    comps = {c.index: c for c in a.outputs}
    for c in b.outputs:
        p = comps.get(c.index)
        if p is None:
            comps[c.index] = c
            continue
        lps = p.logprobs + c.logprobs if p.logprobs is not None and c.logprobs is not None else \
            (c.logprobs if p.logprobs is None else p.logprobs)
        comps[c.index] = replace(c, text=p.text + c.text, token_ids=[*p.token_ids, *c.token_ids], logprobs=lps)
    return replace(b, outputs=list(comps.values()), error=b.error if b.error is not None else a.error,
                   prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
                   prompt=b.prompt if b.prompt is not None else a.prompt,
                   prompt_token_ids=b.prompt_token_ids if b.prompt_token_ids is not None else a.prompt_token_ids)


async def results(rid: str, q: asyncio.Queue):
    """The deltas of one request until it finishes. A consumer that falls behind (the deltas of several steps are
    waiting when it asks for the next) gets them as one (merge_deltas), so that under load a streamed chunk carries
    several tokens instead of the stream lagging further behind (vLLM's streaming does the same); one that keeps up
    gets every step's delta as it comes."""
    held = None                                   # an error that came after deltas merged into the one yielded
    while True:
        item = held if held is not None else await q.get()
        held = None
        if isinstance(item, BaseException):
            raise _failed(item)
        while not item.finished and not q.empty():
            nxt = q.get_nowait()
            if isinstance(nxt, BaseException):
                held = nxt
                break
            item = merge_deltas(item, nxt)
        yield item
        if item.finished:
            return


async def until_disconnected(request: Request) -> None:
    """Returns once the client has gone away (http.disconnect; the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work) -> Any:
    """The result of the coroutine `work`, or None as soon as the client goes away first (`work` is then
    cancelled, which aborts the request it is collecting)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


async def collect(async_engine, rid: str, q: asyncio.Queue):
    """Accumulates a request's deltas (non-streaming); aborts it in `async_engine` if cancelled (the client went
    away)."""
    texts: dict[int, str] = {}
    ids: dict[int, list] = {}
    lps: dict[int, list] = {}
    final: dict[int, Any] = {}
    prompt_ids: list = []
    prompt_text, prompt_lps = None, None
    err = None
    try:
        async for out in results(rid, q):
            prompt_ids = out.prompt_token_ids
            prompt_text = out.prompt if prompt_text is None else prompt_text
            prompt_lps = out.prompt_logprobs if prompt_lps is None else prompt_lps
            err = err or out.error
            for c in out.outputs:
                texts[c.index] = texts.get(c.index, "") + c.text
                ids.setdefault(c.index, []).extend(c.token_ids)
                if c.logprobs is not None:
                    lps.setdefault(c.index, []).extend(c.logprobs)
                final[c.index] = c
    except BaseException:
        async_engine.abort(rid)
        raise
    if err:
        raise APIError(err, status=500, type="server_error")
    from xllm_gen.runtime.engine.outputs import CompletionOutput
    comps = [CompletionOutput(i, texts.get(i, ""), ids.get(i, []), final[i].finish_reason,
                              lps.get(i) if final[i].logprobs is not None else None, None, final[i].stop_reason)
             for i in sorted(final)]
    return S.Collected(prompt_ids, comps, prompt_lps, prompt_text)
