"""Normalization layers."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime import ops


class RMSNorm(nn.Module):
    """RMSNorm with HF math.

    weight_offset 0.0 (default): the w-scaled norm (float32 variance,
    `weight * x_normed.to(input_dtype)`). weight_offset 1.0: the (1 + w) norm, all in float32
    (`x_normed * (1.0 + weight.float())`, then cast to the input dtype); the checkpoint stores w (zero-centred).

    forward(x) -> y; forward(x, residual) -> (y, x + residual) with y = rmsnorm(x + residual);
    forward(x, None) -> (rmsnorm(x), x)  (the first layer of a residual stream).
    """

    def __init__(self, dim: int, eps: float = 1e-6, weight_offset: float = 0.0):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight_offset = float(weight_offset)
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = ..., /):
        if residual is ...:
            return ops.rms_norm(x, self.weight, self.eps, self.weight_offset)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, self.weight_offset), x
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.weight_offset)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}" + (f", weight_offset={self.weight_offset}" if self.weight_offset else "")


class LayerNorm(nn.Module):
    """nn.LayerNorm math with params `weight` [dim] and `bias` [dim] (when bias=True).

    Same residual protocol as RMSNorm, so a decoder step may use either: forward(x) -> y;
    forward(x, residual) -> (layernorm(x + residual), x + residual); forward(x, None) -> (layernorm(x), x).
    """

    def __init__(self, dim: int, eps: float = 1e-6, bias: bool = True):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim)) if bias else None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = ..., /):
        if residual is ...:
            return self._norm(x)
        if residual is None:
            return self._norm(x), x
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, bias={self.bias is not None}"
