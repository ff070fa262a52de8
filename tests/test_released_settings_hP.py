"""(hP) Fast checks of the fixes found by the released-settings trials of tests/test_real_settings_hP.py (each fails
without its fix):

- adept/persimmon-8b-base / -chat: `num_key_value_heads: 64` (= the heads; PersimmonConfig has no such field, its
  attention is multi-head), refused as unknown.
- DiffLlama files derived from Llama's carry Llama's `mlp_bias: false` / `pretraining_tp: 1`, refused as unknown
  (transformers' DiffLlama reads neither: its MLP has no biases); mlp_bias true is refused by name.
- mistralai/Ministral-8B-Instruct-2410 ships as MistralForCausalLM with Ministral's `layer_types` (a full-attention
  layer every 4th), refused as unknown. transformers' Mistral ignores them (every layer slides by sliding_window);
  the release's window is its whole context (32768 = max_position_embeddings), where both readings agree: served.
  A shorter window beside a full_attention layer is refused naming layer_types.
- tiiuae/falcon-rw-1b (Falcon-RW): `alibi: true` with `parallel_attn: false` was refused (alibi assumed false).
  transformers' Falcon adds ALiBi to its mask divided by sqrt(head_dim) (Bloom's is not scaled), builds it in
  bfloat16 at the absolute key positions (slopes rounded, products rounded), turns no rotary, and runs sequential
  blocks (input_layernorm -> attention -> post_attention_layernorm -> MLP). specs/falcon.yaml reads alibi and
  parallel_attn now; the attention language got `alibi` as a per-checkpoint flag, `alibi_scale` and `alibi_bf16`.
  The shared-norm parallel form (Falcon-7B / 11B) reads its one input_layernorm into both parallel norms.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REAL = Path(__file__).parent / "data" / "real_configs"


def _config(stem: str, **edit):
    from xllm_gen.runtime.loading import registry

    cfg = json.loads((REAL / f"{stem}.json").read_text())
    cfg.update(edit)
    module, _ = registry.resolve(cfg)
    return module.Config, cfg


def test_persimmon_8b_num_key_value_heads_is_accepted():
    config, cfg = _config("persimmon__persimmon-8b-base")
    c = config.from_hf(cfg)
    assert (c.num_attention_heads, c.head_dim) == (64, 64)


def test_diffllama_llama_leftovers_are_accepted_and_mlp_bias_true_refused():
    config, cfg = _config("diffllama__DiffLlama-0.3B-handcut")
    assert config.from_hf(cfg).num_key_value_heads == 8
    config, cfg = _config("diffllama__DiffLlama-0.3B-handcut", mlp_bias=True)
    with pytest.raises(ValueError, match="mlp_bias"):
        config.from_hf(cfg)


def test_ministral_8b_2410_as_released_is_served_by_mistral():
    config, cfg = _config("mistral__Ministral-8B-Instruct-2410")
    assert config.__module__.endswith("mistral.model")
    c = config.from_hf(cfg)
    assert (c.sliding_window, c.max_position_embeddings) == (32768, 32768)


@pytest.mark.parametrize("edit", [{"sliding_window": 4096},
                                  {"max_position_embeddings": 131072}])
def test_mistral_layer_types_other_than_transformers_reading_are_refused(edit):
    config, cfg = _config("mistral__Ministral-8B-Instruct-2410", **edit)
    with pytest.raises(ValueError, match="layer_types"):
        config.from_hf(cfg)


def test_mistral_layer_types_all_sliding_are_served():
    config, cfg = _config("mistral__Ministral-8B-Instruct-2410", sliding_window=4096,
                          layer_types=["sliding_attention"] * 36)
    assert config.from_hf(cfg).sliding_window == 4096


_FALCON_RW = {"alibi": True, "parallel_attn": False, "bias": True, "multi_query": False,
              "new_decoder_architecture": False, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 4,
              "num_hidden_layers": 2}


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_falcon_rw_alibi_sequential_is_served(tiny_checkpoint, tp):
    from test_released_settings import _TOKENS, _served_as_transformers

    want = _served_as_transformers(tiny_checkpoint("FalconForCausalLM", overrides=_FALCON_RW), "Falcon-RW form", tp)
    # sensitivity: the ALiBi bias matters (transformers' tokens with the rotary form instead differ)
    assert _TOKENS.hf(tiny_checkpoint("FalconForCausalLM", overrides={**_FALCON_RW, "alibi": False})) != want


def test_falcon_alibi_bias_is_transformers_bfloat16_bias():
    """32 heads (Falcon-RW-1B's): slopes 2 ** (-i / 4), not powers of two, so transformers' bfloat16 bias (rounded at
    the absolute key positions) differs from the float32 relative one beyond what the softmax shift absorbs. Past
    position 256 transformers rounds the positions themselves to bfloat16 (257 -> 256): 600 positions cover it (a
    blind exercise found the engine off from position 257 when they were kept exact)."""
    import math

    import torch
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    from xllm_gen.runtime.attention.torch_ref import alibi_bias
    from xllm_gen.runtime.layers.attention import alibi_slopes

    heads, head_dim, n = 32, 64, 600
    want = build_alibi_tensor(torch.ones(1, n, dtype=torch.long), heads, torch.float32).view(heads, 1, n)
    want = want / math.sqrt(head_dim)                                    # FalconModel.forward's scaling
    slopes = alibi_slopes(heads).view(heads, 1, 1)
    kpos, qpos = torch.arange(n)[None, :], torch.arange(n)[:, None]
    got = alibi_bias(slopes, kpos, qpos, head_dim ** -0.5)              # [heads, 1, n]: the same for every query
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    rel = alibi_bias(slopes * head_dim ** -0.5, kpos, qpos)               # the float32 relative form
    shift = (rel - want).amax(-1, keepdim=True)                          # the softmax-invariant per-query offset
    assert (rel - want - shift).abs().max() > 1e-3


def test_falcon_new_decoder_sequential_is_refused():
    """transformers' new-decoder layer reads its parallel norms (ln_attn) whatever parallel_attn says, and fails on a
    sequential file: refused by name rather than served as some other form."""
    config, cfg = _config("falcon__falcon-40b", parallel_attn=False)
    with pytest.raises(ValueError, match="sequential_old_decoder"):
        config.from_hf(cfg)
    config, cfg = _config("falcon__falcon-rw-1b")
    c = config.from_hf(cfg)
    assert (c.alibi, c.parallel_attn) == (True, False)


def test_falcon_old_decoder_fewer_kv_heads_is_refused():
    """The old decoder without multi-query stores q/k/v per head; transformers' Falcon fails on such a file that says
    fewer KV heads (num_kv_heads 8 of 32): refused by name, not served in the per-group layout."""
    config, cfg = _config("falcon__falcon-rw-1b", num_kv_heads=8)
    with pytest.raises(ValueError, match="old_decoder_kv_per_head"):
        config.from_hf(cfg)
    config, cfg = _config("falcon__falcon-rw-1b", num_kv_heads=32)
    assert config.from_hf(cfg).num_kv_heads == 32
