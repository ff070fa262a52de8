"""Structured outputs on a GPU: the token bitmask applied to CUDA logits (xgrammar's kernel), decode CUDA
graphs and async scheduling on. Constrained rows validate; unconstrained rows of the same batch keep the tokens
they get alone; a constrained request that joins a batch of async decode steps still validates."""
from __future__ import annotations

import json
import re

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "fish"]}}}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from fixtures.tiny_hf import make_tiny_qwen3

    from xllm_gen import LLM
    d = make_tiny_qwen3(tmp_path_factory.mktemp("tiny_structured"), hidden_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=512, seed=0)
    llm = LLM(str(d), dtype="bfloat16", max_num_seqs=16, num_kv_blocks=512)
    yield llm
    llm.shutdown()


def _valid(text):
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_mixed_batch_on_cuda(llm):
    from xllm_gen import SamplingParams

    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["Once upon a time", "The weather today", "Hello"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    cons = [SamplingParams(temperature=0.0, max_tokens=64, structured_outputs={"json": SCHEMA}),
            SamplingParams(temperature=1.0, seed=2, max_tokens=64, structured_outputs={"json": SCHEMA}),
            SamplingParams(temperature=0.0, max_tokens=16, structured_outputs={"regex": "[a-f]{3}-[0-9]{3}"})]
    outs = llm.generate(prompts + ["a", "b", "c"], [free] * 3 + cons)
    assert [o.outputs[0].token_ids for o in outs[:3]] == alone
    assert _valid(outs[3].outputs[0].text) and _valid(outs[4].outputs[0].text)
    assert re.fullmatch("[a-f]{3}-[0-9]{3}", outs[5].outputs[0].text)


def test_constrained_request_joins_async_decode(llm):
    from xllm_gen import SamplingParams

    eng = llm.engine
    eng.add_request("plain", "Tell a story", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(5):
        eng.step_outputs()
    eng.add_request("json", "Tell a story", SamplingParams(temperature=0.0, max_tokens=64,
                                                           structured_outputs={"json": SCHEMA}))
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step_outputs()})
    assert _valid(outs["json"].outputs[0].text)
    assert len(outs["plain"].outputs[0].token_ids) == 40
