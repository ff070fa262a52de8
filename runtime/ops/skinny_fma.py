"""The skinny GEMM (FMA weight stream) of 1..8 decode rows, its launch table and tuning candidates; more rows go to
the tensor-core form (ops/skinny_mma.py). The launcher accepts CPU tensors when TRITON_INTERPRET=1 was set before
triton was imported (tests).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops import pdl
from xllm_gen.runtime.ops.pdl import pdl_enter, pdl_trigger, prefetch_rows_l2
from xllm_gen.runtime.ops.skinny_mma import skinny_mma_gemm


# ---------------------------------------------------------------------------------------------- skinny GEMM (GEMV)
# y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for M <= 8 decode rows: a pure weight stream, HBM-bound.
# Each program owns BLOCK_N rows of W (output columns) for all M rows of x and walks K in BLOCK_K chunks. A chunk is
# a 3-D tile [BLOCK_N, BLOCK_K // VEC, VEC], VEC = 16 bytes of elements: each thread loads VEC contiguous elements
# (one 16-byte load) of every one of the BLOCK_N rows, lanes and warps go along K, so a warp reads 512 contiguous
# bytes of a row per load and the x chunk a thread loads serves all BLOCK_N rows. The products are summed over the
# VEC axis inside the thread (no shuffles in the loop) into fp32 accumulators [BLOCK_N, BLOCK_K // VEC], one per x
# row (M * BLOCK_N registers a thread); one tl.sum over K at the end. Out-of-range rows of the last tile are clamped
# to row N-1 (read, never stored), so the hot loop has no masks when K % BLOCK_K == 0. The loop carries num_stages
# itself (tl.range): Triton only software-pipelines (cp.async) the loads of a loop without tl.dot when the loop asks.
# No split-K (no second pass, no atomics): BLOCK_N shrinks until the grid has enough programs to fill the SMs.
# SCALED: a float8 weight (16 elements a vector) with float32 block scales s [ceil(N / S_ROWS), ceil(K / S_COLS)]
# (128 x 128 blocks, per channel, per tensor: ops/quant_gemv.py's fp8 form), S_COLS a multiple of VEC: each VEC-wide
# partial dot lies inside one scale block and is multiplied by its scale (a [BLOCK_N, KC] gather of a few cached
# floats a tile), so the weight streams at one byte an element with one FFMA an element more than nothing.
@triton.jit
def _slice_dots(w, x, sc, SCALED: tl.constexpr):
    """The tile's VEC-wide partial dots [BLOCK_N, KC] of one x row, each times its block's scale where SCALED."""
    if SCALED:
        return tl.sum(w * x, axis=2) * sc
    return tl.sum(w * x, axis=2)


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, s_ptr, N, K, stride_xm, stride_wn, stride_ym, stride_sn,
                        S_ROWS, S_COLS,
                        M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        VEC: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr = 0,
                        KP: tl.constexpr = 1, LINE: tl.constexpr = 64, SCALED: tl.constexpr = False):
    KC: tl.constexpr = BLOCK_K // VEC
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    prefetch_rows_l2(PDL, w_ptr, rows, stride_wn, K, KP, LINE)   # weights: safe before the wait
    pdl_enter(PDL, LARGE=True)
    kc = tl.arange(0, KC)
    kv = tl.max_contiguous(tl.multiple_of(tl.arange(0, VEC), VEC), VEC)
    offs_k = kc[None, :, None] * VEC + kv[None, None, :]                  # [1, KC, VEC]
    w_ptrs = w_ptr + rows[:, None, None] * stride_wn + offs_k             # [BLOCK_N, KC, VEC]
    x_ptrs = x_ptr + offs_k
    if SCALED:      # the scale rows of the program's weight rows
        s_rows = s_ptr + (rows // S_ROWS)[:, None] * stride_sn
    acc0 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
    if M > 1:
        acc1 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
    if M > 2:
        acc2 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
    if M > 3:
        acc3 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
    if M > 4:
        acc4 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
    if M > 5:
        acc5 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
    if M > 6:
        acc6 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
    if M > 7:
        acc7 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first").to(tl.float32)
            x0 = tl.load(x_ptrs + k0).to(tl.float32)
            if M > 1:
                x1 = tl.load(x_ptrs + stride_xm + k0).to(tl.float32)
            if M > 2:
                x2 = tl.load(x_ptrs + 2 * stride_xm + k0).to(tl.float32)
            if M > 3:
                x3 = tl.load(x_ptrs + 3 * stride_xm + k0).to(tl.float32)
            if M > 4:
                x4 = tl.load(x_ptrs + 4 * stride_xm + k0).to(tl.float32)
            if M > 5:
                x5 = tl.load(x_ptrs + 5 * stride_xm + k0).to(tl.float32)
            if M > 6:
                x6 = tl.load(x_ptrs + 6 * stride_xm + k0).to(tl.float32)
            if M > 7:
                x7 = tl.load(x_ptrs + 7 * stride_xm + k0).to(tl.float32)
        else:
            km = (offs_k + k0) < K
            w = tl.load(w_ptrs + k0, mask=km, other=0.0, eviction_policy="evict_first").to(tl.float32)
            x0 = tl.load(x_ptrs + k0, mask=km, other=0.0).to(tl.float32)
            if M > 1:
                x1 = tl.load(x_ptrs + stride_xm + k0, mask=km, other=0.0).to(tl.float32)
            if M > 2:
                x2 = tl.load(x_ptrs + 2 * stride_xm + k0, mask=km, other=0.0).to(tl.float32)
            if M > 3:
                x3 = tl.load(x_ptrs + 3 * stride_xm + k0, mask=km, other=0.0).to(tl.float32)
            if M > 4:
                x4 = tl.load(x_ptrs + 4 * stride_xm + k0, mask=km, other=0.0).to(tl.float32)
            if M > 5:
                x5 = tl.load(x_ptrs + 5 * stride_xm + k0, mask=km, other=0.0).to(tl.float32)
            if M > 6:
                x6 = tl.load(x_ptrs + 6 * stride_xm + k0, mask=km, other=0.0).to(tl.float32)
            if M > 7:
                x7 = tl.load(x_ptrs + 7 * stride_xm + k0, mask=km, other=0.0).to(tl.float32)
        sc = 1.0
        if SCALED:
            # the scale of each (row, VEC-wide K slice) of the tile; slices past K (masked tail, w = 0) clamped
            sc = tl.load(s_rows + (tl.minimum(k0 + kc * VEC, K - 1) // S_COLS)[None, :])
        acc0 += _slice_dots(w, x0, sc, SCALED)
        if M > 1:
            acc1 += _slice_dots(w, x1, sc, SCALED)
        if M > 2:
            acc2 += _slice_dots(w, x2, sc, SCALED)
        if M > 3:
            acc3 += _slice_dots(w, x3, sc, SCALED)
        if M > 4:
            acc4 += _slice_dots(w, x4, sc, SCALED)
        if M > 5:
            acc5 += _slice_dots(w, x5, sc, SCALED)
        if M > 6:
            acc6 += _slice_dots(w, x6, sc, SCALED)
        if M > 7:
            acc7 += _slice_dots(w, x7, sc, SCALED)
    pdl_trigger(PDL)
    n_mask = offs_n < N
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    out_ty = y_ptr.dtype.element_ty
    y_ptrs = y_ptr + offs_n
    tl.store(y_ptrs, (tl.sum(acc0, axis=1) + bias).to(out_ty), mask=n_mask)
    if M > 1:
        tl.store(y_ptrs + stride_ym, (tl.sum(acc1, axis=1) + bias).to(out_ty), mask=n_mask)
    if M > 2:
        tl.store(y_ptrs + 2 * stride_ym, (tl.sum(acc2, axis=1) + bias).to(out_ty), mask=n_mask)
    if M > 3:
        tl.store(y_ptrs + 3 * stride_ym, (tl.sum(acc3, axis=1) + bias).to(out_ty), mask=n_mask)
    if M > 4:
        tl.store(y_ptrs + 4 * stride_ym, (tl.sum(acc4, axis=1) + bias).to(out_ty), mask=n_mask)
    if M > 5:
        tl.store(y_ptrs + 5 * stride_ym, (tl.sum(acc5, axis=1) + bias).to(out_ty), mask=n_mask)
    if M > 6:
        tl.store(y_ptrs + 6 * stride_ym, (tl.sum(acc6, axis=1) + bias).to(out_ty), mask=n_mask)
    if M > 7:
        tl.store(y_ptrs + 7 * stride_ym, (tl.sum(acc7, axis=1) + bias).to(out_ty), mask=n_mask)


SKINNY_MAX_M = 8


def skinny_gemm_config(M: int, N: int, K: int, elem_size: int = 2) -> tuple[int, int, int, int]:
    """The fixed launch table: (M, N, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages); no autotuning (CUDA-graph
    capture, determinism). Sized for a 132-SM H200, 4 warps, 3 stages:
      BLOCK_K: 16-byte vector x 32 lanes x 4 warps (1024 bf16 / 512 fp32) when K is a multiple of it, else the
               largest power of 2 of at most that size dividing K (>= 128 elements), else that size with masks;
               for small K, next_power_of_2(K) (>= 32).
      BLOCK_N: 8 rows (the x chunk a thread loads is reused by 8 rows: x reads stay <= the W stream up to M = 8),
               halved while the grid has fewer than 512 programs (M <= 2) / 256 programs (M > 2: the x chunk
               costs M / BLOCK_N of the W bytes, so fewer, wider programs), down to 1.
    A 0.6B model's (N, K) (hidden 1024, 16 x 128 heads) at M 1 / 8: (4096, 1024) -> 8 / 8; (6144, 1024) -> 8 / 8; (1024, 2048), (1024, 3072) -> 2 / 4."""
    vec = 16 // elem_size
    full = vec * 32 * 4
    if K < full:
        bk = max(32, triton.next_power_of_2(K))
    else:
        bk = full
        while K % bk and bk > 128:
            bk //= 2
        if K % bk:
            bk = full
    min_programs = 512 if M <= 2 else 256
    bn = 8
    while bn > 1 and triton.cdiv(N, bn) < min_programs:
        bn //= 2
    return bn, bk, 4, 3


