"""`xllm-gen-serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

    xllm-gen-serve [MODEL] [--host 127.0.0.1 --port 8000 --tensor-parallel-size 1 --max-model-len N
                   --max-num-seqs 256 --max-queue 256 ...]

Without MODEL it serves the embedded default (xllm_gen/default_model.py: a tiny random-weight checkpoint built offline on first use).
Endpoints: POST /v1/completions, POST /v1/chat/completions (stream: true gives Server-Sent Events in
OpenAI's chunk format ending with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from xllm_gen.runtime.serving.async_engine import QueueFullError
from xllm_gen.runtime.serving.chat import render_chat
from xllm_gen.runtime.serving.chat_reply import ReplySplitter, plan_tools, reply_message
from xllm_gen.runtime.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, param_of

logger = logging.getLogger("xllm_gen.serving")


# ------------------------------------------------------------------------------------ response shaping
def _completion_logprobs(c, engine, text_offset: int) -> Optional[dict]:
    if c.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset
    for tid, entry in zip(c.token_ids, c.logprobs):
        lp = entry.get(tid)
        s = lp.decoded_token if lp and lp.decoded_token is not None else engine.decode_text([tid])
        tokens.append(s)
        token_lps.append(lp.logprob if lp else None)
        tops.append({(v.decoded_token or ""): v.logprob for t, v in entry.items()})
        offsets.append(off)
        off += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(c, n_top: int) -> Optional[dict]:
    if c.logprobs is None:
        return None
    content = []
    for tid, entry in zip(c.token_ids, c.logprobs):
        lp = entry.get(tid)
        tok = lp.decoded_token or ""
        tops = sorted(((v.rank, t, v) for t, v in entry.items() if v.rank <= n_top), key=lambda x: x[0])
        content.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode("utf-8", "replace")),
                        "top_logprobs": [{"token": v.decoded_token or "", "logprob": v.logprob,
                                          "bytes": list((v.decoded_token or "").encode("utf-8", "replace"))}
                                         for _, _, v in tops[:n_top]]})
    return {"content": content}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------------------------ the app
def build_app(async_engine, model_name: str, metrics, *, tool_parser: Optional[str] = None,
              reasoning_parser: Optional[str] = None, chat_template: Optional[str] = None,
              allowed_local_media_path: Optional[str] = None, api_key: Optional[str] = None,
              allowed_origins: Optional[list] = None, log_requests: bool = True):
    """The FastAPI app. `tool_parser` / `reasoning_parser`: names in runtime/serving/tool_parsers/ and
    reasoning_parsers/ (None: tool_choice auto / required / named are refused; no reasoning split);
    `chat_template`: the default template (Jinja text) instead of the checkpoint's."""
    from xllm_gen.runtime.serving import reasoning_parsers, tool_parsers

    engine = async_engine.engine
    tools_cls = tool_parsers.get(tool_parser) if tool_parser else None
    reasoning = reasoning_parsers.get(reasoning_parser)() if reasoning_parser else None

    @asynccontextmanager
    async def lifespan(app):
        async_engine.start(asyncio.get_running_loop())
        yield
        await asyncio.to_thread(async_engine.stop)

    app = FastAPI(title="xllm-gen", lifespan=lifespan)
    app.state.async_engine = async_engine
    access = logging.getLogger("xllm_gen.access")

    @app.middleware("http")
    async def _auth_and_log(request: Request, call_next):
        """--api-key: a Bearer token on /v1/* (401 in OpenAI's shape otherwise); one access line per request
        (method, path, status, latency) unless --disable-log-requests."""
        t0 = time.monotonic()
        if api_key and request.url.path.startswith("/v1/") and request.method != "OPTIONS":
            import hmac
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                response = JSONResponse(APIError("invalid or missing API key (Authorization: Bearer ...)", 401,
                                                 type="authentication_error").body(), status_code=401)
                if log_requests:
                    access.info("%s %s %d %.1f ms", request.method, request.url.path, 401,
                                1000 * (time.monotonic() - t0))
                return response
        response = await call_next(request)
        if log_requests:
            access.info("%s %s %d %.1f ms%s", request.method, request.url.path, response.status_code,
                        1000 * (time.monotonic() - t0),
                        " (streaming)" if isinstance(response, StreamingResponse) else "")
        return response

    if allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in allowed_origins)

    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """404 / 405 in OpenAI's error shape."""
        if exc.status_code == 404:
            msg = f"no such endpoint: {request.method} {request.url.path} (see /v1/models, /v1/completions, " \
                  "/v1/chat/completions, /health, /metrics)"
            return JSONResponse(APIError(msg, 404, type="not_found_error").body(), status_code=404)
        return JSONResponse(APIError(str(exc.detail), exc.status_code, type="invalid_request_error").body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    def error(e: APIError) -> JSONResponse:
        if metrics is not None:
            metrics.labels(metrics.rejected, reason=str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x not in ("body",)]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        if first.get("type") == "extra_forbidden":        # never silently dropped
            unknown = sorted(".".join(str(x) for x in e.get("loc", ()) if x != "body")
                             for e in errs if e.get("type") == "extra_forbidden")
            return error(APIError(f"unknown field(s) {', '.join(unknown)}: not supported by this server",
                                  param=param))
        if first.get("type") == "json_invalid":
            ctx = first.get("ctx") or {}
            return error(APIError(f"the request body is not valid JSON: {ctx.get('error', 'decode error')} "
                                  f"at character {first.get('loc', ('', '?'))[-1]}", param=None))
        return error(APIError(f"{where}: {first.get('msg', 'invalid request body')}", param=param))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error(exc)

    @app.get("/health")
    async def health():
        if not async_engine.alive:
            return JSONResponse({"status": "error", "error": repr(async_engine.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "xllm-gen", "root": str(engine.model_dir),
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prom():
        from prometheus_client import CONTENT_TYPE_LATEST
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def check_model(body) -> None:
        if body.model not in (None, model_name, str(engine.model_dir)):
            raise APIError(f"model {body.model!r} does not exist; this server serves {model_name!r}",
                           status=404, param="model", type="not_found_error")

    async def precompile(params, where: str, param: str) -> None:
        """Compiles the request's constraint in a worker thread (cached), so that the engine's step never
        waits on a compile and an invalid schema / regex / grammar is a 400 naming it."""
        so = params.structured_outputs
        if so is None:
            return
        try:
            backend = engine.structured
            await asyncio.to_thread(backend.compile, so, where)
        except ValueError as e:
            raise APIError(str(e), param=param) from None

    async def admit(rid: str, prompt: Any, params) -> asyncio.Queue:
        try:
            return await async_engine.add(rid, prompt, params)
        except QueueFullError as e:
            raise APIError(str(e), status=503, type="server_overloaded") from None
        except ValueError as e:
            msg = str(e).replace(f"request {rid}: ", "")
            raise APIError(msg, param=param_of(msg) or "prompt") from None
        except RuntimeError as e:
            raise APIError(str(e), status=503, type="server_error") from None

    async def admit_all(base: str, prompts: list, params) -> list:
        queues = []
        try:
            for i, p in enumerate(prompts):
                queues.append((f"{base}-{i}", await admit(f"{base}-{i}", p, params)))
        except BaseException:
            for rid, _ in queues:
                async_engine.abort(rid)
            raise
        return queues

    async def results(rid: str, q: asyncio.Queue):
        """The deltas of one request until it finishes."""
        while True:
            item = await q.get()
            if isinstance(item, BaseException):
                raise APIError(f"the engine failed: {type(item).__name__}: {item}", status=500, type="server_error")
            yield item
            if item.finished:
                return

    async def collect(rid: str, q: asyncio.Queue, request: Request):
        """Accumulates a request's deltas (non-streaming); aborts it when the client goes away."""
        texts: dict[int, str] = {}
        ids: dict[int, list] = {}
        lps: dict[int, list] = {}
        final: dict[int, Any] = {}
        prompt_ids: list = []
        err = None
        gen = results(rid, q)
        try:
            while True:
                nxt = asyncio.ensure_future(gen.__anext__())
                while not nxt.done():
                    await asyncio.wait([nxt], timeout=1.0)
                    if not nxt.done() and await request.is_disconnected():
                        nxt.cancel()
                        async_engine.abort(rid)
                        return None
                try:
                    out = nxt.result()
                except StopAsyncIteration:
                    break
                prompt_ids = out.prompt_token_ids
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
        return prompt_ids, comps

    # ---- /v1/completions ------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        prompts = body.prompts()
        params = body.sampling_params(engine.max_model_len)
        await precompile(params, *body.structured_where())
        base = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        queues = await admit_all(base, prompts, params)
        n = params.n
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream_completions(base, created, queues, n, include_usage, params),
                                     media_type="text/event-stream")
        choices, p_tok, c_tok = [], 0, 0
        for k, (rid, q) in enumerate(queues):
            got = await collect(rid, q, request)
            if got is None:
                for r, _ in queues:
                    async_engine.abort(r)
                return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
            prompt_ids, comps = got
            p_tok += len(prompt_ids)
            for c in comps:
                c_tok += len(c.token_ids)
                choices.append({"index": k * n + c.index, "text": c.text,
                                "logprobs": _completion_logprobs(c, engine, 0), "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
        return {"id": base, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": _usage(p_tok, c_tok)}

    async def stream_completions(base, created, queues, n, include_usage, params) -> AsyncIterator[str]:
        p_tok, c_tok = 0, 0
        offsets: dict = {}
        live = {rid for rid, _ in queues}
        try:
            for k, (rid, q) in enumerate(queues):
                async for out in results(rid, q):
                    if not out.outputs and not out.finished:
                        continue
                    if out.prompt_token_ids and rid not in offsets:
                        offsets[rid] = {}
                        p_tok += len(out.prompt_token_ids)
                    for c in out.outputs:
                        c_tok += len(c.token_ids)
                        off = offsets[rid].get(c.index, 0)
                        offsets[rid][c.index] = off + len(c.text)
                        chunk = {"id": base, "object": "text_completion", "created": created, "model": model_name,
                                 "choices": [{"index": k * n + c.index, "text": c.text,
                                              "logprobs": _completion_logprobs(c, engine, off),
                                              "finish_reason": c.finish_reason,
                                              "stop_reason": c.stop_reason}]}
                        if include_usage:
                            chunk["usage"] = None
                        yield _sse(chunk)
                    if out.error:
                        yield _sse({"error": {"message": out.error, "type": "server_error", "code": 500}})
                live.discard(rid)
            if include_usage:
                yield _sse({"id": base, "object": "text_completion", "created": created, "model": model_name,
                            "choices": [], "usage": _usage(p_tok, c_tok)})
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
        finally:                              # client gone (cancelled) or finished: free what is left
            for rid in live:
                async_engine.abort(rid)

    # ---- /v1/chat/completions -------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body)
        body.check_supported()
        params = body.sampling_params(engine.max_model_len)
        template_tools, parser = plan_tools(body, params, tools_cls)
        where, param = body.structured_where()
        if parser is not None and params.structured_outputs is not None and body.tool_choice not in (None, "auto"):
            where, param = "tools", "tools"
        await precompile(params, where, param)
        prompt = await asyncio.to_thread(render_chat, engine, body.messages, body.chat_template or chat_template,
                                         bool(body.add_generation_prompt), template_tools,
                                         body.chat_template_kwargs, allowed_local_media_path)
        base = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        rid, q = (await admit_all(base, [prompt], params))[0]
        n_top = body.top_logprobs or 0
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream_chat(base, created, rid, q, params.n, include_usage, n_top, parser),
                                     media_type="text/event-stream")
        got = await collect(rid, q, request)
        if got is None:
            return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
        prompt_ids, comps = got
        choices = []
        for c in comps:
            message = reply_message(c.text, reasoning, parser)
            finish = "tool_calls" if message.get("tool_calls") else c.finish_reason
            choices.append({"index": c.index, "message": message, "logprobs": _chat_logprobs(c, n_top),
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        return {"id": base, "object": "chat.completion", "created": created, "model": model_name,
                "choices": choices, "usage": _usage(len(prompt_ids), sum(len(c.token_ids) for c in comps))}

    async def stream_chat(base, created, rid, q, n, include_usage, n_top, parser=None) -> AsyncIterator[str]:
        head = {"id": base, "object": "chat.completion.chunk", "created": created, "model": model_name}
        p_tok, c_tok = 0, 0
        finished = False
        state = {i: ReplySplitter(reasoning, parser) for i in range(n)}     # per choice

        try:
            for i in range(n):
                chunk = {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]}
                if include_usage:
                    chunk["usage"] = None
                yield _sse(chunk)
            async for out in results(rid, q):
                p_tok = len(out.prompt_token_ids)
                for c in out.outputs:
                    c_tok += len(c.token_ids)
                    if reasoning is None and parser is None:
                        delta = {"content": c.text} if (c.text or not c.finish_reason) else {}
                    else:
                        delta = state[c.index].feed(c.text, c.finish_reason is not None)
                        if not delta and not c.finish_reason and not c.logprobs:
                            continue                  # held back (a tag may be starting)
                    finish = c.finish_reason
                    if finish is not None and state[c.index].calls_sent:
                        finish = "tool_calls"
                    chunk = {**head, "choices": [{"index": c.index, "delta": delta,
                                                  "logprobs": _chat_logprobs(c, n_top),
                                                  "finish_reason": finish, "stop_reason": c.stop_reason}]}
                    if include_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
                if out.error:
                    yield _sse({"error": {"message": out.error, "type": "server_error", "code": 500}})
            finished = True
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(p_tok, c_tok)})
            yield "data: [DONE]\n\n"
        except APIError as e:
            finished = True
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                async_engine.abort(rid)

    return app


# ------------------------------------------------------------------------------------ command line
# engine._DTYPES's names (written out: --help must not import torch; tests/test_serving_hardening.py checks it)
DTYPES = ("bf16", "bfloat16", "float", "float16", "float32", "fp16", "fp32", "half")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="xllm-gen-serve", description="An OpenAI-compatible server (completions, "
                                 "chat, streaming, metrics) over a Hugging Face checkpoint dir.")
    ap.add_argument("model", nargs="?", help="HF checkpoint dir (default: the embedded tiny checkpoint, built on first use)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8000, help="TCP port (0: pick a free one, printed at start)")
    ap.add_argument("--served-model-name", help="model name in the API (default: the checkpoint dir name)")
    ap.add_argument("--tokenizer", help="tokenizer dir (default: the checkpoint dir)")
    ap.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, help="tensor-parallel ranks")
    ap.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one batch")
    ap.add_argument("--max-queue", type=int, default=256,
                    help="most requests waiting beyond the batch; more are refused with HTTP 503")
    ap.add_argument("--max-num-batched-tokens", type=int, help="tokens per prefill step")
    ap.add_argument("--enable-chunked-prefill", action="store_true", help="prefill long prompts in chunks")
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="weights and KV dtype")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--num-kv-blocks", type=int, help="KV blocks (default: from --gpu-memory-utilization)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="fraction of GPU memory to use")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--cuda-graph-sizes", type=int, nargs="*",
                    help="decode CUDA-graph batch sizes (default: 1 2 4 8, then multiples of 16 up to --max-num-seqs)")
    ap.add_argument("--prefill-graph-sizes", type=int, nargs="*",
                    help="token counts of the piecewise prefill CUDA graphs (default: 16 ... 4096; none: eager prefill)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: random weights of the config's shapes, no checkpoint read (benchmarks)")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="fp8: quantize an unquantized checkpoint's linear weights to fp8 per channel at load "
                         "(a quantized checkpoint's own quantization_config needs no flag)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                    help="fp8: the KV cache in float8 e4m3 (with the checkpoint's k_scale / "
                         "v_scale, per tensor or per KV head, where it has them, else scale 1.0)")
    ap.add_argument("--mm-preprocess-device", default="cpu",
                    help="where image / video preprocessing runs: cpu (the host; the default until the device "
                         "path has run on a GPU), auto (the model's GPU when the processor supports it), or a "
                         "device such as cuda:0")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="reuse the KV of shared prompt prefixes (on by default)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="launch each greedy decode step before the previous one's tokens are read back, so that "
                         "the host's work overlaps the GPU's (on by default)")
    ap.add_argument("--speculative-config", metavar="JSON",
                    help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 3, '
                         '"prompt_lookup_max": 3}\' or \'{"method": "draft_model", "model": DIR, '
                         '"num_speculative_tokens": 4}\' (runtime/engine/spec_decode.py)')
    ap.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    ap.add_argument("--chat-template", help="chat template (a Jinja file, or the template text) used instead of the "
                    "checkpoint's (a request's chat_template still wins)")
    ap.add_argument("--tool-call-parser", help="how tool calls are read from the output (hermes: <tool_call> JSON "
                    "</tool_call>); enables tools with tool_choice auto, required and named")
    ap.add_argument("--reasoning-parser", help="split the reasoning from the answer into reasoning_content "
                    "(think: a reply opening with <think> ... </think>; model-family names are aliases, see README)")
    ap.add_argument("--engine-in-process", action="store_true",
                    help="run the engine (scheduler, model, sampling) in a thread of the API process instead of its "
                         "own engine-core process (talking over ZeroMQ, the default)")
    ap.add_argument("--api-server-count", type=int, default=1, metavar="N",
                    help="API processes (HTTP, tokenization, detokenization) sharing the port and one engine core; "
                         "each has its own /metrics counters (the gauges are the core's)")
    ap.add_argument("--_api-server", help=argparse.SUPPRESS)     # INDEX,IN,OUT,FD: an API process i > 0
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds in-flight requests may take to finish after SIGTERM before they are aborted")
    ap.add_argument("--allowed-local-media-path", metavar="DIR",
                    help="image / video parts may name local files (paths or file:// URLs) under DIR only "
                         "(default: local files are refused)")
    ap.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (default: $XLLM_API_KEY; none)")
    ap.add_argument("--allowed-origins", nargs="*", metavar="ORIGIN",
                    help="CORS: origins allowed to call the API from a browser ('*': any)")
    ap.add_argument("--disable-log-requests", action="store_true", help="no access log line per request")
    ap.add_argument("--log-stats-interval", type=float, default=10.0,
                    help="seconds between stats lines (running, waiting, KV usage, tokens/s) while busy; 0: none")
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                    help="log level")
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    return ap


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("xllm-gen")
    except Exception:
        return "unknown"


