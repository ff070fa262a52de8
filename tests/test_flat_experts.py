"""Stacked expert parameters from one tensor per segment holding every expert, stored stacked [E, rows, cols] or
flat [E * rows, cols] (DBRX's experts.mlp.w1 / v1 / w2), the flat down projection read transposed where the spec
declares it (`transpose: true`): the loaded parameter equals the per-expert matrices; a tensor of the wrong size is
refused naming the shapes, and an undeclared [in, out] one naming `transpose` (never guessed from the shape)."""
from __future__ import annotations

import pytest
import torch


def _moe(E=3, H=8, I=6):
    from xllm_gen.runtime import layers as L
    return L.FusedMoE(E, H, I, 2, True, "silu")


def test_flat_and_stacked_segments_load():
    from xllm_gen.runtime.executor.sharding import WeightLoadError
    from xllm_gen.runtime.loading.weights import TensorLayout

    E, H, I = 3, 8, 6
    moe = _moe(E, H, I)
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g),
                      torch.randn(E, H, I, generator=g))
    p = moe.experts.gate_up_proj if hasattr(moe, "experts") else moe.gate_up_proj
    d = moe.experts.down_proj if hasattr(moe, "experts") else moe.down_proj
    p.weight_loader(p, gate.reshape(E * I, H), "gate")                 # flat [E * I, H]
    p.weight_loader(p, up, "up")                                       # stacked [E, I, H]
    flat_t = down.transpose(1, 2).reshape(E * I, H)                    # flat, each expert stored [in, out]
    with pytest.raises(WeightLoadError, match=r"\(experts, in, out\).*transpose: true"):
        d.weight_loader(d, flat_t, None)                               # undeclared: refused, not guessed
    d.weight_loader(d, TensorLayout("w2", transpose=True).view(flat_t), None)
    torch.testing.assert_close(p.data, torch.cat([gate, up], dim=1), atol=0, rtol=0)
    torch.testing.assert_close(d.data, down, atol=0, rtol=0)
    assert p.tp_split.segment_indices("gate") == tuple(range(0, 2 * E, 2))
    with pytest.raises(WeightLoadError, match="expected"):
        p.weight_loader(p, torch.randn(E * I + 1, H), "gate")


def test_stacked_experts_orientation_is_declared_never_guessed():
    """A stacked [E, in, out] tensor loads only through the declared `transpose`; undeclared, it is refused naming
    the fix (it was read transposed silently when not square, and as [out, in] when square: a spec that forgot
    `transpose` passed on one checkpoint and served another wrong)."""
    from xllm_gen.runtime.executor.sharding import WeightLoadError
    from xllm_gen.runtime.loading.weights import TensorLayout

    E, H, I = 3, 8, 6
    d = _moe(E, H, I).experts.down_proj if hasattr(_moe(E, H, I), "experts") else _moe(E, H, I).down_proj
    down = torch.randn(E, H, I, generator=torch.Generator().manual_seed(1))
    with pytest.raises(WeightLoadError, match="transpose: true"):
        d.weight_loader(d, down.transpose(1, 2).contiguous(), None)
    d.weight_loader(d, TensorLayout("down", transpose=True).view(down.transpose(1, 2).contiguous()), None)
    torch.testing.assert_close(d.data, down, atol=0, rtol=0)
