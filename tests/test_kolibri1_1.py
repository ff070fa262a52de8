"""Kolibri 1.1 (specs/kolibri1_1.yaml): attention `kv_nvfp4` (runtime L.nvfp4_round) and the context cap at the
indexed-attention layers' dense budget.

- L.nvfp4_round equals transformers' nvfp4_fake_quantize bit for bit;
- the engine's context (max_position_embeddings, its max_model_len) is index_topk + local + sink tokens where the
  model has indexed-attention layers: a longer prompt is refused; and the cap is needed: past the budget
  transformers' own outputs leave the dense attention's (its key selection starts);
- sensitivity arm (slow): without the NVFP4 rounding the engine's tokens on the tiny checkpoint leave
  transformers' (which the spec battery shows the engine meets).
"""
from __future__ import annotations

import pytest
import torch

from xllm_gen.runtime.layers.nvfp4_round import nvfp4_round

ARCH = "Kolibri1_1ForCausalLM"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_round_matches_transformers(dtype):
    from transformers.models.kolibri1_1.modeling_kolibri1_1 import nvfp4_fake_quantize
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=g) * torch.logspace(-4, 3, 7)[:, None, None]
    x[0, 0, :16] = 0.0                       # an all-zero block
    x[1, 1, 5] = 1e4                         # a block whose scale saturates
    x = x.to(dtype)
    assert torch.equal(nvfp4_round(x), nvfp4_fake_quantize(x))
    assert not torch.equal(nvfp4_round(x), x)
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_round(torch.zeros(2, 24))


def test_context_is_capped_at_the_dense_budget(tiny_checkpoint):
    import json

    from conformance.families import generated_model, spec_for
    ckpt = tiny_checkpoint(ARCH)
    cfg = json.loads((ckpt / "config.json").read_text())
    model = generated_model(spec_for(ARCH))
    budget = cfg["index_topk"] + cfg["index_num_local_tokens"] + cfg["index_num_sink_tokens"]
    assert model.Config.from_hf(cfg).max_position_embeddings == min(budget, cfg["max_position_embeddings"])
    for field in ("index_topk", "index_num_local_tokens", "index_num_sink_tokens"):    # each field moves the cap
        assert model.Config.from_hf(dict(cfg, **{field: cfg[field] + 5})).max_position_embeddings == budget + 5
    assert model.Config.from_hf(dict(cfg, max_position_embeddings=budget - 1)).max_position_embeddings == budget - 1
    sliding = dict(cfg, layer_types=["sliding_attention"] * 4, kv_source_layers=[0, 1, 2, 3], index_layers=[])
    assert model.Config.from_hf(sliding).max_position_embeddings == cfg["max_position_embeddings"]
    from xllm_gen import LLM, SamplingParams
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4) as llm:
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([{"prompt_token_ids": list(range(3, 3 + budget + 1))}], SamplingParams(max_tokens=1))


def test_past_the_budget_transformers_selects_keys(tiny_checkpoint):
    """Why the cap: a sequence longer than the budget gets other logits from transformers than with a budget that
    covers it (the same weights), i.e. its selection is not dense attention."""
    import json

    from transformers import AutoModelForCausalLM
    ckpt = tiny_checkpoint(ARCH)
    cfg = json.loads((ckpt / "config.json").read_text())
    budget = cfg["index_topk"] + cfg["index_num_local_tokens"] + cfg["index_num_sink_tokens"]
    ids = torch.randint(3, cfg["vocab_size"], (1, budget + 24), generator=torch.Generator().manual_seed(1))
    logits = []
    for topk in (cfg["index_topk"], 10 * budget):
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, index_topk=topk,
                                                     index_pool_size=10 * budget)
        with torch.no_grad():
            logits.append(model(input_ids=ids, use_cache=False).logits[0])
    assert torch.allclose(logits[0][:budget], logits[1][:budget], atol=1e-5)      # within the budget: dense
    assert not torch.allclose(logits[0][budget:], logits[1][budget:], atol=1e-3)   # past it: a selection


@pytest.mark.slow
@pytest.mark.engine
def test_kv_nvfp4_sensitivity(tiny_checkpoint, monkeypatch):
    from test_spec_battery import BLOCK_SIZE, MAX_TOKENS, Tokens, _requests

    from xllm_gen import LLM, SamplingParams
    from xllm_gen.runtime import layers as L
    ckpt = tiny_checkpoint(ARCH)
    want = Tokens().hf(ckpt)
    monkeypatch.setattr(L, "nvfp4_round", lambda x: x)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=BLOCK_SIZE) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(
            _requests(ckpt), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    assert got != want, "the engine's tokens do not depend on the NVFP4 rounding of keys and values"
