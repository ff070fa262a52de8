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
