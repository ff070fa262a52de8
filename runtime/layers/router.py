"""A router's own input transform and a learned per-expert scale of its routing weights: r = rmsnorm(x) * w * scale
before the router's linear, and each chosen expert's weight times its learned scale (the spec's `router.input_norm` /
`input_weight` / `input_scale` / `expert_scale`)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from xllm_gen.runtime.executor.sharding import replicated
from xllm_gen.runtime.ops import reference


class RouterInput(nn.Module):
    """r = N(x) * weight * scale, each part optional: N a weightless RMSNorm (x / rms(x) in float32, cast back to
    x's dtype) where `eps` is given; `weight` a learned per-channel vector [dim] (replicated); `scale` a constant.
    The multiplications run in the model dtype, in this order."""

    def __init__(self, dim: int, eps: Optional[float] = None, weight: bool = False, scale: Optional[float] = None):
        super().__init__()
        self.dim, self.eps, self.scale = dim, eps, scale
        self.weight = replicated(nn.Parameter(torch.empty(dim)), "router_input") if weight else None
        if eps is not None:
            self.register_buffer("zero", torch.zeros(dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.eps is not None:
            x = reference.rms_norm(x, self.zero, self.eps, 1.0)      # x / rms(x) in float32, cast back
        if self.weight is not None:
            x = x * self.weight
        if self.scale is not None:
            x = x * self.scale
        return x

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, weight={self.weight is not None}, scale={self.scale}"


def expert_scale(num_experts: int) -> nn.Parameter:
    """A learned per-expert scale [num_experts] of the routing weights, replicated: pass it to
    FusedMoE.forward(..., expert_scale=)."""
    return replicated(nn.Parameter(torch.empty(num_experts)), "expert_scale")
