"""Families new in transformers 5.25, served by spec (h25): MiniCPM 5 MoE (specs/minicpm5_moe.yaml: GLM-4-MoE's
decoder with an output gate per element in q_gate_proj's rows, whole-head rotary, MLP kinds from mlp_layer_types).

Fast: greedy parity with transformers at TP 1 (float32, CPU) on the tiny checkpoint (DeepSeek-V3 routing over 8
experts in 4 groups, a dense first layer); the config guard reads what transformers reads and refuses by name what the
spec does not model. Slow: TP 2, and the output gate is load-bearing (its rows scaled: transformers' tokens move, the
engine follows). The features-ON configs are the conformance battery's (tests/conformance/). And the model types
transformers 5.25 serves with Glm4MoeForCausalLM (param2moe; sarvam_moe) take their own config classes' defaults."""
from __future__ import annotations

import copy

import pytest
import torch
from fixtures.tiny_hf import tiny_config
from test_norm_dataflow import _arm, _edit_tensors
from test_spec_battery import Tokens, _assert_same

MINICPM5 = "MiniCPM5MoeForCausalLM"

needs_525 = pytest.mark.skipif(not hasattr(__import__("transformers"), "MiniCPM5MoeConfig"),
                               reason="transformers < 5.25 has no MiniCPM5Moe")


def _config_json(architecture: str, overrides: dict | None = None) -> dict:
    return copy.deepcopy(tiny_config(architecture, overrides).to_dict())


def _config(module: str, hf: dict):
    import importlib
    return importlib.import_module(f"xllm_gen.generated.{module}.model").Config.from_hf(hf)


def _refusal(module: str, hf: dict) -> str:
    from xllm_gen.runtime.loading.hf_config import ConfigError
    with pytest.raises(ConfigError) as e:
        _config(module, hf)
    return str(e.value)


@pytest.fixture(scope="module")
def tokens() -> Tokens:
    return Tokens()


@needs_525
@pytest.mark.engine
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["tp1", "tp2"])
def test_minicpm5_moe_parity(tiny_checkpoint, tokens, tp):
    ckpt = tiny_checkpoint(MINICPM5)
    _assert_same(tokens.engine(ckpt, tp), tokens.hf(ckpt), f"minicpm5_moe tp={tp}")


@needs_525
def test_minicpm5_moe_config_guard():
    """head_dim: absent 128, null hidden_size // heads (transformers' __post_init__); mlp_layer_types read, else from
    first_k_dense_replace; no gated attention, a partial rotary and q/k norms are refused by name."""
    hf = _config_json(MINICPM5)
    assert _config("minicpm5_moe", hf).head_dim == 16
    assert _config("minicpm5_moe", {k: v for k, v in hf.items() if k != "head_dim"}).head_dim == 128
    assert _config("minicpm5_moe", {**hf, "head_dim": None}).head_dim == 64 // 4
    legacy = {k: v for k, v in hf.items() if k != "mlp_layer_types"}
    assert _config("minicpm5_moe", {**legacy, "first_k_dense_replace": 2}).mlp_layer_types == ("dense", "dense",
                                                                                                  "sparse")
    assert "use_gated_attention" in _refusal("minicpm5_moe", {**hf, "use_gated_attention": False})
    rope = {**hf, "rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": 0.5}}
    assert "partial_rotary_factor" in _refusal("minicpm5_moe", rope)
    assert "use_qk_norm" in _refusal("minicpm5_moe", {**hf, "use_qk_norm": True})


@needs_525
@pytest.mark.slow
def test_minicpm5_moe_output_gate_matters(tiny_checkpoint, tmp_path):
    """The gate rows of q_gate_proj (each head's second half) scaled: transformers' tokens move, the engine follows."""
    base = tiny_checkpoint(MINICPM5)
    cfg = _config_json(MINICPM5)
    d = cfg["head_dim"]

    def edit(name, t):
        if not name.endswith("self_attn.q_proj.weight"):      # q_gate_proj in memory, q_proj stored
            return None
        t = t.clone().view(cfg["num_attention_heads"], 2 * d, -1)
        t[:, d:] *= torch.linspace(-3.0, 3.0, d).view(1, d, 1)
        return t.view(-1, t.shape[-1])
    _arm(base, _edit_tensors(base, tmp_path / "gate", edit), "scaling the output gate's rows of q_gate_proj")


@pytest.mark.parametrize("model_type", ["glm4_moe", "param2moe", "sarvam_moe"])
def test_glm4_moe_defaults_follow_the_model_type(model_type):
    """transformers serves Param2 MoE and Sarvam MoE with Glm4MoeForCausalLM, each with its own config class: a field
    that config.json omits takes that class's default (specs/glm4_moe.yaml's default expressions over model_type)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    omit = ("rms_norm_eps", "head_dim", "tie_word_embeddings", "max_position_embeddings", "use_qk_norm",
            "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
            "routed_scaling_factor")
    hf = {k: v for k, v in CONFIG_MAPPING[model_type]().to_dict().items() if k not in omit}
    hf["rope_parameters"] = {"rope_type": "default"}           # theta and partial_rotary_factor absent too
    ref = CONFIG_MAPPING[model_type](**{k: v for k, v in hf.items() if k not in ("model_type", "transformers_version")})
    cfg = _config("glm4_moe", hf)
    for name in omit[2:]:
        assert getattr(cfg, name) == getattr(ref, name), name
    assert cfg.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert cfg.head_dim == getattr(ref, "head_dim", ref.hidden_size // ref.num_attention_heads)
    assert cfg.rope_theta == ref.rope_parameters["rope_theta"]
    assert cfg.partial_rotary_factor == ref.rope_parameters["partial_rotary_factor"]
