"""The tensor-core skinny GEMM of 9..64 decode rows ("swap AB", split-K with a deterministic last-program
reduction), its launch configs and tuning candidates. The launcher accepts CPU tensors when TRITON_INTERPRET=1 was
set before triton was imported (tests).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops import pdl
from xllm_gen.runtime.ops.pdl import pdl_enter, pdl_trigger


# ---------------------------------------------------------------------------------------------- skinny MMA GEMM
# y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for 9 <= M <= 64 decode rows, still a weight stream at these sizes but with
# too many rows for the FMA kernel above (its x reads grow with M). Tensor cores, "swap AB": each program computes
# the transposed tile y^T[BLOCK_N, BLOCK_M] = W[BLOCK_N, K-range] @ x^T[K-range, BLOCK_M], so the weight rows are
# the MMA's M side (>= 16) and the few decode rows its N side (BLOCK_M = 16 / 32 / 64, padded rows masked).
# A 1024-wide layer (N 1024) gives only N / BLOCK_N programs, so K is split: program (n, s) sums the s-th of
# SPLIT_K contiguous K ranges into an fp32 workspace slice; the last program of column block n to finish (an
# acq_rel atomic counter per column block, reset by that program) sums the SPLIT_K slices in index order, adds the
# bias and stores y. Which program finishes last varies, the summation order does not: results are deterministic
# and identical between eager and graph replays. cuBLAS does the same with a second reduce kernel.
@triton.jit
def _skinny_mma_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, K_SPLIT, SPLIT_K, stride_xm,
                       stride_wn, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                       NUM_STAGES: tl.constexpr, PDL: tl.constexpr = 0):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pdl_enter(PDL, LARGE=True)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)          # clamped: the last tile's extra rows are never stored
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]                # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M] (x^T)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
            xt = tl.load(x_ptrs + k0, mask=m_mask[None, :], other=0.0)
        else:
            km = (offs_k + k0) < k_hi
            w = tl.load(w_ptrs + k0, mask=km[None, :], other=0.0, eviction_policy="evict_first")
            xt = tl.load(x_ptrs + k0, mask=m_mask[None, :] & km[:, None], other=0.0)
        acc = tl.dot(w, xt.to(w.dtype), acc)
    pdl_trigger(PDL)
    n_mask = offs_n < N
    out_mask = n_mask[:, None] & m_mask[None, :]
    y_ptrs = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    if not SPLIT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        # workspace [SPLIT_K, N_pad, BLOCK_M], N_pad = the grid's column blocks * BLOCK_N: no masks needed
        n_pad = tl.num_programs(0) * BLOCK_N
        tile = offs_n[:, None].to(tl.int64) * BLOCK_M + offs_m[None, :]
        tl.store(ws_ptr + pid_k * n_pad * BLOCK_M + tile, acc)
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(0, SPLIT_K):
                total += tl.load(ws_ptr + s * n_pad * BLOCK_M + tile, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)              # ready for the next call (or graph replay)


SKINNY_MMA_MAX_M = 64
_SPLITK_COUNTERS: dict = {}


def _splitk_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 counter per column block, kept per device (each reduction leaves its counter at 0 again, so
    calls and graph replays share it; calls on one stream never overlap). Grown outside of graph capture: an engine
    runs every decode GEMM shape eagerly (tuning, warm-up) before capturing."""
    buf = _SPLITK_COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _SPLITK_COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf


def skinny_mma_block_m(M: int) -> int:
    return 16 if M <= 16 else 32 if M <= 32 else 64


def skinny_mma_config(M: int, N: int, K: int, block_n: int = 64, block_k: int = 128, num_warps: int = 4,
                      num_stages: int = 4, programs: int = 264) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K): K split so that the grid has about `programs`
    programs (2 per SM of an H200), each K range a whole number of BLOCK_K chunks."""
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    chunks = triton.cdiv(K, block_k)
    split = max(1, min(chunks, round(programs / triton.cdiv(N, block_n))))
    split = triton.cdiv(chunks, triton.cdiv(chunks, split))       # equal ranges: no empty split
    return skinny_mma_block_m(M), block_n, block_k, num_warps, num_stages, split


def skinny_mma_candidates(M: int, N: int, K: int) -> list[tuple[int, int, int, int, int, int]]:
    """Launch configs worth timing for (M, N, K), 9 <= M <= 64 (tune_decode_gemms keeps the fastest, or cuBLAS): the
    ones bench/bench_gemv.py --rows 16,32,64 found best on an H200 over 0.6B- and 8B-parameter model shapes (BLOCK_N 128 and
    BLOCK_N 64 with BLOCK_K 256 never were; bench/results/h200_gemv_mma.md)."""
    out = []
    for bn, bk, warps, stages, programs in ((64, 128, 4, 4, 264), (32, 128, 4, 4, 264), (32, 256, 4, 3, 132),
                                            (64, 128, 4, 4, 132)):
        cfg = skinny_mma_config(M, N, K, bn, bk, warps, stages, programs)
        if cfg not in out:
            out.append(cfg)
    return out


def skinny_mma_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    config: Optional[tuple] = None) -> torch.Tensor:
    """x [M, K] (M <= 64), weight [N, K], bias [N] or None -> y [M, N] in x's dtype (fp32 accumulation) on tensor
    cores; config (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K), default skinny_mma_config's.
    BLOCK_M comes from the config, not from M: rows padded up to a graph bucket run the bucket's kernel, and each
    row's result does not depend on how many rows there are."""
    M, K = x.shape
    N = weight.shape[0]
    if M > SKINNY_MMA_MAX_M:
        raise ValueError(f"skinny_mma_gemm: M={M} > {SKINNY_MMA_MAX_M}")
    if weight.shape[1] != K:
        raise ValueError(f"skinny_mma_gemm: x {tuple(x.shape)} vs weight {tuple(weight.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(M, N))
    bm, bn, bk, warps, stages, split = config or skinny_mma_config(M, N, K)
    if bm < M:
        raise ValueError(f"skinny_mma_gemm: BLOCK_M {bm} < M {M}")
    grid_n = triton.cdiv(N, bn)
    k_split = triton.cdiv(triton.cdiv(K, bk), split) * bk
    split = triton.cdiv(K, k_split)
    if split > 1:
        ws = torch.empty((split, grid_n * bn, bm), dtype=torch.float32, device=x.device)
        cnt = _splitk_counters(x.device, grid_n)
    else:
        ws = cnt = y
    has_bias = bias is not None
    _skinny_mma_kernel[(grid_n, split)](
        x, weight, bias if has_bias else weight, y, ws, cnt, M, N, K, k_split, split, x.stride(0), weight.stride(0),
        y.stride(0), HAS_BIAS=has_bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split > 1,
        EVEN_K=K % k_split == 0 and k_split % bk == 0, NUM_STAGES=stages, num_warps=warps, num_stages=stages,
        **pdl.launch(x))
    return y
