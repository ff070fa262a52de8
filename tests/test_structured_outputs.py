"""Structured outputs in the engine (no server): a random tiny model writes garbage unless it is constrained, so
each check is strong: the output parses and validates against the schema, matches the regex, is one of the
choices; the same request without the constraint does not. Constrained and unconstrained rows share a batch
(the unconstrained rows' tokens are unchanged), also when a constrained request joins a batch that runs
async decode steps; n > 1 completions each walk the grammar; bad constraints are refused by name, and so are JSON
schema keywords the grammar would not enforce (each kept keyword is shown enforced) and grammars that allow no first
token; a grammar that dead-ends mid-output fails that request alone."""
from __future__ import annotations

import json
import re

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

pytestmark = pytest.mark.engine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "fish"]}}}


def _sp(**kw):
    from xllm_gen import SamplingParams

    return SamplingParams(**{"temperature": 0.0, "max_tokens": 48, **kw})


def _so(**kw):
    from xllm_gen import StructuredOutputsParams

    return StructuredOutputsParams(**kw)


@pytest.fixture(scope="module")
def llm(qwen3_tied, make_llm):
    return make_llm(qwen3_tied)


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_json_schema_greedy_and_sampled(llm):
    outs = llm.generate(["Hello there"] * 4, [_sp(), _sp(structured_outputs=_so(json=SCHEMA)),
                                              _sp(temperature=1.0, seed=5, structured_outputs=_so(json=SCHEMA)),
                                              _sp(temperature=0.8, top_p=0.9, structured_outputs={"json": SCHEMA})])
    assert not _valid(outs[0].outputs[0].text)        # unconstrained: garbage
    for o in outs[1:]:
        assert _valid(o.outputs[0].text), o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop"


def test_regex_choice_grammar_json_object(llm):
    rx = r"[a-z]{3}-\d{2,4}"
    choices = ["yes please", "no thanks", "maybe"]
    outs = llm.generate(["Pick one"] * 5, [_sp(structured_outputs=_so(regex=rx)),
                                           _sp(structured_outputs=_so(choice=choices)),
                                           _sp(structured_outputs=_so(grammar='root ::= ("ab" | "ba")+ "!"')),
                                           _sp(max_tokens=96, structured_outputs=_so(json_object=True)),
                                           _sp(temperature=1.0, seed=1, structured_outputs=_so(choice=choices))])
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(rx, texts[0]), texts[0]
    assert texts[1] in choices and texts[4] in choices
    assert re.fullmatch(r"(ab|ba)+!", texts[2]), texts[2]
    assert isinstance(json.loads(texts[3]), dict) and outs[3].outputs[0].finish_reason == "stop"
    plain = llm.generate(["Pick one"], _sp())[0].outputs[0].text
    assert not re.fullmatch(rx, plain) and plain not in choices


def test_mixed_batch_leaves_unconstrained_rows_unchanged(llm):
    prompts = ["Once upon a time", "The weather today", "Hello, world!"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, _sp(max_tokens=24, ignore_eos=True))]
    mixed = llm.generate(prompts + ["x", "y"], [_sp(max_tokens=24, ignore_eos=True)] * 3
                         + [_sp(structured_outputs=_so(json=SCHEMA)), _sp(structured_outputs=_so(regex="[0-9]{5}"))])
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    assert _valid(mixed[3].outputs[0].text) and re.fullmatch("[0-9]{5}", mixed[4].outputs[0].text)


def test_n_completions_each_follow_the_grammar(llm):
    out = llm.generate(["Hi"], _sp(n=3, temperature=1.0, seed=11, structured_outputs=_so(json=SCHEMA)))[0]
    assert len(out.outputs) == 3 and all(_valid(c.text) for c in out.outputs)
    assert len({c.text for c in out.outputs}) > 1          # independent draws, each valid


