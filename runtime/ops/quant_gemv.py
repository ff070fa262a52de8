"""Weight-only low-precision GEMMs for decode: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias), M small.

The weights stay in their low-precision form on the GPU and are dequantized in registers, tile by tile, to the
activation dtype (the exact values the reference layer holds after dequantizing at load: `dequant_int4` /
`dequant_fp8` below), then multiplied with fp32 accumulation. Two weight forms, one kernel:

- int4 (AWQ / GPTQ, repacked at load): `qweight` int32 [N, K / 8], nibble j (bits 4j..4j+3) of word w holds the
  code of column j K/8 + w (eight K-slices of K/8 columns share a word: a tile of words unpacks by one shift and
  mask per slice, no register shuffles, and each slice is a plain [BLOCK_N, BLOCK_K] operand of its own tl.dot);
  `scales` [N, K / g] (the checkpoint's float dtype), `zeros` uint8 [N, K / g]; w = (q - z) * s.
- fp8 (float8_e4m3fn [N, K]) with float32 scales [ceil(N / bn), ceil(K / bk)], one per bn x bk block: 128 x 128
  blocks (the official *-FP8 releases of large MoE and dense models), per output channel (bn 1, bk K) or per tensor (bn N, bk K); w = q * s.

The kernel: one program per BLOCK_N output rows and 16 input rows (rows past M masked), walking K in BLOCK_K
tiles (int4: BLOCK_K words). When one scale covers a tile's columns (group / block a multiple of the tile, or one
per channel) the scales (and zeros) are one [BLOCK_N] vector per tile; otherwise they are gathered per element.
The product is tl.dot on the dequantized tile. Measured on an H200 (ARCHITECTURE.md, "Quantized checkpoints"): a
broadcast multiply-sum on the CUDA cores for 1-4 rows was 1.5-6x slower than the tensor-core tile padded to 16
rows; applying the scales to raw-code partial sums instead of dequantizing each element was no faster for fp8 and
2x slower for int4. Larger M (prefill) is left to the caller: dequantize + cuBLAS.

Up to 16 rows the split-K GEMV on the CUDA cores (quant_splitk.py) reads the same packed weights with less work an
element (no per-element scale, no cast, no 16-row padding); `gemv_choice` below picks one of the two per call
(XLLM_QUANT_GEMV=auto | splitk | mma).

The launchers accept CPU tensors when TRITON_INTERPRET=1 was set before triton was imported (tests).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops import quant_int4_codes, quant_tinygemm
from xllm_gen.runtime.ops.quant_splitk import SPLITK_MAX_M, splitk_gemv
from xllm_gen.runtime.ops.skinny_fma import SKINNY_MAX_M, fp8_fits, fp8_skinny_gemm

GEMV_MAX_M = 64        # rows up to which the layers call these kernels (else dequantize + cuBLAS)


@triton.jit
def _wq_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K,
                    stride_xm, stride_qn, stride_sn, stride_zn, stride_ym, S_ROWS, S_COLS,
                    INT4: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SCALE_PER_TILE: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)          # rows past N are clamped reads, never stored
    srows = rows // S_ROWS
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    if INT4:
        # BLOCK_K words a tile; nibble j of word w is column j * K8 + w: eight [BLOCK_N, BLOCK_K] slices, one per j
        K8 = K // 8
        for w0 in tl.range(0, K8, BLOCK_K, num_stages=NUM_STAGES):
            kw = w0 + offs_k
            w_mask = kw < K8
            words = tl.load(q_ptr + rows[:, None] * stride_qn + kw[None, :], mask=w_mask[None, :], other=0,
                            eviction_policy="evict_first")                                  # [BN, BK] int32
            for j in tl.static_range(8):
                cols = j * K8 + kw
                x = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & w_mask[None, :], other=0.0)
                if SCALE_PER_TILE:
                    g = (j * K8 + w0) // S_COLS
                    s = tl.load(s_ptr + rows * stride_sn + g).to(tl.float32)[:, None]
                    z = tl.load(z_ptr + rows * stride_zn + g).to(tl.float32)[:, None]
                else:
                    gk = (cols // S_COLS)[None, :]
                    s = tl.load(s_ptr + rows[:, None] * stride_sn + gk, mask=w_mask[None, :], other=0.0)
                    z = tl.load(z_ptr + rows[:, None] * stride_zn + gk, mask=w_mask[None, :], other=0).to(tl.float32)
                    s = s.to(tl.float32)
                # q - z without an int-to-float conversion: the bits of 2^23 + q (exponent 2^23, q in the mantissa)
                # as a float, minus 2^23 + z: exact, an OR and a subtract on the FMA pipe
                q = ((words >> (4 * j)) & 0xF) | 0x4B000000
                w = ((q.to(tl.float32, bitcast=True) - (8388608.0 + z)) * s).to(x.dtype)
                acc += tl.dot(x, tl.trans(w))
    else:
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            kk = k0 + offs_k
            k_mask = kk < K
            x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)     # [BM, BK]
            q = tl.load(q_ptr + rows[:, None] * stride_qn + kk[None, :], mask=k_mask[None, :], other=0.0,
                        eviction_policy="evict_first").to(tl.float32)                           # [BN, BK]
            if SCALE_PER_TILE:
                s = tl.load(s_ptr + srows * stride_sn + k0 // S_COLS)[:, None]
            else:
                s = tl.load(s_ptr + srows[:, None] * stride_sn + (kk // S_COLS)[None, :], mask=k_mask[None, :],
                            other=0.0)
            w = (q * s).to(x.dtype)
            acc += tl.dot(x, tl.trans(w))
    n_mask = offs_n < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def wq_gemm_config(M: int, N: int, K: int, int4: bool, s_cols: int) -> tuple[int, int, int, int]:
    """The fixed launch table (M, N, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages); no autotuning (CUDA-graph
    capture, determinism). From a sweep on an H200 at 8B-model shapes (hidden 4096, MLP 12288), M = 1 (bench/bench_quant.py --sweep):
      int4: BLOCK_K 128 words (8 x 128 columns; the largest of 128 / 64 / 32 dividing the group), 2 stages;
            64 rows, 8 warps for N >= 6144 (qkv 24 us against 47 us with 16 rows), 64 rows x 32 words, 4 warps for
            N >= 16384 (gate_up), else 32 rows, 4 warps;
      fp8:  BLOCK_K 128 (one 128-block a tile; 256 per channel), 4 warps, 4 stages; 64 rows for N >= 16384, else 32."""
    if int4:
        k8 = K // 8
        bk = next(b for b in (128, 64, 32, 16) if s_cols % b == 0 or b == 16)
        bk = min(bk, max(16, triton.next_power_of_2(k8)))
        if N >= 16384:
            return 64, min(bk, 32), 4, 2
        return (64, bk, 8, 2) if N >= 6144 else (32, bk, 4, 2)
    bk = 256 if s_cols >= K and K >= 256 else 128
    bk = min(bk, max(16, triton.next_power_of_2(K)))
    return (64 if N >= 16384 else 32), bk, 4, 4


def wq_gemm_candidates(M: int, N: int, K: int, int4: bool, s_cols: int) -> list[tuple[int, int, int, int]]:
    """Launch configs worth timing for a shape (bench/bench_quant.py --sweep): the table's and its neighbours."""
    table = wq_gemm_config(M, N, K, int4, s_cols)
    out = [table]
    for bn in (16, 32, 64):
        for bk in ((32, 64, 128) if int4 else (64, 128, 256)):
            for warps in (4, 8):
                for stages in (2, 4):
                    cfg = (bn, bk, warps, stages)
                    if cfg not in out:
                        out.append(cfg)
    return out


