"""Laguna (specs/laguna.yaml): the per-layer rotating share (`rotary.fraction` reading `layer`: half of a full layer's
head, all of a sliding layer's), the per-head softplus output gate (`attention.out_gate: {per: head}`) and per-layer
query head counts (`heads: "num_attention_heads_per_layer[layer]"`: each layer's projections and KV cache at its own
shape). Arms on the tiny checkpoint (sliding, full, sliding layers; conformance checks it as built): each changes
transformers' tokens and the engine must agree."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

ARCH = "LagunaForCausalLM"


def _check(ckpt, arm, seed, label):
    from test_scalings import _agree, _engine, _hf

    prompt = np.random.default_rng(seed).integers(0, 400, 12).tolist()
    base, want = _hf(ckpt, prompt), _hf(arm, prompt)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), f"{label} changes nothing"
    _agree(_engine(arm, prompt), want, label)


@pytest.mark.engine
def test_per_layer_rotary_fraction(tiny_checkpoint, tmp_path):
    from fixtures.tiny_hf import edit_config

    ckpt = tiny_checkpoint(ARCH)

    def edit(cfg):     # the sliding layers rotate half of the head too
        assert cfg["rope_parameters"]["sliding_attention"]["partial_rotary_factor"] == 1.0
        cfg["rope_parameters"]["sliding_attention"]["partial_rotary_factor"] = 0.5

    _check(ckpt, edit_config(ckpt, tmp_path / "frac", edit), 8, "sliding partial_rotary_factor 0.5")


@pytest.mark.slow
@pytest.mark.engine
def test_per_head_gate(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = tiny_checkpoint(ARCH)
    arm = tmp_path / "gate"
    shutil.copytree(ckpt, arm)
    tensors = load_file(str(arm / "model.safetensors"))
    hit = [k for k in tensors if k.endswith("self_attn.g_proj.weight")]
    assert hit and tensors[hit[0]].shape[0] == 4          # one gate per head
    for k in hit:
        tensors[k] = -tensors[k]
    save_file(tensors, str(arm / "model.safetensors"), metadata={"format": "pt"})
    _check(ckpt, arm, 9, "negated per-head gate")


def test_guard_refuses_unmodeled_forms():
    from conformance.families import config_json

    from generated.laguna.model import Config

    for field, value in [("gating", "per-element"), ("moe_router_logit_softcapping", 5.0),
                         ("moe_apply_router_weight_on_input", True)]:
        with pytest.raises(Exception) as e:
            Config.from_hf({**config_json(ARCH), field: value})
        assert field in str(e.value), (field, str(e.value))


@pytest.mark.engine
def test_per_layer_head_counts(tiny_checkpoint, tmp_path):
    """num_attention_heads_per_layer [4, 2, 4]: layer 1 has 2 query heads (its q / g / o projections half as wide, one
    query head per KV head). Served in agreement with transformers; the same weights under a config.json that swaps
    two layers' counts are refused at load, naming a tensor whose shape does not fit (never served wrong)."""
    from fixtures.tiny_hf import edit_config

    from xllm_gen import LLM

    ckpt = tiny_checkpoint(ARCH, overrides={"num_attention_heads_per_layer": [4, 2, 4]})
    prompt = np.random.default_rng(11).integers(0, 400, 12).tolist()
    from test_scalings import _agree, _engine, _hf

    _agree(_engine(ckpt, prompt), _hf(ckpt, prompt), "per-layer head counts [4, 2, 4]")

    def swap(cfg):
        cfg["num_attention_heads_per_layer"] = [2, 4, 4]

    bad = edit_config(ckpt, tmp_path / "swapped", swap)
    with pytest.raises(Exception) as e:
        LLM(model=str(bad), device="cpu", dtype="float32")
    assert "layers.0.self_attn" in str(e.value) or "layers.1.self_attn" in str(e.value), str(e.value)