def _chat_template(arg: Optional[str]) -> Optional[str]:
    """--chat-template: a file's text, or the argument itself when it is a template (contains '{')."""
    if not arg:
        return None
    if "{" in arg:
        return arg
    from pathlib import Path
    path = Path(arg)
    if not path.is_file():
        raise ValueError(f"--chat-template: no such file: {arg}")
    return path.read_text()


def check_model_path(model: str) -> None:
    """A clear error for a model argument that is not a checkpoint dir (before any heavy import)."""
    from pathlib import Path

    p = Path(model)
    if p.is_dir():
        return
    if p.exists():
        raise ValueError(f"model {model!r} is a file; give the checkpoint directory (with config.json)")
    parts = model.split("/")
    if len(parts) == 2 and all(parts) and not model.startswith((".", "~")):
        raise ValueError(f"model {model!r} does not exist locally; it looks like a Hugging Face hub id, but "
                         "downloads are not supported: download it first (e.g. `huggingface-cli download "
                         f"{model} --local-dir DIR`) and pass DIR")
    raise ValueError(f"model path {model!r} does not exist")


def bind_socket(host: str, port: int):
    """The listening socket, bound before the model loads, so that a busy port fails at once."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e} (is another server running there? "
                         "pick another --port, or 0 for a free one)") from None
    return sock                        # not inheritable: tensor-parallel rank processes never hold it


def make_engine(args):
    import inspect

    from xllm_gen.runtime.engine.engine import LLMEngine

    model = args.model
    if not model:
        from xllm_gen.runtime.cli import default_checkpoint
        model = str(default_checkpoint())
    else:
        check_model_path(model)
    kw = dict(device=args.device, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
              block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
              seed=args.seed, enable_chunked_prefill=args.enable_chunked_prefill or None, tokenizer=args.tokenizer,
              load_format=args.load_format, cuda_graph_sizes=args.cuda_graph_sizes,
              prefill_graph_sizes=args.prefill_graph_sizes, async_scheduling=args.async_scheduling,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    if args.mm_preprocess_device != "cpu":
        kw["mm_preprocess_device"] = args.mm_preprocess_device
    if getattr(args, "speculative_config", None):
        from xllm_gen.runtime.engine.spec_decode import SpeculativeConfig
        kw["speculative_config"] = SpeculativeConfig.parse(args.speculative_config)   # errors name the flag's key
    if args.enable_prefix_caching is not None:
        if "enable_prefix_caching" not in inspect.signature(LLMEngine.__init__).parameters:
            raise ValueError("--enable-prefix-caching: this engine has no prefix cache")
        kw["enable_prefix_caching"] = args.enable_prefix_caching
    return LLMEngine(model, **kw)


def _start_api_servers(argv: list, aeng, sock) -> list:
    """API processes 1..N-1 (--api-server-count N): the same arguments, the listening socket inherited, each
    with its own output address of the core that this process started."""
    import subprocess

    in_addr, outs = aeng.addresses
    fd = sock.fileno()
    os_set_inheritable(fd)
    return [subprocess.Popen([sys.executable, "-m", "xllm_gen.runtime.serving.server", *argv, "--_api-server",
                              f"{i},{in_addr},{outs[i]},{fd}"], pass_fds=(fd,)) for i in range(1, len(outs))]


def os_set_inheritable(fd: int) -> None:
    import os
    os.set_inheritable(fd, True)


def main(argv=None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    child = args._api_server
    several = args.api_server_count > 1 or child
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s"
                        f"{'[%(process)d]' if several else ''}: %(message)s")
    import os

    import uvicorn

    from xllm_gen.runtime.serving.async_engine import AsyncEngine
    from xllm_gen.runtime.serving.metrics import ServerMetrics

    api_key = args.api_key or os.environ.get("XLLM_API_KEY") or None
    try:
        if args.model:
            check_model_path(args.model)
        if args.allowed_local_media_path and not os.path.isdir(args.allowed_local_media_path):
            raise ValueError(f"--allowed-local-media-path: no such directory: {args.allowed_local_media_path}")
        if args.api_server_count < 1 or (args.api_server_count > 1 and args.engine_in_process):
            raise ValueError("--api-server-count must be >= 1, and 1 with --engine-in-process (several API "
                             "processes share one engine-core process)")
        if not args.engine_in_process:
            try:
                import zmq  # noqa: F401
            except ImportError:
                raise ValueError("the engine-core process talks over ZeroMQ, and pyzmq is not installed: "
                                 "pip install pyzmq, or serve with --engine-in-process") from None
        if child:                      # an API process i > 0: the first one's socket, its core
            import socket

            from xllm_gen.runtime.serving.engine_core import die_with_parent
            die_with_parent(os.getppid())
            index, in_addr, out_addr, fd = child.split(",")
            sock = socket.socket(fileno=int(fd))
        else:
            sock = bind_socket(args.host, args.port)
        template = _chat_template(args.chat_template)
        from xllm_gen.runtime.serving import reasoning_parsers, tool_parsers
        if args.tool_call_parser:
            tool_parsers.get(args.tool_call_parser)
        if args.reasoning_parser:
            reasoning_parsers.get(args.reasoning_parser)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t_load = time.monotonic()
    from xllm_gen.runtime.serving.engine_core import engine_info

    try:
        if args.engine_in_process:
            engine = make_engine(args)
            aeng = AsyncEngine(engine, None, max_queue=args.max_queue, stats_interval=args.log_stats_interval)
            info = engine_info(engine)
        else:                          # the engine core in its own process (runtime/serving/engine_core.py)
            from xllm_gen.runtime.serving.core_client import CoreClient
            if child:
                aeng = CoreClient(args, None, max_queue=args.max_queue, stats_interval=0, index=int(index),
                                  addresses=(in_addr, [out_addr]))
            else:
                aeng = CoreClient(args, None, max_queue=args.max_queue, stats_interval=args.log_stats_interval,
                                  count=args.api_server_count)
                aeng.children = _start_api_servers(raw_argv, aeng, sock) if args.api_server_count > 1 else []
            engine = aeng.wait_ready()
            info = aeng.info
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or engine.model_dir.name
    metrics = aeng.metrics = ServerMetrics(name)
    app = build_app(aeng, name, metrics, tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                    chat_template=template, allowed_local_media_path=args.allowed_local_media_path,
                    api_key=api_key, allowed_origins=args.allowed_origins,
                    log_requests=not args.disable_log_requests)
    config = uvicorn.Config(app, host=args.host, port=sock.getsockname()[1], log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    server = uvicorn.Server(config)
    kv_bytes = info["kv_bytes"]
    if child:
        logger.info("API server %s of %d serving on the shared socket", index, args.api_server_count)
    else:
        logger.info("serving %s as %r on http://%s:%d: device %s, tensor parallel %d, dtype %s, loaded in %.1f s, "
                    "%d KV blocks of %d tokens (%s), max_model_len %d, max_num_seqs %d, engine %s%s",
                    engine.model_dir, name, args.host, sock.getsockname()[1], info["device"],
                    args.tensor_parallel_size, info["dtype"], time.monotonic() - t_load, info["num_blocks"],
                    info["block_size"], f"{kv_bytes} bytes" if kv_bytes is not None else "size unknown",
                    info["max_model_len"], info["max_num_seqs"],
                    "in process" if args.engine_in_process else f"core process pid {info['pid']}",
                    f", {args.api_server_count} API processes" if args.api_server_count > 1 else "")
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then re-raises the signal with the handlers found at
    # start: these make that a clean exit (0 for SIGTERM, 130 for Ctrl-C) instead of a kill or a traceback.
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
    try:
        server.run(sockets=[sock])
    finally:
        if aeng._thread is None:            # the app never started: still stop the ranks (or the core)
            aeng.stop() if not args.engine_in_process else engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