def _launch(x, q, s, z, bias, N, K, s_rows, s_cols, int4, config):
    M = x.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    bn, bk, warps, stages = config or wq_gemm_config(M, N, K, int4, s_cols)
    bm = 16
    if int4:        # one group a tile: the groups tile K / 8 (column j K8 + w is in group (j K8 + w) // g)
        per_tile = (K // 8) % s_cols == 0 and s_cols % bk == 0
    else:
        per_tile = s_cols % bk == 0 or s_cols >= K
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm))
    has_bias = bias is not None
    _wq_gemm_kernel[grid](
        x, q, s, z if z is not None else s, bias if has_bias else s, y, M, N, K,
        x.stride(0), q.stride(0), s.stride(0), z.stride(0) if z is not None else 0, y.stride(0), s_rows, s_cols,
        INT4=int4, HAS_BIAS=has_bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SCALE_PER_TILE=per_tile,
        NUM_STAGES=stages, num_warps=warps, num_stages=stages)
    return y


# ---------------------------------------------------------------------------------------------- dispatch
# Two kernels take a decode batch: the tensor-core tile above ("mma", any M <= GEMV_MAX_M) and the split-K GEMV on
# the CUDA cores (quant_splitk.py, "splitk", M <= SPLITK_MAX_M). XLLM_QUANT_GEMV=splitk / mma forces one (splitk:
# where M allows); auto (default) takes the per-shape decision measured at engine start (QUANT_GEMV_CHOICE, filled
# by layers/quant_tuning.py and kept in ops/tuning_cache.py's file), else split-K up to SPLITK_AUTO_MAX_M rows.
# int4 layers that hold tinygemm's layout as well (quant_tinygemm.py, bf16 activations) have a third kernel,
# "tinygemm": auto takes it up to TINYGEMM_AUTO_MAX_M rows where nothing was measured; XLLM_QUANT_GEMV=tinygemm
# forces it where the layer has it. fp8 layers up to 8 rows have the skinny GEMM streaming the float8 weight
# (ops/skinny_fma.py fp8_skinny_gemm, "fma"): taken where measured faster, or forced by XLLM_QUANT_GEMV=fma.
# int4 layers with 1-16 bf16 / fp16 rows have the tensor cores over the raw codes (ops/quant_int4_codes.py,
# "codes"): taken where measured faster, or forced by XLLM_QUANT_GEMV=codes where the shape fits.
QUANT_GEMV_MODE = os.environ.get("XLLM_QUANT_GEMV", "auto").strip().lower() or "auto"
if QUANT_GEMV_MODE not in ("auto", "splitk", "mma", "tinygemm", "fma", "codes"):
    raise ValueError(f"XLLM_QUANT_GEMV={QUANT_GEMV_MODE!r}: 'auto', 'splitk', 'mma', 'tinygemm', 'fma' or 'codes'")