def skinny_gemm_candidates(M: int, N: int, K: int, elem_size: int = 2) -> list[tuple[int, int, int, int]]:
    """Launch configs worth timing for (M, N, K) (tune_decode_gemms keeps the fastest): the table's, and those a
    sweep on an H200 found best across hidden-1024 and hidden-4096 model shapes (bench/bench_gemv.py --sweep-configs,
    bench/results/h200_gemv_configs.md): two rows per program, one stage, BLOCK_K 256-512 for 1-2 rows (1.3-2x
    faster than the table on the tall shapes); 2-4 rows per program for more rows. BLOCK_K never exceeds the
    table's (which fits small K). float8 weights (elem_size 1) have their own list, FP8_CANDIDATES."""
    table = skinny_gemm_config(M, N, K, elem_size)
    if elem_size == 1:
        return list(dict.fromkeys((bn, min(bk, table[1]), w, st) for bn, bk, w, st in FP8_CANDIDATES[M <= 2]))
    alts = [(2, 512, 4, 1), (2, 256, 2, 1)] if M <= 2 else [(4, 512, 2, 3), (2, 512, 2, 1)]
    out = [table]
    for bn, bk, warps, stages in alts:
        cfg = (bn, min(bk, table[1]), warps, stages)
        if cfg not in out:
            out.append(cfg)
    return out


