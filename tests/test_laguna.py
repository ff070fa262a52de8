"""Laguna (specs/laguna.yaml): the per-layer rotating share (`rotary.fraction` reading `layer`: half of a full layer's
head, all of a sliding layer's) and the per-head softplus output gate (`attention.out_gate: {per: head}`). Arms on the
tiny checkpoint (sliding, full, sliding layers; conformance checks it as built): each changes transformers' tokens and
the engine must agree."""
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
                         ("num_attention_heads_per_layer", [4, 2, 4]),
                         ("moe_apply_router_weight_on_input", True)]:
        with pytest.raises(Exception) as e:
            Config.from_hf({**config_json(ARCH), field: value})
        assert field in str(e.value), (field, str(e.value))
