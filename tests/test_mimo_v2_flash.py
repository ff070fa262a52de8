"""MiMo-V2-Flash (specs/mimo_v2_flash.yaml): attention shapes per layer type (the sliding layers have twice the KV
heads of the full ones), value heads of their own width (`v_head_dim`) scaled by `attention_value_scale`, attention
sinks on the sliding layers only. The tiny checkpoint (tests/fixtures/tiny_hf.py: full, sliding, sliding layers; q/k
heads 24, value heads 16) is checked as built by the spec and conformance batteries; the arms here switch a feature off
or corrupt it: transformers' tokens must change and the engine must agree, or the engine must refuse by name."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

ARCH = "MiMoV2FlashForCausalLM"


def _check(ckpt, arm, seed, label):
    from test_scalings import _agree, _engine, _hf

    prompt = np.random.default_rng(seed).integers(0, 400, 12).tolist()
    base, want = _hf(ckpt, prompt), _hf(arm, prompt)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), f"{label} changes nothing"
    _agree(_engine(arm, prompt), want, label)


@pytest.mark.slow
@pytest.mark.engine
def test_sinks_of_the_sliding_layers_only(tiny_checkpoint, tmp_path):
    """The sliding layers' sinks (`attention_sink_bias`, the full layer has none) made large: transformers' tokens
    change and the engine follows (a per-layer `sinks` flag: the parameter exists and is used where it holds)."""
    from safetensors.torch import load_file, save_file

    ckpt = tiny_checkpoint(ARCH)
    arm = tmp_path / "sinks"
    shutil.copytree(ckpt, arm)
    tensors = load_file(str(arm / "model.safetensors"))
    hit = sorted(k for k in tensors if k.endswith("self_attn.attention_sink_bias"))
    assert hit == ["model.layers.1.self_attn.attention_sink_bias", "model.layers.2.self_attn.attention_sink_bias"]
    for k in hit:
        tensors[k] = tensors[k] + 3.0
    save_file(tensors, str(arm / "model.safetensors"), metadata={"format": "pt"})
    _check(ckpt, arm, 4, "larger sinks on the sliding layers")


@pytest.mark.slow
@pytest.mark.engine
def test_value_scale_off(tiny_checkpoint, tmp_path):
    """attention_value_scale null: transformers scales the values by 1.0 (not 0.707); the engine follows."""
    from fixtures.tiny_hf import edit_config

    ckpt = tiny_checkpoint(ARCH)

    def edit(cfg):
        assert cfg["attention_value_scale"] == 0.707
        cfg["attention_value_scale"] = None

    _check(ckpt, edit_config(ckpt, tmp_path / "vscale", edit), 6, "attention_value_scale null")


def test_layer_types_swapped_is_refused(tiny_checkpoint, tmp_path):
    """The same weights under a config.json whose layer types are swapped (layer 0 sliding, layer 1 full): each
    layer's KV head count follows its type, so the k / v projections and the sinks no longer fit: refused at load,
    naming the tensor (never served wrong)."""
    from fixtures.tiny_hf import edit_config

    from xllm_gen import LLM

    ckpt = tiny_checkpoint(ARCH)

    def edit(cfg):
        assert cfg["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
        cfg["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]

    bad = edit_config(ckpt, tmp_path / "swapped", edit)
    with pytest.raises(Exception) as e:
        LLM(model=str(bad), device="cpu", dtype="float32")
    assert "model.layers.0.self_attn" in str(e.value) or "model.layers.1.self_attn" in str(e.value), str(e.value)


def test_per_layer_shapes_and_cache():
    """Each layer's attention and KV cache at its shape: the full layer 2 KV heads, the sliding ones 4; keys of 24,
    values of 16 (no padding); the cache's bytes per block sum the layers."""
    import torch
    from conformance.families import config_json

    from generated.mimo_v2_flash.model import Config, Model
    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.executor.model_runner import ModelRunner

    cfg = Config.from_hf(config_json(ARCH))
    with torch.device("meta"):
        model = Model(cfg)
    attn = [m for m in model.modules() if isinstance(m, L.Attention)]
    assert [(a.num_heads, a.num_kv_heads, a.head_dim, a.v_head_dim, a.variant.sinks) for a in attn] == \
        [(4, 2, 24, 16, False), (4, 4, 24, 16, True), (4, 4, 24, 16, True)]
    runner = type("R", (), {})()
    runner.attn_layers, runner.kv_dtype, runner.block_size = attn, torch.float32, 4
    runner.dtype, runner.index_layers = torch.float32, []      # (no sparse-attention indexer key caches)
    assert ModelRunner._kv_bytes_per_block(runner) == 4 * 4 * (2 * 40 + 4 * 40 + 4 * 40)


def test_guard_refuses_unmodeled_forms():
    from conformance.families import config_json

    from generated.mimo_v2_flash.model import Config

    base = config_json(ARCH)
    rope = base["rope_parameters"]
    cases = [
        ("rope_type", {**base, "rope_parameters": {**rope, "full_attention": {**rope["full_attention"],
                                                                              "rope_type": "linear", "factor": 2.0}}}),
        ("rotary_dims_sliding", {**base, "rope_parameters": {**rope, "sliding_attention": {
            **rope["sliding_attention"], "partial_rotary_factor": 0.05}}}),
        ("n_group", {**base, "n_group": 8, "topk_group": 1}),
    ]
    for field, cfg in cases:
        with pytest.raises(Exception) as e:
            Config.from_hf(cfg)
        assert field in str(e.value), (field, str(e.value))
