"""Reasoning parsers: split a model's thinking from its answer, chosen with `--reasoning-parser NAME`.

`extract(text)` -> (reasoning or None, content or None) for a finished output; `streamer()` gives an object
whose `feed(delta)` / `finish()` return (reasoning delta, content delta). Adding one: a file here with a
subclass decorated `@register("name")`, and its module in `_BUILTIN`. Parsers are named by their output
format; the names of model families that use a format are aliases kept outside the runtime
(xllm_gen/parser_aliases.py)."""
from __future__ import annotations

from typing import Optional

from xllm_gen.runtime.serving.parser_registry import ParserRegistry

_REGISTRY = ParserRegistry("reasoning parser", {"think": "xllm_gen.runtime.serving.reasoning_parsers.think"}, "REASONING_PARSERS")
register, names, get = _REGISTRY.register, _REGISTRY.names, _REGISTRY.get


class ThinkTagParser:
    """Reasoning written as START ... END at the start of the output (leading whitespace allowed); without
    START the whole output is content; an output that ends before END is all reasoning. `opened`: the prompt
    already ends with START (a chat template that opens the thinking itself), so the output starts inside the
    reasoning and only END closes it (`opened_by(prompt)` says so). `opened="maybe"`: the prompt opened it but a
    constraint held from the reply's first token, so the reply is reasoning only if it writes END (held back until
    END or the end; without END it is all content: the constrained answer)."""
    start = "<think>"
    end = "</think>"

    def opened_by(self, prompt) -> bool:
        """Whether a rendered prompt leaves the reply inside the reasoning (it ends with START)."""
        return isinstance(prompt, str) and prompt.rstrip().endswith(self.start)

    def extract(self, text: str, opened: bool = False) -> tuple[Optional[str], Optional[str]]:
        s = self.streamer(opened)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        r, c = r1 + r2, c1 + c2
        return (r if s.saw_start else None), (c or None)

    def streamer(self, opened: bool = False) -> "_ThinkStream":
        return _ThinkStream(self, opened)


class _ThinkStream:
    def __init__(self, p: ThinkTagParser, opened: bool = False):
        self.p = p
        self.buf = ""
        # "undecided" -> "reasoning" -> "content", or "content" at once; a prompt that opened START: "reasoning";
        # "maybe" -> "content" (END seen: what came before it was the reasoning), or all content at the end
        self.state = "maybe" if opened == "maybe" else "reasoning" if opened else "undecided"
        self.saw_start = opened is True
        self.opened = opened

    def feed(self, delta: str) -> tuple[str, str]:
        p = self.p
        self.buf += delta
        r = c = ""
        if self.state == "maybe":
            j = self.buf.find(p.end)
            if j < 0:
                return r, c
            self.saw_start = True
            r, self.buf, self.state = self.buf[:j], self.buf[j + len(p.end):], "content"
        if self.state == "undecided":
            head = self.buf.lstrip()
            if head.startswith(p.start):
                self.state, self.saw_start = "reasoning", True
                self.buf = head[len(p.start):]
            elif p.start.startswith(head):
                return r, c                  # may still become <think>
            else:
                self.state = "content"
        if self.state == "reasoning":
            j = self.buf.find(p.end)
            if j >= 0:
                r, self.buf, self.state = self.buf[:j], self.buf[j + len(p.end):], "content"
            else:
                k = 0
                for n in range(min(len(self.buf), len(p.end) - 1), 0, -1):
                    if p.end.startswith(self.buf[-n:]):
                        k = n
                        break
                r, self.buf = self.buf[:len(self.buf) - k], self.buf[len(self.buf) - k:]
                return r, c
        if self.state == "content":
            c, self.buf = self.buf, ""
        return r, c

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest
