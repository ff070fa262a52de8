"""ERNIE 4.5 MoE (specs/ernie4_5_moe.yaml): the MoE routing keys `renormalize_min` (the renormalizing sum clamped to
at least moe_norm_min) and the selection-only bias read through a `weights` entry's `squeeze` (stored [1, E]).
The arm on the tiny checkpoint (dense layer 0, MoE layers 1-2): a moe_norm_min above any top-k sum (the clamp
binds): transformers' output must change and the engine must still agree."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_scalings import _agree, _engine, _hf

ARCH = "Ernie4_5_MoeForCausalLM"


def test_selection_bias_is_live_in_the_checkpoint(tiny_checkpoint):
    from safetensors import safe_open

    ckpt = tiny_checkpoint(ARCH)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        bias = f.get_tensor("model.layers.1.mlp.moe_statics.e_score_correction_bias")
    assert bias.shape == (1, 8) and bias.abs().max() > 0.05      # nonzero: the battery's parity exercises it


def test_renormalize_min_clamps_the_sum():
    from xllm_gen.runtime.ops import moe as moe_ops

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, _ = moe_ops.select_experts(logits, 2, True)
    assert torch.allclose(w.sum(), torch.tensor(1.0))
    p = torch.softmax(logits, -1).topk(2).values
    w, _ = moe_ops.select_experts(logits, 2, True, renormalize_min=2.0)
    assert torch.allclose(w.sort(descending=True).values, p / 2.0)


@pytest.mark.engine
def test_moe_norm_min_matters(tiny_checkpoint, tmp_path):
    edit = "moe_norm_min"
    from fixtures.tiny_hf import edit_config

    ckpt = tiny_checkpoint(ARCH)
    prompt = np.random.default_rng(13).integers(0, 400, 11).tolist()
    base = _hf(ckpt, prompt)
    _agree(_engine(ckpt, prompt), base, "as built")

    def arm_cfg(cfg):
        cfg["moe_norm_min"] = 1.5                    # top-k softmax sums are <= 1: the clamp binds

    arm = edit_config(ckpt, tmp_path / edit, arm_cfg)
    want = _hf(arm, prompt)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), \
        f"{edit}: changes nothing in transformers' output on the tiny checkpoint: no arm"
    _agree(_engine(arm, prompt), want, edit)
