"""Activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime import ops


class SiluAndMul(nn.Module):
    """x [..., 2n] -> silu(x[..., :n]) * x[..., n:] (gate | up halves, as a merged gate/up projection gives)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)


class GELU(nn.Module):
    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"GELU approximate must be 'tanh' or 'none', not {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
