"""Triton kernels of the row-wise fused ops: RMSNorm (with the residual add fused), and silu / gelu and mul.

The arithmetic follows ops/reference.py (and so HF): statistics in float32, and the same roundings to the
activation dtype at the same points (normalized x is cast to the input dtype before the weight product), so bf16
results stay close to HF's modules. The launchers accept CPU tensors when TRITON_INTERPRET=1 was set before triton
was imported (tests).

`quant` (the launchers' optional last argument): the output goes through the fp8 round trip of the linear layer
that reads it (layers/quant.py ActQuant) in the same kernel, bit for bit the op followed by ops/fp8_act_quant.py:
(group, None[, pow2]) dynamic scales per token and `group` columns (None: per token; pow2: rounded up to powers of
two), (None, scale) a static scale. An FP8
checkpoint's decode step then spends no launch of its own on quantizing the qkv / gate_up / down inputs.
`quant_fits` says whether a row width can take it (else the caller runs the two ops).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops import pdl
from xllm_gen.runtime.ops.fp8_act_quant import fp8_round_trip_tile
from xllm_gen.runtime.ops.pdl import pdl_enter
from xllm_gen.runtime.ops.triton_util import _warps

_ACT_BLOCK = 1024              # columns per program of the gated activations
_WHOLE_ROW_MAX = 16384         # a per-token scale needs the whole row in one program: up to this width


@triton.jit
def _epilogue(y, out_dtype: tl.constexpr, qscale, QUANT: tl.constexpr, QGROUP: tl.constexpr, BLOCK: tl.constexpr):
    """y (float32) rounded to the output dtype, then (QUANT 1: dynamic per QGROUP columns, 2: static qscale, 3:
    dynamic with power-of-two scales) its fp8 round trip."""
    y = y.to(out_dtype)
    if QUANT != 0:
        y = fp8_round_trip_tile(y.to(tl.float32), qscale, QGROUP, BLOCK, QUANT == 2,
                                out_dtype == tl.bfloat16, QUANT == 3).to(out_dtype)
    return y


def _quant_group(quant, width: int, block: int):
    """The epilogue's QGROUP for `quant` over a row of `width` columns in tiles of `block`, or None where it cannot
    run there (a group that is no power of two, or a whole row wider than one program holds)."""
    group, static = quant[:2]
    if static is not None:
        return 1
    if group is None or group >= width:           # one scale per row (as fp8_act_quant: a group past the row)
        return block if block >= width and width <= _WHOLE_ROW_MAX else None
    return group if group & (group - 1) == 0 and block % group == 0 else None


def quant_fits(quant, width: int, gated: bool = False) -> bool:
    """Whether the norm (gated=False) or a gated activation (True) over rows of `width` output columns can end in
    the fp8 round trip `quant`."""
    return _quant_group(quant, width, _act_block(width, quant) if gated else triton.next_power_of_2(width)) is not None


def _act_block(n: int, quant) -> int:
    if quant is None:
        return min(_ACT_BLOCK, triton.next_power_of_2(n))
    group, static = quant[:2]
    if static is None and (group is None or group >= n):      # the whole row in one program
        return triton.next_power_of_2(n)
    return max(min(_ACT_BLOCK, triton.next_power_of_2(n)), group or 1)


def _quant_kw(quant, width: int, block: int) -> dict:
    if quant is None:
        return dict(qscale=1.0, QUANT=0, QGROUP=1)
    qgroup = _quant_group(quant, width, block)
    if qgroup is None:
        raise ValueError(f"fp8 round trip {quant} cannot end an op over rows of {width} columns (quant_fits)")
    pow2 = len(quant) > 2 and quant[2]
    return dict(qscale=float(quant[1]) if quant[1] is not None else 1.0,
                QUANT=2 if quant[1] is not None else 3 if pow2 else 1, QGROUP=qgroup)


# ---------------------------------------------------------------------------------------------- rms_norm
@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, ro_ptr, stride_x, stride_r, D, eps, offset, qscale,
                     HAS_RESIDUAL: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0,
                     QUANT: tl.constexpr = 0, QGROUP: tl.constexpr = 1):
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
    y = tl.where(mask, y, 0.0)
    tl.store(y_ptr + row * D + offs, _epilogue(y, y_ptr.dtype.element_ty, qscale, QUANT, QGROUP, BLOCK), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def norm_out_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype, weight_offset: float) -> torch.dtype:
    """The output dtype of rms_norm: HF's `weight * x.to(dtype)` promotes (offset 0); the (offset + w) norm's `.type_as(x)`
    keeps the input dtype (offset != 0)."""
    return x_dtype if weight_offset else torch.promote_types(x_dtype, w_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
             quant=None) -> torch.Tensor:
    D = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=norm_out_dtype(x.dtype, weight.dtype, weight_offset), device=x.device)
    M = x2.shape[0]
    if M:
        B = triton.next_power_of_2(D)
        _rms_norm_kernel[(M,)](x2, x2, weight, y, y, x2.stride(0), 0, D, eps, float(weight_offset),
                               **_quant_kw(quant, D, B), HAS_RESIDUAL=False, HAS_OFFSET=bool(weight_offset), BLOCK=B, num_warps=_warps(B), **pdl.launch(x2))
    return y


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       weight_offset: float = 0.0, quant=None):
    D = x.shape[-1]
    x2, r2 = _rows(x), _rows(residual)
    rdt = torch.promote_types(x.dtype, residual.dtype)
    new_r = torch.empty(x.shape, dtype=rdt, device=x.device)
    y = torch.empty(x.shape, dtype=norm_out_dtype(rdt, weight.dtype, weight_offset), device=x.device)
    M = x2.shape[0]
    if M:
        B = triton.next_power_of_2(D)
        _rms_norm_kernel[(M,)](x2, r2, weight, y, new_r, x2.stride(0), r2.stride(0), D, eps, float(weight_offset),
                               **_quant_kw(quant, D, B), HAS_RESIDUAL=True, HAS_OFFSET=bool(weight_offset), BLOCK=B, num_warps=_warps(B), **pdl.launch(x2))
    return y, new_r


# ---------------------------------------------------------------------------------------------- silu / gelu and mul
@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, stride_x, n, qscale, BLOCK: tl.constexpr, PDL: tl.constexpr = 0,
                         QUANT: tl.constexpr = 0, QGROUP: tl.constexpr = 1):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    b = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0)
    af = a.to(tl.float32)
    s = (af / (1.0 + tl.exp(-af))).to(a.dtype).to(tl.float32)
    y = tl.where(mask, s * b.to(tl.float32), 0.0)
    tl.store(y_ptr + row * n + offs, _epilogue(y, y_ptr.dtype.element_ty, qscale, QUANT, QGROUP, BLOCK), mask=mask)


def silu_and_mul(x: torch.Tensor, quant=None) -> torch.Tensor:
    n = x.shape[-1] // 2
    x2 = _rows(x)
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    M = x2.shape[0]
    if M and n:
        B = _act_block(n, quant)
        _silu_and_mul_kernel[(M, triton.cdiv(n, B))](x2, y, x2.stride(0), n, **_quant_kw(quant, n, B), BLOCK=B, num_warps=_warps(B), **pdl.launch(x2))
    return y


@triton.jit
def _gelu_and_mul_kernel(x_ptr, y_ptr, stride_x, n, qscale, TANH: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = 0, QUANT: tl.constexpr = 0, QGROUP: tl.constexpr = 1):
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
    y = tl.where(mask, g * b.to(tl.float32), 0.0)
    tl.store(y_ptr + row * n + offs, _epilogue(y, y_ptr.dtype.element_ty, qscale, QUANT, QGROUP, BLOCK), mask=mask)


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh", quant=None) -> torch.Tensor:
    if approximate not in ("tanh", "none"):
        raise ValueError(f"gelu approximate must be 'tanh' or 'none', not {approximate!r}")
    n = x.shape[-1] // 2
    x2 = _rows(x)
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    M = x2.shape[0]
    if M and n:
        B = _act_block(n, quant)
        _gelu_and_mul_kernel[(M, triton.cdiv(n, B))](x2, y, x2.stride(0), n, **_quant_kw(quant, n, B), TANH=approximate == "tanh", BLOCK=B,
                                                     num_warps=_warps(B), **pdl.launch(x2))
    return y
