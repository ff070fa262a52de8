"""A learned per-channel gate on a residual add (the spec's `residual_gate` block kind, a step's `gate:`):
`x = residual(w) * x + branch(w) * h`, `w` the parameter `weight [hidden]` (kept in float32, replicated), `branch` /
`residual` elementwise formulas over it that the generated code passes as functions of the float32 weight (None: 1).

The layer's steps hand the stream on lazily, as `(h, x)` (the next step's norm adds them), so the gate scales both
parts where they stand: `forward(h, x) -> (branch(w) * h, residual(w) * x)`, the coefficients computed in float32 and
each product cast back to its operand's dtype. Static shapes, no host sync (graph-capturable)."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import nn

from xllm_gen.runtime.executor.sharding import replicated

Formula = Optional[Callable[[torch.Tensor], torch.Tensor]]


class ResidualGate(nn.Module):
    def __init__(self, hidden: int, branch: Formula = None, residual: Formula = None):
        super().__init__()
        if branch is None and residual is None:
            raise ValueError("ResidualGate: both coefficients are 1 (a plain residual add)")
        self.hidden, self.branch, self.residual = hidden, branch, residual
        self.weight = replicated(nn.Parameter(torch.zeros(hidden, dtype=torch.float32)), "residual_gate")

    def coefficients(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(branch(w), residual(w)) in float32 [hidden]; None where the formula is 1."""
        w = self.weight.float()
        return (None if self.branch is None else self.branch(w),
                None if self.residual is None else self.residual(w))

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if x is None:
            raise ValueError("ResidualGate: the step's residual stream is missing (a gate follows a step's add)")
        b, r = self.coefficients()
        if b is not None:
            h = (h.float() * b).to(h.dtype)
        if r is not None:
            x = (x.float() * r).to(x.dtype)
        return h, x

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, branch={'learned' if self.branch else 1}, " \
               f"residual={'learned' if self.residual else 1}"
