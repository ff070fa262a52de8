"""The float8 forms of the fused decode GEMVs (ops/fused_gemv.py, up to 8 rows: `_prologue_gemv_kernel`).

- Weight-only fp8 (a packed layer, layers/quant_linear.py PackedFp8, whose input stays bf16 / fp16): the weight
  streams as float8 e4m3 with float32 scales s [ceil(N / S_ROWS), ceil(K / S_COLS)] exactly as skinny_fma.py's
  `_skinny_gemm_kernel` (SCALED) streams it: each VEC-wide (16-element) partial dot of the tile lies inside one
  scale block and is multiplied by its scale. The prologue is unchanged, so against the unfused norm / activation
  kernel + the layer's GEMM the only differences are the bf16 prologue's (the normalized x kept in fp32) and the
  GEMM's own order of summation (the unfused tensor-core GEMM also rounds each dequantized weight to bf16).
- Activation-quantized fp8 (the *-FP8 releases: layers/quant.py ActQuant("group", 128), the input rounded to fp8
  e4m3 per token and `group` columns, dynamic scales): the prologue's x chunk is quantized in the kernel
  (`group_fp8`), each VEC-wide partial dot of the fp8 codes times the weight's block scale and the x group's
  scale. BLOCK_K holds whole groups (a multiple of the group, itself a multiple of VEC and a power of two), so each
  group lies in one chunk, aligned from column 0 as ActQuant aligns them (a masked tail is zeros: no amax changes).
  * norm prologue: rmsnorm's factor r = rsqrt(mean(h^2) + eps) is one scalar a row, unknown until the K loop
    ends; it cancels in the group quantization (the unfused scale is r amax(g h) / 448 and the code
    e4m3(r g h / that) = e4m3(g h * 448 / amax(g h))), so the group of v = g h (fp32) is quantized as
    q = e4m3(v * (448 / amax)), its scale amax / 448, and r multiplies the row's dot at the end. Rounding
    differences against the unfused norm kernel (its quant epilogue) + GEMM: the unfused path quantizes the norm's
    output rounded to the activation dtype (bf16: relative 2^-9) and divides by its rounded scale, the fused one
    quantizes v in fp32 by a reciprocal, so a code near a rounding tie of the e4m3 grid (spacing 2^-3 relative) may
    land one step apart: in bf16 a few percent of the codes move by one fp8 step (random in sign), far fewer than
    the quantization itself moves (tests/test_fused_fp8.py bounds the fused-vs-unfused difference by a fraction of
    the quantization's own error); in fp32 essentially none. The unfused path also rounds each dequantized x
    (q * scale) to bf16 (relative 2^-9), the fused one keeps q * scale * r in fp32; the 1e-12 scale floor (an
    all-zero group) is not applied (a zero group has zero codes either way). Power-of-two scales (ue8m0) do not
    commute with r: refused (the caller runs the plain ops).
  * act prologue: act(gate) * up rounded to the activation dtype as the unfused activation kernel rounds it has no
    per-row factor, so its group is quantized exactly as ActQuant / the activation kernel's quant epilogue does it:
    scale = max(amax / 448, 1e-12) (correctly rounded, power-of-two scales rounded up), code e4m3(v / scale)
    (correctly rounded): the codes and scales are the unfused path's bit for bit; only the bf16 rounding of
    q * scale (relative 2^-9) and the summation order differ.

Measured on an H100 (bench/bench_fused_fp8.py, bench/results/h100_fused_fp8.md): slower than the plain pair at
an 8B model's decode shapes (one row: qkv 13.3 against 10.6 us, down 26.4 / 27.2 against 24.1 / 23.4; the quantized act
prologue about 2x): each program recomputes the prologue for its whole K while the float8 weight streams twice as
fast as bf16, so XLLM_FUSED_DECODE=auto (layers/fused.py, tune_fused_gemvs) keeps the plain ops there.
"""
from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl

from xllm_gen.runtime.ops.fp8_act_quant import FP8_MAX, MIN_SCALE, _ceil_pow2, _e4m3_round
from xllm_gen.runtime.ops.skinny_fma import SKINNY_MAX_M, fp8_fits, skinny_gemm_candidates, skinny_gemm_config

VEC = 16        # float8 elements of one 16-byte vector: the width of a partial dot


