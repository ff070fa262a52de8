"""int4 weight-only decode GEMM on the tensor cores over the raw codes: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, M <= 16.

quant_gemv.py's tensor-core tile dequantizes every element to (q - z) s in float32 and casts it (~5 instructions
an element: bound by that, not by HBM). This kernel hands the tensor cores the codes themselves, two at a time
(Marlin's trick, in Triton): with quant_gemv's packing, word w holds slice j's code in bits 4j..4j+3 and slice j+4's
in bits 16+4j.., so for j < 4

    t = (w >> 4j) & 0x000F000F | 0x43004300      (bf16; fp16: 0x64006400)

is one shift and one LOP3 for two elements, and each 16-bit half of t read as bf16 is exactly 128 + q (fp16: 1024 +
q): no conversion. The dot of the activations with these offset codes over a group's columns g is corrected once
per (row, group) instead of per element:

    sum_g x (q - z) s  =  s (sum_g x (OFF + q)  -  (OFF + z) sum_g x)

(OFF + q and the bf16 / fp16 products are exact; the float32 partial sums lose ~log2(OFF / 16) bits to the
cancellation: a relative error ~1e-6 of the dot, far below the output's rounding.)

Layout: acc [BLOCK_N, 16] = codes [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, 16] per slice (the weight tile is the dot's
first operand, so a program holds 64+ weight rows and the 1-16 activation rows pad only the small side). A program
owns BLOCK_N rows and a CHUNK of the K / 8 words; the split-K partials are combined by quant_splitk.py's _finish_split
(serial tickets, deterministic order). Needs the group to be a multiple of BLOCK_K and K / 8 a multiple of the group (every
tile of a slice lies in one group); other shapes keep the other kernels (`fits`).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops.quant_splitk import _finish_split, _sm_count, lock_buffer

CODES_MAX_M = 16


@triton.jit
def _correct(acc, raw, x_ptr, stride_xm, ms, m_mask, col, CHUNK: tl.constexpr, s_ptr, z_ptr, rows, stride_sn,
             stride_zn, GROUP, OFF: tl.constexpr):
    """acc + s (raw - (OFF + z) sum x) for one slice: raw [BN, BM] = (OFF + q) . x over the chunk's columns
    col..col + CHUNK, which lie in one group."""
    ck = col + tl.arange(0, CHUNK)
    xs = tl.load(x_ptr + ms[:, None].to(tl.int64) * stride_xm + ck[None, :], mask=m_mask[:, None], other=0.0)
    xsum = tl.sum(xs.to(tl.float32), axis=1)                                                 # [BM]
    g = col // GROUP
    s = tl.load(s_ptr + rows * stride_sn + g).to(tl.float32)
    z = tl.load(z_ptr + rows * stride_zn + g).to(tl.float32)
    return acc + s[:, None] * (raw - (OFF + z)[:, None] * xsum[None, :])


@triton.jit
def _codes_dot(raw, t16, x_ptr, stride_xm, ms, m_mask, cols):
    """raw [BN, BM] + (the tile's offset codes, 16-bit) @ x^T at columns `cols`."""
    codes = t16.to(x_ptr.dtype.element_ty, bitcast=True)                                     # [BN, BK] OFF + q
    # loaded K-contiguous (one vector load a thread), transposed on the way to shared memory
    xs = tl.load(x_ptr + ms[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=m_mask[:, None], other=0.0)
    return tl.dot(codes, tl.trans(xs), raw)


@triton.jit
def _int4_codes_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, lock_ptr, M, N, KW,
                       stride_xm, stride_qn, stride_sn, stride_zn, stride_ym, GROUP, MAGIC,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       CHUNK: tl.constexpr, SPLIT_K: tl.constexpr, OFF: tl.constexpr,
                       NUM_STAGES: tl.constexpr):
    # MAGIC comes in a register (a kernel argument): (w & imm) | reg is one LOP3, where two immediates took two.
    # The chunk lies in one group of each slice (GROUP % CHUNK == 0): the eight slices' raw dots accumulate apart
    # over the chunk and are scaled and corrected once, at the end
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)          # rows past N are clamped reads, never stored
    ms = tl.arange(0, BLOCK_M)
    m_mask = ms < M
    offs_k = tl.arange(0, BLOCK_K)
    r0 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    r1 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    r2 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    r3 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    r4 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    r5 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    r6 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    r7 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_lo = pid_k * CHUNK
    for w0 in tl.range(k_lo, k_lo + CHUNK, BLOCK_K, num_stages=NUM_STAGES):
        kk = w0 + offs_k
        words = tl.load(q_ptr + rows[:, None] * stride_qn + kk[None, :], eviction_policy="evict_first")
        # t = (w >> 4j) & 0x000F000F | MAGIC: its low half is slice j's OFF + q, its high half slice j + 4's
        t = (words & 0x000F000F) | MAGIC
        r0 = _codes_dot(r0, t.to(tl.int16), x_ptr, stride_xm, ms, m_mask, kk)
        r4 = _codes_dot(r4, (t >> 16).to(tl.int16), x_ptr, stride_xm, ms, m_mask, 4 * KW + kk)
        t = ((words >> 4) & 0x000F000F) | MAGIC
        r1 = _codes_dot(r1, t.to(tl.int16), x_ptr, stride_xm, ms, m_mask, KW + kk)
        r5 = _codes_dot(r5, (t >> 16).to(tl.int16), x_ptr, stride_xm, ms, m_mask, 5 * KW + kk)
        t = ((words >> 8) & 0x000F000F) | MAGIC
        r2 = _codes_dot(r2, t.to(tl.int16), x_ptr, stride_xm, ms, m_mask, 2 * KW + kk)
        r6 = _codes_dot(r6, (t >> 16).to(tl.int16), x_ptr, stride_xm, ms, m_mask, 6 * KW + kk)
        t = ((words >> 12) & 0x000F000F) | MAGIC
        r3 = _codes_dot(r3, t.to(tl.int16), x_ptr, stride_xm, ms, m_mask, 3 * KW + kk)
        r7 = _codes_dot(r7, (t >> 16).to(tl.int16), x_ptr, stride_xm, ms, m_mask, 7 * KW + kk)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc = _correct(acc, r0, x_ptr, stride_xm, ms, m_mask, k_lo, CHUNK, s_ptr, z_ptr, rows, stride_sn, stride_zn,
                   GROUP, OFF)
    acc = _correct(acc, r1, x_ptr, stride_xm, ms, m_mask, KW + k_lo, CHUNK, s_ptr, z_ptr, rows, stride_sn,
                   stride_zn, GROUP, OFF)
    acc = _correct(acc, r2, x_ptr, stride_xm, ms, m_mask, 2 * KW + k_lo, CHUNK, s_ptr, z_ptr, rows, stride_sn,
                   stride_zn, GROUP, OFF)
    acc = _correct(acc, r3, x_ptr, stride_xm, ms, m_mask, 3 * KW + k_lo, CHUNK, s_ptr, z_ptr, rows, stride_sn,
                   stride_zn, GROUP, OFF)
    acc = _correct(acc, r4, x_ptr, stride_xm, ms, m_mask, 4 * KW + k_lo, CHUNK, s_ptr, z_ptr, rows, stride_sn,
                   stride_zn, GROUP, OFF)
    acc = _correct(acc, r5, x_ptr, stride_xm, ms, m_mask, 5 * KW + k_lo, CHUNK, s_ptr, z_ptr, rows, stride_sn,
                   stride_zn, GROUP, OFF)
    acc = _correct(acc, r6, x_ptr, stride_xm, ms, m_mask, 6 * KW + k_lo, CHUNK, s_ptr, z_ptr, rows, stride_sn,
                   stride_zn, GROUP, OFF)
    acc = _correct(acc, r7, x_ptr, stride_xm, ms, m_mask, 7 * KW + k_lo, CHUNK, s_ptr, z_ptr, rows, stride_sn,
                   stride_zn, GROUP, OFF)
    _finish_split(acc, ms, M, N, offs_n, n_mask, pid_n, pid_k, y_ptr, b_ptr, part_ptr, lock_ptr, stride_ym,
                  HAS_BIAS, BLOCK_M, SPLIT_K, True)


