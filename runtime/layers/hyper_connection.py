"""Hyper-connections: the residual stream as `n` parallel streams `[tokens, n, dim]`, mixed into each block's input
and the block's output mixed back (the spec's `hyper_connection` block kind and `{hyper: HC, ...}` steps;
codegen/README.md, "Hyper-connections").

A `HyperConnection` reads the streams and gives `(x, post, mix)`: `x` the block's input `[tokens, dim]`, `post`
`[tokens, n]` the weights that write the block's output `h` into each stream, `mix` `[tokens, n, n]` (or None: the
identity) the residual mix; `merge` forms the next streams, `out_k = post_k * h + sum_j mix[j, k] * streams_j`. The
coefficients are computed in float32 from parameters kept in float32 (as the reference keeps these modules),
replicated on every rank (each rank holds the whole streams: the blocks' outputs are all-reduced). Static shapes:
nothing depends on the batch's content, so a decode step captures in a CUDA graph.

Two coefficient forms (`form`):
- `fused` (manifold-constrained "mHC" and independent "iHC" hyper-connections): `y = flatten(streams) / rms(...)` (weightless, over n * dim), one projection
  `l = fn @ y` (`fn [m, n * dim]`) split into pre `[n]`, post `[n]` and, with a mix, `[n, n]` logits; each group g
  is `l_g * scale[g] + base_g`; `pre = sigmoid(.) + pre_eps`, `post = magnitude * sigmoid(.) + post_eps`, `mix =
  sinkhorn(softmax_row(.) + mix_eps)` (a column normalization, then `iters - 1` row / column rounds, each sum + eps);
  the block input is `sum_k pre_k * streams_k` (the raw streams).
- `low_rank` (a gated residual): `y = norm(streams)` per stream (a weighted RMSNorm over each stream's dim,
  weight `offset + w` over n * dim), per-channel input gates `w = sigmoid(up(silu(down(y) / n)))` `[n, dim]`, the
  block input `mean_k(w_k * y_k)`; `post = magnitude * sigmoid(inject(y) / n) + post_eps`; no mix (the identity).
Without `post` (a decoder's final collapse) the module gives only `x`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.executor.sharding import replicated


def _param(*shape: int) -> nn.Parameter:
    return replicated(nn.Parameter(torch.empty(*shape, dtype=torch.float32)), "hyper_connection")


def expand_streams(hidden_states: torch.Tensor, streams: int) -> torch.Tensor:
    """The decoder's input as `streams` equal copies: [tokens, dim] -> [tokens, streams, dim]."""
    return hidden_states.unsqueeze(-2).expand(*hidden_states.shape[:-1], streams, hidden_states.shape[-1]).contiguous()


class HyperConnection(nn.Module):
    def __init__(self, streams: int, dim: int, form: str, norm_eps: float, norm_weight: bool = False,
                 norm_offset: float = 0.0, per_stream: bool = False, rank: Optional[int] = None,
                 pre_eps: float = 0.0, post: bool = True, magnitude: float = 1.0, post_eps: float = 0.0,
                 mix: bool = False, sinkhorn_iters: int = 0, mix_eps: float = 0.0):
        super().__init__()
        if form not in ("fused", "low_rank"):
            raise ValueError(f"hyper_connection: form {form!r} is not fused or low_rank")
        self.n, self.dim, self.form = int(streams), int(dim), form
        self.norm_eps, self.norm_offset, self.per_stream = float(norm_eps), float(norm_offset), bool(per_stream)
        self.pre_eps, self.post, self.magnitude, self.post_eps = float(pre_eps), bool(post), float(magnitude), \
            float(post_eps)
        self.mix, self.sinkhorn_iters, self.mix_eps = bool(mix), int(sinkhorn_iters), float(mix_eps)
        n, flat = self.n, self.n * self.dim
        self.hc_norm = None
        if norm_weight:
            self.hc_norm = nn.Module()
            self.hc_norm.weight = _param(flat)
        if form == "fused":
            groups = 1 + int(self.post) + int(self.mix)
            self.fn = _param(2 * n * int(self.post) + n * int(not self.post) + n * n * int(self.mix), flat)
            self.base = _param(self.fn.shape[0])
            self.scale = _param(groups)
        else:
            self.input_mix_weight_down = nn.Module()
            self.input_mix_weight_down.weight = _param(int(rank), flat)
            self.input_mix_weight_up = nn.Module()
            self.input_mix_weight_up.weight = _param(flat, int(rank))
            if self.post:
                self.block_inject_weight = nn.Module()
                self.block_inject_weight.weight = _param(n, flat)

    def _normed(self, streams: torch.Tensor) -> torch.Tensor:
        """[tokens, n * dim] float32: the streams normalized for the coefficients (per stream or over all of them)."""
        x = streams.float()
        if not self.per_stream:
            x = x.flatten(-2)
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.norm_eps)
        y = y.flatten(-2) if self.per_stream else y
        if self.hc_norm is not None:
            y = y * (self.norm_offset + self.hc_norm.weight.float())
        return y

    def forward(self, streams: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        n = self.n
        y = self._normed(streams)
        post = mix = None
        if self.form == "fused":
            logits = F.linear(y, self.fn.float())
            base, scale = self.base.float(), self.scale.float()
            pre = torch.sigmoid(logits[..., :n] * scale[0] + base[:n]) + self.pre_eps
            x = (pre.unsqueeze(-1) * streams.float()).sum(-2)
            if self.post:
                post = self.magnitude * torch.sigmoid(logits[..., n:2 * n] * scale[1] + base[n:2 * n]) + self.post_eps
            if self.mix:
                m = (logits[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
                m = torch.softmax(m, dim=-1) + self.mix_eps
                m = m / (m.sum(-2, keepdim=True) + self.mix_eps)
                for _ in range(self.sinkhorn_iters - 1):
                    m = m / (m.sum(-1, keepdim=True) + self.mix_eps)
                    m = m / (m.sum(-2, keepdim=True) + self.mix_eps)
                mix = m
        else:
            w = F.silu(F.linear(y, self.input_mix_weight_down.weight.float()) / n)
            w = torch.sigmoid(F.linear(w, self.input_mix_weight_up.weight.float()))
            x = (w * y).unflatten(-1, (n, self.dim)).mean(-2)
            if self.post:
                post = self.magnitude * torch.sigmoid(F.linear(y, self.block_inject_weight.weight.float()) / n) \
                    + self.post_eps
        return x.to(streams.dtype), post, mix

    def merge(self, streams: torch.Tensor, h: torch.Tensor, post: torch.Tensor,
              mix: Optional[torch.Tensor]) -> torch.Tensor:
        """The next streams: post_k * h + (sum_j mix[j, k] * streams_j, or streams_k without a mix), in float32."""
        s = streams.float()
        res = s if mix is None else torch.matmul(mix.transpose(-1, -2), s)
        return (post.unsqueeze(-1) * h.float().unsqueeze(-2) + res).to(streams.dtype)
