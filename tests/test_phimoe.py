"""PhimoeForCausalLM (Phi-3.5-MoE, specs/phimoe.yaml): the moe block's `routing: sparsemixer`, LongRoPE with
per-regime mscale, LayerNorms with bias, attention and lm_head biases, a sliding window.

- the routing primitive equals transformers' own `sparsemixer` (eval mode) on random logits, ties and wide margins
  included, and differs from softmax top-2 (its sensitivity);
- greedy parity on a tiny checkpoint with every feature on (longrope in the short regime: engine max_model_len 64
  = original_max_position_embeddings; transformers' PhiMoE applies short_factor at every length, as the spec's
  `longrope_factors: short` does, with long_mscale beyond the original context: with this fixture's two different
  mscales only the short regime is comparable; the release's are equal, see test_released_settings.py);
- router_jitter_noise reaches the computation (another value changes transformers' tokens and the engine's agree);
- the guard refuses num_experts_per_tok other than 2, naming it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

ARCH = "PhimoeForCausalLM"
PROMPTS = [np.random.default_rng(2).integers(0, 400, n).tolist() for n in (3, 9, 17, 30)]
STEPS = 16
FEATURES = {"attention_bias": True, "lm_head_bias": True, "router_jitter_noise": 0.3, "sliding_window": 6,
            "max_position_embeddings": 256,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                "short_factor": [1.5, 2.0, 1.0, 3.0, 1.2, 1.1, 2.5, 1.0], "long_factor": [4.0] * 8,
                                "original_max_position_embeddings": 64, "short_mscale": 1.3, "long_mscale": 1.1}}


@pytest.mark.parametrize("eps", [0.0, 0.01, 0.3, 2.0])
def test_sparsemixer_equals_transformers(eps):
    from transformers.models.phimoe.modeling_phimoe import sparsemixer as hf_sparsemixer

    from xllm_gen.runtime.ops.moe import select_experts, sparsemixer

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=g) * 3
    logits[0, :] = 1.0                                   # all tied
    logits[1, 2] = logits[1, 5] = logits[1].max() + 1    # a tie for the top
    w, ids = sparsemixer(logits, eps)
    hw, hids = hf_sparsemixer(logits, jitter_eps=eps, training=False)
    assert torch.equal(ids, hids) and torch.equal(w, hw)
    sw, sids = select_experts(logits, 2, False)          # softmax top-2: another routing
    assert not torch.allclose(torch.zeros(64, 8).scatter(1, sids, sw), torch.zeros(64, 8).scatter(1, ids, w))


def _engine(ckpt, max_model_len=None):
    from xllm_gen import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4, max_model_len=max_model_len) as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


@pytest.mark.engine
def test_features_on_match_hf_and_jitter_eps_matters(tiny_checkpoint):
    from hf_ref import hf_greedy

    ckpt = tiny_checkpoint(ARCH, overrides=FEATURES)
    want = hf_greedy(ckpt, PROMPTS, STEPS)
    assert _engine(ckpt, max_model_len=64) == want
    narrow = tiny_checkpoint(ARCH, overrides={**FEATURES, "router_jitter_noise": 0.01})
    narrow_want = hf_greedy(narrow, PROMPTS, STEPS)
    assert narrow_want != want, "fixture: router_jitter_noise changes nothing in transformers' output"
    assert _engine(narrow, max_model_len=64) == narrow_want


@pytest.mark.parametrize("field, value", [("num_experts_per_tok", 3), ("num_experts_per_tok", 1)])
def test_guard_refuses(field, value):
    from xllm_gen.generated.phimoe.model import Config

    hf = {"architectures": [ARCH], "model_type": "phimoe", "vocab_size": 512, "hidden_size": 64,
          "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, field: value}
    with pytest.raises(ValueError, match=field):
        Config.from_hf(hf)


def test_phi3_ignores_mscale():
    """transformers' Phi-3 ignores short_mscale / long_mscale (its generic longrope computes the attention factor from
    factor / attention_factor); phi3.yaml's rotary, without `longrope_mscale`, ignores them too (it was refused)."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from xllm_gen.generated.phi3.model import Config, Phi3Attention

    hf = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 512, "hidden_size": 64,
          "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
          "max_position_embeddings": 8192, "original_max_position_embeddings": 4096,
          "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                           "short_mscale": 1.2, "long_mscale": 1.2}}
    rot = Phi3Attention(Config.from_hf(hf), 0).rotary_emb
    rot.set_context_len(4096)
    _, want = ROPE_INIT_FUNCTIONS["longrope"](Phi3Config.from_dict(hf), "cpu")
    assert rot.attention_factor == want != 1.2
