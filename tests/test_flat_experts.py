"""Stacked expert parameters from one tensor per segment holding every expert, stored stacked [E, rows, cols] or
flat [E * rows, cols] (DBRX's experts.mlp.w1 / v1 / w2), the flat down projection read transposed: the loaded
parameter equals the per-expert matrices, and a tensor of the wrong size is refused naming the shapes."""
from __future__ import annotations

import pytest
import torch


def _moe(E=3, H=8, I=6):
    from xllm_gen.runtime import layers as L
    return L.FusedMoE(E, H, I, 2, True, "silu")


def test_flat_and_stacked_segments_load():
    from xllm_gen.runtime.executor.sharding import WeightLoadError

    E, H, I = 3, 8, 6
    moe = _moe(E, H, I)
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g),
                      torch.randn(E, H, I, generator=g))
    p = moe.experts.gate_up_proj if hasattr(moe, "experts") else moe.gate_up_proj
    d = moe.experts.down_proj if hasattr(moe, "experts") else moe.down_proj
    p.weight_loader(p, gate.reshape(E * I, H), "gate")                 # flat [E * I, H]
    p.weight_loader(p, up, "up")                                       # stacked [E, I, H]
    d.weight_loader(d, down.transpose(1, 2).reshape(E * I, H), None)   # flat, each expert stored [in, out]
    torch.testing.assert_close(p.data, torch.cat([gate, up], dim=1), atol=0, rtol=0)
    torch.testing.assert_close(d.data, down, atol=0, rtol=0)
    assert p.tp_split.segment_indices("gate") == tuple(range(0, 2 * E, 2))
    with pytest.raises(WeightLoadError, match="expected"):
        p.weight_loader(p, torch.randn(E * I + 1, H), "gate")