TINYGEMM_AUTO_MAX_M = 4
# rows up to which `auto` takes split-K for a shape nothing measured. H200, an 8B model's qkv 6144 x 4096 (bench/bench_quant.py
# --sweep, bench/results/h200_quant_splitk.md): int4 split-K 12.8 / 16.4 us at M = 1 / 2 against 24.8 / 25.0 for
# the tensor-core tile, but 24.5 at M = 4 and 1.1x the tile on the down projection (4096 x 12288) at M = 1; fp8
# split-K wins at M = 1 on three of four shapes alone, yet a whole 8B decode step at batch 1 was slower with it
# (TPOT 4.56 ms against 4.13 for the tile: bench/results/h200_quant_e2e.md), so fp8 takes the tile unless measured.
# Keep them powers of two (decode graph buckets), so an eager step of 3 rows runs the kernel its bucket of 4 does.
SPLITK_AUTO_MAX_M = {"int4": 1, "fp8": 0}
# rows up to which `auto` takes the fp8 skinny GEMM for a shape nothing measured: at one row it beat the tile and
# split-K on all four 8B shapes (H200, 128 x 128 blocks: qkv / o / gate_up / down 9.3 / 6.7 / 28.5 / 14.9 us against
# the tile's 17.6 / 13.6 / 34.7 / 34.9 and split-K's 14.8 / 12.6 / 46.3 / 26.5), at four rows it lost gate_up (59.8
# against 35.1: bench/results/h200_quant_fma_2026-12-04.md)
FMA_AUTO_MAX_M = 2
# (kind "int4" | "fp8", M, N, K, scale columns (group / block), activation dtype) -> "mma" | "tinygemm" | a split-K
# launch config (tuple of ints) | ("fma", BLOCK_N, BLOCK_K, num_warps, num_stages) | ("codes", BLOCK_N, BLOCK_K,
# CHUNK, num_warps, num_stages): measured per shape
QUANT_GEMV_CHOICE: dict = {}