@triton.jit
def group_fp8(v, PRO: tl.constexpr, POW2: tl.constexpr, KC: tl.constexpr, GS: tl.constexpr):
    """v [1, KC, VEC] (float32; a chunk starting a group) as fp8 e4m3 codes per group of GS consecutive VEC-wide
    slices, and each slice's group scale [1, KC]: PRO 1 (the norm's g h, before its per-row factor) code
    v * (448 / amax), scale amax / 448; PRO 2 (the activation) ActQuant's scale and code (see the module doc)."""
    sa = tl.max(tl.abs(v), axis=2)                                           # [1, KC]
    ga = tl.max(tl.reshape(sa, (KC // GS, GS)), axis=1)                      # [KC // GS]
    amax = tl.reshape(tl.broadcast_to(ga[:, None], (KC // GS, GS)), (1, KC))
    if PRO == 1:
        inv = FP8_MAX / tl.where(amax > 0.0, amax, 1.0)      # (an all-zero group: codes 0)
        q = v * inv[:, :, None]
        s = amax * (1.0 / FP8_MAX)
    else:
        s = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
        if POW2:
            s = _ceil_pow2(s)
        q = tl.math.div_rn(v, s[:, :, None])
    return _e4m3_round(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)), s


def quant_group(act_quant, prologue: str) -> Optional[int]:
    """The group a fused GEMV's prologue quantizes `act_quant` (ActQuant or None) with: 0 for none (weight-only),
    the group for dynamic per-token groups of a power of two >= VEC (power-of-two scales: the act prologue only),
    None where the fused kernel cannot (per-token / static / int8 kinds)."""
    if act_quant is None:
        return 0
    g = act_quant.group
    if act_quant.kind != "group" or g < VEC or g & (g - 1) or (act_quant.pow2 and prologue != "act"):
        return None
    return g


def fits(M: int, K: int, block: tuple, group: int, block_k: Optional[int] = None) -> bool:
    """Whether the fp8 fused GEMV takes M rows, K columns, the weight's scale block (rows, cols) and the input
    group (0: none), in a BLOCK_K of block_k (None: any that default_config gives)."""
    if not 0 < M <= SKINNY_MAX_M or not fp8_fits(K, block):
        return False
    return not group or block_k is None or (block_k % group == 0 and block_k >= VEC)


def default_config(M: int, N: int, K: int, group: int = 0) -> tuple:
    """The skinny GEMM's float8 launch config (skinny_fma.FP8_CANDIDATES' first), BLOCK_K raised to the group."""
    bn, bk, warps, stages = skinny_gemm_candidates(M, N, K, 1)[0]
    return bn, max(bk, group, VEC), warps, stages


def candidates(M: int, N: int, K: int, group: int = 0) -> list:
    """Launch configs timed for an fp8 fused GEMV: the float8 skinny GEMM's, and wider ones (4 / 8 weight rows a
    program: each program computes its x chunk itself, so fewer programs do less of that; for more than 2 rows 8
    rows a program with VEC 8 / 4, the config's 5th entry: each thread holds more weight rows for the x it
    computes), BLOCK_K a multiple of the group. An H100 sweep (bench/bench_fused_fp8.py,
    bench/results/h100_fused_fp8.md) found (4, 512 / 1024, 2 / 4, 1) best at one row, the VEC 8 / 4 ones at four."""
    table_bk = skinny_gemm_config(M, N, K, 1)[1]
    wide = [(4, 1024, 4, 1), (4, 512, 2, 1)] + ([(8, 512, 2, 1, 8), (8, 512, 4, 1, 4)] if M > 2 else [])
    out = [(bn, max(min(bk, table_bk), group, VEC if len(rest) == 0 else rest[0]), w, st, *rest)
           for bn, bk, w, st, *rest in skinny_gemm_candidates(M, N, K, 1) + wide]
    return list(dict.fromkeys(out))


def kernel_args(fp8: Optional[tuple], bk: int, vec: int) -> tuple:
    """((stride_sn, S_ROWS, S_COLS), the constexprs) of `_prologue_gemv_kernel` for fp8 (scale, block, group, pow2)
    or None (a bf16 / fp16 weight)."""
    if fp8 is None:
        return (0, 1, 1), dict(SCALED=False, QUANT=0, QGS=1)
    scale, block, group, pow2 = fp8
    if group and (bk % group or group % vec):
        raise ValueError(f"fused fp8 GEMV: BLOCK_K {bk} must hold whole groups of {group} columns ({vec}-wide slices)")
    return ((scale.stride(0), int(block[0]), int(block[1])),
            dict(SCALED=True, QUANT=(2 if pow2 else 1) if group else 0, QGS=group // vec if group else 1))
