"""MiniMax-M2 (specs/minimax_m2.yaml): the config guard on the released config.json's form (MiniMax's own fields,
the legacy `rotary_dim`), and an arm on the rotating share of each head read from `rotary_dim` alone (the
conformance battery checks the tiny checkpoint as built: partial rotary, q/k norms over the projection, sigmoid
routing with a nonzero correction bias)."""
from __future__ import annotations

import numpy as np
import pytest

ARCH = "MiniMaxM2ForCausalLM"

# The released MiniMaxAI/MiniMax-M2 config.json (its fields; sizes as published)
RELEASED = {
    "architectures": [ARCH], "attention_dropout": 0.0, "attn_type_list": [1] * 62, "bos_token_id": None,
    "eos_token_id": None, "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 1536, "layernorm_full_attention_beta": 1.0, "layernorm_linear_attention_beta": 1.0,
    "layernorm_mlp_beta": 1.0, "max_position_embeddings": 196608, "mlp_intermediate_size": 8192,
    "model_type": "minimax_m2", "mtp_transformer_layers": 1, "num_attention_heads": 48, "num_experts_per_tok": 8,
    "num_hidden_layers": 62, "num_key_value_heads": 8, "num_local_experts": 256, "num_mtp_modules": 3,
    "output_router_logits": False, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5000000,
    "rotary_dim": 64, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "scoring_func": "sigmoid",
    "shared_intermediate_size": 0, "shared_moe_mode": "sigmoid", "sliding_window": None,
    "tie_word_embeddings": False, "use_cache": True, "use_mtp": True, "use_qk_norm": True,
    "use_routing_bias": True, "vocab_size": 200064,
}


def _config():
    from generated.minimax_m2.model import Config
    return Config


def test_released_config_is_read():
    cfg = _config().from_hf(dict(RELEASED))
    assert cfg.partial_rotary_factor == 0.5 and cfg.rotary_dims == 64      # rotary_dim 64 of head_dim 128
    assert cfg.rope_theta == 5e6 and cfg.num_local_experts == 256


def test_rope_parameters_factor_wins_over_rotary_dim():
    # transformers: convert_rope_params_to_dict only fills partial_rotary_factor from rotary_dim when absent
    cfg = _config().from_hf({**RELEASED, "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                                             "partial_rotary_factor": 0.25}})
    assert cfg.rotary_dims == 32


@pytest.mark.parametrize("field,value", [
    ("attn_type_list", [0] + [1] * 61),     # a lightning-attention layer
    ("scoring_func", "softmax"),
    ("use_routing_bias", False),
    ("shared_intermediate_size", 1024),
    ("sliding_window", 4096),
    ("use_qk_norm", False),
])
def test_guard_refuses_what_transformers_does_not_compute(field, value):
    with pytest.raises(Exception) as e:
        _config().from_hf({**RELEASED, field: value})
    assert field in str(e.value) or "softmax_attention_layers" in str(e.value)


@pytest.mark.slow
@pytest.mark.engine
def test_rotary_dim_alone_decides_the_rotating_share(tiny_checkpoint, tmp_path):
    """config.json with `rotary_dim` and no partial_rotary_factor (the released form): rotating the whole head
    (rotary_dim = head_dim) must change transformers' tokens and the engine must follow."""
    from fixtures.tiny_hf import edit_config
    from test_scalings import _agree, _engine, _hf

    ckpt = tiny_checkpoint(ARCH)
    prompt = np.random.default_rng(5).integers(0, 400, 13).tolist()

    def legacy(rotary_dim):
        def edit(cfg):
            cfg["rope_parameters"].pop("partial_rotary_factor", None)
            cfg["rotary_dim"] = rotary_dim
        return edit

    half = edit_config(ckpt, tmp_path / "half", legacy(8))
    full = edit_config(ckpt, tmp_path / "full", legacy(16))
    want_half, want_full = _hf(half, prompt), _hf(full, prompt)
    assert want_half[0] != want_full[0] or not np.allclose(want_half[1], want_full[1], atol=1e-3)
    _agree(_engine(half, prompt), want_half, "rotary_dim 8 of 16")
    _agree(_engine(full, prompt), want_full, "rotary_dim 16 of 16")
