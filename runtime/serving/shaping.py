"""The OpenAI-shaped parts of a reply (app.py's endpoints assemble them): completion and chat logprobs, an echoed
prompt and its logprobs, vLLM's prompt_logprobs field, usage, Server-Sent Event lines."""
from __future__ import annotations

import json
import re
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


def _byte_level_map() -> dict:
    """Byte-level BPE's printable stand-in character of each byte (GPT-2's bytes_to_unicode), inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_level_map()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer, tid: int, text: str) -> list:
    """OpenAI's logprobs `bytes` of one token: its own UTF-8 bytes, so that the tokens of a character split over
    several join into it. A token whose text is whole is that text's bytes; one that holds part of a character
    (its text reads U+FFFD) is read from the vocabulary: a byte-fallback piece (<0xE9>) or a byte-level BPE piece
    (one stand-in character per byte); else (no tokenizer, another vocabulary) the text's bytes."""
    if "\ufffd" in text and tokenizer is not None:
        try:
            piece = tokenizer.convert_ids_to_tokens(int(tid))
        except Exception:
            piece = None
        if isinstance(piece, str) and piece:
            m = _BYTE_TOKEN.fullmatch(piece)
            if m:
                return [int(m.group(1), 16)]
            if all(ch in _BYTE_OF for ch in piece):
                return [_BYTE_OF[ch] for ch in piece]
    return list(text.encode("utf-8", "replace"))


def chat_logprobs(c, n_top: int, tokenizer=None) -> Optional[dict]:
    """A chat choice's logprobs (OpenAI's shape); `tokenizer`: where a split character's tokens get their own
    bytes (token_bytes)."""
    if c.logprobs is None:
        return None
    content = []
    for tid, entry in zip(c.token_ids, c.logprobs):
        lp = entry.get(tid)
        tok = lp.decoded_token or ""
        tops = sorted(((v.rank, t, v) for t, v in entry.items() if v.rank <= n_top), key=lambda x: x[0])
        content.append({"token": tok, "logprob": lp.logprob, "bytes": token_bytes(tokenizer, tid, tok),
                        "top_logprobs": [{"token": v.decoded_token or "", "logprob": v.logprob,
                                          "bytes": token_bytes(tokenizer, t, v.decoded_token or "")}
                                         for _, t, v in tops[:n_top]]})
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
