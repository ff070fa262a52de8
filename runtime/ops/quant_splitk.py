"""Split-K weight-only GEMV on the CUDA cores for decode (M = 1..16 rows): int4 (AWQ / GPTQ) and fp8 weights.

The tensor-core kernel of quant_gemv.py pads M to a 16-row tile and dequantizes every element to the activation
dtype before tl.dot; measured on an H200 it streams 1-1.5 T weight elements/s, bound by that dequantize, not HBM.
This kernel does less per element and spreads K over many programs (the form of gemlite's GEMV_REVSPLITK and of
Marlin's dequantize):

- grid (ceil(N / BLOCK_N), SPLIT_K): a program owns BLOCK_N output rows and one CHUNK of K (int4: CHUNK words,
  i.e. CHUNK columns of each of the eight K/8 slices of quant_gemv's repacked layout), walked in [BLOCK_N,
  BLOCK_K] tiles of the weight as stored (K contiguous; a thread-row's BLOCK_K words / bytes are one vector load);
- every tensor of the loop is such a 2-D tile or a vector of it: no 3-D broadcast, so Triton keeps the load's
  layout throughout (checked offline in the sm_90 TTGIR: no layout conversion in the loop);
- int4: the eight slices are unrolled, each with its own accumulator; nibble j of a word masked in place,
  (w & 0xF << 4 (j % 4)) | 0x4B000000 (j >= 4: of w >> 16), read as a float is 2^23 + q 16^(j % 4) exactly
  (Marlin / FasterTransformer's magic number; passed in a register so that mask and OR are one LOP3), minus
  2^23 + z 16^(j % 4) it is (q - z) 16^(j % 4) exactly: one LOP3 and one FADD an element (one shift a word), then
  one FFMA with the activation (sm_90 SASS of the loop: 4.3-4.8 instructions an element at 2-4 rows a thread);
  fp8: e4m3 -> fp32 conversion, then one FFMA (~4 instructions an element);
- the group scale is applied once per (row, slice) to the partial dot, s 16^-(j % 4) (x . (q - z)), not per
  element, where the CHUNK lies inside one group (int4: K/8 a multiple of the group and the group a multiple of
  CHUNK, or one group a row; fp8: one scale per row over the CHUNK: per channel / tensor, or 128-blocks with CHUNK
  dividing 128). Otherwise (odd groups or blocks) scales and zeros are gathered per element (exact, slower);
- M = 1 accumulates element-wise in fp32 registers [BLOCK_N, BLOCK_K] and reduces over K once at the end; M > 1
  (BLOCK_M the next power of two, BLOCK_K >= BLOCK_M) reduces each row's dot over the tile in-thread and adds it
  to column m of the accumulator (a select on a per-register constant: one add);
- the K splits are combined deterministically: each program writes its fp32 partial [BLOCK_M, BLOCK_N] to a
  buffer, then takes a ticket from a per-N-tile counter (atomic add, acq_rel); the last one to arrive sums the
  SPLIT_K partials in split order (fixed order: run-to-run and graph / eager identical), adds the bias, casts,
  stores, and resets the counter (so the counters are zero between calls, also inside CUDA graphs).
  XLLM_QUANT_SPLITK_REDUCE=twopass instead sums the partials in a second small kernel (no counters).

Precision against the reference (F.linear on the weight dequantized to the activation dtype): the reference rounds
each (q - z) s (resp. q s) to bf16 / fp16 once; this kernel multiplies the exact products in fp32 and rounds only the
sum (the fp32 accumulation order differs): a relative error of the output of ~2^-9 / sqrt(terms) in bf16, ~1e-6 in
float32 activations (the CPU tests).

The launcher accepts CPU tensors when TRITON_INTERPRET=1 was set before triton was imported (tests).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

SPLITK_MAX_M = 16                # rows this kernel takes (BLOCK_M = next power of two)
_REDUCE = os.environ.get("XLLM_QUANT_SPLITK_REDUCE", "serial")
if _REDUCE not in ("serial", "twopass"):
    raise ValueError(f"XLLM_QUANT_SPLITK_REDUCE={_REDUCE!r}: 'serial' or 'twopass'")
_LOCK_SLOTS = 1 << 16            # N tiles a counter buffer serves
_LOCKS: dict = {}                # device -> the shared counter buffer (calls without a layer's own buffer)


@triton.jit
def _store_rows(y_ptr, b_ptr, acc, ms, M, offs_n, n_mask, stride_ym, HAS_BIAS: tl.constexpr):
    # acc [BLOCK_N, C]: column c holds activation row ms[c] (rows >= M not stored)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + ms[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & (ms < M)[None, :])


@triton.jit
def _finish_split(out, ms, M, N, offs_n, n_mask, pid_n, pid_k, y_ptr, b_ptr, part_ptr, lock_ptr, stride_ym,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, SERIAL: tl.constexpr):
    """A program's partial out [BN, C] (column c: activation row ms[c]) to y: stored directly without a split; else
    written to part [SPLIT_K, BLOCK_M, N] and, SERIAL, the last of the N tile's programs (a ticket from its counter)
    sums the partials in split order (deterministic), stores, and resets the counter."""
    if SPLIT_K == 1:
        _store_rows(y_ptr, b_ptr, out, ms, M, offs_n, n_mask, stride_ym, HAS_BIAS)
    else:
        p_off = ms[None, :].to(tl.int64) * N + offs_n[:, None]
        pm = n_mask[:, None] & (ms < M)[None, :]
        tl.store(part_ptr + pid_k * BLOCK_M * N + p_off, out, mask=pm)
        if SERIAL:
            tl.debug_barrier()              # every thread's partial written before the ticket (release)
            ticket = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel")
            if ticket == SPLIT_K - 1:       # the last of the N tile's programs: sum the partials in split order
                tot = tl.zeros_like(out)
                for sk in range(0, SPLIT_K):
                    tot += tl.load(part_ptr + sk * BLOCK_M * N + p_off, mask=pm, other=0.0, cache_modifier=".cg")
                _store_rows(y_ptr, b_ptr, tot, ms, M, offs_n, n_mask, stride_ym, HAS_BIAS)
                tl.atomic_xchg(lock_ptr + pid_n, 0)


@triton.jit
def _rows_dot(acc, w, x_ptr, stride_xm, M, cols, k_mask, colid, BLOCK_M: tl.constexpr):
    """acc [BN, BK] + w [BN, BK] times the activations at `cols`. One row: element-wise (reduced over K once, at the
    end). BLOCK_M rows: each row's dot reduced over the tile (in-thread) and added to column m of acc (a select on
    a per-register constant: one add), so every tensor keeps the weight tile's layout (no 3-D broadcast, no layout
    conversion in the loop)."""
    if BLOCK_M == 1:
        acc += w * tl.load(x_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)[None, :]
    else:
        for m in tl.static_range(BLOCK_M):
            xv = tl.load(x_ptr + m * stride_xm + cols, mask=k_mask & (m < M), other=0.0).to(tl.float32)
            part = tl.sum(w * xv[None, :], axis=1)
            acc = tl.where(colid == m, acc + part[:, None], acc)
    return acc


@triton.jit
def _int4_group(z_ptr, s_ptr, rows, stride_zn, stride_sn, col, S_COLS, J: tl.constexpr):
    """Slice J's group over the chunk (its first column `col`): (2^23 + z 16^(J % 4), s 16^-(J % 4)), [BLOCK_N]."""
    PW: tl.constexpr = 1 << (4 * (J % 4))
    g = col // S_COLS
    z = tl.load(z_ptr + rows * stride_zn + g).to(tl.float32)
    s = tl.load(s_ptr + rows * stride_sn + g).to(tl.float32)
    return 8388608.0 + z * PW, s * (1.0 / PW)