def gemv_choice(kind: str, M: int, N: int, K: int, s_cols: int, dtype,
                tinygemm: bool = False) -> tuple[str, Optional[tuple]]:
    """("splitk" | "mma" | "tinygemm" | "fma" | "codes", launch config or None) for a call of M rows; `tinygemm`:
    the layer holds that layout (int4, bf16); "fma" only for fp8 scales of 16-column multiples (or one block a row);
    "codes" only for int4 shapes quant_int4_codes.fits."""
    if QUANT_GEMV_MODE == "tinygemm" and tinygemm:
        return "tinygemm", None
    codes_fits = kind == "int4" and quant_int4_codes.fits(M, K, s_cols, dtype)
    if QUANT_GEMV_MODE == "codes" and codes_fits:
        return "codes", None
    fma_fits = kind == "fp8" and M <= SKINNY_MAX_M and fp8_fits(K, (1, s_cols))
    if QUANT_GEMV_MODE == "fma" and fma_fits:
        return "fma", None
    if QUANT_GEMV_MODE == "mma" or (M > SPLITK_MAX_M and not tinygemm):
        return "mma", None
    if QUANT_GEMV_MODE == "splitk":
        return ("splitk" if M <= SPLITK_MAX_M else "mma"), None
    c = QUANT_GEMV_CHOICE.get((kind, M, N, K, s_cols, dtype))
    if c == "tinygemm" and not tinygemm:     # measured on a layer with the layout, this one has none
        c = None
    if c is None:
        if tinygemm and M <= TINYGEMM_AUTO_MAX_M:
            return "tinygemm", None
        if fma_fits and M <= FMA_AUTO_MAX_M:
            return "fma", None
        return ("splitk" if M <= SPLITK_AUTO_MAX_M[kind] else "mma"), None
    if isinstance(c, tuple) and c[:1] == ("fma",):
        return ("fma", tuple(c[1:])) if fma_fits else ("mma", None)
    if isinstance(c, tuple) and c[:1] == ("codes",):
        return ("codes", tuple(c[1:])) if codes_fits else ("mma", None)
    return ("splitk", c) if isinstance(c, tuple) else (c, None)


