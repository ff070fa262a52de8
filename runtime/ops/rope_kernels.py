"""Triton kernels of rotary: q/k per-head RMSNorm + rotary of the decoder (one program per token), and the vision
tower's in-place rotary of q and k (one program per patch row).

The arithmetic follows ops/reference.py (and so HF): statistics in float32, and the same roundings to the
activation dtype at the same points (q*cos and rotate_half(q)*sin are each rounded before the sum), so bf16
results stay close to HF's modules. The launchers accept CPU tensors when TRITON_INTERPRET=1 was set before triton
was imported (tests).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops import pdl
from xllm_gen.runtime.ops.pdl import pdl_enter
from xllm_gen.runtime.ops.triton_util import _warps


# ---------------------------------------------------------------------------------------------- q/k norm + rope
# One program per token: its cos / sin row (the token's position; per frequency for multi-axis rotary) is read
# once and applied to every q and k head, each a [heads, head_dim / 2] tile (one program per token and head
# was ~40 us per layer for a 1000-token prefill: tens of thousands of one-warp programs).
@triton.jit
def _norm_rope_values(src, sh, w_ptr, NH, c, s, j, jm, eps,
                      HEAD_DIM: tl.constexpr, BH: tl.constexpr, HAS_NORM: tl.constexpr):
    """The normed, rotated halves (o1, o2) [BH, HALF_BLOCK] of NH heads at src, in src's dtype."""
    HALF: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, BH)[:, None]
    m = (h < NH) & jm[None, :]
    x1 = tl.load(src + h * sh + j[None, :], mask=m, other=0.0)
    x2 = tl.load(src + h * sh + HALF + j[None, :], mask=m, other=0.0)
    dt = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    if HAS_NORM:
        var = (tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HEAD_DIM
        rstd = (1.0 / tl.sqrt(var + eps))[:, None]
        w1 = tl.load(w_ptr + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        f1 = (w1 * (f1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        f2 = (w2 * (f2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    cc = c.to(dt).to(tl.float32)[None, :]
    ss = s.to(dt).to(tl.float32)[None, :]
    o1 = (f1 * cc).to(dt).to(tl.float32) + (-f2 * ss).to(dt).to(tl.float32)
    o2 = (f2 * cc).to(dt).to(tl.float32) + (f1 * ss).to(dt).to(tl.float32)
    return o1.to(dt), o2.to(dt)


@triton.jit
def _norm_rope_heads(src, sh, w_ptr, dst, NH, c, s, j, jm, eps,
                     HEAD_DIM: tl.constexpr, BH: tl.constexpr, HAS_NORM: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    o1, o2 = _norm_rope_values(src, sh, w_ptr, NH, c, s, j, jm, eps, HEAD_DIM, BH, HAS_NORM)
    h = tl.arange(0, BH)[:, None]
    m = (h < NH) & jm[None, :]
    tl.store(dst + h * HEAD_DIM + j[None, :], o1, mask=m)
    tl.store(dst + h * HEAD_DIM + HALF + j[None, :], o2, mask=m)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, pos_ptr, cache_ptr, axis_ptr,
                         sqn, sqh, skn, skh, stride_pos_axis, H, Hk, eps,
                         HEAD_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr, QH_BLOCK: tl.constexpr,
                         KH_BLOCK: tl.constexpr, HAS_NORM: tl.constexpr, IS_MROPE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    j = tl.arange(0, HALF_BLOCK)
    jm = j < HALF
    if IS_MROPE:
        axis = tl.load(axis_ptr + j, mask=jm, other=0).to(tl.int64)
        p = tl.load(pos_ptr + axis * stride_pos_axis + n, mask=jm, other=0).to(tl.int64)
    else:
        p = tl.load(pos_ptr + n).to(tl.int64)
    c = tl.load(cache_ptr + p * HEAD_DIM + j, mask=jm, other=0.0)
    s = tl.load(cache_ptr + p * HEAD_DIM + HALF + j, mask=jm, other=0.0)
    _norm_rope_heads(q_ptr + n * sqn, sqh, qw_ptr, qo_ptr + n * H * HEAD_DIM, H, c, s, j, jm, eps,
                     HEAD_DIM, QH_BLOCK, HAS_NORM)
    _norm_rope_heads(k_ptr + n * skn, skh, kw_ptr, ko_ptr + n * Hk * HEAD_DIM, Hk, c, s, j, jm, eps,
                     HEAD_DIM, KH_BLOCK, HAS_NORM)


def _heads(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x


class _RopeLaunch:
    """What qk_norm_rope and fused_rope_store.qk_norm_rope_store prepare alike for their kernels: q / k as heads,
    the outputs, the norm weights (or q / k as dummies), the positions and axis map, the block sizes."""

    def __init__(self, q, k, q_weight, k_weight, positions, axis_map, what: str):
        self.N, self.H, self.D = q.shape
        self.Hk = k.shape[1]
        self.q, self.k = _heads(q), _heads(k)
        self.qo = torch.empty((self.N, self.H, self.D), dtype=q.dtype, device=q.device)
        self.ko = torch.empty((self.N, self.Hk, self.D), dtype=k.dtype, device=k.device)
        self.has_norm = q_weight is not None
        if self.has_norm != (k_weight is not None):
            raise ValueError(f"{what}: give both q and k norm weights or neither")
        self.is_mrope = positions.dim() == 2
        self.positions = positions.contiguous() if positions.stride(-1) != 1 else positions
        self.qw = q_weight if self.has_norm else self.q
        self.kw = k_weight if self.has_norm else self.k
        self.ax = axis_map if self.is_mrope else self.positions
        self.pos_stride = self.positions.stride(0) if self.is_mrope else 0
        self.half_block = triton.next_power_of_2(self.D // 2)
        self.qh, self.kh = triton.next_power_of_2(self.H), triton.next_power_of_2(self.Hk)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: Optional[torch.Tensor],
                 k_weight: Optional[torch.Tensor], eps: float, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, axis_map: Optional[torch.Tensor]):
    r = _RopeLaunch(q, k, q_weight, k_weight, positions, axis_map, "qk_norm_rope")
    if r.N == 0:
        return r.qo, r.ko
    _qk_norm_rope_kernel[(r.N,)](
        r.q, r.k, r.qw, r.kw, r.qo, r.ko, r.positions, cos_sin_cache, r.ax,
        r.q.stride(0), r.q.stride(1), r.k.stride(0), r.k.stride(1), r.pos_stride, r.H, r.Hk, eps,
        HEAD_DIM=r.D, HALF_BLOCK=r.half_block, QH_BLOCK=r.qh, KH_BLOCK=r.kh, HAS_NORM=r.has_norm,
        IS_MROPE=r.is_mrope, num_warps=_warps(r.qh * r.half_block), **pdl.launch(r.q))
    return r.qo, r.ko


# ---------------------------------------------------------------------------------------------- vision rotary
# One program per patch row rotates that row's q and k, every head, in place: the halves x1, x2 of each head in
# float32, (x1 c1 - x2 s1, x2 c2 + x1 s2), stored in the input dtype. Replaces ~10 elementwise kernels per
# layer of the torch form (casts, rotate_half's neg + cat, mul, add).
@triton.jit
def _vision_rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, sq_p, sq_h, sk_p, sk_h, sc_p, H, HALF,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    m = (h < H) & dm[None, :]
    c1 = tl.load(cos_ptr + p * sc_p + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + p * sc_p + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + p * sc_p + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + p * sc_p + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    qp = q_ptr + p * sq_p + h * sq_h + d[None, :]
    q1 = tl.load(qp, mask=m, other=0.0).to(tl.float32)
    q2 = tl.load(qp + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(qp, (q1 * c1 - q2 * s1).to(q_ptr.dtype.element_ty), mask=m)
    tl.store(qp + HALF, (q2 * c2 + q1 * s2).to(q_ptr.dtype.element_ty), mask=m)
    kp = k_ptr + p * sk_p + h * sk_h + d[None, :]
    k1 = tl.load(kp, mask=m, other=0.0).to(tl.float32)
    k2 = tl.load(kp + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(kp, (k1 * c1 - k2 * s1).to(k_ptr.dtype.element_ty), mask=m)
    tl.store(kp + HALF, (k2 * c2 + k1 * s2).to(k_ptr.dtype.element_ty), mask=m)


def vision_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: q, k [P, H, D] (any row / head strides, contiguous D) rotated by cos, sin [P, D]."""
    P, H, D = q.shape
    assert k.shape == q.shape and q.stride(-1) == 1 and k.stride(-1) == 1 and D % 2 == 0
    cos, sin = cos.contiguous(), sin.contiguous()
    if P:
        BH, BD = triton.next_power_of_2(H), triton.next_power_of_2(D // 2)
        _vision_rope_kernel[(P,)](q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
                                  H, D // 2, BLOCK_H=BH, BLOCK_D=BD, num_warps=_warps(BH * BD))
