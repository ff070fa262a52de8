"""Guards and sensitivity arms of the near-Llama families added by spec in h10 (specs/apertus1p5.yaml,
specs/cohere_compass.yaml, specs/aria_text.yaml, specs/minimax_m3_vl_text.yaml): the config values they do not
model are refused by name (no model is run: fast), and the features they add change transformers' tokens with the
engine following (slow)."""
from __future__ import annotations

import copy

import pytest
import torch
from fixtures.tiny_hf import tiny_config
from test_norm_dataflow import _arm, _edit_tensors


def _config_json(architecture: str, overrides: dict | None = None) -> dict:
    return copy.deepcopy(tiny_config(architecture, overrides).to_dict())


def _from_hf(module: str, hf: dict):
    import importlib
    mod = importlib.import_module(f"xllm_gen.generated.{module}.model")
    return mod.Config.from_hf(hf)


def _refusal(module: str, hf: dict) -> str:
    from xllm_gen.runtime.loading.hf_config import ConfigError
    with pytest.raises(ConfigError) as e:
        _from_hf(module, hf)
    return str(e.value)


def test_apertus1p5_pruned_head_guard():
    """A pruned LM head (output_vocab_size < vocab_size) is read; tied to the wider embedding it is refused, naming
    the tie and the pruned width."""
    hf = _config_json("Apertus1p5TextForCausalLM", {"output_vocab_size": 256})
    assert _from_hf("apertus1p5", hf).lm_head_rows == 256
    hf["tie_word_embeddings"] = True
    msg = _refusal("apertus1p5", hf)
    assert "tie_word_embeddings" in msg and "lm_head_rows" in msg, msg


def test_cohere_compass_rope_mapping_per_layer_type():
    """A null rope mapping turns rotary off on that layer type (theta None); a flat (not per-layer-type) mapping,
    which transformers cannot build, and an unknown layer type are refused by name."""
    hf = _config_json("CohereCompassForCausalLM")
    hf["rope_parameters"]["full_attention"] = None
    cfg = _from_hf("cohere_compass", hf)
    assert cfg.rope_theta_full is None and cfg.rope_theta_sliding == 10000.0
    flat = _config_json("CohereCompassForCausalLM")
    flat["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    assert "rope_parameters.rope_theta" in _refusal("cohere_compass", flat)
    odd = _config_json("CohereCompassForCausalLM")
    odd["layer_types"] = ["sliding_attention", "chunked_attention", "sliding_attention"]
    assert "layer_types" in _refusal("cohere_compass", odd)


def test_minimax_m3_sparse_attention_layers_are_refused():
    """MiniMax-M3's lightning-indexer layers (`minimax_m3_sparse`) are not modeled: refused naming layer_types; so
    is the legacy sparse_attention_config that would introduce them."""
    hf = _config_json("MiniMaxM3VLForCausalLM")
    hf["layer_types"] = ["full_attention", "minimax_m3_sparse", "full_attention"]
    assert "layer_types" in _refusal("minimax_m3_vl_text", hf)
    legacy = _config_json("MiniMaxM3VLForCausalLM")
    legacy["sparse_attention_config"] = {"sparse_attention_freq": [0, 1, 0]}
    assert "sparse_attention_config" in _refusal("minimax_m3_vl_text", legacy)


@pytest.mark.slow
def test_cohere_compass_null_rope_mapping_matters(tiny_checkpoint):
    """Rotary on the full layers (their own mapping) vs none (a null mapping): transformers' tokens move, and the
    engine follows in both forms."""
    base = tiny_checkpoint("CohereCompassForCausalLM")
    nope = tiny_checkpoint("CohereCompassForCausalLM", overrides={"rope_parameters.full_attention": None})
    _arm(base, nope, "a null full_attention rope mapping (NoPE on the full layers)")


@pytest.mark.slow
def test_aria_shared_experts_matter(tiny_checkpoint, tmp_path):
    """Aria's shared experts (always on, summed with the routed ones): perturbing only their weights moves
    transformers' tokens, and the engine follows."""
    base = tiny_checkpoint("AriaTextForCausalLM")
    g = torch.Generator().manual_seed(13)

    def edit(name, t):
        return 3.0 * t * torch.rand(t.shape, generator=g) if ".mlp.shared_experts." in name else None
    _arm(base, _edit_tensors(base, tmp_path / "aria_shared", edit), "perturbing the shared experts")