@triton.jit
def _int4_slice(acc, words, hi, magic, x_ptr, stride_xm, M, kk, k_mask, colid, KW, zo, rows, z_ptr, s_ptr,
                stride_zn, stride_sn, S_COLS, J: tl.constexpr, SCALE_PER_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc + the tile's slice J (columns J K/8 + kk) times the activations; without its group scale where
    SCALE_PER_CHUNK (applied once at the end), else with scales and zeros per element."""
    PW: tl.constexpr = 1 << (4 * (J % 4))
    if J < 4:
        src = words
    else:
        src = hi
    # nibble J masked in place: the bits of 2^23 + q 16^(J % 4) as a float, exact (no int-to-float conversion). The
    # magic number 0x4B000000 comes in a register (a kernel argument): (w & imm) | reg is one LOP3, where two
    # immediates took two
    qf = ((src & (0xF << (4 * (J % 4)))) | magic).to(tl.float32, bitcast=True)               # [BN, BK]
    cols = J * KW + kk
    if SCALE_PER_CHUNK:
        d = qf - zo[:, None]                                        # (q - z) 16^(J % 4), exact
    else:
        gk = (cols // S_COLS)[None, :]
        ze = tl.load(z_ptr + rows[:, None] * stride_zn + gk, mask=k_mask[None, :], other=0).to(tl.float32)
        se = tl.load(s_ptr + rows[:, None] * stride_sn + gk, mask=k_mask[None, :], other=0.0).to(tl.float32)
        d = (qf - (8388608.0 + ze * PW)) * (se * (1.0 / PW))       # (q - z) s
    return _rows_dot(acc, d, x_ptr, stride_xm, M, cols, k_mask, colid, BLOCK_M)


@triton.jit
def _splitk_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, lock_ptr, M, N, KW,
                        stride_xm, stride_qn, stride_sn, stride_zn, stride_ym, S_ROWS, S_COLS, MAGIC,
                        INT4: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, SPLIT_K: tl.constexpr,
                        SCALE_PER_CHUNK: tl.constexpr, SERIAL: tl.constexpr, EVEN_K: tl.constexpr):
    # KW: K / 8 words (int4) or K (fp8); S_ROWS x S_COLS: rows x columns one scale covers (int4: 1 x group).
    # Every tensor of the loop is a [BLOCK_N, BLOCK_K] tile in the weight's own layout (K contiguous: one vector load
    # a thread-row) or a vector of it; BLOCK_M > 1 needs BLOCK_K >= BLOCK_M (column m of the accumulators: row m).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)          # rows past N are clamped reads, never stored
    offs_k = tl.arange(0, BLOCK_K)
    colid = offs_k[None, :]
    k_lo = pid_k * CHUNK
    if INT4:
        # eight slices unrolled, each with its accumulator (and, SCALE_PER_CHUNK, its group's zero and scale)
        zo0, s0 = _int4_group(z_ptr, s_ptr, rows, stride_zn, stride_sn, k_lo, S_COLS, 0)
        zo1, s1 = _int4_group(z_ptr, s_ptr, rows, stride_zn, stride_sn, KW + k_lo, S_COLS, 1)
        zo2, s2 = _int4_group(z_ptr, s_ptr, rows, stride_zn, stride_sn, 2 * KW + k_lo, S_COLS, 2)
        zo3, s3 = _int4_group(z_ptr, s_ptr, rows, stride_zn, stride_sn, 3 * KW + k_lo, S_COLS, 3)
        zo4, s4 = _int4_group(z_ptr, s_ptr, rows, stride_zn, stride_sn, 4 * KW + k_lo, S_COLS, 4)
        zo5, s5 = _int4_group(z_ptr, s_ptr, rows, stride_zn, stride_sn, 5 * KW + k_lo, S_COLS, 5)
        zo6, s6 = _int4_group(z_ptr, s_ptr, rows, stride_zn, stride_sn, 6 * KW + k_lo, S_COLS, 6)
        zo7, s7 = _int4_group(z_ptr, s_ptr, rows, stride_zn, stride_sn, 7 * KW + k_lo, S_COLS, 7)
        a0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        a1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        a2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        a3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        a4 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        a5 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        a6 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        a7 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(k_lo, k_lo + CHUNK, BLOCK_K):
            kk = k0 + offs_k
            if EVEN_K:                      # no K tail: unmasked loads (no predicates, no zero fills)
                k_mask = tl.full([BLOCK_K], 1, tl.int1)
            else:
                k_mask = kk < KW
            words = tl.load(q_ptr + rows[:, None] * stride_qn + kk[None, :], mask=k_mask[None, :], other=0,
                            eviction_policy="evict_first")                                  # [BN, BK] int32
            hi = words >> 16
            a0 = _int4_slice(a0, words, hi, MAGIC, x_ptr, stride_xm, M, kk, k_mask, colid, KW, zo0, rows, z_ptr, s_ptr,
                             stride_zn, stride_sn, S_COLS, 0, SCALE_PER_CHUNK, BLOCK_M)
            a1 = _int4_slice(a1, words, hi, MAGIC, x_ptr, stride_xm, M, kk, k_mask, colid, KW, zo1, rows, z_ptr, s_ptr,
                             stride_zn, stride_sn, S_COLS, 1, SCALE_PER_CHUNK, BLOCK_M)
            a2 = _int4_slice(a2, words, hi, MAGIC, x_ptr, stride_xm, M, kk, k_mask, colid, KW, zo2, rows, z_ptr, s_ptr,
                             stride_zn, stride_sn, S_COLS, 2, SCALE_PER_CHUNK, BLOCK_M)
            a3 = _int4_slice(a3, words, hi, MAGIC, x_ptr, stride_xm, M, kk, k_mask, colid, KW, zo3, rows, z_ptr, s_ptr,
                             stride_zn, stride_sn, S_COLS, 3, SCALE_PER_CHUNK, BLOCK_M)
            a4 = _int4_slice(a4, words, hi, MAGIC, x_ptr, stride_xm, M, kk, k_mask, colid, KW, zo4, rows, z_ptr, s_ptr,
                             stride_zn, stride_sn, S_COLS, 4, SCALE_PER_CHUNK, BLOCK_M)
            a5 = _int4_slice(a5, words, hi, MAGIC, x_ptr, stride_xm, M, kk, k_mask, colid, KW, zo5, rows, z_ptr, s_ptr,
                             stride_zn, stride_sn, S_COLS, 5, SCALE_PER_CHUNK, BLOCK_M)
            a6 = _int4_slice(a6, words, hi, MAGIC, x_ptr, stride_xm, M, kk, k_mask, colid, KW, zo6, rows, z_ptr, s_ptr,
                             stride_zn, stride_sn, S_COLS, 6, SCALE_PER_CHUNK, BLOCK_M)
            a7 = _int4_slice(a7, words, hi, MAGIC, x_ptr, stride_xm, M, kk, k_mask, colid, KW, zo7, rows, z_ptr, s_ptr,
                             stride_zn, stride_sn, S_COLS, 7, SCALE_PER_CHUNK, BLOCK_M)
        if SCALE_PER_CHUNK:
            acc = (a0 * s0[:, None] + a1 * s1[:, None] + a2 * s2[:, None] + a3 * s3[:, None] + a4 * s4[:, None]
                   + a5 * s5[:, None] + a6 * s6[:, None] + a7 * s7[:, None])
        else:
            acc = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7
    else:
        srows = rows // S_ROWS
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(k_lo, k_lo + CHUNK, BLOCK_K):
            kk = k0 + offs_k
            if EVEN_K:                      # no K tail: unmasked loads (no predicates, no zero fills)
                k_mask = tl.full([BLOCK_K], 1, tl.int1)
            else:
                k_mask = kk < KW
            w = tl.load(q_ptr + rows[:, None] * stride_qn + kk[None, :], mask=k_mask[None, :], other=0.0,
                        eviction_policy="evict_first").to(tl.float32)                     # [BN, BK]
            if not SCALE_PER_CHUNK:
                w = w * tl.load(s_ptr + srows[:, None] * stride_sn + (kk // S_COLS)[None, :], mask=k_mask[None, :],
                                other=0.0)
            acc = _rows_dot(acc, w, x_ptr, stride_xm, M, kk, k_mask, colid, BLOCK_M)
        if SCALE_PER_CHUNK:                 # one scale per row over the chunk
            acc = acc * tl.load(s_ptr + srows * stride_sn + k_lo // S_COLS)[:, None]
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[:, None]                  # [BN, 1]
        ms = tl.arange(0, 1)
    else:
        out = acc                                           # [BN, BK]: column m is row m
        ms = offs_k
    _finish_split(out, ms, M, N, offs_n, n_mask, pid_n, pid_k, y_ptr, b_ptr, part_ptr, lock_ptr, stride_ym,
                  HAS_BIAS, BLOCK_M, SPLIT_K, SERIAL)


@triton.jit
def _splitk_reduce_kernel(part_ptr, b_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    ms = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    p_off = ms[None, :].to(tl.int64) * N + offs_n[:, None]
    tot = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for sk in range(0, SPLIT_K):
        tot += tl.load(part_ptr + sk * BLOCK_M * N + p_off, mask=n_mask[:, None] & (ms < M)[None, :], other=0.0)
    _store_rows(y_ptr, b_ptr, tot, ms, M, offs_n, n_mask, stride_ym, HAS_BIAS)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def chunk_choices(KW: int, int4: bool, s_cols: int, K: int, bk: int) -> list[int]:
    """CHUNK values (multiples of bk, largest first) under which the scales are constant per row (and slice) over a
    chunk: dividing the group (int4, K/8 a multiple of it) or the 128-block (fp8); any for one scale a row."""
    top = max(bk, triton.next_power_of_2(KW))
    cands = [c for c in (512, 256, 128, 64, 32, 16, 8, 4, 2) if bk <= c <= top]
    if int4:
        one_group = s_cols >= K
        fits = [c for c in cands if one_group or (KW % s_cols == 0 and s_cols % c == 0)]
    else:
        fits = [c for c in cands if s_cols >= K or s_cols % c == 0]
    return fits or cands


def splitk_config(M: int, N: int, K: int, int4: bool, s_cols: int, sms: int = 132) -> tuple[int, int, int, int]:
    """The launch table (M, N, K) -> (BLOCK_N, BLOCK_K, CHUNK, num_warps); no autotuning (CUDA graphs,
    determinism). From the sm_90 SASS of the loop (ptxas offline): one 16-byte vector
    load a thread-row (int4: 4 words = 32 codes; fp8: 16 bytes); 256 rows a program on 4 warps (2 rows a thread:
    the activations' loads and bf16 -> fp32 conversions shared by 2 rows; int4 ~4.8 instructions an element, 160
    registers; 4 rows a thread: ~4.3, 252 registers), and the largest chunk (16-128 words / 64-512 bytes) that
    leaves >= 2 programs per SM (fp8: as measured, below); else 128, 64, 32 rows (an 8B model's qkv 6144x4096 int4: 24 x 16 programs of 32
    words; a 1024-wide model's o 1024x2048: 32 x 16 programs of 16 words)."""
    KW = K // 8 if int4 else K
    # fp8: 32-byte vectors, 128 rows and chunks <= 256 bytes measured best on the H200 at M = 1 (an 8B model's qkv 6144 x 4096: 13.1 /
    # 14.9 us per channel / 128-blocks against 15.7 / 17.8 for 16 bytes x 256 rows; bench/results/h200_quant_splitk.md)
    bk = min(4 if int4 else 32, triton.next_power_of_2(KW))
    lo, hi = (16, 128) if int4 else (64, 256)
    fits = chunk_choices(KW, int4, s_cols, K, bk)
    chunks = [c for c in fits if min(lo, fits[0]) <= c <= hi] or fits
    tiles = ((256, 4), (128, 4), (64, 2), (32, 1)) if int4 else ((128, 4), (256, 4), (64, 2), (32, 1))
    for bn, warps in tiles:
        for c in chunks:
            if triton.cdiv(N, bn) * triton.cdiv(KW, c) >= 2 * sms:
                return bn, bk, c, warps
    return 32, bk, chunks[-1], 1


def splitk_candidates(M: int, N: int, K: int, int4: bool, s_cols: int, sms: int = 132) -> list[tuple]:
    """Launch configs worth timing for a shape (bench/bench_quant.py --sweep, layers/quant_tuning.py): the table's,
    then its neighbours (the table's vector width first)."""
    KW = K // 8 if int4 else K
    table = splitk_config(M, N, K, int4, s_cols, sms)
    out = [table]
    for bk in (table[1],) + ((8, 2) if int4 else (16, 8)):
        bk = min(bk, triton.next_power_of_2(KW))
        for c in [c for c in chunk_choices(KW, int4, s_cols, K, bk) if c >= 4 * bk][:3] or [table[2]]:
            for bn, warps in ((256, 4), (512, 4), (128, 4), (512, 8), (64, 2)):
                if (bn, bk, c, warps) not in out and triton.cdiv(N, bn) * triton.cdiv(KW, c) >= sms:
                    out.append((bn, bk, c, warps))
    return out


def lock_buffer(device: torch.device) -> torch.Tensor:
    """Zeroed split-K counters (int32), one a N tile; each call leaves them zero again. A packed layer holds its own
    (allocated at load: never inside a graph capture, never shared by concurrent streams); other callers share one
    per device."""
    buf = _LOCKS.get(device)
    if buf is None:
        buf = _LOCKS[device] = torch.zeros(_LOCK_SLOTS, dtype=torch.int32, device=device)
    return buf


def new_lock_buffer(N: int, device) -> torch.Tensor:
    """A layer's own counters: enough for its N at the smallest BLOCK_N of the candidates (32)."""
    return torch.zeros(triton.cdiv(N, 32), dtype=torch.int32, device=device)


def splitk_gemv(x, q, s, z, bias, N: int, K: int, s_rows: int, s_cols: int, int4: bool,
                config: Optional[tuple] = None, locks: Optional[torch.Tensor] = None,
                reduce: Optional[str] = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T (+ bias), M <= SPLITK_MAX_M; q, s, z as quant_gemv's int4_gemm / fp8_gemm hold
    them (checked there). `reduce`: "serial" / "twopass" (default: XLLM_QUANT_SPLITK_REDUCE, else serial)."""
    M = x.shape[0]
    if M > SPLITK_MAX_M:
        raise ValueError(f"splitk_gemv: {M} rows > SPLITK_MAX_M {SPLITK_MAX_M}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    KW = K // 8 if int4 else K
    bn, bk, chunk, warps = config or splitk_config(M, N, K, int4, s_cols, _sm_count(x.device))
    bm = triton.next_power_of_2(M)
    if bm > 1 and bk < bm:          # column m of the accumulators holds row m: BLOCK_K >= BLOCK_M
        bk = bm
        chunk = max(chunk, bk)
    split = triton.cdiv(KW, chunk)
    if int4:
        per_chunk = s_cols >= K or (KW % s_cols == 0 and s_cols % chunk == 0)
    else:
        per_chunk = s_cols >= K or s_cols % chunk == 0
    n_tiles = triton.cdiv(N, bn)
    serial = split > 1 and (reduce or _REDUCE) == "serial"
    if serial:
        if locks is None or locks.numel() < n_tiles:
            if x.is_cuda and torch.cuda.is_current_stream_capturing() and x.device not in _LOCKS:
                serial = False      # a fresh buffer's zeros would only exist at replay: no counters in this graph
            else:
                locks = lock_buffer(x.device)
        serial = serial and n_tiles <= locks.numel()
    part = torch.empty((split, bm, N), dtype=torch.float32, device=x.device) if split > 1 else y
    has_bias = bias is not None
    _splitk_gemv_kernel[(n_tiles, split)](
        x, q, s, z if z is not None else s, bias if has_bias else s, y, part, locks if serial else part, M, N, KW,
        x.stride(0), q.stride(0), s.stride(0), z.stride(0) if z is not None else 0, y.stride(0), s_rows, s_cols,
        0x4B000000, INT4=int4, HAS_BIAS=has_bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK=chunk, SPLIT_K=split,
        SCALE_PER_CHUNK=per_chunk, SERIAL=serial, EVEN_K=KW % chunk == 0, num_warps=warps, num_stages=2)
    if split > 1 and not serial:
        rbn = 128
        _splitk_reduce_kernel[(triton.cdiv(N, rbn),)](part, bias if has_bias else s, y, M, N, y.stride(0),
                                                      SPLIT_K=split, HAS_BIAS=has_bias, BLOCK_M=bm, BLOCK_N=rbn,
                                                      num_warps=4)
    return y
