"""Routed linears: a projection whose weight is chosen per token and slot from a stack of expert matrices,
`y[t, s] = W[e(t, s)] x[t]` (a mixture of attention heads: each token's top-k attention experts each give it query heads
through their own q projection, and their own output projection maps those heads back, weighted).

The expert choice comes from `topk_softmax` over a replicated router's logits. Both forms run every expert on every
token (one GEMM over the stacked weight, `experts` times the FLOPs of the chosen ones: static shapes, so decode graphs
capture them; plain torch ops on every device) and pick / combine the chosen slots:

- column (`RoutedLinear(..., "column")`): x [T, in] -> [T, S, out_local]; the output rows (a head's `unit` rows each)
  are split over the TP ranks, per expert;
- row (`"row"`): x [T, S, in_local], weights [T, S] -> sum_s weights[t, s] * W[e(t, s)] x[t, s] [T, out]; the input
  columns are split over the ranks per expert, the partial sums all-reduced, then the (replicated) bias added once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.executor.distributed import all_reduce, get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, Segment, raise_or_defer, replicated, split_segment
from xllm_gen.runtime.layers.expert_split import ExpertSplit, _attach_experts


def topk_softmax(logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in `dtype`, expert ids [T, k]): the k largest router logits (computed in float32), their
    softmax (the top-k of the softmax renormalized). Slot s is the s-th largest logit."""
    top, ids = logits.float().topk(top_k, dim=-1)
    return torch.softmax(top, dim=-1).to(dtype), ids


class RoutedLinear(nn.Module):
    """A stack of `num_experts` linear maps `[out, in]` (parameter `weight [experts, out, in]`, no bias in the column
    form; `bias [out]`, replicated, in the row form), applied per token and slot to the chosen expert's matrix."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, parallel: str, unit: int = 1,
                 bias: bool = False, name: str = "routed"):
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(f"RoutedLinear: parallel must be 'column' or 'row', not {parallel!r}")
        if parallel == "column" and bias:
            raise ValueError("RoutedLinear: a column-parallel routed linear has no bias")
        tp, rank = get_tp_size(), get_tp_rank()
        self.tp_size, self.parallel, self.num_experts = tp, parallel, num_experts
        problems: list = []
        owner = type(self).__name__
        split_dim = out_features if parallel == "column" else in_features
        seg = split_segment(Segment(name, split_dim // unit, unit), tp, rank, problems)
        raise_or_defer(self, problems)
        if parallel == "column":
            self.in_features, self.out_features = in_features, seg.rows
            inner = ParamSplit("column", 0, (seg,), (seg.rows, in_features), tp, rank, owner)
        else:
            self.in_features, self.out_features = seg.rows, out_features
            inner = ParamSplit("row", 1, (seg,), (out_features, seg.rows), tp, rank, owner)
        self.weight = nn.Parameter(torch.empty(num_experts, self.out_features, self.in_features))
        _attach_experts(self.weight, ExpertSplit(inner, num_experts, 0, num_experts, "tensor", owner))
        self.bias = replicated(nn.Parameter(torch.empty(out_features)), owner) if bias else None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        E, O, I = self.weight.shape
        T, S = ids.shape
        if self.parallel == "column":           # every expert on every token, then each slot's expert
            y = F.linear(x, self.weight.reshape(E * O, I)).view(T, E, O)
            return y.gather(1, ids.unsqueeze(-1).expand(T, S, O))
        if weights is None:
            raise ValueError("RoutedLinear: the row form combines the slots by their routing weights")
        # z[t, e] = sum over the slots s that chose e of weights[t, s] * x[t, s]; then one GEMM over all experts
        z = x.new_zeros(T, E, I).scatter_add_(1, ids.unsqueeze(-1).expand(T, S, I), x * weights.unsqueeze(-1))
        y = F.linear(z.reshape(T, E * I), self.weight.permute(1, 0, 2).reshape(O, E * I))
        if self.tp_size > 1:
            y = all_reduce(y)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        E, O, I = self.weight.shape
        return f"experts={E}, in={I}, out={O}, {self.parallel}" + (", bias" if self.bias is not None else "")


def output_bias(dim: int) -> nn.Parameter:
    """A replicated bias `[dim]` added to a block's output after its all-reduce (a MoE's output bias)."""
    return replicated(nn.Parameter(torch.empty(dim)), "output_bias")
