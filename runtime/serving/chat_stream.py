"""A streamed chat completion (Server-Sent Events in OpenAI's chunk format): a role chunk per choice, then each
step's deltas split into reasoning_content / content / tool_calls (chat_reply.ReplySplitter), the finish reason
("tool_calls" when calls were made and the reply ended on its own, "length" when it was cut short), then the usage
chunk (stream_options.include_usage) and `data: [DONE]`. stream_options.continuous_usage_stats: every chunk carries
the usage so far (vLLM's), the role chunks then wait for the prompt's token count."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from xllm_gen.runtime.serving import shaping as S
from xllm_gen.runtime.serving.chat_reply import ReplySplitter, finish_reason
from xllm_gen.runtime.serving.protocol import APIError


@dataclass
class ChatStreamOptions:
    n: int = 1
    include_usage: bool = False
    continuous_usage: bool = False
    n_top: int = 0
    reasoning: Any = None
    parser: Any = None
    opened: bool = False
    include_reasoning: bool = True
    return_token_ids: bool = False
    tokenizer: Any = None               # logprobs' bytes of a split character's tokens (shaping.token_bytes)


async def stream_chat(head: dict, deltas: AsyncIterator, o: ChatStreamOptions,
                      abort: Callable[[], None]) -> AsyncIterator[str]:
    """The SSE lines of one chat request; `deltas`: its RequestOutputs until finished; `abort` frees it when the
    client goes away."""
    p_tok, c_tok = 0, 0
    finished = False
    state = {i: ReplySplitter(o.reasoning, o.parser, o.opened, o.include_reasoning) for i in range(o.n)}
    plain = o.reasoning is None and o.parser is None

    def usage_field() -> dict:
        if o.continuous_usage:
            return {"usage": S.usage(p_tok, c_tok)}
        return {"usage": None} if o.include_usage else {}

    def roles(prompt_ids: Optional[list]) -> list:
        out = []
        for i in range(o.n):
            choice: dict = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}
            chunk = {**head, "choices": [choice], **usage_field()}
            if o.return_token_ids and i == 0 and prompt_ids is not None:
                chunk["prompt_token_ids"] = list(prompt_ids)
            out.append(S.sse(chunk))
        return out

    try:
        sent_roles = not o.continuous_usage and not o.return_token_ids
        if sent_roles:
            for line in roles(None):
                yield line
        async for out in deltas:
            p_tok = len(out.prompt_token_ids)
            if not sent_roles:
                sent_roles = True
                for line in roles(out.prompt_token_ids):
                    yield line
            if out.prompt_logprobs is not None:      # once, before the choices' deltas
                yield S.sse({**head, "choices": [], "prompt_logprobs": S.prompt_logprobs(out.prompt_logprobs),
                             **usage_field()})
            for c in out.outputs:
                c_tok += len(c.token_ids)
                last = c.finish_reason is not None
                if plain:
                    delta = {"content": c.text} if (c.text or not last) else {}
                else:
                    delta = state[c.index].feed(c.text, last, c.finish_reason == "length")
                    if not delta and not last and not c.logprobs and not o.return_token_ids:
                        continue                  # held back (a tag may be starting)
                choice = {"index": c.index, "delta": delta, "logprobs": S.chat_logprobs(c, o.n_top, o.tokenizer),
                          "finish_reason": finish_reason(c.finish_reason, state[c.index].calls_sent > 0),
                          "stop_reason": c.stop_reason}
                if o.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                yield S.sse({**head, "choices": [choice], **usage_field()})
            if out.error:
                yield S.sse({"error": {"message": out.error, "type": "server_error", "code": 500}})
        finished = True
        if o.include_usage:
            yield S.sse({**head, "choices": [], "usage": S.usage(p_tok, c_tok)})
        yield "data: [DONE]\n\n"
    except APIError as e:
        finished = True
        yield S.sse(e.body())
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            abort()
