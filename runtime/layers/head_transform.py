"""The LM head's input transform (`decoder.head_transform`): a prediction head, `norm(act(dense(x)))`, between
the decoder's final norm and the LM head projection (dense -> GELU -> LayerNorm, e.g.)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from xllm_gen.runtime.layers.activation import act
from xllm_gen.runtime.layers.linear import ReplicatedLinear


class HeadTransform(nn.Module):
    """y = norm(act(dense(x))): `dense` a replicated linear `[out, in]` (and bias), `act` from the activation table,
    `norm` a LayerNorm / RMSNorm module of width `out` (None: none). Replicated on every rank: each rank computes the
    whole transform of its tokens, and the vocab-parallel LM head reads it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, activation: str,
                 norm: Optional[nn.Module] = None):
        super().__init__()
        self.dense = ReplicatedLinear(in_features, out_features, bias=bias)
        self.act_fn = act(activation)
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act_fn(self.dense(x))
        return x if self.norm is None else self.norm(x)
