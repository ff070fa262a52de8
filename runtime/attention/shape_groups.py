"""Attention layers of different shapes in one model: one backend per shape group.

A backend such as FlashInfer's plans its wrappers for one (query heads, KV heads, head_dim) per step. A model whose
layers differ in shape (per-layer head counts, KV heads or head dims: Laguna's `num_attention_heads_per_layer`,
MiMo-V2-Flash's sliding layers with twice the KV heads) gets a `ShapeGroupBackend`: one backend per distinct shape
(each built, planned and run exactly as for a model of that one shape), planned once per step together, and each
layer's forward dispatched to the backend of its shape (read from q [N, H, D] and the layer's k_cache [.., Hk, D]).
The groups run one after another (layers run in order), so their backends may share a float workspace.
"""
from __future__ import annotations

from typing import Mapping

import torch

from xllm_gen.runtime.attention.base import AttentionBackend
from xllm_gen.runtime.executor.context import ForwardContext


def layer_shape(layer) -> tuple[int, int, int]:
    """An attention layer's per-rank shape key: (query heads, KV heads, head_dim)."""
    return (int(layer.num_heads), int(layer.num_kv_heads), int(layer.head_dim))


class ShapeGroupBackend(AttentionBackend):
    """plan(ctx) plans every group's backend; forward(...) runs the backend of the layer's shape."""

    def __init__(self, groups: Mapping[tuple[int, int, int], AttentionBackend]):
        if not groups:
            raise ValueError("ShapeGroupBackend needs at least one shape group")
        self.groups = dict(groups)

    @property
    def takes_rope(self) -> bool:
        return all(getattr(b, "takes_rope", False) for b in self.groups.values())

    def plan(self, ctx: ForwardContext) -> None:
        for backend in self.groups.values():
            backend.plan(ctx)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, ctx: ForwardContext, scale: float, variant=None, **kw) -> torch.Tensor:
        shape = (q.shape[1], k.shape[1], q.shape[2])
        backend = self.groups.get(shape)
        if backend is None:
            raise RuntimeError(f"attention of shape (heads, kv_heads, head_dim) = {shape} has no planned backend "
                               f"(groups: {sorted(self.groups)})")
        if variant is not None:
            kw["variant"] = variant
        return backend.forward(q, k, v, k_cache, v_cache, ctx, scale, **kw)
