"""The spec language's position-dependent query scale, chunked local attention, weightless q/k norm and MoE routing
weights on the expert input, proven by Llama 4 (specs/llama4.yaml) and Ministral 3 (specs/ministral3.yaml).

The spec battery checks greedy parity of both tiny checkpoints as built (tests/fixtures/tiny_hf.py ARCH_DEFAULTS:
Llama 4 with a chunk of 8, a NoPE layer with temperature tuning floor 4, a dense layer between MoE layers; Ministral
3 with an original context of 8, so that every feature moves the tokens within the tests' prompts). Here: the
primitives against transformers' own formulas, and one sensitivity arm per feature (the feature switched off in
config.json: transformers' output must change, and the engine must still agree); guard refusals by name."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_scalings import _agree, _engine, _hf

from xllm_gen.runtime.ops import moe as M

LLAMA4 = "Llama4ForCausalLM"
MINISTRAL3 = "Ministral3ForCausalLM"


# ---------------------------------------------------------------------------------------------- primitives
def test_query_scale_matches_transformers_formulas():
    """L.QueryScale(beta, floor, offset) is Ministral 3's get_llama_4_attn_scale (offset 0) and Llama 4's
    temperature tuning (offset 1), position by position, prefill or decode alike (one position per token)."""
    from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale

    from xllm_gen.runtime.layers import QueryScale
    pos = torch.arange(0, 200)
    q = torch.randn(200, 4, 8)
    ministral = get_llama_4_attn_scale(pos[None], 0.1, 16)[0, 0, :, 0]              # [1, 1, N, 1] -> [N]
    torch.testing.assert_close(QueryScale(0.1, 16, 0)(pos, q), q * ministral[:, None, None], rtol=1e-6, atol=1e-6)
    llama4 = torch.log1p(torch.floor((pos.float() + 1.0) / 8)) * 0.5 + 1.0
    torch.testing.assert_close(QueryScale(0.5, 8, 1)(pos, q), q * llama4[:, None, None], rtol=1e-6, atol=1e-6)
    # decode: a batch of rows at unrelated positions scales each by its own position
    rows = torch.tensor([3, 150, 7])
    torch.testing.assert_close(QueryScale(0.5, 8, 1)(rows, q[:3]), q[:3] * llama4[rows][:, None, None])
    assert QueryScale(0.5, 8, 1).scale(torch.tensor([0, 6]))[0] == 1.0 and \
        QueryScale(0.5, 8, 1).scale(torch.tensor([7]))[0] == pytest.approx(1 + 0.5 * math.log(2))
    with pytest.raises(ValueError, match="floor"):
        QueryScale(0.1, 0, 0)
    with pytest.raises(ValueError, match="one position per token"):
        QueryScale(0.1, 4, 0)(torch.zeros(3, 5, dtype=torch.long), q[:5])


def test_weightless_rmsnorm_is_llama4_l2_norm():
    from transformers.models.llama4.modeling_llama4 import Llama4TextL2Norm

    from xllm_gen.runtime.layers import RMSNorm
    x = torch.randn(5, 4, 16) * 3
    norm = RMSNorm(16, 1e-5, weight=False)
    assert not list(norm.parameters())
    torch.testing.assert_close(norm(x), Llama4TextL2Norm(1e-5)(x), rtol=0, atol=0)


def test_moe_weights_on_input_is_llama4_routing():
    """weights_on_input: sum_k expert_e(w_k * x) (Llama4TextMoe: the sigmoid top-k scores scale the experts'
    input), per expert loop as transformers computes it; the output-weighted sum differs (silu is not linear)."""
    torch.manual_seed(0)
    T, H, I, E, K = 9, 16, 24, 4, 2
    x = torch.randn(T, H)
    w13, w2 = torch.randn(E, 2 * I, H) * 0.3, torch.randn(E, H, I) * 0.3
    logits = torch.randn(T, E)
    w, ids = M.select_experts(logits, K, False, "sigmoid")
    act = lambda h: torch.nn.functional.silu(h[..., :I]) * h[..., I:]   # noqa: E731
    want = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            want[t] += w2[e] @ act(w13[e] @ (w[t, k] * x[t]))
    got = M.fused_moe_reference(x, w13, w2, w, ids, act, block_m=4, weights_on_input=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(M.fused_moe_reference(x, w13, w2, w, ids, act, block_m=4), want, atol=1e-3)


# ------------------------------------------------------------------------------------------ sensitivity arms
def _arm(tiny_checkpoint, tmp_path, arch, name, edit, seed=7, length=21):
    """The tiny checkpoint as built and with `edit` applied to its config.json: transformers' output must differ,
    the engine must agree with transformers on both."""
    from fixtures.tiny_hf import edit_config

    ckpt = tiny_checkpoint(arch)
    prompt = np.random.default_rng(seed).integers(0, 400, length).tolist()
    base = _hf(ckpt, prompt)
    _agree(_engine(ckpt, prompt), base, "as built")
    arm = edit_config(ckpt, tmp_path / name, edit)
    want = _hf(arm, prompt)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), \
        f"{name}: no change in transformers' output on the tiny checkpoint: no arm"
    _agree(_engine(arm, prompt), want, name)


@pytest.mark.engine
@pytest.mark.slow
def test_llama4_chunking_off_changes_output(tiny_checkpoint, tmp_path):
    """Chunked local attention off (every layer global; prompt 21 tokens + decode, chunk 8)."""
    def off(cfg):
        assert "chunked_attention" in cfg["layer_types"]
        cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    _arm(tiny_checkpoint, tmp_path, LLAMA4, "chunking_off", off)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("field", ["attn_temperature_tuning", "use_qk_norm"])
def test_llama4_feature_off_changes_output(field, tiny_checkpoint, tmp_path):
    def off(cfg):
        assert cfg[field] is True
        cfg[field] = False
    _arm(tiny_checkpoint, tmp_path, LLAMA4, field, off)


@pytest.mark.engine
@pytest.mark.slow
def test_llama4_top2_input_scaled_routing(tiny_checkpoint, tmp_path):
    """Two experts per token (the released models route top-1): each chosen expert's input scaled by its own
    sigmoid score, summed."""
    def top2(cfg):
        cfg["num_experts_per_tok"] = 2
    _arm(tiny_checkpoint, tmp_path, LLAMA4, "top2", top2)


@pytest.mark.engine
def test_ministral3_query_scale_off_changes_output(tiny_checkpoint, tmp_path):
    """llama_4_scaling_beta 0: no query scale (original context 8, positions up to ~30)."""
    def off(cfg):
        assert cfg["rope_parameters"]["llama_4_scaling_beta"] != 0
        cfg["rope_parameters"]["llama_4_scaling_beta"] = 0.0
    _arm(tiny_checkpoint, tmp_path, MINISTRAL3, "beta_off", off)


def test_chunking_switched_off_in_the_engine_diverges(tiny_checkpoint, monkeypatch):
    """The engine with chunked attention made global no longer agrees with transformers on a prompt longer than
    the chunk (the spec battery checks that it agrees as built): the chunk reaches the attention backend."""
    from xllm_gen.runtime.attention import base

    ckpt = tiny_checkpoint(LLAMA4)
    prompt = np.random.default_rng(7).integers(0, 400, 21).tolist()
    want = _hf(ckpt, prompt)
    import xllm_gen.runtime.layers.attention as layer_attention
    make = base.make_variant
    monkeypatch.setattr(layer_attention, "make_variant",
                        lambda window=None, cap=None, sinks=False, alibi=False, chunk_size=None:
                        make(window, cap, sinks, alibi))
    got = _engine(ckpt, prompt)
    assert got[0] != want[0] or not np.allclose(got[1], want[1], atol=1e-3)


def test_query_scale_switched_off_in_the_engine_diverges(tiny_checkpoint, monkeypatch):
    """The engine with its query scale made the identity no longer agrees with transformers: the primitive is live
    in the compiled model (not only in the config it reads)."""
    from xllm_gen.runtime.layers import QueryScale

    ckpt = tiny_checkpoint(MINISTRAL3)
    prompt = np.random.default_rng(7).integers(0, 400, 21).tolist()
    want = _hf(ckpt, prompt)
    monkeypatch.setattr(QueryScale, "forward", lambda self, positions, q: q)
    got = _engine(ckpt, prompt)
    assert got[0] != want[0] or not np.allclose(got[1], want[1], atol=1e-3)


# ------------------------------------------------------------------------------------------------ the guard
def _config(name):
    import importlib
    return importlib.import_module(f"xllm_gen.generated.{name}.model")


def _tiny_json(arch):
    import json

    from fixtures.tiny_hf import tiny_config
    return json.loads(tiny_config(arch).to_json_string())


def test_guard_refuses_what_the_specs_do_not_model():
    from xllm_gen.runtime.loading.hf_config import ConfigError

    l4 = _config("llama4").Config
    cfg = _tiny_json(LLAMA4)
    l4.from_hf(cfg)
    bad = dict(cfg, layer_types=["sliding_attention", "full_attention", "chunked_attention"])
    with pytest.raises(ConfigError, match="unknown_layer_types"):
        l4.from_hf(bad)
    with pytest.raises(ConfigError, match="unknown_layer_types"):       # chunked layers without a chunk size
        l4.from_hf(dict(cfg, attention_chunk_size=None))
    assert l4.from_hf(dict(cfg, attention_chunk_size=None, layer_types=["full_attention"] * 3))
    m3 = _config("ministral3").Config
    cfg = _tiny_json(MINISTRAL3)
    m3.from_hf(cfg)
    no_beta = dict(cfg, rope_parameters={k: v for k, v in cfg["rope_parameters"].items()
                                         if k != "llama_4_scaling_beta"})
    with pytest.raises(ConfigError, match="llama_4_scaling_beta"):
        m3.from_hf(no_beta)
    with pytest.raises(ConfigError, match="default"):
        m3.from_hf(dict(cfg, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    # a family whose spec has no query scale still refuses the key by name
    ll = _config("llama").Config
    lcfg = _tiny_json("LlamaForCausalLM")
    lcfg["rope_parameters"] = dict(lcfg["rope_parameters"], llama_4_scaling_beta=0.1)
    with pytest.raises(ConfigError, match="llama_4_scaling_beta"):
        ll.from_hf(lcfg)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("arch", [LLAMA4, MINISTRAL3])
@pytest.mark.parametrize("engine_kw", [dict(enable_chunked_prefill=True, max_num_batched_tokens=8),
                                       dict(enable_prefix_caching=True)], ids=["chunked_prefill", "prefix_cache"])
def test_batched_chunked_prefill_and_prefix_cache_agree(arch, engine_kw, tiny_checkpoint):
    """Prompts across chunk boundaries (chunk 8) and the query scale's floor, batched together, prefilled in 8-token
    pieces or from the prefix cache (a second pass): the positions each piece sees are the sequence's own."""
    from hf_ref import hf_greedy_logprobs

    from xllm_gen import LLM, SamplingParams
    ckpt = tiny_checkpoint(arch)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 400, n).tolist() for n in (5, 21, 13, 30)]
    want = [list(hf_greedy_logprobs(ckpt, p, 12)[0]) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4, **engine_kw) as llm:
        for _ in range(2):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            assert [list(o.outputs[0].token_ids) for o in outs] == want