def fits(M: int, K: int, group: int, dtype: torch.dtype) -> bool:
    """Shapes this kernel takes: 1-16 rows of bf16 / fp16, a group of 16-column multiples tiling K / 8."""
    KW = K // 8
    return (0 < M <= CODES_MAX_M and dtype in (torch.bfloat16, torch.float16) and K % 8 == 0 and group % 16 == 0
            and KW % group == 0)


def codes_config(M: int, N: int, K: int, group: int, sms: int = 132) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, CHUNK, num_warps, num_stages). Measured on an H100 at an 8B model's four shapes, 1 / 4 / 16
    rows (bench/bench_quant.py --sweep, bench/results/h100_2026-12-06_session31.md): 64 rows on 4 warps (one
    warpgroup's MMA tile), tiles of 32 words and a chunk of one group (128 words) were fastest everywhere (64-word
    tiles 10-20% slower: 255 registers); 3 stages."""
    KW = K // 8
    bk = min(32, group)
    chunk = max(c for c in (128, 64, 32, 16) if c >= bk and group % c == 0 and KW % c == 0)
    return 64, bk, chunk, 4, 3


def codes_candidates(M: int, N: int, K: int, group: int, sms: int = 132) -> list[tuple]:
    """Launch configs worth timing for a shape: the table's first, then its neighbours."""
    KW = K // 8
    out = [codes_config(M, N, K, group, sms)]
    for bn, warps in ((64, 4), (128, 8)):
        for bk in (32, 64, 128):
            for chunk in (bk, 2 * bk, 4 * bk):
                if group % bk or group % chunk or triton.cdiv(N, bn) * (KW // chunk) < sms:
                    continue
                for stages in (3, 2):
                    cfg = (bn, bk, chunk, warps, stages)
                    if cfg not in out:
                        out.append(cfg)
    return out[:1] + sorted(out[1:], key=lambda c: (-c[2], c[1], c[0], -c[4]))     # whole groups first


def int4_codes_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                    bias: Optional[torch.Tensor] = None, config: Optional[tuple] = None,
                    locks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ dequant_int4(qweight [N, K/8] int32, scales [N, K/g], zeros uint8 [N, K/g])^T (+ bias [N]),
    quant_gemv's packing; `fits(M, K, group, x.dtype)` must hold."""
    M, K = x.shape
    N = qweight.shape[0]
    if not fits(M, K, group, x.dtype):
        raise ValueError(f"int4_codes_gemm: {M} rows of {x.dtype}, K {K}, group {group}: not a shape it takes")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    KW = K // 8
    bn, bk, chunk, warps, stages = config or codes_config(M, N, K, group, _sm_count(x.device))
    split = KW // chunk
    n_tiles = triton.cdiv(N, bn)
    if split > 1:
        if locks is None or locks.numel() < n_tiles:
            locks = lock_buffer(x.device)
        part = torch.empty((split, 16, N), dtype=torch.float32, device=x.device)
    else:
        part = locks = y
    has_bias = bias is not None
    fp16 = x.dtype == torch.float16        # the halves of t read as fp16 are 1024 + q, as bf16 128 + q
    _int4_codes_kernel[(n_tiles, split)](
        x, qweight, scales, zeros, bias if has_bias else scales, y, part, locks, M, N, KW,
        x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), y.stride(0), group,
        0x64006400 if fp16 else 0x43004300, HAS_BIAS=has_bias, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, CHUNK=chunk, SPLIT_K=split,
        OFF=1024.0 if fp16 else 128.0, NUM_STAGES=stages, num_warps=warps, num_stages=stages)
    return y