def test_constrained_request_joins_an_async_batch(llm):
    """A plain greedy request decodes with async steps (launched before the previous step's tokens are read);
    constrained requests that arrive mid-way join those steps (greedy ones: masked once the previous tokens are
    accepted by their grammars), their outputs validate and the plain request's tokens are those it gets
    alone."""
    eng = llm.engine
    assert eng._async is not None, "async scheduling is on by default on one process"
    solo = llm.generate(["Tell a story"], _sp(max_tokens=40, ignore_eos=True))[0].outputs[0].token_ids
    eng.add_request("plain", "Tell a story", _sp(max_tokens=40, ignore_eos=True))
    outs, launched = {}, False
    for _ in range(6):
        for o in eng.step_outputs():
            outs[o.request_id] = o
        launched = launched or eng._async.inflight is not None
    assert launched, "the plain request never took an async step"
    eng.add_request("json", "Tell a story", _sp(structured_outputs=_so(json=SCHEMA)))
    eng.add_request("rx", "Tell a story", _sp(temperature=1.0, seed=3, structured_outputs=_so(regex="[a-c]{4}x")))
    while eng.has_unfinished_requests():
        for o in eng.step_outputs():
            outs[o.request_id] = o
    assert outs["plain"].outputs[0].token_ids == solo
    assert _valid(outs["json"].outputs[0].text)
    assert re.fullmatch("[a-c]{4}x", outs["rx"].outputs[0].text)