def _pick(kind, x, N, K, s_cols, config, kernel, tinygemm=False):
    if kernel is None:
        if config is not None:
            return "mma", config
        return gemv_choice(kind, x.shape[0], N, K, s_cols, x.dtype, tinygemm)
    if (kernel not in ("splitk", "mma", "tinygemm", "fma", "codes") or (kernel == "tinygemm" and not tinygemm)
            or (kernel == "fma" and kind != "fp8")
            or (kernel == "codes" and not (kind == "int4" and quant_int4_codes.fits(x.shape[0], K, s_cols, x.dtype)))):
        raise ValueError(f"{kind}_gemm: kernel {kernel!r}: 'splitk', 'mma', (int4 with its layout) 'tinygemm', "
                         "(fp8) 'fma' or (int4, 1-16 bf16 / fp16 rows, groups tiling K / 8) 'codes'")
    return kernel, config


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
              bias: Optional[torch.Tensor] = None, config: Optional[tuple] = None, kernel: Optional[str] = None,
              locks: Optional[torch.Tensor] = None, tinygemm: Optional[tuple] = None) -> torch.Tensor:
    """x [M, K] @ dequant_int4(qweight [N, K/8] int32, scales [N, K/g], zeros uint8 [N, K/g])^T (+ bias [N]).
    kernel: "splitk" / "mma" / "tinygemm" / "codes" / None (gemv_choice; a `config` alone means the tensor-core
    kernel's);
    locks: the layer's split-K counters (quant_splitk.new_lock_buffer); tinygemm: the same weight in tinygemm's
    layout (quant_tinygemm.pack), used for bf16 activations."""
    N, KW = qweight.shape
    K = x.shape[1]
    if qweight.dtype != torch.int32 or KW * 8 != K or K % group or scales.shape != (N, K // group) \
            or zeros.shape != scales.shape:
        raise ValueError(f"int4_gemm: x {tuple(x.shape)}, qweight {tuple(qweight.shape)} {qweight.dtype}, scales "
                         f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)}, group {group} do not fit")
    tinygemm = tinygemm if x.dtype == torch.bfloat16 else None
    kernel, config = _pick("int4", x, N, K, group, config, kernel, tinygemm is not None)
    if kernel == "tinygemm":
        return quant_tinygemm.gemm(x, tinygemm, group, bias)
    if kernel == "splitk":
        return splitk_gemv(x, qweight, scales, zeros, bias, N, K, 1, group, True, config, locks)
    if kernel == "codes":
        return quant_int4_codes.int4_codes_gemm(x, qweight, scales, zeros, group, bias, config, locks)
    return _launch(x, qweight, scales, zeros, bias, N, K, 1, group, True, config)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple,
             bias: Optional[torch.Tensor] = None, config: Optional[tuple] = None, kernel: Optional[str] = None,
             locks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ dequant_fp8(weight [N, K] float8_e4m3fn, scale float32 [ceil(N/bn), ceil(K/bk)], block (bn, bk))^T."""
    N, K = weight.shape
    bn, bk = block
    if x.shape[1] != K or scale.shape != (-(-N // bn), -(-K // bk)) or scale.dtype != torch.float32:
        raise ValueError(f"fp8_gemm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, scale {tuple(scale.shape)} "
                         f"{scale.dtype}, block {block} do not fit")
    kernel, config = _pick("fp8", x, N, K, bk, config, kernel)
    if kernel == "fma":
        return fp8_skinny_gemm(x, weight, scale, block, bias, config)
    if kernel == "splitk":
        return splitk_gemv(x, weight, scale.contiguous(), None, bias, N, K, bn, bk, False, config, locks)
    return _launch(x, weight, scale.contiguous(), None, bias, N, K, bn, bk, False, config)


# ---------------------------------------------------------------------------------------------- dequantize
# For more rows than GEMV_MAX_M (prefill chunks): the weight dequantized into one [N, K] tensor of the activation
# dtype, then cuBLAS. One program per [BLOCK_N, BLOCK_K] tile (int4: of words, eight column slices), the same
# arithmetic as the GEMM's tiles and as dequant_int4 / dequant_fp8 below (bit-identical results), no temporaries
# besides the output.
@triton.jit
def _wq_dequant_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, K, stride_qn, stride_sn, stride_zn, S_ROWS, S_COLS,
                       INT4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SCALE_PER_TILE: tl.constexpr = False):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    if INT4:
        K8 = K // 8
        m = n_mask[:, None] & (offs_k < K8)[None, :]
        words = tl.load(q_ptr + rows[:, None] * stride_qn + offs_k[None, :], mask=m, other=0)
        for j in tl.static_range(8):
            cols = j * K8 + offs_k
            gk = (cols // S_COLS)[None, :]
            s = tl.load(s_ptr + rows[:, None] * stride_sn + gk, mask=m, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + rows[:, None] * stride_zn + gk, mask=m, other=0).to(tl.float32)
            q = ((words >> (4 * j)) & 0xF) | 0x4B000000
            w = (q.to(tl.float32, bitcast=True) - (8388608.0 + z)) * s
            tl.store(w_ptr + rows[:, None] * K + cols[None, :], w.to(w_ptr.dtype.element_ty), mask=m)
    else:
        m = n_mask[:, None] & (offs_k < K)[None, :]
        q = tl.load(q_ptr + rows[:, None] * stride_qn + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
        if SCALE_PER_TILE:      # the tile lies in one group of scale columns: a scale per row, not per value (a
            gk = tl.program_id(1) * BLOCK_K // S_COLS      # gather and an index division per value made the
            s = tl.load(s_ptr + (rows // S_ROWS) * stride_sn + gk, mask=n_mask, other=0.0)[:, None]   # kernel slow)
        else:
            s = tl.load(s_ptr + (rows // S_ROWS)[:, None] * stride_sn + (offs_k // S_COLS)[None, :], mask=m, other=0.0)
        tl.store(w_ptr + rows[:, None] * K + offs_k[None, :], (q * s).to(w_ptr.dtype.element_ty), mask=m)


def _dequant_launch(q, s, z, N, K, s_rows, s_cols, int4, dtype):
    w = torch.empty((N, K), dtype=dtype, device=q.device)
    if N and K:
        bn, bk = (32, 64) if int4 else (64, 128)
        grid = (triton.cdiv(N, bn), triton.cdiv(K // 8 if int4 else K, bk))
        per_tile = not int4 and (s_cols % bk == 0 or s_cols >= K)
        _wq_dequant_kernel[grid](q, s, z if z is not None else s, w, N, K, q.stride(0), s.stride(0),
                                 z.stride(0) if z is not None else 0, s_rows, s_cols, INT4=int4, BLOCK_N=bn,
                                 BLOCK_K=bk, SCALE_PER_TILE=per_tile, num_warps=4)
    return w


def int4_dequantize(qweight, scales, zeros, group: int, dtype) -> torch.Tensor:
    """dequant_int4 in one Triton kernel (CUDA; CPU under the interpreter)."""
    return _dequant_launch(qweight, scales, zeros, qweight.shape[0], qweight.shape[1] * 8, 1, group, True, dtype)


def fp8_dequantize(weight, scale, block: tuple, dtype) -> torch.Tensor:
    """dequant_fp8 in one Triton kernel."""
    return _dequant_launch(weight, scale.contiguous(), None, weight.shape[0], weight.shape[1], block[0], block[1],
                           False, dtype)


# ---------------------------------------------------------------------------------------------- references
def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15) -> int32 [N, K / 8], column j K/8 + w in bits 4j..4j+3 of word w."""
    N, K = codes.shape
    c = codes.to(torch.int64).reshape(N, 8, K // 8) << (4 * torch.arange(8, device=codes.device))[:, None]
    c = c.sum(1)
    return torch.where(c >= 2**31, c - 2**32, c).to(torch.int32)            # two's complement


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K / 8] -> codes uint8 [N, K]."""
    N, KW = qweight.shape
    shifts = 4 * torch.arange(8, device=qweight.device, dtype=torch.int32)[:, None]
    return ((qweight[:, None, :] >> shifts) & 0xF).reshape(N, KW * 8).to(torch.uint8)


def dequant_int4(qweight, scales, zeros, group: int, dtype) -> torch.Tensor:
    """The reference weight [N, K] in `dtype`: (q - z) * s in float32, rounded once."""
    q = unpack_int4(qweight).to(torch.float32)
    z = zeros.to(torch.float32).repeat_interleave(group, 1)
    s = scales.to(torch.float32).repeat_interleave(group, 1)
    return ((q - z) * s).to(dtype)


def dequant_fp8(weight, scale, block: tuple, dtype) -> torch.Tensor:
    N, K = weight.shape
    bn, bk = block
    s = scale.to(torch.float32).repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return (weight.to(torch.float32) * s).to(dtype)
