"""Normalization layers."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime import ops
from xllm_gen.runtime.executor.distributed import all_reduce, get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, Segment, attach, raise_or_defer, split_segment
from xllm_gen.runtime.ops import reference


class RMSNorm(nn.Module):
    """RMSNorm with HF math.

    weight_offset 0.0 (default): the w-scaled norm (float32 variance,
    `weight * x_normed.to(input_dtype)`). weight_offset 1.0: the (1 + w) norm, all in float32
    (`x_normed * (1.0 + weight.float())`, then cast to the input dtype); the checkpoint stores w (zero-centred).

    bias=True adds a learned `bias` [dim] to the output. weight=False: no parameter, y = x / rms(x) in float32, cast
    to the input dtype (computed as the (1 + w) form with a zero buffer w).

    forward(x) -> y; forward(x, residual) -> (y, x + residual) with y = rmsnorm(x + residual);
    forward(x, None) -> (rmsnorm(x), x)  (the first layer of a residual stream).
    """

    def __init__(self, dim: int, eps: float = 1e-6, weight_offset: float = 0.0, bias: bool = False,
                 weight: bool = True):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight_offset = float(weight_offset)
        if weight:
            self.weight = nn.Parameter(torch.empty(dim))
        else:   # parameter-free: x / rms(x) in float32, as the (1 + w) form computes it with w = 0 (not a parameter)
            if weight_offset:
                raise ValueError("RMSNorm: weight_offset needs a weight")
            self.weight_offset = 1.0
            self.register_buffer("weight", torch.zeros(dim), persistent=False)
        self.bias = nn.Parameter(torch.empty(dim)) if bias else None

    # the residual stream in float32 (`keep_residual_float32`): None (off), "layer" (a layer's step norm: the float32
    # sum, normalized in the input's dtype) or "final" (the decoder's final norm: normalized in float32, cast back)
    residual_float32: Optional[str] = None

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = ..., /):
        if residual is ...:
            return self._biased(ops.rms_norm(x, self.weight, self.eps, self.weight_offset))
        if self.residual_float32 is not None:     # the torch ops on every device (a float32 input, a model-dtype weight)
            r = x.float() if residual is None else residual.float() + x.float()
            src = r if self.residual_float32 == "final" else r.to(x.dtype)
            return self._biased(reference.rms_norm(src, self.weight, self.eps, self.weight_offset)).to(x.dtype), r
        if residual is None:
            return self._biased(ops.rms_norm(x, self.weight, self.eps, self.weight_offset)), x
        y, r = ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.weight_offset)
        return self._biased(y), r

    def _biased(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"{self.dim}, eps={self.eps}" + (f", weight_offset={self.weight_offset}" if self.weight_offset else "")
                + (", bias=True" if self.bias is not None else "")
                + ("" if isinstance(self.weight, nn.Parameter) else ", weight=False"))


def keep_residual_float32(layers: nn.Module, final: "RMSNorm") -> None:
    """The residual stream in float32 (transformers' `residual_in_fp32`, Mamba): each decoder layer's step norms add
    the block output to the float32 residual and normalize the sum cast to the model dtype (`norm(residual.to(dtype))`,
    the residual itself staying float32); the final norm normalizes the float32 sum (its output cast to the model dtype,
    as the LM head reads it). In float32 serving this is the plain stream."""
    for m in layers.modules():
        if isinstance(m, RMSNorm):
            m.residual_float32 = "layer"
    final.residual_float32 = "final"


class LayerNorm(nn.Module):
    """nn.LayerNorm math with params `weight` [dim] (when weight=True) and `bias` [dim] (when bias=True);
    weight_offset 1.0 scales by (1 + weight). Without weight and bias (a non-parametric LayerNorm) it
    normalizes in float32 and casts back.

    Same residual protocol as RMSNorm, so a decoder step may use either: forward(x) -> y;
    forward(x, residual) -> (layernorm(x + residual), x + residual); forward(x, None) -> (layernorm(x), x).

    center=False (a form a config chooses): no mean subtraction, y = w * (x / rms(x)) (+ b) with the statistics in
    float32 and the normalized value cast to the input dtype before the weight (RMSNorm's math, the same parameters).
    """

    def __init__(self, dim: int, eps: float = 1e-6, bias: bool = True, weight: bool = True,
                 weight_offset: float = 0.0, center: bool = True):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight_offset = float(weight_offset)
        self.center = bool(center)
        if not self.center and (not weight or self.weight_offset):
            raise ValueError("LayerNorm: the uncentered (RMS) form needs a plain weight")
        self.weight = nn.Parameter(torch.empty(dim)) if weight else None
        self.bias = nn.Parameter(torch.empty(dim)) if bias else None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if not self.center:
            xf = x.float()
            y = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        if self.weight is None and self.bias is None:
            return F.layer_norm(x.float(), (self.dim,), None, None, self.eps).to(x.dtype)
        w = self.weight + self.weight_offset if self.weight is not None and self.weight_offset else self.weight
        return F.layer_norm(x, (self.dim,), w, self.bias, self.eps)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = ..., /):
        if residual is ...:
            return self._norm(x)
        if residual is None:
            return self._norm(x), x
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return (f"{self.dim}, eps={self.eps}, bias={self.bias is not None}"
                + (", weight=False" if self.weight is None else "")
                + (f", weight_offset={self.weight_offset}" if self.weight_offset else "")
                + ("" if self.center else ", center=False"))


class IdentityNorm(nn.Module):
    """A norm that is absent in some layers (a per-layer `enabled: false`, e.g. a first layer without one): no parameters,
    the identity, with the residual protocol of RMSNorm / LayerNorm, so a decoder step reads it as any norm:
    forward(x) -> x; forward(x, residual) -> (x + residual, x + residual); forward(x, None) -> (x, x)."""

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = ..., /):
        if residual is ...:
            return x
        if residual is None:
            return x, x
        x = x + residual
        return x, x


class ProjectionNorm(nn.Module):
    """An RMSNorm / LayerNorm over a whole attention projection: all `heads` heads of `head_dim` jointly (a q / k
    norm over the whole projection), not per head. `weight` (and `bias`) [heads * head_dim] are split over the TP ranks
    like the projection's segment (`replicate_ok`: KV heads replicated when heads < tp, as QKVParallelLinear
    does), so each rank normalizes its own columns; the statistics (sum, sum of squares) are all-reduced over the
    ranks and divided by tp * local width, which counts every replicated head as often as it is held, so the mean
    is the full projection's. At TP 1 the math is the per-token norm of RMSNorm / LayerNorm.

    forward(x [tokens, local heads * head_dim]) -> same shape."""

    def __init__(self, kind: str, heads: int, head_dim: int, eps: float, weight_offset: float = 0.0,
                 bias: bool = False, replicate_ok: bool = False, name: str = "projection"):
        super().__init__()
        if kind not in ("rmsnorm", "layernorm"):
            raise ValueError(f"ProjectionNorm: kind {kind!r} is not rmsnorm or layernorm")
        self.kind, self.eps, self.weight_offset = kind, eps, float(weight_offset)
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        problems: list = []
        seg = split_segment(Segment(name, heads, head_dim, replicate_ok=replicate_ok), self.tp_size, self.tp_rank,
                            problems)
        raise_or_defer(self, problems)
        self.dim = seg.rows
        self.weight = nn.Parameter(torch.empty(seg.rows))
        self.bias = nn.Parameter(torch.empty(seg.rows)) if bias else None
        for p in (self.weight, self.bias):
            if p is not None:
                attach(p, ParamSplit("column", 0, (seg,), (seg.rows,), self.tp_size, self.tp_rank, "ProjectionNorm"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            if self.kind == "rmsnorm":
                y = ops.rms_norm(x, self.weight, self.eps, self.weight_offset)
                return y if self.bias is None else y + self.bias.to(y.dtype)
            w = self.weight + self.weight_offset if self.weight_offset else self.weight
            return F.layer_norm(x, (self.dim,), w, self.bias, self.eps)
        xf = x.float()
        n = self.tp_size * x.shape[-1]
        if self.kind == "layernorm":
            xf = xf - all_reduce(xf.sum(-1, keepdim=True)) / n
        y = xf * torch.rsqrt(all_reduce(xf.pow(2).sum(-1, keepdim=True)) / n + self.eps)
        if self.kind == "rmsnorm" and not self.weight_offset:
            y = self.weight * y.to(x.dtype)          # HF's w-scaled RMSNorm: weight * x_normed.to(dtype)
        else:
            y = (y * (self.weight.float() + self.weight_offset)).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"{self.kind}, {self.dim} (per rank), eps={self.eps}, tp={self.tp_size}"
                + (f", weight_offset={self.weight_offset}" if self.weight_offset else "")
                + (", bias=True" if self.bias is not None else ""))


class HeadNorm(nn.Module):
    """An RMSNorm / LayerNorm of each head of x [tokens, heads, head_dim] over head_dim, with a weight (and bias) of
    its own per head: `weight` [heads, head_dim], split over the TP ranks by heads like the projection's segment
    (`replicate_ok`: KV heads replicated when heads < tp). Computed in float32 (LayerNorm as mean and variance of
    the centred values), scaled by (weight_offset + weight), cast back to x's dtype.

    forward(x [tokens, local heads, head_dim]) -> same shape."""

    def __init__(self, kind: str, heads: int, head_dim: int, eps: float, weight_offset: float = 0.0,
                 bias: bool = False, replicate_ok: bool = False, name: str = "heads"):
        super().__init__()
        if kind not in ("rmsnorm", "layernorm"):
            raise ValueError(f"HeadNorm: kind {kind!r} is not rmsnorm or layernorm")
        self.kind, self.eps, self.weight_offset = kind, eps, float(weight_offset)
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        problems: list = []
        seg = split_segment(Segment(name, heads, 1, replicate_ok=replicate_ok), self.tp_size, self.tp_rank, problems)
        raise_or_defer(self, problems)
        self.heads, self.head_dim = seg.rows, head_dim
        self.weight = nn.Parameter(torch.empty(seg.rows, head_dim))
        self.bias = nn.Parameter(torch.empty(seg.rows, head_dim)) if bias else None
        for p in (self.weight, self.bias):
            if p is not None:
                attach(p, ParamSplit("column", 0, (seg,), (seg.rows, head_dim), self.tp_size, self.tp_rank,
                                     "HeadNorm"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.kind == "layernorm":
            xf = xf - xf.mean(-1, keepdim=True)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = (self.weight.float() + self.weight_offset) * y
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.kind}, heads={self.heads} (per rank), head_dim={self.head_dim}, eps={self.eps}"
                + (f", weight_offset={self.weight_offset}" if self.weight_offset else "")
                + (", bias=True" if self.bias is not None else ""))


class LowRankGatedNorm(nn.Module):
    """A norm whose output passes a low-rank input-dependent sigmoid gate (A.X-K2's GatedRMSNorm, Megatron's
    GatedNormWrapper): y = norm(x); out = y * sigmoid(fc2(silu(fc1(y)))) (the sigmoid in float32, cast back to y's
    dtype). Modules: `norm` (any norm with the residual protocol), `mlp.fc1` [rank, dim], `mlp.fc2` [dim, rank]
    (no biases, replicated). Same residual protocol as RMSNorm: forward(x) -> out; forward(x, residual) -> (out,
    x + residual); the gate reads the normalized sum."""

    def __init__(self, norm: nn.Module, dim: int, rank: int):
        super().__init__()
        from xllm_gen.runtime.layers.linear import ReplicatedLinear
        self.norm = norm
        self.mlp = nn.Module()
        self.mlp.fc1 = ReplicatedLinear(dim, rank, bias=False)
        self.mlp.fc2 = ReplicatedLinear(rank, dim, bias=False)

    def _gate(self, y: torch.Tensor) -> torch.Tensor:
        g = self.mlp.fc2(F.silu(self.mlp.fc1(y)))
        return (y * torch.sigmoid(g.float())).to(y.dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = ..., /):
        if residual is ...:
            return self._gate(self.norm(x))
        y, r = self.norm(x, residual)
        return self._gate(y), r