def test_min_tokens_yields_to_a_grammar_that_must_end(llm):
    out = llm.generate(["Pick"], _sp(min_tokens=20, structured_outputs=_so(choice=["yes", "no"])))[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop", out
    longer = llm.generate(["Pick"], _sp(min_tokens=6, max_tokens=12, structured_outputs=_so(regex="[a-z]+")))[0]
    assert re.fullmatch("[a-z]+", longer.outputs[0].text) and len(longer.outputs[0].token_ids) >= 6


def test_async_and_sync_scheduling_agree(llm, qwen3_tied, make_llm):
    """Greedy constrained rows take async decode steps (their masks filled after the previous tokens are
    accepted); the tokens equal those of synchronous steps, where each mask is built from the sampled token."""
    sync = make_llm(qwen3_tied, async_scheduling=False)
    assert sync.engine._async is None and llm.engine._async is not None
    prompts = ["Once upon a time", "The weather today", "Hello, world!", "Numbers: 0 1 2"]
    sps = [_sp(structured_outputs=_so(json=SCHEMA)), _sp(max_tokens=30, ignore_eos=True),
           _sp(structured_outputs=_so(regex="[a-z ]{5,40}\\.")), _sp(structured_outputs=_so(json_object=True), max_tokens=96)]
    eng, launched = llm.engine, 0
    launch = eng._async.launch

    def counting(seqs, prev=None):
        nonlocal launched
        launched += any(s.grammar is not None for s in seqs)
        return launch(seqs, prev)
    eng._async.launch = counting
    try:
        a = llm.generate(prompts, sps)
    finally:
        eng._async.launch = launch
    b = sync.generate(prompts, sps)
    assert launched > 5, "constrained rows never took an async step"
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert _valid(a[0].outputs[0].text) and re.fullmatch("[a-z ]{5,40}\\.", a[2].outputs[0].text)


def test_logprobs_are_the_models(llm):
    """Logprobs report the model's distribution, not the masked one (as vLLM): the chosen token's logprob
    equals the unconstrained run's logprob of that token at the first step."""
    free = llm.generate(["Hi"], _sp(max_tokens=1, logprobs=20))[0].outputs[0]
    con = llm.generate(["Hi"], _sp(max_tokens=1, logprobs=20, structured_outputs=_so(choice=["zzz"])))[0].outputs[0]
    tok = con.token_ids[0]
    assert con.logprobs[0][tok].logprob < 0 and con.logprobs[0][tok].logprob != 0.0
    top = max(free.logprobs[0].items(), key=lambda kv: kv[1].logprob)
    assert con.logprobs[0][top[0]].logprob == pytest.approx(top[1].logprob)


@pytest.mark.parametrize("so,words", [
    ({"json": {"type": "objec"}}, ["structured_outputs.json", "objec"]),
    ({"json": "{not json"}, ["structured_outputs.json", "not valid JSON"]),
    ({"regex": "a("}, ["structured_outputs.regex", "invalid regex"]),
    ({"grammar": 'root ::= "a" | '}, ["structured_outputs.grammar", "invalid EBNF"]),
    ({"choice": []}, ["choice"]),
    ({"regex": "a", "choice": ["b"]}, ["exactly one"]),
    ({"json": {"type": "object", "properties": {"a": {"type": 7}}}}, ["structured_outputs.json", "properties/a"]),
])
def test_bad_constraints_are_refused_by_name(llm, so, words):
    from xllm_gen import SamplingParams

    with pytest.raises(ValueError) as e:
        p = SamplingParams(max_tokens=4, structured_outputs=so)
        llm.engine.add_request("bad", "x", p)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "bad" not in llm.engine._requests


def test_unknown_structured_outputs_field():
    from xllm_gen import SamplingParams

    with pytest.raises(ValueError, match="unknown field.*'jsonn'"):
        SamplingParams(structured_outputs={"jsonn": {}})


def test_compiles_are_cached(llm):
    backend = llm.engine.structured
    before = backend.misses
    for _ in range(3):
        llm.generate(["a"], _sp(max_tokens=2, structured_outputs=_so(regex="[q-z]{7}")))
    assert backend.misses == before + 1


def test_idle_engine_step_returns_nothing(llm):
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.step_outputs() == [] and llm.engine.step_deltas() == []


@pytest.mark.slow
def test_tensor_parallel_2(qwen3_tied, make_llm):
    """At TP 2 the sampler (and the grammar) run on rank 0 over the gathered logits: same outputs as TP 1."""
    sps = [_sp(structured_outputs=_so(json=SCHEMA)), _sp(temperature=1.0, seed=4, structured_outputs=_so(regex="[a-z]{2}[0-9]{2}")),
           _sp(max_tokens=12, ignore_eos=True)]
    tp1 = make_llm(qwen3_tied).generate(["Hi", "Hi", "Hi"], sps)
    tp2 = make_llm(qwen3_tied, tensor_parallel_size=2).generate(["Hi", "Hi", "Hi"], sps)
    assert _valid(tp2[0].outputs[0].text) and re.fullmatch("[a-z]{2}[0-9]{2}", tp2[1].outputs[0].text)
    assert [o.outputs[0].token_ids for o in tp2] == [o.outputs[0].token_ids for o in tp1]


# ------------------------------------------------------------------ what the grammar cannot enforce is refused
@pytest.mark.parametrize("schema,words", [
    ({"type": "number", "multipleOf": 0.5}, ["'multipleOf'", "/multipleOf"]),
    ({"not": {}}, ["'not'", "/not"]),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, ["'uniqueItems'", "/uniqueItems"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, ["'dependentRequired'", "/dependentRequired"]),
    ({"$defs": {"x": {"type": "integer", "nullable": True}}, "$ref": "#/$defs/x"}, ["'nullable'", "/$defs/x/nullable"]),
    ({"type": "object", "properties": {"p": {"anyOf": [{"type": "array", "contains": {"const": 1}}]}}},
     ["'contains'", "/properties/p/anyOf/0/contains"]),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, ["'if'", "'then'"]),
    ({"type": "string", "format": "idn-email"}, ["'format'", "idn-email"]),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, ["'maxLength'", "beside 'pattern'"]),
    ({"type": "integer", "minimum": 0, "anyOf": [{"type": "integer", "maximum": 5}]}, ["beside 'anyOf'"]),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, ["'oneOf'", "branches 0 and 1"]),
    ({"type": "integer", "enum": [1, "a"]}, ["'enum'", '"a"']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, ["'required'", "'b'"]),
    ({"minimum": 3}, ["'minimum'", "beside a \"type\""]),
])
def test_unenforced_schema_keywords_are_refused(llm, schema, words):
    """A keyword xgrammar would ignore (the output could break it) is refused at admission, naming the keyword and
    its JSON path; the other requests of the call are served."""
    with pytest.raises(ValueError) as e:
        llm.generate(["a", "b"], [_sp(max_tokens=4), _sp(structured_outputs=_so(json=schema))])
    msg = str(e.value)
    assert msg.startswith("request 1: structured_outputs.json") and "does not enforce" in msg, msg
    assert all(w in msg for w in words), msg
    assert e.value.outputs[0].outputs and e.value.outputs[1].error


