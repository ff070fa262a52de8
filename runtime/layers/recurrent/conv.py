"""The depthwise causal conv1d every recurrent mixer runs before its recurrence: `CausalConv1d` (the weight, split
by channel segments under TP), `causal_conv1d` (a prompt chunk from the slot's conv state) and
`causal_conv1d_step` (one batched decode token).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.executor.distributed import get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, Segment, attach, raise_or_defer, split_segment


# ------------------------------------------------------------------------------------------------ conv1d
class CausalConv1d(nn.Module):
    """Depthwise causal conv1d over time of `channels` channels (kernel `kernel`, optional bias), parameter
    `weight [channels, 1, kernel]` as nn.Conv1d stores it. `segments`: the channel segments (name, heads, unit) in
    order, split over TP ranks by heads (each rank holds its heads' channels of every segment)."""

    def __init__(self, segments, kernel: int, bias: bool = False):
        # segments: (name, heads, unit) or (name, heads, unit, replicate_ok): a segment of fewer heads than ranks
        # may be replicated (rank r serves head r // (tp / heads)), as KV heads are
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        problems: list = []
        segs = tuple(split_segment(Segment(*seg), tp, rank, problems) for seg in segments)
        self.channels = sum(s.rows for s in segs)
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(self.channels, 1, kernel))
        attach(self.weight, ParamSplit("column", 0, segs, tuple(self.weight.shape), tp, rank, "CausalConv1d"))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.channels))
            attach(self.bias, ParamSplit("column", 0, segs, tuple(self.bias.shape), tp, rank, "CausalConv1d"))
        raise_or_defer(self, problems)

    def extra_repr(self) -> str:
        return f"channels={self.channels} (per rank), kernel={self.kernel}, bias={self.bias is not None}"


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], state: torch.Tensor,
                  activation: Optional[str] = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [T, C] (this chunk), weight [C, 1, K], state [C, K - 1] (the previous inputs; zeros at the
    start). Returns (act(conv(x)) [T, C], new state [C, K - 1])."""
    C = x.shape[1]
    K = weight.shape[-1]
    ext = torch.cat([state.to(weight.dtype), x.t().to(weight.dtype)], dim=-1)          # [C, K - 1 + T]
    out = F.conv1d(ext.unsqueeze(0), weight, bias, groups=C)[0]                        # [C, T]
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: activation {activation!r} (silu or None)")
    return out.t().to(x.dtype), ext[:, ext.shape[-1] - (K - 1):]


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], state: torch.Tensor,
                       activation: Optional[str] = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step of B sequences: x [B, C], state [B, C, K - 1]. Returns (out [B, C], new state)."""
    ext = torch.cat([state.to(weight.dtype), x.unsqueeze(-1).to(weight.dtype)], dim=-1)   # [B, C, K]
    out = (ext.float() * weight[:, 0].float().unsqueeze(0)).sum(-1)       # accumulated in float32, as conv1d does
    if bias is not None:
        out = out + bias.float()
    out = out.to(weight.dtype)
    if activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype), ext[:, :, 1:]
