"""Structured outputs (constrained decoding) with xgrammar, as vLLM's `structured_outputs`.

A request's `SamplingParams.structured_outputs` names exactly one constraint: a JSON schema (`json`), any JSON
object (`json_object`), a regular expression (`regex`), one of several strings (`choice`) or a context-free
grammar in EBNF (`grammar`, xgrammar's / GBNF's dialect). The backend compiles it once per distinct
constraint (an LRU cache, thread-safe: the server compiles in a worker thread before admission, so a step
never waits on a compile and a bad grammar is a 400 before the request is queued). Each sequence then owns a
GrammarMatcher (its position in the grammar). Every step the sampler fills the token bitmask of the
constrained rows on the host (while the device runs the step), applies it to those rows' logits only
(xgrammar's kernel on CUDA, its CPU routine otherwise) and advances each matcher with the token drawn. Rows
without a constraint in the same batch are untouched. Once the grammar is complete only EOS is allowed.

What the grammar cannot hold is refused at compile (a 400 / ValueError before admission), never served as output
that breaks it: a JSON schema keyword xgrammar would ignore (engine/schema_support.py), and a grammar that allows no
first token (it matches nothing this tokenizer can write: an empty character class, `root ::= root`). A grammar that
reaches such a dead end later ends that request alone with an error (GrammarBackend.apply reports the row)
instead of sampling from an all -inf row.

Under async decode (engine/async_decode.py) a greedy constrained row's step is launched before the previous
token is read; its mask is filled only after that token is accepted by the matcher (AsyncDecode.finish_masked),
so the mask always matches the row's real state.

`reasoning_tags` (start, end): the constraint applies after the reply's reasoning, as vLLM's structured outputs
with a reasoning parser (the server sets them from --reasoning-parser): the first token may open the reasoning
(the start tag) or begin the constrained text; a reasoning (opened there or left open by the prompt) runs free
until the end tag, and the constraint holds from the next token (ReasoningGate). Each tag must be one token of the
tokenizer (a model's <think> / </think> are); where it is not, the constraint holds from the first token."""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from xllm_gen.runtime.engine.regex_limits import MAX_DEPTH, depth, schema_regex_problems, size_problem
from xllm_gen.runtime.engine.schema_support import unenforced

KINDS = ("json", "regex", "choice", "grammar", "json_object")
_XGR_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


class GrammarError(ValueError):
    """An invalid schema / regex / grammar; the message names the field and xgrammar's reason."""