def test_enforced_keywords_are_accepted_and_really_enforced(llm):
    """The allow-list keeps what xgrammar enforces: for each keyword, an instance that breaks only it is refused
    by the compiled grammar (and its twin without the break is accepted)."""
    backend = llm.engine.structured
    obj = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    cases = [  # (schema, valid instance, instance breaking one keyword)
        ({"type": "integer", "multipleOf": 7}, 14, 15),
        ({"type": "integer", "exclusiveMinimum": 3, "maximum": 9}, 4, 3),
        ({"type": "string", "minLength": 2, "maxLength": 3}, "ab", "abcd"),
        ({"type": "string", "pattern": "^a+$"}, "aa", "b"),
        ({"type": "string", "format": "ipv4"}, "1.2.3.4", "1.2.3"),
        ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}}, [1, "x"], [1, 2]),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, [1], [1, 2, 3]),
        ({**obj, "required": ["a"]}, {"a": 1}, {"b": 1}),
        ({**obj, "minProperties": 2}, {"a": 1, "b": 2}, {"a": 1}),
        ({**obj, "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2}),
        ({"type": "object", "patternProperties": {"^x.*$": {"type": "integer"}}}, {"xa": 1}, {"xa": "s"}),
        ({"type": "object", "propertyNames": {"maxLength": 2}, "additionalProperties": {"type": "integer"}},
         {"ab": 1}, {"abc": 1}),
        ({"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}},
         {"a": 1}, {"a": "s"}),
        ({"anyOf": [{"type": "integer"}, {"type": "null"}], "title": "t", "default": None}, None, "s"),
        ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                    {"type": "object", "properties": {"k": {"const": "b"}, "n": {"type": "integer"}},
                     "required": ["k"]}]}, {"k": "b", "n": 1}, {"k": "a", "n": 1}),
        ({"type": "string", "enum": ["cat", "dog"]}, "dog", "cow"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}, [1, 1], ["s"]),
    ]
    for schema, good, bad in cases:
        compiled = backend.compile(_so(json=schema))

        def accepts(value):
            m = backend.xgr.GrammarMatcher(compiled)
            return m.accept_string(json.dumps(value)) and m.is_completed()
        assert accepts(good) and not accepts(bad), (schema, good, bad)
        jsonschema.validate(good, schema)
    out = llm.generate(["n"], _sp(temperature=1.0, seed=2, structured_outputs=_so(
        json={"type": "integer", "multipleOf": 7, "minimum": -1000, "maximum": 1000})))[0].outputs[0]
    assert out.finish_reason == "stop" and int(out.text) % 7 == 0, out.text


@pytest.mark.parametrize("so", [{"regex": "[^\\x00-\\U0010FFFF]"}, {"grammar": "root ::= root"}])
def test_a_grammar_that_cannot_start_is_refused(llm, so):
    with pytest.raises(ValueError, match=r"request 1: structured_outputs\.\w+: the grammar accepts no token at the "
                                         "start") as e:
        llm.generate(["a", "b"], [_sp(max_tokens=2), _sp(structured_outputs=so)])
    assert e.value.outputs[0].outputs and e.value.outputs[1].error


def test_a_dead_end_mid_output_fails_that_request_alone(llm):
    """A grammar that admits "a" and then nothing: the request ends with a clear error after its first token
    (greedy, through the async masked steps, and sampled), the requests beside it are served unchanged."""
    dead = {"grammar": 'root ::= "a" [^\\x00-\\U0010FFFF]'}
    plain = _sp(max_tokens=12, ignore_eos=True)
    alone = llm.generate(["Hello there"], plain)[0].outputs[0].token_ids
    for kw in (dict(), dict(temperature=1.0, seed=3)):
        outs = llm.generate(["x", "Hello there"], [_sp(max_tokens=8, structured_outputs=dead, **kw), plain],
                            on_error="return")
        assert outs[0].error and "the grammar allows no next token after 1 generated token" in outs[0].error, outs[0]
        assert outs[0].error.startswith("request 0: ")
        assert outs[1].error is None and outs[1].outputs[0].token_ids == alone
