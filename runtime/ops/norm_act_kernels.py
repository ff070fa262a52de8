"""Triton kernels of the row-wise fused ops: RMSNorm (with the residual add fused), and silu / gelu and mul.

The arithmetic follows ops/reference.py (and so HF): statistics in float32, and the same roundings to the
activation dtype at the same points (normalized x is cast to the input dtype before the weight product), so bf16
results stay close to HF's modules. The launchers accept CPU tensors when TRITON_INTERPRET=1 was set before triton
was imported (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops import pdl
from xllm_gen.runtime.ops.pdl import pdl_enter
from xllm_gen.runtime.ops.triton_util import _warps


# ---------------------------------------------------------------------------------------------- rms_norm
@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, ro_ptr, stride_x, stride_r, D, eps, offset,
                     HAS_RESIDUAL: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(ro_ptr.dtype.element_ty)
        tl.store(ro_ptr + row * D + offs, x, mask=mask)
    in_dtype = x.dtype
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / D
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_OFFSET:      # (offset + w) norm: (x_normed * (offset + w)) in float32, one rounding at the end
        y = (xf * (1.0 / tl.sqrt(var + eps))) * (offset + w)
    else:               # w norm: x_normed rounded to the input dtype, then times w
        y = w * (xf * (1.0 / tl.sqrt(var + eps))).to(in_dtype).to(tl.float32)
    tl.store(y_ptr + row * D + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def norm_out_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype, weight_offset: float) -> torch.dtype:
    """The output dtype of rms_norm: HF's `weight * x.to(dtype)` promotes (offset 0); the (offset + w) norm's `.type_as(x)`
    keeps the input dtype (offset != 0)."""
    return x_dtype if weight_offset else torch.promote_types(x_dtype, w_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    D = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=norm_out_dtype(x.dtype, weight.dtype, weight_offset), device=x.device)
    M = x2.shape[0]
    if M:
        B = triton.next_power_of_2(D)
        _rms_norm_kernel[(M,)](x2, x2, weight, y, y, x2.stride(0), 0, D, eps, float(weight_offset),
                               HAS_RESIDUAL=False, HAS_OFFSET=bool(weight_offset), BLOCK=B, num_warps=_warps(B), **pdl.launch(x2))
    return y


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       weight_offset: float = 0.0):
    D = x.shape[-1]
    x2, r2 = _rows(x), _rows(residual)
    rdt = torch.promote_types(x.dtype, residual.dtype)
    new_r = torch.empty(x.shape, dtype=rdt, device=x.device)
    y = torch.empty(x.shape, dtype=norm_out_dtype(rdt, weight.dtype, weight_offset), device=x.device)
    M = x2.shape[0]
    if M:
        B = triton.next_power_of_2(D)
        _rms_norm_kernel[(M,)](x2, r2, weight, y, new_r, x2.stride(0), r2.stride(0), D, eps, float(weight_offset),
                               HAS_RESIDUAL=True, HAS_OFFSET=bool(weight_offset), BLOCK=B, num_warps=_warps(B), **pdl.launch(x2))
    return y, new_r


# ---------------------------------------------------------------------------------------------- silu / gelu and mul
@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, stride_x, n, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    b = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0)
    af = a.to(tl.float32)
    s = (af / (1.0 + tl.exp(-af))).to(a.dtype).to(tl.float32)
    tl.store(y_ptr + row * n + offs, (s * b.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    x2 = _rows(x)
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    M = x2.shape[0]
    if M and n:
        B = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(M, triton.cdiv(n, B))](x2, y, x2.stride(0), n, BLOCK=B, num_warps=_warps(B), **pdl.launch(x2))
    return y


@triton.jit
def _gelu_and_mul_kernel(x_ptr, y_ptr, stride_x, n, TANH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    b = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0)
    af = a.to(tl.float32)
    if TANH:            # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(u) = 1 - 2 / (exp(2u) + 1)
        u = 0.7978845608028654 * (af + 0.044715 * af * af * af)
        t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
        g = 0.5 * af * (1.0 + t)
    else:               # 0.5 x (1 + erf(x / sqrt(2)))
        g = 0.5 * af * (1.0 + tl.erf(af * 0.7071067811865476))
    g = g.to(a.dtype).to(tl.float32)
    tl.store(y_ptr + row * n + offs, (g * b.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    if approximate not in ("tanh", "none"):
        raise ValueError(f"gelu approximate must be 'tanh' or 'none', not {approximate!r}")
    n = x.shape[-1] // 2
    x2 = _rows(x)
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    M = x2.shape[0]
    if M and n:
        B = min(1024, triton.next_power_of_2(n))
        _gelu_and_mul_kernel[(M, triton.cdiv(n, B))](x2, y, x2.stride(0), n, TANH=approximate == "tanh", BLOCK=B,
                                                     num_warps=_warps(B), **pdl.launch(x2))
    return y