@dataclass
class StructuredOutputsParams:
    json: Optional[Union[str, dict]] = None     # a JSON schema (dict or its JSON text)
    regex: Optional[str] = None
    choice: Optional[list] = None               # the output is exactly one of these strings
    grammar: Optional[str] = None               # EBNF (root ::= ...)
    json_object: Optional[bool] = None          # any JSON object
    disable_any_whitespace: bool = True         # compact JSON (xgrammar's separators ", " and ": ")
    reasoning_tags: Optional[Union[list, tuple]] = None     # (start, end): the constraint follows the reasoning

    @classmethod
    def from_dict(cls, d: Any, where: str = "structured_outputs") -> "StructuredOutputsParams":
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be an object with one of {', '.join(KINDS)}, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    @property
    def kind(self) -> Optional[str]:
        set_ = self._set()
        return set_[0] if len(set_) == 1 else None

    def _set(self) -> list[str]:
        return [k for k in KINDS if getattr(self, k) not in (None, False)]

    def problems(self, where: str = "structured_outputs") -> list[str]:
        p = []
        set_ = self._set()
        if len(set_) != 1:
            p.append(f"{where} must set exactly one of {', '.join(KINDS)}, got "
                     f"{', '.join(set_) if set_ else 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            p.append(f"{where}.json must be a JSON schema (an object or its JSON text)")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                p.append(f"{where}.{k} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            p.append(f"{where}.choice must be a non-empty list of non-empty strings")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            p.append(f"{where}.json_object must be a bool")
        if not isinstance(self.disable_any_whitespace, bool):
            p.append(f"{where}.disable_any_whitespace must be a bool")
        tags = self.reasoning_tags
        if tags is not None and not (isinstance(tags, (list, tuple)) and len(tags) == 2
                                     and all(isinstance(t, str) and t for t in tags)):
            p.append(f"{where}.reasoning_tags must be two non-empty strings (start, end)")
        return p

    def key(self) -> tuple:
        """A hashable identity of the constraint (the compile cache's key)."""
        kind = self.kind
        v = getattr(self, kind)
        if kind == "json" and isinstance(v, dict):
            v = json.dumps(v, sort_keys=True)
        elif kind == "choice":
            v = tuple(v)
        return kind, v, self.disable_any_whitespace


def dead_end_error(num_tokens: int) -> str:
    """The error of a request whose grammar allows no next token (GrammarBackend.apply's dead rows)."""
    return (f"structured outputs: the grammar allows no next token after {num_tokens} generated token(s): no "
            "continuation this tokenizer can write completes it")


def _reason(e: Exception) -> str:
    lines = [_XGR_PREFIX.sub("", ln) for ln in str(e).strip().splitlines() if ln.strip()]
    return " ".join(lines) or type(e).__name__


class GrammarBackend:
    """Compiles constraints for one tokenizer / vocabulary and makes the per-sequence matchers."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, cache_size: int = 256):
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=self.stop_token_ids or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=4, cache_enabled=False)
        self._cache: OrderedDict = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.bitmask_words = xgr.get_bitmask_shape(1, self.info.vocab_size)[1]
        self._host: dict = {}           # (rows, turn) -> pinned host bitmask buffer (two per size, alternating:
        self._turn = 0                  # a buffer is refilled only after the copy from it was waited on)
        self._batch = None              # xgrammar BatchGrammarMatcher: fills many rows' masks on several threads

    # ---- compile (cached) -----------------------------------------------------------------------
    def compile(self, so: StructuredOutputsParams, where: str = "structured_outputs"):
        """The compiled grammar of `so`; GrammarError naming `where`.kind and the reason when it is invalid."""
        problems = so.problems(where)
        if problems:
            raise GrammarError("; ".join(problems))
        key = so.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        compiled = self._compile(so, where)         # outside the lock: compiles run in parallel
        self._check_first_token(compiled, so, where)
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, so: StructuredOutputsParams, where: str):
        kind = so.kind
        c = self.compiler
        ws = not so.disable_any_whitespace
        try:
            if kind == "json":
                schema = so.json
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except json.JSONDecodeError as e:
                        raise GrammarError(f"{where}.json: the schema is not valid JSON ({e})") from None
                if not isinstance(schema, (dict, bool)):
                    raise GrammarError(f"{where}.json: a JSON schema is an object, got {type(schema).__name__}")
                _check_schema(schema, f"{where}.json")
                problems = unenforced(schema)
                if problems:
                    raise GrammarError(f"{where}.json: JSON schema keyword(s) the grammar backend does not enforce "
                                       f"(the output could break them): {'; '.join(problems)}")
                problems = schema_regex_problems(schema, self.xgr.Grammar.from_regex)
                if problems:
                    raise GrammarError(f"{where}.json: {'; '.join(problems)}")
                return c.compile_json_schema(json.dumps(bounded_strings(schema)), any_whitespace=ws, strict_mode=True)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=ws)
            if kind == "regex":
                problem = size_problem(so.regex, f"{where}.regex")
                if problem:
                    raise GrammarError(problem)
                return c.compile_regex(so.regex)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False)
                                                                   for s in so.choice))
            return c.compile_grammar(so.grammar)
        except GrammarError:
            raise
        except Exception as e:      # xgrammar's RuntimeError / ValueError: say what was wrong
            what = {"json": "invalid JSON schema", "json_object": "invalid JSON object grammar",
                    "regex": "invalid regex", "choice": "invalid choice", "grammar": "invalid EBNF grammar"}[kind]
            raise GrammarError(f"{where}.{kind}: {what}: {_reason(e)}") from None

    def _check_first_token(self, compiled, so: StructuredOutputsParams, where: str) -> None:
        """A grammar whose first mask is empty (it cannot start, nor end at once) would fail at the first sampling
        step: refused here, once per compile."""
        import torch

        mask = torch.zeros((1, self.bitmask_words), dtype=torch.int32)
        self.xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids or None
                                ).fill_next_token_bitmask(mask, 0)
        if not bool(mask.any()):
            raise GrammarError(f"{where}.{so.kind}: the grammar accepts no token at the start: it matches no text "
                               "this tokenizer can write")

    # ---- per step ---------------------------------------------------------------------------------
    def matcher(self, compiled, gate: Optional[tuple] = None):
        """A sequence's matcher; `gate` (start token id, end token id, reasoning open at the prompt's end): the
        matcher behind a ReasoningGate."""
        m = self.xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids or None)
        return m if gate is None else ReasoningGate(m, *gate)

    def apply(self, logits, matchers: list) -> list:
        """Masks, in place, the rows of `logits` [B, V] (float32) whose matcher is not None (a ReasoningGate's row
        only past its reasoning; at its start the start tag is allowed beside the grammar's tokens). Returns the
        rows whose grammar allows no token at all (a dead end: the row's logits are all -inf, nothing to sample)."""
        extra: dict = {}
        real = list(matchers)
        for i, m in enumerate(matchers):
            if isinstance(m, ReasoningGate):
                real[i], tok = m.mask_rule()
                if tok is not None:
                    extra[i] = tok
        matchers = real
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return []
        n = logits.shape[0]
        self._turn ^= 1
        host = self._host.get((n, self._turn))
        if host is None:
            import torch
            host = torch.empty((n, self.bitmask_words), dtype=torch.int32,
                               pin_memory=logits.is_cuda)
            self._host[(n, self._turn)] = host
        if len(rows) == 1:
            matchers[rows[0]].fill_next_token_bitmask(host, rows[0])
        else:
            if self._batch is None:
                self._batch = self.xgr.BatchGrammarMatcher(max_threads="auto")
            self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], host, indices=rows)
        for i, tok in extra.items():                # the bit of the start tag (int32 words, bit 31 the sign)
            word = int(host[i, tok // 32]) | (1 << (tok % 32))
            host[i, tok // 32] = word - (1 << 32) if word >= 1 << 31 else word
        bm = host.to(logits.device, non_blocking=True) if logits.is_cuda else host
        self.xgr.apply_token_bitmask_inplace(logits, bm, vocab_size=min(self.info.vocab_size, logits.shape[-1]),
                                             indices=rows)
        # one host reduction over the masks just filled; a terminated matcher's empty mask is no dead end
        alive = host[rows].any(dim=1).tolist()
        return [i for i, ok in zip(rows, alive) if not ok and not matchers[i].is_terminated()]


class ReasoningGate:
    """A sequence's grammar behind its reasoning (StructuredOutputsParams.reasoning_tags): "start": the next token
    may be the start tag (then "thinking") or the grammar's first (then "grammar"); "thinking": every token is free
    until the end tag (then "grammar"); "grammar": the matcher's. The interface the engine uses of a matcher:
    accept_token, is_terminated; GrammarBackend.apply reads mask_rule."""

    def __init__(self, matcher, start_id: int, end_id: int, opened: bool):
        self.matcher, self.start_id, self.end_id = matcher, int(start_id), int(end_id)
        self.state = "thinking" if opened else "start"

    def accept_token(self, token: int) -> bool:
        if self.state == "thinking":
            if token == self.end_id:
                self.state = "grammar"
            return True
        if self.state == "start":
            if token == self.start_id:
                self.state = "thinking"
                return True
            self.state = "grammar"
        return self.matcher.accept_token(token)

    def is_terminated(self) -> bool:
        return self.state == "grammar" and self.matcher.is_terminated()

    def mask_rule(self) -> tuple:
        """(the matcher whose mask applies, or None: unmasked; a token allowed beside it, or None)."""
        if self.state == "thinking":
            return None, None
        return self.matcher, (self.start_id if self.state == "start" else None)


def reasoning_gate(tokenizer, tags, prompt_ids) -> Optional[tuple]:
    """(start id, end id, open at the prompt's end) of `tags` in `tokenizer`, or None where a tag is not one token.
    Open: the prompt's last tag is the start tag (a template that opens the reasoning)."""
    ids = []
    for tag in tags:
        enc = tokenizer.encode(tag, add_special_tokens=False)
        if len(enc) != 1:
            return None
        ids.append(int(enc[0]))
    start, end = ids
    last_start = max((i for i, t in enumerate(prompt_ids) if t == start), default=-1)
    last_end = max((i for i, t in enumerate(prompt_ids) if t == end), default=-1)
    return start, end, last_start > last_end


def bounded_strings(node: Any) -> Any:
    """A copy of the schema where a string with minLength / maxLength (and no pattern, format, enum or const)
    becomes the same bound as a pattern of plain characters: xgrammar (0.2.9) compiles such strings to
    "any character but quote, backslash, CR, LF", which lets control characters into the output and makes it
    invalid JSON. The pattern excludes control characters (and escapes: such strings hold no quote nor
    backslash)."""
    if isinstance(node, list):
        return [bounded_strings(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: bounded_strings(v) for k, v in node.items()}
    lo, hi = out.get("minLength"), out.get("maxLength")
    if ((isinstance(lo, int) or isinstance(hi, int)) and out.get("type", "string") == "string"
            and not {"pattern", "format", "enum", "const"} & set(out)):
        lo = lo if isinstance(lo, int) and not isinstance(lo, bool) else 0
        hi = hi if isinstance(hi, int) and not isinstance(hi, bool) else ""
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = "^[^\"\\\\\\x00-\\x1f]{%d,%s}$" % (lo, hi)
    return out


def _check_schema(schema: Any, where: str) -> None:
    """A structural check with the JSON Schema meta-schema when `jsonschema` is installed (xgrammar silently
    ignores some malformed keywords). A schema nested deeper than MAX_DEPTH levels is refused first (the checks and
    the grammar recurse per level)."""
    levels = depth(schema)
    if levels > MAX_DEPTH:
        raise GrammarError(f"{where}: the schema is nested more than {MAX_DEPTH} levels deep (objects and arrays); "
                           f"at most {MAX_DEPTH} are served")
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.absolute_path)
        raise GrammarError(f"{where}: invalid JSON schema{' at ' + path if path else ''}: {e.message}") from None
