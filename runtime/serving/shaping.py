"""The OpenAI-shaped parts of a reply (app.py's endpoints assemble them): completion and chat logprobs, an echoed
prompt and its logprobs, vLLM's prompt_logprobs field, usage, Server-Sent Event lines."""
from __future__ import annotations

import json
from typing import Any, NamedTuple, Optional


def _top_by_text(entry) -> dict:
    """A completions top_logprobs entry: {token text: logprob}. Distinct ids can decode alike (each byte token of
    a split character reads "\ufffd"): the text keeps the likeliest, so the sampled token's entry holds at least
    its own logprob and the top ones stay the top ones."""
    out: dict = {}
    for v in sorted(entry.values(), key=lambda v: v.rank):
        out.setdefault(v.decoded_token or "", v.logprob)
    return out


def completion_logprobs(c, engine, text_offset: int) -> Optional[dict]:
    if c.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset
    for tid, entry in zip(c.token_ids, c.logprobs):
        lp = entry.get(tid)
        s = lp.decoded_token if lp and lp.decoded_token is not None else engine.decode_text([tid])
        tokens.append(s)
        token_lps.append(lp.logprob if lp else None)
        tops.append(_top_by_text(entry))
        offsets.append(off)
        off += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


class Collected(NamedTuple):
    """A request's accumulated output (non-streaming)."""
    prompt_ids: list
    comps: list
    prompt_logprobs: Optional[list]     # None for the first prompt token (each: {token id: Logprob})
    prompt_text: Optional[str]          # the prompt as given (None: given as token ids)


def prompt_logprobs(entries) -> Optional[list]:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
                                    for t, v in e.items()} for e in entries]


def echoed_logprobs(prompt_ids: list, entries, engine) -> dict:
    """The completions `logprobs` of the echoed prompt tokens (the first one has none, as in OpenAI's API)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    off = 0
    for i, tid in enumerate(prompt_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        lp = entry.get(tid) if entry else None
        s = lp.decoded_token if lp and lp.decoded_token is not None else engine.decode_text([tid])
        tokens.append(s)
        token_lps.append(lp.logprob if lp else None)
        tops.append(_top_by_text(entry) if entry else None)
        offsets.append(off)
        off += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def completion_choice(body, got: Collected, c, engine, index: int, prompt_only: bool = False) -> dict:
    """One /v1/completions choice: the generated text (after the prompt with `echo`; only the prompt with
    `echo` and max_tokens 0, or `prompt_only`: a stream's first chunk), its logprobs, the prompt logprobs when
    asked for."""
    prefix, lps = "", None
    if body.echo:
        prefix = got.prompt_text if got.prompt_text is not None else engine.decode_text(list(got.prompt_ids))
        if body.logprobs is not None:
            lps = echoed_logprobs(list(got.prompt_ids), got.prompt_logprobs, engine)
    gen = prompt_only or body.echo_only
    text = prefix + ("" if gen else c.text)
    own = None if gen else completion_logprobs(c, engine, len(prefix))
    if lps is None:
        lps = own
    elif own is not None:
        lps = {k: lps[k] + own[k] for k in lps}
    choice = {"index": index, "text": text, "logprobs": lps,
              "finish_reason": None if prompt_only else "length" if body.echo_only else c.finish_reason,
              "stop_reason": None if gen else c.stop_reason}
    if body.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs(got.prompt_logprobs)
    return choice


def chat_logprobs(c, n_top: int) -> Optional[dict]:
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


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def system_fingerprint(model_name: str) -> str:
    """OpenAI's system_fingerprint: the serving configuration (this package's version and the served model)."""
    import hashlib

    try:
        from importlib.metadata import version
        v = version("xllm-gen")
    except Exception:
        v = "unknown"
    return f"fp_xllm-gen-{v}-{hashlib.sha256(model_name.encode()).hexdigest()[:8]}"
