"""Regexes the grammar backend (xgrammar 0.2.x) would serve wrongly or compile for minutes, found before a compile.

- xgrammar builds a JSON schema's `pattern` into an automaton that unrolls every counted repetition: the work grows
  with the square of the unrolled size (`^[a-z]{0,2000}$` 0.25 s, `^[a-z]{0,30000}[0-9]{0,30000}$` six minutes,
  and no compile can be interrupted). `expanded_size` counts the unrolled size (nested counts multiply);
  above MAX_EXPANDED a regex, a pattern or a string's minLength / maxLength (written as a pattern) is refused.
- In a schema's `pattern` xgrammar drops what its regex parser refuses in `structured_outputs.regex`
  (lookaheads, inline flags such as (?i), ...: the output could break the pattern). Each pattern is parsed as a
  regex first (`Grammar.from_regex`, no tokenizer work), so the schema path refuses what the regex path does."""
from __future__ import annotations

import re
from typing import Any, Iterator

MAX_EXPANDED = 4096
MAX_DEPTH = 128                   # nesting of a JSON schema value (objects and arrays)
_COUNT = re.compile(r"\{(\d*)(,(\d*))?\}")


def expanded_size(rx: str) -> int:
    """The number of atoms of `rx` once every counted repetition {m,n} is unrolled (its bound: n, else m)."""
    frames: list = []
    total = last = 0
    i, n = 0, len(rx)
    while i < n:
        ch = rx[i]
        if ch == "\\":
            i, atom = i + 2, 1
        elif ch == "[":
            j = i + 1
            if j < n and rx[j] == "^":
                j += 1
            if j < n and rx[j] == "]":
                j += 1
            while j < n and rx[j] != "]":
                j += 2 if rx[j] == "\\" else 1
            i, atom = j + 1, 1
        elif ch == "(":
            frames.append((total, last))
            total = last = 0
            i += 1
            continue
        elif ch == ")":
            group = total
            total, last = frames.pop() if frames else (0, 0)
            total += group
            last = group
            i += 1
            continue
        elif ch == "{":
            m = _COUNT.match(rx, i)
            if m and (m.group(1) or m.group(3)):
                bound = int(m.group(3)) if m.group(3) else int(m.group(1) or 0)
                total += last * (max(bound, 1) - 1)
                last *= max(bound, 1)
                i = m.end()
                continue
            i, atom = i + 1, 1
        elif ch in "|*+?^$":
            i += 1
            if ch == "|":
                last = 0
            continue
        else:
            i, atom = i + 1, 1
        total += atom
        last = atom
    while frames:
        group = total
        total, _ = frames.pop()
        total += group
    return total


def size_problem(rx: str, what: str) -> str:
    """Why `rx` is refused for its size ('' if it is not)."""
    size = expanded_size(rx)
    if size <= MAX_EXPANDED:
        return ""
    return (f"{what} unrolls to {size} characters of repetitions (counted repetitions such as {{0,N}} multiply); "
            f"at most {MAX_EXPANDED} are served: the grammar's compile time grows with the square of it")


def depth(value: Any) -> int:
    """The nesting depth of a JSON value (1: a scalar or an empty container), without recursion."""
    best, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        best = max(best, d)
        if d > MAX_DEPTH:
            return d
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return best


def schema_patterns(node: Any, path: str = "") -> Iterator[tuple]:
    """(JSON pointer, keyword, regex or a string's length bound) of every pattern, patternProperties key and
    minLength / maxLength in a schema."""
    stack = [(node, path)]
    while stack:
        s, p = stack.pop()
        if isinstance(s, list):
            stack.extend((x, f"{p}/{i}") for i, x in enumerate(s))
            continue
        if not isinstance(s, dict):
            continue
        for key, v in s.items():
            at = f"{p}/{str(key).replace('~', '~0').replace('/', '~1')}"
            if key == "pattern" and isinstance(v, str):
                yield at, key, v
            elif key in ("minLength", "maxLength") and isinstance(v, int) and not isinstance(v, bool):
                yield at, key, v
            elif key == "patternProperties" and isinstance(v, dict):
                for rx, sub in v.items():
                    yield f"{at}/{rx}", key, rx
                    stack.append((sub, f"{at}/{rx}"))
                continue
            if key not in ("enum", "const", "default", "examples") and isinstance(v, (dict, list)):
                stack.append((v, at))


def schema_regex_problems(schema: Any, parse) -> list:
    """What in `schema`'s regexes the grammar would drop or take minutes over; `parse(rx)` raises on a regex the
    backend's regex parser refuses."""
    out = []
    for at, key, v in schema_patterns(schema):
        if key in ("minLength", "maxLength"):
            if v > MAX_EXPANDED:
                out.append(f"'{key}' at {at}: {v} is above {MAX_EXPANDED}, the longest bounded string served (the "
                           "grammar's compile time grows with the square of it)")
            continue
        try:
            parse(v)
        except Exception as e:           # xgrammar's parser: its message says where
            from xllm_gen.runtime.engine.structured_outputs import _reason
            out.append(f"'{key}' at {at}: the regex {v!r} uses a feature the grammar backend does not support (it "
                       f"would be ignored, as a lookahead is): {_reason(e)}")
            continue
        problem = size_problem(v, f"the regex {v[:60]!r}{'...' if len(v) > 60 else ''}")
        if problem:
            out.append(f"'{key}' at {at}: {problem}")
    return out
