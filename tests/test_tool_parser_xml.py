"""The XML function-call format (runtime/serving/tool_parsers/xml_function.py; `--tool-call-parser xml_function`,
aliases qwen3_coder / qwen3_xml): calls read from a finished reply and as it streams (any split of the text),
parameter values read by their schema types, malformed calls left in the content, and the grammar of a forced call:
the tiny model, constrained by it, writes calls that parse and whose arguments validate against the schema, greedy
and sampled; an unconstrained reply does not."""
from __future__ import annotations

import json

import pytest

from xllm_gen.runtime.serving import tool_parsers

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "required": ["city", "days"],
          "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
                         "unit": {"enum": ["celsius", "fahrenheit"]}, "detailed": {"type": "boolean"},
                         "ratio": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
                         "opts": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n<parameter=detailed>\nTrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
        "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=opts>\n{\"x\": 2}\n</parameter>\n"
        "<parameter=note>\nline one\nline two\n</parameter>\n</function>\n</tool_call>")
ARGS = {"city": "New York", "days": 3, "detailed": True, "ratio": 0.5, "tags": ["a", "b"], "opts": {"x": 2},
        "note": "line one\nline two"}


def _parser():
    return tool_parsers.get("xml_function")(tool_parsers.check_tools(TOOLS))


def test_aliases_name_the_format():
    assert tool_parsers.get("qwen3_coder") is tool_parsers.get("qwen3_xml") is tool_parsers.get("xml_function")


def test_extract_reads_values_by_schema_type():
    content, calls = _parser().extract("Let me look.\n" + CALL + "\n" + "<tool_call>\n<function=ping>\n</function>\n"
                                       "</tool_call>")
    assert content.strip() == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS), ("ping", {})]


def test_values_that_do_not_read_as_their_type_stay_text():
    from xllm_gen.runtime.serving.tool_parsers.xml_function import read_value
    assert read_value("three", "integer") == "three" and read_value("maybe", "boolean") == "maybe"
    assert read_value("{bad", "object") == "{bad" and read_value("null", "integer") is None
    assert read_value(" 7 ", "string") == " 7 " and read_value("7", None) == "7" and read_value("1e3", "number") == 1e3


def test_streamed_in_any_split_equals_whole():
    text = "Sure.\n" + CALL + "\nDone."
    want = _parser().extract(text)
    for step in (1, 2, 3, 7, 50):
        s = _parser().streamer()
        content, calls = "", []
        for i in range(0, len(text), step):
            c, k = s.feed(text[i:i + step])
            content, calls = content + c, calls + k
            assert "<tool_call" not in content and "<function" not in content
        c, k = s.finish()
        content, calls = content + c, calls + k
        assert content.strip() == want[0].strip() and [(c.name, c.arguments) for c in calls] == \
            [(c.name, c.arguments) for c in want[1]]


def test_malformed_calls_stay_in_the_content_and_dropped_closers_are_tolerated():
    bad = "<tool_call>\nno function here\n</tool_call>"
    assert _parser().extract(bad) == (bad, [])
    content, calls = _parser().extract("<tool_call>\n<function=ping>\n<parameter=x>\n1")    # output ended early
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("ping", {"x": "1"})]


@pytest.mark.engine
def test_forced_call_grammar_drives_the_model(tmp_path):
    pytest.importorskip("xgrammar")
    from fixtures.tiny_hf import make_tiny_qwen3

    from xllm_gen import LLM, SamplingParams
    from xllm_gen.runtime.engine.structured_outputs import StructuredOutputsParams
    forced = {"type": "object", "required": ["city", "days"],
              "properties": {"city": {"type": "string", "maxLength": 8},
                             "days": {"type": "integer", "minimum": 1, "maximum": 14},
                             "unit": {"enum": ["celsius", "fahrenheit"]}, "detailed": {"type": "boolean"},
                             "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 4}}}}
    parser = tool_parsers.get("xml_function")(tool_parsers.check_tools(
        [{"type": "function", "function": {"name": "get_weather", "parameters": forced}}]))
    ebnf = parser.grammar(parser.tools)
    ckpt = make_tiny_qwen3(tmp_path / "m", seed=0)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=16, enforce_eager=True) as llm:
        prompt = {"prompt_token_ids": [11, 187, 0, 57]}
        outs = [llm.generate([prompt], SamplingParams(temperature=t, seed=s, max_tokens=400,
                                                      structured_outputs=StructuredOutputsParams(grammar=ebnf)))
                [0].outputs[0] for t, s in ((0.0, None), (1.0, 3), (1.0, 9))]
        free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60))[0].outputs[0].text
    for o in outs:
        assert o.finish_reason == "stop", o.text
        content, calls = parser.extract(o.text)
        assert content is None and len(calls) == 1 and calls[0].name == "get_weather", o.text
        jsonschema.validate(json.loads(calls[0].arguments), forced)
    assert not parser.extract(free)[1]