# The float8 weight stream's launch configs (BLOCK_N, BLOCK_K, num_warps, num_stages), best first, for 1-2 rows (True)
# and 3-8: a sweep of 27 configs on an H200 at an 8B model's four decode shapes, 128 x 128 block scales (bench/bench_quant.py
# --rows 1,4 --only "block128 fma" --sweep, bench/results/h200_quant_fma_2026-12-04.md). M = 1: qkv 9.3 us with
# (2, 1024, 2, 1), o / gate_up / down 6.7 / 28.5 / 14.9 us with (2, 2048, 2, 1), against bf16 cuBLAS 15.9 / 13.7 / 50.1
# / 30.3; M = 4: 18.5 / 13.4 / 59.8 / 32.3. The one-byte launch table ((8, 2048, 4, 3): 2048 fp32 products a thread in
# flight) was 1.7-2.4x slower, so the first entry is also the default.
FP8_CANDIDATES = {True: [(2, 1024, 2, 1), (2, 2048, 2, 1), (2, 512, 2, 1), (1, 1024, 2, 1)],
                  False: [(2, 1024, 4, 1), (4, 1024, 2, 1), (2, 512, 2, 1), (4, 512, 2, 1)]}


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                block_n: Optional[int] = None, config: Optional[tuple] = None) -> torch.Tensor:
    """x [M, K] (M <= 8), weight [N, K], bias [N] or None -> y [M, N] in x's dtype, fp32 accumulation.
    block_n (a power of 2) overrides the table's BLOCK_N (tests: fewer programs under the interpreter);
    config (BLOCK_N, BLOCK_K, num_warps, num_stages) overrides the whole table entry (bench_gemv's sweep).
    A 6-entry config (skinny_mma_config's), or more than 8 rows without a config, runs skinny_mma_gemm."""
    M, K = x.shape
    N = weight.shape[0]
    if (config is not None and len(config) == 6) or (config is None and block_n is None and M > SKINNY_MAX_M):
        return skinny_mma_gemm(x, weight, bias, config=config)
    if M > SKINNY_MAX_M:
        raise ValueError(f"skinny_gemm: M={M} > {SKINNY_MAX_M}")
    if weight.shape[1] != K:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} vs weight {tuple(weight.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(M, N))
    return _launch(x, weight, bias, y, config, block_n)


def _launch(x, weight, bias, y, config, block_n=None, scale=None, s_rows=1, s_cols=1):
    M, K = x.shape
    N = weight.shape[0]
    bn, bk, warps, stages = config or skinny_gemm_config(M, N, K, weight.element_size())
    bn = block_n or bn
    vec = min(16 // weight.element_size(), bk)
    has_bias = bias is not None
    _skinny_gemm_kernel[(triton.cdiv(N, bn),)](
        x, weight, bias if has_bias else weight, y, weight if scale is None else scale, N, K, x.stride(0),
        weight.stride(0), y.stride(0), 0 if scale is None else scale.stride(0), s_rows, s_cols,
        M=M, HAS_BIAS=has_bias, BLOCK_N=bn, BLOCK_K=bk, VEC=vec, EVEN_K=K % bk == 0, NUM_STAGES=stages,
        SCALED=scale is not None, num_warps=warps, num_stages=stages, **pdl.launch(x),
        **pdl.prefetch_meta(K, weight.element_size()))
    return y


def fp8_fits(K: int, block: tuple) -> bool:
    """fp8_skinny_gemm takes this scale form: each 16-element slice of a row inside one scale block."""
    return block[1] % 16 == 0 or block[1] >= K


def fp8_skinny_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple,
                    bias: Optional[torch.Tensor] = None, config: Optional[tuple] = None) -> torch.Tensor:
    """x [M, K] (M <= 8) @ dequant(weight [N, K] float8_e4m3fn, scale float32 [ceil(N / bn), ceil(K / bk)],
    block (bn, bk))^T (+ bias) -> [M, N] in x's dtype: the skinny GEMM streaming the float8 weight (SCALED), each
    16-wide partial dot times its block's scale, fp32 accumulation. config: (BLOCK_N, BLOCK_K, num_warps,
    num_stages), default FP8_CANDIDATES' first."""
    M, K = x.shape
    N = weight.shape[0]
    if M > SKINNY_MAX_M or weight.shape[1] != K or weight.element_size() != 1 or not fp8_fits(K, block) \
            or scale.dtype != torch.float32 or scale.shape != (-(-N // block[0]), -(-K // block[1])):
        raise ValueError(f"fp8_skinny_gemm: x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, scale "
                         f"{tuple(scale.shape)} {scale.dtype}, block {block} do not fit (<= {SKINNY_MAX_M} rows, "
                         "16-column slices inside a block)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    config = config or skinny_gemm_candidates(M, N, K, 1)[0]
    return _launch(x, weight.contiguous(), bias, y, config, None, scale.contiguous(), block[0], block[1])
