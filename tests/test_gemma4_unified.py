"""Gemma4UnifiedForCausalLM (gemma4_unified_text, the 12B's text decoder) is served by specs/gemma4.yaml: transformers'
unified text model is Gemma 4's decoder without per-layer inputs and without the MoE block (same attention, MLP,
norms, layer_scalar, KV sharing). Its config class has other defaults (a 1024 window, 262144 positions, no per-layer
inputs), which the spec reads by model_type; a unified config.json asking for per-layer inputs or the MoE (fields
transformers' unified model ignores) is refused by name. Greedy parity of the tiny checkpoint (and its feature-ON
form) is the conformance battery's (tests/conformance, Gemma4UnifiedForCausalLM)."""
from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

ARCH = "Gemma4UnifiedForCausalLM"


def _cfg(tiny_checkpoint):
    return json.loads((tiny_checkpoint(ARCH) / "config.json").read_text())


def test_unified_defaults_follow_its_config_class(tiny_checkpoint):
    """Absent fields take the unified config class's defaults, not gemma4_text's (transformers' own values)."""
    transformers = pytest.importorskip("transformers")
    mod = importlib.import_module("xllm_gen.generated.gemma4.model")
    cfg = _cfg(tiny_checkpoint)
    for field in ("sliding_window", "max_position_embeddings"):
        cfg.pop(field, None)
    c = mod.Config.from_hf(cfg)
    ref = transformers.Gemma4UnifiedTextConfig()
    assert (c.sliding_window, c.max_position_embeddings) == (ref.sliding_window, ref.max_position_embeddings)
    assert c.hidden_size_per_layer_input == 0 and not c.enable_moe_block
    text = mod.Config.from_hf({**cfg, "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"]})
    assert (text.sliding_window, text.max_position_embeddings, text.hidden_size_per_layer_input) == (512, 131072, 256)


@pytest.mark.parametrize("extra", [{"hidden_size_per_layer_input": 8}, {"enable_moe_block": True, "num_experts": 4,
                                                                        "top_k_experts": 2,
                                                                        "moe_intermediate_size": 8}])
def test_unified_refuses_what_its_model_ignores(extra, tiny_checkpoint):
    from xllm_gen.runtime.loading.hf_config import ConfigError

    mod = importlib.import_module("xllm_gen.generated.gemma4.model")
    with pytest.raises(ConfigError, match="unified_is_dense"):
        mod.Config.from_hf({**_cfg(tiny_checkpoint), **extra})


@pytest.mark.engine
def test_unified_parity(tiny_checkpoint):
    """The default tiny unified checkpoint: greedy tokens and log-probabilities as transformers' in float32."""
    from test_scalings import _agree, _engine, _hf

    ckpt = tiny_checkpoint(ARCH)
    prompt = np.random.default_rng(31).integers(0, 400, 12).tolist()
    _agree(_engine(ckpt, prompt), _hf(ckpt, prompt), "gemma4 unified")
