"""The attention layer: writes this step's K/V into the paged cache, then runs the step's backend."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from xllm_gen.runtime import ops
from xllm_gen.runtime.attention.base import FULL, make_variant
from xllm_gen.runtime.executor.context import get_context
from xllm_gen.runtime.executor.distributed import get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, Segment, attach, raise_or_defer, split_segment


class Attention(nn.Module):
    """forward(q [N, H, D], k [N, Hk, D], v [N, Hk, D]) -> [N, H * D]. Head counts are per rank.

    sliding_window (None or an int >= 1): key j is visible to query i iff j <= i and j > i - sliding_window
    (HF masking_utils). logit_softcap (None or > 0): scores = cap * tanh(scores / cap) on the scaled scores,
    before masking. Both are per layer: `variant` (an AttentionVariant) is what the backend plans for;
    layers of one model may differ (e.g. alternating sliding-window and full layers).

    `k_cache` / `v_cache` ([num_blocks, block_size, Hk, D], NHD) are plain attributes attached by the runner
    (not parameters or buffers: they are not part of the state dict). The backend comes from the forward
    context (`ctx.backend`, already planned for the step); this layer never imports a backend.

    sinks=True: attention sinks, a learned logit per query head in the softmax denominator; the owning module
    holds the parameter (`attention_sinks`) and passes it to forward(..., sinks=).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None, sinks: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.variant = make_variant(sliding_window, logit_softcap, sinks)
        self.sliding_window = self.variant.sliding_window
        self.logit_softcap = self.variant.logit_softcap
        self.k_cache = torch.tensor([])
        self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: Optional[torch.Tensor] = None, kv_stored: bool = False) -> torch.Tensor:
        """kv_stored: this step's k, v are already in the cache (L.qk_norm_rope_store wrote them)."""
        ctx = get_context()
        if (sinks is not None) != self.variant.sinks:
            raise ValueError("Attention: pass `sinks` exactly when the layer was built with sinks=True")
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if ctx.graph_break is not None:      # piecewise prefill capture: attention runs between captured pieces
            return ctx.graph_break(self, q, k, v)
        if self.k_cache.numel() and self.v_cache.numel() and not kv_stored:
            ops.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if self.variant == FULL:
            out = ctx.backend.forward(q, k, v, self.k_cache, self.v_cache, ctx, self.scale)
        elif sinks is not None:
            out = ctx.backend.forward(q, k, v, self.k_cache, self.v_cache, ctx, self.scale, variant=self.variant,
                                      sinks=sinks)
        else:
            out = ctx.backend.forward(q, k, v, self.k_cache, self.v_cache, ctx, self.scale, variant=self.variant)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        s = f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, scale={self.scale}"
        if self.sliding_window is not None:
            s += f", sliding_window={self.sliding_window}"
        if self.logit_softcap is not None:
            s += f", logit_softcap={self.logit_softcap}"
        if self.variant.sinks:
            s += ", sinks=True"
        return s


def attention_sinks(num_heads: int) -> nn.Parameter:
    """The attention-sink logits of `num_heads` query heads (global count), one float per head, split over the
    TP ranks by heads as the query heads are (rank r holds its heads' sinks): a parameter [num_heads / tp]."""
    tp, rank = get_tp_size(), get_tp_rank()
    problems: list = []
    seg = split_segment(Segment("sinks", num_heads, 1), tp, rank, problems)
    param = nn.Parameter(torch.empty(seg.rows))
    holder = nn.Module()
    raise_or_defer(holder, problems)
    return attach(param, ParamSplit("column", 0, (seg,), (seg.rows,), tp, rank, "attention_sinks"))
