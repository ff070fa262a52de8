"""An RMSNorm of each routed expert's output with that expert's own weight (the spec's `moe.expert_out_norm`; Ergo's
`experts.post_expert_norm`): `y_e = rmsnorm(expert_e(x)) * weight[e]` in float32, cast back, before the routing
weights. The weight `[experts, hidden]` (float32) is split over the ranks by whole experts, as the experts are
(`parallel: expert`): each rank normalizes the outputs of the experts it holds, which are whole there."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ExpertNorm(nn.Module):
    def __init__(self, local_experts: int, hidden: int, eps: float):
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(local_experts, hidden, dtype=torch.float32))

    def forward(self, y: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """y [rows, hidden] the experts' outputs, expert [rows] this rank's expert of each row."""
        normed = F.rms_norm(y.float(), (y.shape[-1],), eps=self.eps)
        return (normed * self.weight[expert].float()).to(y.dtype)

    def extra_repr(self) -> str:
        return f"experts={self.weight.shape[0]} (this rank), hidden={self.weight.shape[1]}, eps={self.eps}"
