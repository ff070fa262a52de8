"""The OpenAI-compatible HTTP app (FastAPI) over an async engine: `build_app` and the response shaping it uses
(completions, chat completions with tools and reasoning, streaming as Server-Sent Events, /v1/models, /tokenize, /health,
/metrics). server.py is the `xllm-gen-serve` command that builds the engine and serves this app."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from xllm_gen.runtime.serving import shaping as S
from xllm_gen.runtime.serving.async_engine import QueueFullError
from xllm_gen.runtime.serving.chat import render_chat
from xllm_gen.runtime.serving.chat_reply import constrained_from_start, finish_reason, plan_tools, reply_message
from xllm_gen.runtime.serving.chat_stream import ChatStreamOptions, stream_chat
from xllm_gen.runtime.serving.grammar_pool import CompileTimeout, GrammarPool
from xllm_gen.runtime.serving.middleware import AuthAndLog
from xllm_gen.runtime.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    body_parse_error,
    param_of,
    validation_error,
)
from xllm_gen.runtime.serving.request_results import collect as collect_results
from xllm_gen.runtime.serving.request_results import results, unless_disconnected

logger = logging.getLogger("xllm_gen.serving")

# a text prompt longer than this many characters per context token is tokenized in the API process first (a worker
# thread) and refused there if it does not fit: the engine would tokenize it on its step loop (app.far_too_long)
PRECHECK_CHARS_PER_TOKEN = 8

# ------------------------------------------------------------------------------------ the app
def build_app(async_engine, model_name: str, metrics, *, tool_parser: Optional[str] = None,
              reasoning_parser: Optional[str] = None, chat_template: Optional[str] = None,
              allowed_local_media_path: Optional[str] = None, api_key: Optional[str] = None,
              allowed_origins: Optional[list] = None, log_requests: bool = True,
              grammar_timeout_s: Optional[float] = None):
    """The FastAPI app. `tool_parser` / `reasoning_parser`: names in runtime/serving/tool_parsers/ and
    reasoning_parsers/ (None: tool_choice auto / required / named are refused; no reasoning split);
    `chat_template`: the default template (Jinja text) instead of the checkpoint's; `grammar_timeout_s`: the
    limit of a constraint's compile (grammar_pool.py; default $XLLM_GRAMMAR_COMPILE_TIMEOUT_S or 30 s)."""
    from xllm_gen.runtime.serving import reasoning_parsers, tool_parsers

    engine = async_engine.engine
    tools_cls = tool_parsers.get(tool_parser) if tool_parser else None
    reasoning = reasoning_parsers.get(reasoning_parser)() if reasoning_parser else None
    grammars = GrammarPool(timeout_s=grammar_timeout_s)
    fingerprint = S.system_fingerprint(model_name)

    @asynccontextmanager
    async def lifespan(app):
        async_engine.start(asyncio.get_running_loop())
        yield
        await asyncio.to_thread(async_engine.stop)

    app = FastAPI(title="xllm-gen", lifespan=lifespan)
    app.state.async_engine = async_engine

    app.add_middleware(AuthAndLog, api_key=api_key, log_requests=log_requests)

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
                  "/v1/chat/completions, /tokenize, /detokenize, /health, /metrics)"
            return JSONResponse(APIError(msg, 404, type="not_found_error").body(), status_code=404)
        if exc.status_code == 400 and exc.__cause__ is not None:     # FastAPI could not read the body as JSON
            return error(body_parse_error(exc.__cause__))
        return JSONResponse(APIError(str(exc.detail), exc.status_code, type="invalid_request_error").body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    def error(e: APIError) -> JSONResponse:
        if metrics is not None:
            metrics.labels(metrics.rejected, reason=str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error(validation_error(exc.errors(), request.headers.get("content-type")))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error(exc)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        """A bug, not a bad request: a 500 in OpenAI's shape (uvicorn still logs the traceback)."""
        return error(APIError(f"internal server error ({type(exc).__name__}); see the server log", status=500,
                              type="server_error"))

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

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """The prompt's token ids as a completion (prompt) or chat (messages) request would be served with."""
        check_model(body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if engine.tokenizer is None:
            raise APIError("this model has no tokenizer", param="prompt")
        if body.messages is not None:
            check_template(body)
            rendered = await asyncio.to_thread(render_chat, engine, body.messages, body.chat_template or chat_template,
                                               body.add_generation_prompt, body.tools, body.chat_template_kwargs,
                                               allowed_local_media_path)
            text, special = rendered["prompt"], bool(body.add_special_tokens)
        else:
            text, special = body.prompt, body.add_special_tokens is not False
        ids = engine.tokenizer.encode(text, add_special_tokens=special) if text else []
        reply = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if body.return_token_strs:
            reply["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
        return reply

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body)
        if engine.tokenizer is None:
            raise APIError("this model has no tokenizer", param="tokens")
        bad = next((t for t in body.tokens if not 0 <= t < engine.vocab_size), None)
        if bad is not None:
            raise APIError(f"tokens: token id {bad} out of vocabulary (size {engine.vocab_size})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def prom():
        from prometheus_client import CONTENT_TYPE_LATEST
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def check_model(body) -> None:
        if body.model not in (None, model_name, str(engine.model_dir)):
            raise APIError(f"model {body.model!r} does not exist; this server serves {model_name!r}",
                           status=404, param="model", type="not_found_error")

    def check_template(body) -> None:
        """A chat_template sent in the body that does not compile is a 400 naming it (not a render error of the
        messages)."""
        if body.chat_template is not None:
            from xllm_gen.runtime.engine.chat_template import template_problem
            problem = template_problem(body.chat_template)
            if problem:
                raise APIError(f"chat_template does not compile: {problem}", param="chat_template")

    async def precompile(params, where: str, param: str) -> None:
        """Compiles the request's constraint in a worker thread (cached), so that the engine's step never
        waits on a compile and an invalid schema / regex / grammar is a 400 naming it. `where`: the body field
        that holds the constraint; where it is not `param` itself (response_format.json_schema.schema), the
        compiler's "<param>.<kind>" (it names structured_outputs' own fields) becomes it."""
        so = params.structured_outputs
        if so is None:
            return
        try:
            await grammars.compile(engine.structured, so, param if where.startswith(param + ".") else where)
        except ValueError as e:
            msg, own = str(e), f"{param}.{so.kind}"
            if where.startswith(param + ".") and msg.startswith(own):
                msg = where + msg[len(own):]
            raise APIError(msg, param=param) from None
        except CompileTimeout as e:
            raise (APIError(str(e), param=param) if e.started else
                   APIError(str(e), status=503, type="server_overloaded")) from None
        except RecursionError:
            raise APIError(f"{where}: the constraint is nested too deeply to compile", param=param) from None

    async def admit(rid: str, prompt: Any, params, name: Optional[str] = None) -> asyncio.Queue:
        """`name`: the prompt's place in the body (prompt[1]; "messages" for a chat), which an error about the
        prompt names (never the engine's own prompt_token_ids)."""
        try:
            return await async_engine.add(rid, prompt, params)
        except QueueFullError as e:
            raise APIError(str(e), status=503, type="server_overloaded") from None
        except ValueError as e:
            raise refusal(str(e).replace(f"request {rid}: ", ""), name) from None
        except RuntimeError as e:
            raise APIError(str(e), status=503, type="server_error") from None

    def refusal(msg: str, name: Optional[str]) -> APIError:
        """The 400 of an admission error `msg` about the prompt named `name` (see admit)."""
        param = param_of(msg) or "prompt"
        if param == "prompt" and name == "messages":
            param, msg = "messages", f"messages: the conversation, rendered by the chat template: {msg}"
        elif param == "prompt" and (name is not None or msg.startswith("prompt_token_ids: ")):
            msg = f"{name or 'prompt'}: {msg.removeprefix('prompt_token_ids: ')}"
        return APIError(msg, param=param)

    async def far_too_long(prompt: Any) -> Optional[str]:
        """The engine's refusal of a text prompt longer than PRECHECK_CHARS_PER_TOKEN characters a context token,
        found by tokenizing it here, in a worker thread: the engine tokenizes what it admits on its step loop, where
        a multi-megabyte prompt would stall every other request's steps for seconds. None when the prompt is not
        such a text, or fits (the engine then admits it as any other)."""
        text = prompt.get("prompt") if isinstance(prompt, dict) and not prompt.get("multi_modal_data") else None
        limit, tok = engine.max_model_len, engine.tokenizer
        if not isinstance(text, str) or tok is None or len(text) <= PRECHECK_CHARS_PER_TOKEN * limit:
            return None
        try:
            n = len(await asyncio.to_thread(tok.encode, text, add_special_tokens=prompt.get("add_special_tokens", True)))
        except Exception:                # the engine's admission names what is wrong with it
            return None
        if n < limit:
            return None
        return f"prompt of {n} tokens does not fit the model's context of {limit} tokens (max_model_len)"

    async def admit_all(base: str, prompts: list, params, batched: bool = False, body=None,
                        field: Optional[str] = None) -> list:
        """`batched`: the body's prompt is a list of prompts (errors name the index). `body`: where max_tokens was
        set explicitly, each prompt plus it must fit the context (a 400 naming the field, as vLLM's). `field`: the
        body field an unbatched prompt's error names (a chat's "messages")."""
        if body is not None and body._max_tokens() is not None:
            prompts = [{**p, "max_tokens_must_fit": body._max_tokens_field()} for p in prompts]
        for i, p in enumerate(prompts):           # before any is admitted: a refused batch admits none
            msg = await far_too_long(p)
            if msg is not None:
                raise refusal(msg, f"prompt[{i}]" if batched else field)
        queues = []
        try:
            for i, p in enumerate(prompts):
                queues.append((f"{base}-{i}", await admit(f"{base}-{i}", p, params,
                                                          f"prompt[{i}]" if batched else field)))
        except BaseException:
            for rid, _ in queues:
                async_engine.abort(rid)
            raise
        return queues

    # ---- /v1/completions ------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        prompts = body.prompts()
        limit = getattr(async_engine, "max_active", None)
        if limit is not None and len(prompts) > limit:      # never admitted whole: a 503 "retry later" would lie
            raise APIError(f"prompt: {len(prompts)} prompts in one request, more than this server admits at once "
                           f"({limit}: --max-num-seqs plus --max-queue); send them in smaller batches",
                           param="prompt")
        params = body.sampling_params(engine.max_model_len, getattr(engine, "default_sampling", None))
        await precompile(params, *body.structured_where())
        base = f"cmpl-{body.request_id or uuid.uuid4().hex}"          # vLLM's id of a request_id
        created = int(time.time())
        queues = await admit_all(f"{base}-{uuid.uuid4().hex[:8]}" if body.request_id else base, prompts, params,
                                 body.batched, body)
        n = params.n
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
            return StreamingResponse(stream_completions(base, created, queues, n, include_usage, body, continuous),
                                     media_type="text/event-stream")
        async def collect_all():
            return [await collect_results(async_engine, rid, q) for rid, q in queues]

        collected = None
        try:
            collected = await unless_disconnected(request, collect_all())
        finally:                              # the others of a failed, cancelled or abandoned request too
            if collected is None:
                for r, _ in queues:
                    async_engine.abort(r)
        if collected is None:
            return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
        choices, p_tok, c_tok = [], 0, 0
        for k, got in enumerate(collected):
            p_tok += len(got.prompt_ids)
            for c in got.comps:
                choice = S.completion_choice(body, got, c, engine, k * n + c.index)
                if body.return_token_ids:            # vLLM's: the ids served, per choice
                    choice.update(prompt_token_ids=list(got.prompt_ids), token_ids=list(c.token_ids))
                c_tok += 0 if body.echo_only else len(c.token_ids)
                choices.append(choice)
        return {"id": base, "object": "text_completion", "created": created, "model": model_name,
                "system_fingerprint": fingerprint, "choices": choices, "usage": S.usage(p_tok, c_tok)}

    async def stream_completions(base, created, queues, n, include_usage, body,
                                 continuous: bool = False) -> AsyncIterator[str]:
        p_tok, c_tok = 0, 0
        offsets: dict = {}
        live = {rid for rid, _ in queues}
        head = {"id": base, "object": "text_completion", "created": created, "model": model_name,
                "system_fingerprint": fingerprint}

        seen: set = set()

        def first_chunk(rid, index) -> bool:
            if (rid, index) in seen:
                return False
            seen.add((rid, index))
            return True

        def usage_field() -> dict:       # continuous_usage_stats: the usage so far in every chunk (vLLM's)
            return {"usage": S.usage(p_tok, c_tok)} if continuous else {"usage": None} if include_usage else {}

        try:
            for k, (rid, q) in enumerate(queues):
                async for out in results(rid, q):
                    if not out.outputs and not out.finished:
                        continue
                    if out.prompt_token_ids and rid not in offsets:
                        offsets[rid] = {}
                        p_tok += len(out.prompt_token_ids)
                    for c in out.outputs:
                        off = offsets[rid].get(c.index)
                        if off is None:     # a choice's first chunk: the echoed prompt, the prompt logprobs
                            first = S.completion_choice(body, S.Collected(out.prompt_token_ids, [], out.prompt_logprobs,
                                                                       out.prompt), c, engine, k * n + c.index,
                                                       prompt_only=True)
                            off = len(first["text"])
                            if body.echo or "prompt_logprobs" in first:
                                yield S.sse({**head, "choices": [first], **usage_field()})
                        text, lps = ("", None) if body.echo_only else (c.text, S.completion_logprobs(c, engine, off))
                        c_tok += 0 if body.echo_only else len(c.token_ids)
                        offsets[rid][c.index] = off + len(text)
                        if body.echo_only and c.finish_reason is None:
                            continue
                        ids = {"token_ids": list(c.token_ids)} if body.return_token_ids else {}
                        if ids and first_chunk(rid, c.index):
                            ids["prompt_token_ids"] = list(out.prompt_token_ids)
                        chunk = {**head, "choices": [{**ids, "index": k * n + c.index, "text": text, "logprobs": lps,
                                                      "finish_reason": "length" if body.echo_only else c.finish_reason,
                                                      "stop_reason": None if body.echo_only else c.stop_reason}],
                                 **usage_field()}
                        yield S.sse(chunk)
                    if out.error:
                        yield S.sse({"error": {"message": out.error, "type": "server_error", "code": 500}})
                live.discard(rid)
            if include_usage:
                yield S.sse({**head, "choices": [], "usage": S.usage(p_tok, c_tok)})
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield S.sse(e.body())
            yield "data: [DONE]\n\n"
        finally:                              # client gone (cancelled) or finished: free what is left
            for rid in live:
                async_engine.abort(rid)

    # ---- /v1/chat/completions -------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body)
        body.check_supported()
        check_template(body)
        params = body.sampling_params(engine.max_model_len, getattr(engine, "default_sampling", None))
        template_tools, parser = plan_tools(body, params, tools_cls)
        where, param = body.structured_where()
        if parser is not None and params.structured_outputs is not None and body.tool_choice not in (None, "auto"):
            where, param = "tools", "tools"
        so = params.structured_outputs
        if reasoning is not None and so is not None and so.reasoning_tags is None:   # the constraint follows the
            so.reasoning_tags = (reasoning.start, reasoning.end)                       # reasoning, as vLLM's
        await precompile(params, where, param)
        kwargs = dict(body.chat_template_kwargs or {})
        if body.reasoning_effort is not None:           # vLLM's: a template variable
            kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        prompt = await asyncio.to_thread(render_chat, engine, body.messages, body.chat_template or chat_template,
                                         bool(body.add_generation_prompt), template_tools, kwargs,
                                         allowed_local_media_path, bool(body.continue_final_message))
        prompt["add_special_tokens"] = bool(body.add_special_tokens)
        base = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
        created = int(time.time())
        rid, q = (await admit_all(base if body.request_id is None else f"{base}-{uuid.uuid4().hex[:8]}",
                                  [prompt], params, body=body, field="messages"))[0]
        reader = reasoning
        opened = reader is not None and reader.opened_by(prompt.get("prompt"))       # the template opened it
        if opened and constrained_from_start(engine, so):    # no room to reason: reasoning only if it writes the end
            opened = "maybe"
        keep_reasoning = body.include_reasoning is not False
        if body.stream:
            so_ = body.stream_options
            opts = ChatStreamOptions(params.n, bool(so_ and so_.include_usage), bool(so_ and so_.continuous_usage_stats),
                                     body.top_logprobs or 0, reader, parser, opened, keep_reasoning,
                                     bool(body.return_token_ids), engine.tokenizer)
            head = {"id": base, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "system_fingerprint": fingerprint}
            return StreamingResponse(stream_chat(head, results(rid, q), opts, lambda: async_engine.abort(rid)),
                                     media_type="text/event-stream")
        got = await unless_disconnected(request, collect_results(async_engine, rid, q))
        if got is None:
            return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
        prompt_ids, comps = got.prompt_ids, got.comps
        choices = []
        for c in comps:
            message = reply_message(c.text, reader, parser, opened, c.finish_reason == "length", keep_reasoning)
            choice = {"index": c.index, "message": message,
                      "logprobs": S.chat_logprobs(c, body.top_logprobs or 0, engine.tokenizer),
                      "finish_reason": finish_reason(c.finish_reason, bool(message.get("tool_calls"))),
                      "stop_reason": c.stop_reason}
            if body.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        reply = {"id": base, "object": "chat.completion", "created": created, "model": model_name,
                 "system_fingerprint": fingerprint, "choices": choices,
                 "usage": S.usage(len(prompt_ids), sum(len(c.token_ids) for c in comps))}
        if body.return_token_ids:
            reply["prompt_token_ids"] = list(prompt_ids)
        if params.prompt_logprobs is not None:
            reply["prompt_logprobs"] = S.prompt_logprobs(got.prompt_logprobs)
        return reply

    return app


# ------------------------------------------------------------------------------------ command line
# engine._DTYPES's names (written out: --help must not import torch; tests/test_serving_hardening.py checks it)
