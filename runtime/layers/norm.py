"""Normalization layers."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime import ops


class RMSNorm(nn.Module):
    """HF Qwen3RMSNorm math (float32 variance, `weight * x_normed.to(input_dtype)`).

    forward(x) -> y; forward(x, residual) -> (y, x + residual) with y = rmsnorm(x + residual);
    forward(x, None) -> (rmsnorm(x), x)  (the first layer of a residual stream).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = ..., /):
        if residual is ...:
            return ops.rms_norm(x, self.weight, self.eps)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps), x
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class LayerNorm(nn.Module):
    """nn.LayerNorm math with params `weight` [dim] and `bias` [dim] (when bias=True)."""

    def __init__(self, dim: int, eps: float = 1e-6, bias: bool = True):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, bias={self.bias is not None}"
