"""Sensitivity arms of the attention-only / MoE families added by spec (specs/hy_v3.yaml, ...): perturbing or
switching a feature changes transformers' output, and the engine serves the changed checkpoint alike."""
from __future__ import annotations

import pytest
import torch
from test_norm_dataflow import _arm, _edit_tensors


@pytest.mark.slow
def test_hy_v3_shared_expert_bias_matters(tiny_checkpoint, tmp_path):
    """Hy3's shared MLP carries biases where mlp_bias is set (`shared_expert.bias`): perturbing only the shared
    MLP's biases moves transformers' tokens, and the engine follows."""
    base = tiny_checkpoint("HYV3ForCausalLM", overrides={"mlp_bias": True})
    g = torch.Generator().manual_seed(11)

    def edit(name, t):
        return 2.0 * torch.randn(t.shape, generator=g) if ".mlp.shared_mlp." in name and name.endswith(".bias") else None
    _arm(base, _edit_tensors(base, tmp_path / "hy_v3_shared_bias", edit), "perturbing the shared MLP's biases")
