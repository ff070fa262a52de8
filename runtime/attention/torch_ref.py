"""Pure-torch paged attention: the CPU backend and the oracle of the CUDA backends."""
from __future__ import annotations

from typing import Optional

import torch

from xllm_gen.runtime.attention.base import FULL, AttentionBackend, AttentionVariant
from xllm_gen.runtime.executor.context import ForwardContext


class TorchPagedBackend(AttentionBackend):
    """Gathers each sequence's K/V from the paged cache through its block table and runs causal attention
    in float32; the query's tokens are the last `query_len` of the sequence's `seq_len` tokens. GQA: query
    head h reads KV head h // (H // Hk). A sequence with no KV (padding row) gives zeros.
    If the caches are empty (no KV cache attached, e.g. a cache-less prefill), the step's k/v are used.
    Variants (sliding window, logit soft-cap) are applied per call: no per-variant plan is needed."""

    def __init__(self):
        self._ctx = None
        self._seq_lens = None
        self._q_bounds = None

    def plan(self, ctx: ForwardContext) -> None:
        self._ctx = ctx
        self._seq_lens = ctx.seq_lens_cpu if ctx.seq_lens_cpu is not None else ctx.seq_lens.tolist()
        cu = ctx.cu_seqlens_q.tolist()
        self._q_bounds = list(zip(cu[:-1], cu[1:]))

    def forward(self, q, k, v, k_cache, v_cache, ctx, scale, variant: Optional[AttentionVariant] = None):
        if ctx is not self._ctx:
            self.plan(ctx)
        variant = variant or FULL
        N, H, D = q.shape
        Hk = k.shape[1]
        out = torch.zeros(N, H, D, dtype=q.dtype, device=q.device)
        use_cache = k_cache is not None and k_cache.numel() > 0
        bs = k_cache.shape[1] if use_cache else ctx.block_size
        for i, ((q0, q1), L) in enumerate(zip(self._q_bounds, self._seq_lens)):
            qlen = q1 - q0
            if qlen == 0 or L == 0:
                continue
            if use_cache:
                nblk = (L + bs - 1) // bs
                blocks = ctx.block_tables[i, :nblk].long()
                ks = k_cache[blocks].reshape(-1, Hk, D)[:L]
                vs = v_cache[blocks].reshape(-1, Hk, D)[:L]
            else:
                if L != qlen:
                    raise ValueError("without a KV cache every sequence must be computed whole")
                ks, vs = k[q0:q1], v[q0:q1]
            out[q0:q1] = attend(q[q0:q1], ks, vs, scale, L - qlen, variant.sliding_window,
                                variant.logit_softcap).to(q.dtype)
        return out

    def reset(self) -> None:
        self._ctx = None
        self._seq_lens = None
        self._q_bounds = None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int,
           sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None) -> torch.Tensor:
    """Causal attention of q [Q, H, D] against k, v [L, Hk, D]; query j sits at position q_offset + j.

    HF eager semantics: scores = q k^T * scale; with logit_softcap c, scores = c * tanh(scores / c) (before the
    mask); key p is visible to query position i iff p <= i and, with a sliding window W, p > i - W."""
    Q, H, D = q.shape
    L, Hk, _ = k.shape
    g = H // Hk
    qf = q.float().transpose(0, 1)                                   # [H, Q, D]
    kf = k.float().repeat_interleave(g, dim=1).transpose(0, 1)       # [H, L, D]
    vf = v.float().repeat_interleave(g, dim=1).transpose(0, 1)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale                 # [H, Q, L]
    if logit_softcap is not None:
        s = torch.tanh(s / logit_softcap) * logit_softcap
    qpos = torch.arange(Q, device=q.device)[:, None] + q_offset
    kpos = torch.arange(L, device=q.device)[None, :]
    hidden = kpos > qpos
    if sliding_window is not None:
        hidden = hidden | (kpos <= qpos - sliding_window)
    s = s.masked_fill(hidden, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, vf).transpose(0, 1)                       # [Q, H, D]
