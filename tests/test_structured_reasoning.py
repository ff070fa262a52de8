"""Structured outputs after the reasoning (StructuredOutputsParams.reasoning_tags; the server sets them from
--reasoning-parser, as vLLM does): with a tokenizer whose <think> / </think> are single tokens (added tokens, as
Qwen3's), the first token may open the reasoning or begin the constrained text; the reasoning runs free until
</think>; the constraint holds from the next token. Checked on the masks themselves (xgrammar's, on a real
tokenizer) and through the engine; without the tags the constraint holds from the first token; tags that are not
single tokens fall back to that."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "required": ["a"], "additionalProperties": False,
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}}
TAGS = ("<think>", "</think>")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny Qwen3 with <think> and </think> added to its tokenizer as ordinary (not special) tokens."""
    from fixtures.tiny_hf import make_tiny_qwen3
    from transformers import AutoTokenizer
    path = make_tiny_qwen3(tmp_path_factory.mktemp("think") / "m", vocab_size=520, seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.add_tokens(list(TAGS)) == 2
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    from xllm_gen import LLM
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=16, enforce_eager=True) as m:
        yield m


def _ids(llm):
    tok = llm.engine.tokenizer
    return [tok.encode(t, add_special_tokens=False)[0] for t in TAGS]


def test_gate_masks(llm):
    """start: the grammar's tokens and <think>; after <think>: unmasked, </think> included; after </think>: the
    grammar's tokens only, and the grammar completes there."""
    from xllm_gen.runtime.engine.structured_outputs import StructuredOutputsParams
    backend = llm.engine.structured
    start, end = _ids(llm)
    so = StructuredOutputsParams(json=SCHEMA, reasoning_tags=TAGS)
    gate = backend.matcher(backend.compile(so), (start, end, False))
    V = llm.engine.vocab_size

    def allowed():
        logits = torch.zeros(1, V)
        backend.apply(logits, [gate])
        return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
    brace = llm.engine.tokenizer.encode("{", add_special_tokens=False)[0]
    first = allowed()
    assert start in first and brace in first and end not in first and len(first) < V // 4
    assert gate.accept_token(start) and gate.state == "thinking"
    assert allowed() == set(range(V)) and not gate.is_terminated()
    for t in (brace, 7, start, 11):                  # anything goes while thinking
        assert gate.accept_token(t)
    assert gate.accept_token(end) and gate.state == "grammar"
    after = allowed()
    assert brace in after and start not in after and end not in after
    for t in llm.engine.tokenizer.encode('{"a": 5}', add_special_tokens=False):
        assert gate.accept_token(t)
    assert not gate.is_terminated() and gate.accept_token(sorted(llm.engine.eos_token_ids)[0])
    assert gate.is_terminated()


def _generate(llm, prompt, tags, **kw):
    from xllm_gen import SamplingParams
    from xllm_gen.runtime.engine.structured_outputs import StructuredOutputsParams
    so = StructuredOutputsParams(json=SCHEMA, reasoning_tags=tags)
    return llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=so, **kw))[0].outputs[0]


def test_reasoning_runs_free_then_the_constraint(llm):
    """A prompt that ends inside the reasoning (a template that opens it): the model writes freely until
    </think> (a logit bias makes it write </think> after a few tokens: min_tokens holds EOS, not </think>, so
    the bias alone decides), then valid JSON; the same request without the tags is JSON from the first token."""
    start, end = _ids(llm)
    prompt = [11, 187, 0, 57, start]
    out = _generate(llm, prompt, TAGS, logit_bias={end: 100.0})
    text = out.text
    assert out.token_ids[0] == end and text.startswith("</think>"), text
    jsonschema.validate(json.loads(text[len("</think>"):]), SCHEMA)
    plain = _generate(llm, prompt, None, logit_bias={end: 100.0})
    assert end not in plain.token_ids
    jsonschema.validate(json.loads(plain.text), SCHEMA)


def test_prompt_decides_whether_the_reply_starts_inside_the_reasoning(llm):
    """Open at the prompt's end when its last tag is <think> (a template that opens the reasoning; earlier turns'
    closed blocks do not count); closed or absent: the gate starts before the reasoning, and a reply that does not
    open it (<think> banned here) is constrained from its first token."""
    from xllm_gen.runtime.engine.structured_outputs import reasoning_gate
    start, end = _ids(llm)
    tok = llm.engine.tokenizer
    assert reasoning_gate(tok, TAGS, [1, start, 2, end, 3, start, 4]) == (start, end, True)
    assert reasoning_gate(tok, TAGS, [1, start, 2, end, 3]) == (start, end, False)
    assert reasoning_gate(tok, TAGS, [1, 2]) == (start, end, False)
    out = _generate(llm, [11, 187, start, 57, end], TAGS, logit_bias={start: -100.0})
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_tags_that_are_not_single_tokens_fall_back(llm):
    """Tags the tokenizer splits: the constraint holds from the first token (logged once)."""
    out = _generate(llm, [11, 187, 0, 57], ("<reason>", "</reason>"))
    jsonschema.validate(json.loads(out.text), SCHEMA)
    from xllm_gen.runtime.engine.structured_outputs import reasoning_gate
    assert reasoning_gate(llm.engine.tokenizer, ("<reason>", "</reason>"), [1, 2]) is None


@pytest.mark.engine
@pytest.mark.slow       # a server round trip (~7 s); the engine-level arms above cover the constraint itself
def test_server_constrains_after_the_reasoning(ckpt, llm):
    """`--reasoning-parser qwen3` and a template that opens the thinking: response_format json_schema holds after
    </think>; the reply's content is the JSON, its reasoning_content the (here empty) reasoning."""
    from pathlib import Path

    import httpx
    from serving_util import ServerProcess
    start, end = _ids(llm)
    template = (Path(__file__).parent / "fixtures" / "qwen3_tools.jinja").read_text() + \
        "{%- if add_generation_prompt %}{{- '<think>\\n' }}{%- endif %}"
    tpl = ckpt.parent / "opener.jinja"
    tpl.write_text(template)
    srv = ServerProcess(ckpt, "--block-size", "16", "--reasoning-parser", "qwen3", "--chat-template", str(tpl))
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Give a."}], "max_tokens": 40, "temperature": 0,
            "logit_bias": {str(end): 100},
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}})
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        jsonschema.validate(json.loads(msg["content"]), SCHEMA)
        assert not msg.get("reasoning_content")
    finally:
        assert srv.stop() == 0, srv.log.read_text()[-3000:]
