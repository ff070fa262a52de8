"""Split-K weight-only GEMV on the CUDA cores for decode (M = 1..16 rows): int4 (AWQ / GPTQ) and fp8 weights.

The tensor-core kernel of quant_gemv.py pads M to a 16-row tile and dequantizes every element to the activation
dtype before tl.dot; measured on an H200 it streams 1-1.5 T weight elements/s, bound by that dequantize, not HBM.
This kernel does less per element and spreads K over many programs (the form of gemlite's GEMV_REVSPLITK and of
Marlin's dequantize):

- grid (ceil(N / BLOCK_N), SPLIT_K): a program owns BLOCK_N output rows and one CHUNK of K (int4: CHUNK words,
  i.e. CHUNK columns of each of the eight K/8 slices of quant_gemv's repacked layout), walked in [BLOCK_N,
  BLOCK_K] tiles of the weight as stored (K contiguous; a thread's BLOCK_K words / bytes are one vector load);
- int4: a tile of words becomes [BLOCK_N, 8, BLOCK_K] codes with no int-to-float conversion: nibble j of a word
  masked in place, (w & 0xF << 4 (j % 4)) | 0x4B000000 (j >= 4: of w >> 16) read as a float is 2^23 + q 16^(j % 4)
  exactly (Marlin / FasterTransformer's magic number), minus 2^23 + z 16^(j % 4) gives (q - z) 16^(j % 4)
  exactly: one LOP3 and one FADD an element (plus one shift a word), then one FFMA with the activation;
  fp8: float8_e4m3fn -> float32 conversion, then one FFMA;
- the group scale is applied once per (row, slice) to the partial dot, s 16^-(j % 4) (sum x (q - z)), not per
  element, where the CHUNK lies inside one group (int4: K/8 a multiple of the group and the group a multiple of
  CHUNK, or one group a row; fp8: one scale per row over the CHUNK: per channel / tensor, or 128-blocks with CHUNK
  dividing 128). Otherwise (odd groups or blocks) scales and zeros are gathered per element (exact, slower);
- M = 1 accumulates element-wise in fp32 registers and reduces over K once at the end; M > 1 (BLOCK_M, the next
  power of two) broadcasts the dequantized tile over the rows and reduces each tile over its K (in-thread);
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
def _store_rows(y_ptr, b_ptr, acc, offs_m, offs_n, m_mask, n_mask, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _splitk_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, lock_ptr, M, N, KW,
                        stride_xm, stride_qn, stride_sn, stride_zn, stride_ym, S_ROWS, S_COLS,
                        INT4: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, SPLIT_K: tl.constexpr,
                        SCALE_PER_CHUNK: tl.constexpr, SERIAL: tl.constexpr):
    # KW: K / 8 words (int4) or K (fp8); S_ROWS x S_COLS: rows x columns one scale covers (int4: 1 x group)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)          # rows past N are clamped reads, never stored
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * CHUNK
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    if INT4:
        jj = tl.arange(0, 8)
        j3 = jj[None, :, None]                                                      # [1, 8, 1]: the slice
        nib = 0xF << (4 * (j3 % 4))
        pw = (1 << (4 * (jj % 4))).to(tl.float32)[None, :]                          # [1, 8]: 16^(j % 4)
        if SCALE_PER_CHUNK:                 # one group per (row, slice) over the chunk: [BN, 8] scales and zeros
            g = (jj * KW + k_lo) // S_COLS
            z = tl.load(z_ptr + rows[:, None] * stride_zn + g[None, :]).to(tl.float32)
            s = tl.load(s_ptr + rows[:, None] * stride_sn + g[None, :]).to(tl.float32) / pw
            zoff = (8388608.0 + z * pw)[:, :, None]                                 # [BN, 8, 1]
        if BLOCK_M == 1:
            acc = tl.zeros([BLOCK_N, 8, BLOCK_K], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N, 8], dtype=tl.float32)
        for k0 in tl.range(k_lo, k_lo + CHUNK, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < KW
            words = tl.load(q_ptr + rows[:, None] * stride_qn + kk[None, :], mask=k_mask[None, :], other=0,
                            eviction_policy="evict_first")[:, None, :]                # [BN, 1, BK] int32
            src = tl.where(j3 < 4, words, words >> 16)
            qf = ((src & nib) | 0x4B000000).to(tl.float32, bitcast=True)            # 2^23 + q 16^(j % 4), exact
            cols = j3 * KW + kk[None, None, :]                                      # [1, 8, BK] columns
            km = k_mask[None, None, :]
            if SCALE_PER_CHUNK:
                d = qf - zoff                                                       # (q - z) 16^(j % 4), exact
            else:
                gk = cols // S_COLS
                ze = tl.load(z_ptr + rows[:, None, None] * stride_zn + gk, mask=km, other=0).to(tl.float32)
                se = tl.load(s_ptr + rows[:, None, None] * stride_sn + gk, mask=km, other=0.0).to(tl.float32)
                p3 = pw[:, :, None]
                d = (qf - (8388608.0 + ze * p3)) * (se / p3)                        # (q - z) s
            if BLOCK_M == 1:
                xv = tl.load(x_ptr + cols, mask=km, other=0.0).to(tl.float32)       # [1, 8, BK]
                acc += d * xv
            else:
                xv = tl.load(x_rows[:, None, None, None] + cols[None], other=0.0,
                             mask=m_mask[:, None, None, None] & km[None]).to(tl.float32)   # [BM, 1, 8, BK]
                acc += tl.sum(d[None] * xv, axis=3)
        if BLOCK_M == 1:
            part = tl.sum(acc, axis=2)                                              # [BN, 8]
            if SCALE_PER_CHUNK:
                part = part * s
            out = tl.sum(part, axis=1)[None, :]                                     # [1, BN]
        else:
            if SCALE_PER_CHUNK:
                acc = acc * s[None]
            out = tl.sum(acc, axis=2)                                               # [BM, BN]
    else:
        srows = rows // S_ROWS
        if SCALE_PER_CHUNK:                 # one scale per row over the chunk
            s = tl.load(s_ptr + srows * stride_sn + k_lo // S_COLS)
        if BLOCK_M == 1:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(k_lo, k_lo + CHUNK, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < KW
            w = tl.load(q_ptr + rows[:, None] * stride_qn + kk[None, :], mask=k_mask[None, :], other=0.0,
                        eviction_policy="evict_first").to(tl.float32)                 # [BN, BK]
            if not SCALE_PER_CHUNK:
                w = w * tl.load(s_ptr + srows[:, None] * stride_sn + (kk // S_COLS)[None, :], mask=k_mask[None, :],
                                other=0.0)
            if BLOCK_M == 1:
                acc += w * tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            else:
                xv = tl.load(x_rows[:, None] + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                             other=0.0).to(tl.float32)                                # [BM, BK]
                acc += tl.sum(w[None, :, :] * xv[:, None, :], axis=2)
        if BLOCK_M == 1:
            out = tl.sum(acc, axis=1)
            if SCALE_PER_CHUNK:
                out = out * s
            out = out[None, :]
        else:
            if SCALE_PER_CHUNK:
                acc = acc * s[None, :]
            out = acc
    if SPLIT_K == 1:
        _store_rows(y_ptr, b_ptr, out, offs_m, offs_n, m_mask, n_mask, stride_ym, HAS_BIAS)
    else:
        p_rows = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]                 # part: [SPLIT_K, BLOCK_M, N]
        pm = m_mask[:, None] & n_mask[None, :]
        tl.store(part_ptr + pid_k * BLOCK_M * N + p_rows, out, mask=pm)
        if SERIAL:
            tl.debug_barrier()              # every thread's partial written before the ticket (release)
            ticket = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel")
            if ticket == SPLIT_K - 1:       # the last of the N tile's programs: sum the partials in split order
                tot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for sk in range(0, SPLIT_K):
                    tot += tl.load(part_ptr + sk * BLOCK_M * N + p_rows, mask=pm, other=0.0, cache_modifier=".cg")
                _store_rows(y_ptr, b_ptr, tot, offs_m, offs_n, m_mask, n_mask, stride_ym, HAS_BIAS)
                tl.atomic_xchg(lock_ptr + pid_n, 0)


@triton.jit
def _splitk_reduce_kernel(part_ptr, b_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    p_rows = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for sk in range(0, SPLIT_K):
        tot += tl.load(part_ptr + sk * BLOCK_M * N + p_rows, mask=m_mask[:, None] & n_mask[None, :], other=0.0)
    _store_rows(y_ptr, b_ptr, tot, offs_m, offs_n, m_mask, n_mask, stride_ym, HAS_BIAS)


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
    determinism). Not yet measured: one vector load a thread-row (int4: 4 words = 32 codes; fp8: 16 bytes), 128
    rows a program (4 warps, one row a thread) and the largest chunk (at most 128 words / 512 bytes, at least
    16 words / 64 bytes) that leaves >= 2 programs per SM; else 64, then 32 rows (1 warp); else the smallest
    chunk (an 8B model's qkv 6144x4096 int4: 48 x 8 programs of 64 words; a 1024-wide model's o 1024x2048:
    32 x 16 programs of 16 words)."""
    KW = K // 8 if int4 else K
    bk = min(4 if int4 else 16, triton.next_power_of_2(KW))
    lo, hi = (16, 128) if int4 else (64, 512)
    fits = chunk_choices(KW, int4, s_cols, K, bk)
    chunks = [c for c in fits if min(lo, fits[0]) <= c <= hi] or fits
    for bn, warps in ((128, 4), (64, 2), (32, 1)):
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
    for bk in (table[1],) + ((8, 2) if int4 else (32, 8)):
        bk = min(bk, triton.next_power_of_2(KW))
        for c in [c for c in chunk_choices(KW, int4, s_cols, K, bk) if c >= 4 * bk][:3] or [table[2]]:
            for bn, warps in ((128, 4), (64, 2), (256, 4), (256, 8)):
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
        INT4=int4, HAS_BIAS=has_bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK=chunk, SPLIT_K=split,
        SCALE_PER_CHUNK=per_chunk, SERIAL=serial, num_warps=warps, num_stages=2)
    if split > 1 and not serial:
        rbn = 128
        _splitk_reduce_kernel[(triton.cdiv(N, rbn),)](part, bias if has_bias else s, y, M, N, y.stride(0),
                                                      SPLIT_K=split, HAS_BIAS=has_bias, BLOCK_M=bm, BLOCK_N=rbn,
                                                      num_warps=4)
    return y
