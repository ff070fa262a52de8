"""The fp8 e4m3 round trip of a linear layer's input (layers/quant.py ActQuant) as one Triton launch.

ActQuant in torch ops is ~10 kernels a call (float, abs, amax, divide, clamp, two casts, multiply, cast back): in
a decode step of an FP8 checkpoint that is ~40 launches a layer on top of the GEMMs. This kernel does the same
arithmetic in one pass, bit for bit: per row (a token) and group of `group` columns (the whole row for per-token
scales), amax, scale = max(amax / 448, 1e-12) (or the static scale), v = clamp(x / scale, -448, 448) rounded to
the e4m3 grid, times the scale, cast to the input dtype. Both divisions are correctly rounded (div_rn, as torch's);
the rounding to e4m3 is done in float32 arithmetic rather than a float8 cast (round half to even to a multiple of
2^(e - 3), e = max(exponent of |v|, -6): the normal and subnormal grids; (v + M) - M with M = 1.5 * 2^(23 + e - 3)
rounds exactly in IEEE float32), which is what torch's cast computes and is also exact under the Triton
interpreter, whose float8 casts are not; likewise the final bfloat16 rounding is done on the bits (the
interpreter truncates a float32 -> bfloat16 cast). POW2 (a checkpoint's `scale_fmt: ue8m0`): each dynamic scale is
rounded up to a power of two on its bits (exponent, plus one where any mantissa bit is set). Reference:
layers/quant.py fp8_round_trip.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)         # float8 e4m3's largest value (layers/quant.py FP8_MAX)
MIN_SCALE = tl.constexpr(1e-12)       # the dynamic scales' floor (layers/quant.py _MIN_SCALE)


@triton.jit
def _e4m3_round(v):
    """v (float32, |v| <= 448) rounded half to even to the nearest float8 e4m3 value, exactly."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127          # the exponent of |v| (zero: -127)
    e = tl.maximum(e, -6)                                             # below 2^-6 the subnormal step 2^-9
    magic = ((e - 3 + 23 + 127) << 23 | 0x400000).to(tl.float32, bitcast=True)     # 1.5 * 2^(23 + e - 3)
    return (v + magic) - magic


@triton.jit
def _ceil_pow2(s):
    """The smallest power of two >= s (s float32, normal, > 0), exactly."""
    bits = s.to(tl.int32, bitcast=True)
    e = bits & 0x7F800000
    return tl.where((bits & 0x7FFFFF) != 0, e + 0x800000, e).to(tl.float32, bitcast=True)


@triton.jit
def fp8_round_trip_tile(y, static_scale, GROUP: tl.constexpr, BLOCK: tl.constexpr, STATIC: tl.constexpr,
                        OUT_BF16: tl.constexpr, POW2: tl.constexpr = False):
    """The round trip of a [BLOCK] float32 tile of one row (zeros where masked: they change no group's amax) whose
    first column starts a group: per GROUP consecutive columns (GROUP divides BLOCK; GROUP == BLOCK: one scale for
    the tile), or with `static_scale`. The one implementation of the round trip: _fp8_act_quant_kernel runs it on one
    group a program, the epilogues of ops/norm_act_kernels.py on their output tiles, so an op ending in it equals
    that op followed by fp8_act_quant bit for bit."""
    if STATIC:
        v = tl.minimum(tl.maximum(tl.math.div_rn(y, static_scale), -FP8_MAX), FP8_MAX)
        out = _e4m3_round(v) * static_scale
    else:
        yg = tl.reshape(y, (BLOCK // GROUP, GROUP))
        s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(yg), axis=1), FP8_MAX), MIN_SCALE)
        if POW2:
            s = _ceil_pow2(s)
        v = tl.minimum(tl.maximum(tl.math.div_rn(yg, s[:, None]), -FP8_MAX), FP8_MAX)
        out = tl.reshape(_e4m3_round(v) * s[:, None], (BLOCK,))
    if OUT_BF16:
        bits = out.to(tl.int32, bitcast=True)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return out


@triton.jit
def _fp8_act_quant_kernel(x_ptr, y_ptr, K, stride_xm, stride_ym, static_scale, GROUP: tl.constexpr,
                          BLOCK: tl.constexpr, STATIC: tl.constexpr, OUT_BF16: tl.constexpr, POW2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    mask = (cols < K) & (tl.arange(0, BLOCK) < GROUP)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    y = fp8_round_trip_tile(x, static_scale, BLOCK, BLOCK, STATIC, OUT_BF16, POW2)     # one group a program
    tl.store(y_ptr + row * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def fp8_act_quant(x: torch.Tensor, group: Optional[int], static_scale: Optional[float] = None,
                  pow2: bool = False) -> torch.Tensor:
    """ActQuant's round trip of x [..., K] in one launch: per row and `group` columns (None: the whole row, a
    per-token scale), or with a static scale (`static_scale`; group ignored); `pow2`: dynamic scales rounded up to
    a power of two. Output in x's dtype and shape."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((x2.shape[0], K), dtype=x.dtype, device=x.device)
    if x2.numel() == 0:
        return y.reshape(x.shape)
    span = K if (group is None or static_scale is not None) else min(int(group), K)
    grid = (x2.shape[0], triton.cdiv(K, span))
    _fp8_act_quant_kernel[grid](x2, y, K, x2.stride(0), y.stride(0),
                                float(static_scale) if static_scale is not None else 1.0,
                                GROUP=span, BLOCK=triton.next_power_of_2(span), STATIC=static_scale is not None,
                                OUT_BF16=x.dtype == torch.bfloat16, POW2=bool(pow2) and static_scale is None,
                                num_warps=4 if span <= 2048 else 8)
    return y.reshape(x.shape)
