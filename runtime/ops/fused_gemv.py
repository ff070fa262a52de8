"""Decode GEMVs with a fused prologue: the op before a linear layer computed while its weight streams.

Up to 8 rows the kernel is the skinny GEMM of skinny_fma.py (`_skinny_gemm_kernel`: a [BLOCK_N, BLOCK_K // VEC,
VEC] weight tile, one fp32 accumulator per row, the same launch configs), from 9 to 64 rows its tensor-core skinny
GEMM (skinny_mma.py's `_skinny_mma_kernel`, split-K; `_prologue_mma_kernel` below), whose x chunk is not read but computed:

- `norm_gemv`: y = W rmsnorm(x + r) (+ bias), new residual x + r. RMSNorm's scale rsqrt(mean(h^2) + eps) is a
  per-row scalar, so it factors out of the dot product: the loop accumulates sum(h^2) beside acc += W (g h), with
  h = x + r rounded to the activation dtype (the residual as the unfused add rounds it) and g the norm weight
  (weight_offset + w, e.g. 1 + w); the epilogue multiplies by rsqrt(ss / K + eps) and adds the bias. One pass,
  no extra launch. The programs of the first N-block (program 0) also store h to a separate residual buffer (the
  inputs are never written, so there is no race). The only difference to the unfused norm + GEMV is rounding:
  the unfused path rounds the normalized x (and w times it) to the activation dtype before the product, the
  fused one keeps them in fp32.
- `act_gemv`: y = W (act(gate) * up) (+ bias) for the gate | up halves of a merged gate/up projection's output
  [M, 2K]: silu, gelu (tanh or erf), with the roundings of ops.silu_and_mul / gelu_and_mul (act rounded to the
  dtype, then the product rounded), so the GEMV reads exactly the values the unfused activation kernel writes.

Up to 8 rows the weight may also be float8 e4m3 with block scales (a packed fp8 layer: `scale`, `block`), its input
optionally quantized to fp8 per row and group of columns inside the prologue (`group`): fused_gemv_fp8.py.

The launchers take CPU tensors under TRITON_INTERPRET=1 (tests), like the kernel modules' (triton_kernels.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops import fused_gemv_fp8 as F8
from xllm_gen.runtime.ops import pdl
from xllm_gen.runtime.ops.fused_gemv_fp8 import group_fp8
from xllm_gen.runtime.ops.pdl import pdl_enter, pdl_trigger, prefetch_rows_l2
from xllm_gen.runtime.ops.skinny_fma import SKINNY_MAX_M, _slice_dots, skinny_gemm_config
from xllm_gen.runtime.ops.skinny_mma import SKINNY_MMA_MAX_M, _splitk_counters, skinny_mma_config

ACT_CODES = {"silu": 0, "gelu_tanh": 1, "gelu": 2}   # act_gemv's activations (gelu: exact erf)


@triton.jit
def _load(ptr, km, EVEN_K: tl.constexpr):
    if EVEN_K:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=km, other=0.0)
    return v


@triton.jit
def _x_chunk(x_ptr, r_ptr, ro_ptr, m, k0, offs_k, km, g, write_res, stride_xm, stride_rm, stride_om, half,
             PRO: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr):
    """Row m's x chunk as the GEMV consumes it (fp32 [1, KC, VEC]) and its sum-of-squares contribution.
    PRO 1: g * h with h = x (+ r) rounded to the dtype (row m of the residual stored where write_res);
    PRO 2: act(x[:half]) * x[half:], rounded as the unfused activation kernel rounds."""
    if PRO == 1:
        x = _load(x_ptr + m * stride_xm + k0 + offs_k, km, EVEN_K)
        if HAS_RES:
            r = _load(r_ptr + m * stride_rm + k0 + offs_k, km, EVEN_K)
            h = (x.to(tl.float32) + r.to(tl.float32)).to(ro_ptr.dtype.element_ty)
            if write_res:       # (a uniform branch: the other programs issue no store)
                if EVEN_K:
                    tl.store(ro_ptr + m * stride_om + k0 + offs_k, h)
                else:
                    tl.store(ro_ptr + m * stride_om + k0 + offs_k, h, mask=km)
            hf = h.to(tl.float32)
        else:
            hf = x.to(tl.float32)
        return hf * g, tl.sum(hf * hf, axis=2)
    else:
        a = _load(x_ptr + m * stride_xm + k0 + offs_k, km, EVEN_K)
        b = _load(x_ptr + m * stride_xm + half + k0 + offs_k, km, EVEN_K)
        af = a.to(tl.float32)
        if ACT == 0:        # silu
            s = af / (1.0 + tl.exp(-af))
        elif ACT == 1:      # gelu, tanh approximation: tanh(u) = 1 - 2 / (exp(2u) + 1)
            u = 0.7978845608028654 * (af + 0.044715 * af * af * af)
            s = 0.5 * af * (1.0 + (1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)))
        else:               # gelu, exact erf
            s = 0.5 * af * (1.0 + tl.erf(af * 0.7071067811865476))
        s = s.to(a.dtype).to(tl.float32)
        v = (s * b.to(tl.float32)).to(a.dtype).to(tl.float32)
        return v, 0.0


@triton.jit
def _row_step(acc, ss, w, sc, g, m, k0, offs_k, km, write_res, x_ptr, r_ptr, ro_ptr, stride_xm, stride_rm, stride_om,
              half, PRO: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr,
              SCALED: tl.constexpr, QUANT: tl.constexpr, KC: tl.constexpr, QGS: tl.constexpr):
    """Row m's step of the K loop: its x chunk (the prologue), then acc += the tile's VEC-wide partial dots, times
    the weight's block scales sc where SCALED; QUANT (1, 2: power-of-two scales): the chunk as fp8 codes per group of
    QGS slices, each partial dot also times its group's scale (fused_gemv_fp8.py)."""
    x, s = _x_chunk(x_ptr, r_ptr, ro_ptr, m, k0, offs_k, km, g, write_res, stride_xm, stride_rm, stride_om, half,
                    PRO, HAS_RES, ACT, EVEN_K)
    if QUANT != 0:
        q, gs = group_fp8(x, PRO, QUANT == 2, KC, QGS)
        d = tl.sum(w * q, axis=2) * (sc * gs)
    else:
        d = _slice_dots(w, x, sc, SCALED)
    return acc + d, ss + s


@triton.jit
def _prologue_gemv_kernel(x_ptr, r_ptr, ro_ptr, g_ptr, w_ptr, b_ptr, y_ptr, s_ptr, N, K, stride_xm, stride_rm,
                          stride_om, stride_wn, stride_ym, stride_sn, S_ROWS, S_COLS, half, eps, g_offset,
                          M: tl.constexpr, PRO: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                          EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr = 0,
                          KP: tl.constexpr = 1, LINE: tl.constexpr = 64, SCALED: tl.constexpr = False,
                          QUANT: tl.constexpr = 0, QGS: tl.constexpr = 1):
    KC: tl.constexpr = BLOCK_K // VEC
    pid = tl.program_id(0)
    write_res = pid == 0
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    prefetch_rows_l2(PDL, w_ptr, rows, stride_wn, K, KP, LINE)   # weights: safe before the wait
    pdl_enter(PDL, LARGE=True)
    kc = tl.arange(0, KC)
    kv = tl.max_contiguous(tl.multiple_of(tl.arange(0, VEC), VEC), VEC)
    offs_k = kc[None, :, None] * VEC + kv[None, None, :]                  # [1, KC, VEC]
    w_ptrs = w_ptr + rows[:, None, None] * stride_wn + offs_k             # [BLOCK_N, KC, VEC]
    if SCALED:      # the scale rows of the program's weight rows (skinny_fma.py `_skinny_gemm_kernel`)
        s_rows = s_ptr + (rows // S_ROWS)[:, None] * stride_sn
    acc0 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
    ss0 = tl.zeros([1, KC], dtype=tl.float32)
    if M > 1:
        acc1 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
        ss1 = tl.zeros([1, KC], dtype=tl.float32)
    if M > 2:
        acc2 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
        ss2 = tl.zeros([1, KC], dtype=tl.float32)
    if M > 3:
        acc3 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
        ss3 = tl.zeros([1, KC], dtype=tl.float32)
    if M > 4:
        acc4 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
        ss4 = tl.zeros([1, KC], dtype=tl.float32)
    if M > 5:
        acc5 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
        ss5 = tl.zeros([1, KC], dtype=tl.float32)
    if M > 6:
        acc6 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
        ss6 = tl.zeros([1, KC], dtype=tl.float32)
    if M > 7:
        acc7 = tl.zeros([BLOCK_N, KC], dtype=tl.float32)
        ss7 = tl.zeros([1, KC], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        km = (offs_k + k0) < K
        if EVEN_K:
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first").to(tl.float32)
        else:
            w = tl.load(w_ptrs + k0, mask=km, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if PRO == 1:
            g = _load(g_ptr + k0 + offs_k, km, EVEN_K).to(tl.float32) + g_offset
        else:
            g = 0.0
        sc = 1.0
        if SCALED:      # each (row, VEC-wide slice)'s scale; slices past K (masked tail, w = 0) clamped
            sc = tl.load(s_rows + (tl.minimum(k0 + kc * VEC, K - 1) // S_COLS)[None, :])
        acc0, ss0 = _row_step(acc0, ss0, w, sc, g, 0, k0, offs_k, km, write_res, x_ptr, r_ptr, ro_ptr, stride_xm,
                              stride_rm, stride_om, half, PRO, HAS_RES, ACT, EVEN_K, SCALED, QUANT, KC, QGS)
        if M > 1:
            acc1, ss1 = _row_step(acc1, ss1, w, sc, g, 1, k0, offs_k, km, write_res, x_ptr, r_ptr, ro_ptr, stride_xm,
                                  stride_rm, stride_om, half, PRO, HAS_RES, ACT, EVEN_K, SCALED, QUANT, KC, QGS)
        if M > 2:
            acc2, ss2 = _row_step(acc2, ss2, w, sc, g, 2, k0, offs_k, km, write_res, x_ptr, r_ptr, ro_ptr, stride_xm,
                                  stride_rm, stride_om, half, PRO, HAS_RES, ACT, EVEN_K, SCALED, QUANT, KC, QGS)
        if M > 3:
            acc3, ss3 = _row_step(acc3, ss3, w, sc, g, 3, k0, offs_k, km, write_res, x_ptr, r_ptr, ro_ptr, stride_xm,
                                  stride_rm, stride_om, half, PRO, HAS_RES, ACT, EVEN_K, SCALED, QUANT, KC, QGS)
        if M > 4:
            acc4, ss4 = _row_step(acc4, ss4, w, sc, g, 4, k0, offs_k, km, write_res, x_ptr, r_ptr, ro_ptr, stride_xm,
                                  stride_rm, stride_om, half, PRO, HAS_RES, ACT, EVEN_K, SCALED, QUANT, KC, QGS)
        if M > 5:
            acc5, ss5 = _row_step(acc5, ss5, w, sc, g, 5, k0, offs_k, km, write_res, x_ptr, r_ptr, ro_ptr, stride_xm,
                                  stride_rm, stride_om, half, PRO, HAS_RES, ACT, EVEN_K, SCALED, QUANT, KC, QGS)
        if M > 6:
            acc6, ss6 = _row_step(acc6, ss6, w, sc, g, 6, k0, offs_k, km, write_res, x_ptr, r_ptr, ro_ptr, stride_xm,
                                  stride_rm, stride_om, half, PRO, HAS_RES, ACT, EVEN_K, SCALED, QUANT, KC, QGS)
        if M > 7:
            acc7, ss7 = _row_step(acc7, ss7, w, sc, g, 7, k0, offs_k, km, write_res, x_ptr, r_ptr, ro_ptr, stride_xm,
                                  stride_rm, stride_om, half, PRO, HAS_RES, ACT, EVEN_K, SCALED, QUANT, KC, QGS)
    pdl_trigger(PDL)
    n_mask = offs_n < N
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    out_ty = y_ptr.dtype.element_ty
    y_ptrs = y_ptr + offs_n
    tl.store(y_ptrs, (_finish(acc0, ss0, K, eps, PRO) + bias).to(out_ty), mask=n_mask)
    if M > 1:
        tl.store(y_ptrs + stride_ym, (_finish(acc1, ss1, K, eps, PRO) + bias).to(out_ty), mask=n_mask)
    if M > 2:
        tl.store(y_ptrs + 2 * stride_ym, (_finish(acc2, ss2, K, eps, PRO) + bias).to(out_ty), mask=n_mask)
    if M > 3:
        tl.store(y_ptrs + 3 * stride_ym, (_finish(acc3, ss3, K, eps, PRO) + bias).to(out_ty), mask=n_mask)
    if M > 4:
        tl.store(y_ptrs + 4 * stride_ym, (_finish(acc4, ss4, K, eps, PRO) + bias).to(out_ty), mask=n_mask)
    if M > 5:
        tl.store(y_ptrs + 5 * stride_ym, (_finish(acc5, ss5, K, eps, PRO) + bias).to(out_ty), mask=n_mask)
    if M > 6:
        tl.store(y_ptrs + 6 * stride_ym, (_finish(acc6, ss6, K, eps, PRO) + bias).to(out_ty), mask=n_mask)
    if M > 7:
        tl.store(y_ptrs + 7 * stride_ym, (_finish(acc7, ss7, K, eps, PRO) + bias).to(out_ty), mask=n_mask)


@triton.jit
def _finish(acc, ss, K, eps, PRO: tl.constexpr):
    out = tl.sum(acc, axis=1)
    if PRO == 1:        # the RMSNorm scale of the row, factored out of the dot product
        out = out * (1.0 / tl.sqrt(tl.sum(tl.sum(ss, axis=1), axis=0) / K + eps))
    return out


# ---------------------------------------------------------------------------------------------- the MMA form
# 9..64 decode rows: the tensor-core skinny GEMM of skinny_mma.py (`_skinny_mma_kernel`: "swap AB", the weight
# rows on the MMA's M side, the decode rows padded to BLOCK_M on its N side, K split over SPLIT_K programs reduced
# by the last one of each column block) whose x^T tile is computed by the same prologues. The tile is rounded to the
# weight dtype for the MMA (the FMA kernel keeps it in fp32): g * h for the norm (its per-row scale rsqrt(sum h^2 /
# K + eps) still applied to the fp32 sum at the end), act(gate) * up rounded as the unfused kernel rounds it. With
# split-K each program's sum of squares covers its own K range: they go to a workspace beside the partial sums and
# the reducing program adds them up.
@triton.jit
def _prologue_mma_kernel(x_ptr, r_ptr, ro_ptr, g_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, ss_ptr, cnt_ptr, M, N, K,
                         K_SPLIT, SPLIT_K, stride_xm, stride_rm, stride_om, stride_wn, stride_ym, half, eps, g_offset,
                         PRO: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                         EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr = 0):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pdl_enter(PDL, LARGE=True)
    write_res = pid_n == 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)          # clamped: the last tile's extra rows are never stored
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    m64 = offs_m[None, :].to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]                # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + m64 * stride_xm + offs_k[:, None]                          # [BLOCK_K, BLOCK_M] (x^T)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = (offs_k + k0) < k_hi
        if EVEN_K:
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
            xm = m_mask[None, :]
        else:
            w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            xm = m_mask[None, :] & k_ok[:, None]
        if PRO == 1:
            x = tl.load(x_ptrs + k0, mask=xm, other=0.0)
            if HAS_RES:
                r = tl.load(r_ptr + m64 * stride_rm + offs_k[:, None] + k0, mask=xm, other=0.0)
                h = (x.to(tl.float32) + r.to(tl.float32)).to(ro_ptr.dtype.element_ty)
                tl.store(ro_ptr + m64 * stride_om + offs_k[:, None] + k0, h, mask=xm & write_res)
                hf = h.to(tl.float32)
            else:
                hf = x.to(tl.float32)
            g = tl.load(g_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32) + g_offset
            ss += tl.sum(hf * hf, axis=0)
            xt = (hf * g[:, None]).to(w.dtype)
        else:
            a = tl.load(x_ptrs + k0, mask=xm, other=0.0)
            b = tl.load(x_ptrs + half + k0, mask=xm, other=0.0)
            af = a.to(tl.float32)
            if ACT == 0:        # silu
                s = af / (1.0 + tl.exp(-af))
            elif ACT == 1:      # gelu, tanh approximation
                u = 0.7978845608028654 * (af + 0.044715 * af * af * af)
                s = 0.5 * af * (1.0 + (1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)))
            else:               # gelu, exact erf
                s = 0.5 * af * (1.0 + tl.erf(af * 0.7071067811865476))
            s = s.to(a.dtype).to(tl.float32)
            xt = (s * b.to(tl.float32)).to(w.dtype)
        acc = tl.dot(w, xt, acc)
    pdl_trigger(PDL)
    n_mask = offs_n < N
    out_mask = n_mask[:, None] & m_mask[None, :]
    y_ptrs = y_ptr + m64 * stride_ym + offs_n[:, None]
    if not SPLIT:
        if PRO == 1:
            acc = acc * (1.0 / tl.sqrt(ss / K + eps))[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        # workspaces: partial sums [SPLIT_K, N_pad, BLOCK_M], sums of squares [grid_n, SPLIT_K, BLOCK_M]
        n_pad = tl.num_programs(0) * BLOCK_N
        tile = offs_n[:, None].to(tl.int64) * BLOCK_M + offs_m[None, :]
        tl.store(ws_ptr + pid_k * n_pad * BLOCK_M + tile, acc)
        if PRO == 1:
            tl.store(ss_ptr + (pid_n * SPLIT_K + pid_k) * BLOCK_M + offs_m, ss)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            ss_all = tl.zeros([BLOCK_M], dtype=tl.float32)
            for s_i in range(0, SPLIT_K):
                total += tl.load(ws_ptr + s_i * n_pad * BLOCK_M + tile, cache_modifier=".cg")
                if PRO == 1:
                    ss_all += tl.load(ss_ptr + (pid_n * SPLIT_K + s_i) * BLOCK_M + offs_m, cache_modifier=".cg")
            if PRO == 1:
                total = total * (1.0 / tl.sqrt(ss_all / K + eps))[None, :]
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)              # ready for the next call (or graph replay)


def _check(x: torch.Tensor, weight: torch.Tensor, K: int, what: str) -> None:
    M = x.shape[0]
    if x.dim() != 2 or M > SKINNY_MMA_MAX_M:
        raise ValueError(f"{what}: x {tuple(x.shape)} must be [M <= {SKINNY_MMA_MAX_M}, K]")
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"{what}: x {tuple(x.shape)} vs weight {tuple(weight.shape)}")


def _launch(x, r, ro, g, weight, bias, y, K, half, eps, g_offset, pro, act, config, fp8=None):
    """fp8: (scale, block, group, pow2) of a float8 weight (fused_gemv_fp8.py), None for a bf16 / fp16 one."""
    M, N = y.shape
    if fp8 is not None:
        scale, block, group, pow2 = fp8
        if not F8.fits(M, K, block, group) or weight.element_size() != 1 or \
                scale.shape != (-(-N // block[0]), -(-K // block[1])):
            raise ValueError(f"fused fp8 GEMV: {M} rows, weight {tuple(weight.shape)} {weight.dtype}, scale "
                             f"{tuple(scale.shape)}, block {block}, group {group} do not fit")
        config = config or F8.default_config(M, N, K, group)
    elif M > SKINNY_MAX_M:
        return _launch_mma(x, r, ro, g, weight, bias, y, K, half, eps, g_offset, pro, act, config)
    bn, bk, warps, stages = (config or skinny_gemm_config(M, N, K, weight.element_size()))[:4]
    # a float8 config's optional 5th entry: VEC, the elements a thread loads of a weight row (default 16 bytes); 4
    # gives each thread more weight rows for the x chunk it computes
    vec = config[4] if fp8 is not None and len(config) > 4 else min(16 // weight.element_size(), bk)
    (stride_sn, s_rows, s_cols), meta = F8.kernel_args(fp8, bk, vec)
    has_bias = bias is not None
    _prologue_gemv_kernel[(triton.cdiv(N, bn),)](
        x, r, ro, g, weight, bias if has_bias else weight, y, weight if fp8 is None else scale, N, K, x.stride(0),
        r.stride(0), ro.stride(0), weight.stride(0), y.stride(0), stride_sn, s_rows, s_cols, half, float(eps),
        float(g_offset),
        M=M, PRO=pro, HAS_RES=r is not x, ACT=act, HAS_BIAS=has_bias, BLOCK_N=bn, BLOCK_K=bk, VEC=vec,
        EVEN_K=K % bk == 0, NUM_STAGES=stages, num_warps=warps, num_stages=stages, **meta, **pdl.launch(x),
        **pdl.prefetch_meta(K, weight.element_size()))


def _launch_mma(x, r, ro, g, weight, bias, y, K, half, eps, g_offset, pro, act, config):
    """9..64 rows: config (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K), default skinny_mma_config's."""
    M, N = y.shape
    bm, bn, bk, warps, stages, split = config or skinny_mma_config(M, N, K)
    if bm < M:
        raise ValueError(f"fused GEMV: BLOCK_M {bm} < M {M}")
    grid_n = triton.cdiv(N, bn)
    k_split = triton.cdiv(triton.cdiv(K, bk), split) * bk
    split = triton.cdiv(K, k_split)
    if split > 1:
        ws = torch.empty((split, grid_n * bn, bm), dtype=torch.float32, device=x.device)
        ss = torch.empty((grid_n, split, bm), dtype=torch.float32, device=x.device) if pro == 1 else ws
        cnt = _splitk_counters(x.device, grid_n)
    else:
        ws = ss = cnt = y
    has_bias = bias is not None
    _prologue_mma_kernel[(grid_n, split)](
        x, r, ro, g, weight, bias if has_bias else weight, y, ws, ss, cnt, M, N, K, k_split, split, x.stride(0),
        r.stride(0), ro.stride(0), weight.stride(0), y.stride(0), half, float(eps), float(g_offset),
        PRO=pro, HAS_RES=r is not x, ACT=act, HAS_BIAS=has_bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        SPLIT=split > 1, EVEN_K=K % k_split == 0 and k_split % bk == 0, NUM_STAGES=stages, num_warps=warps,
        num_stages=stages, **pdl.launch(x))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def norm_gemv(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
              weight_offset: float, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
              config: Optional[tuple] = None, scale: Optional[torch.Tensor] = None, block: Optional[tuple] = None,
              group: int = 0):
    """(W rmsnorm(x + residual) + bias, x + residual) for x, residual [M <= 64, K] (residual None: rmsnorm(x), x);
    the norm's weight [K] scales as (weight_offset + w). config: for M <= 8 the skinny GEMM's (BLOCK_N, BLOCK_K,
    warps, stages), else the MMA kernel's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K); default the launch
    table's. A float8 weight (M <= 8, fused_gemv_fp8.py): its float32 `scale` [ceil(N / block[0]), ceil(K /
    block[1])]; `group`: the normalized x quantized to fp8 per row and `group` columns as the layer's input
    (ActQuant("group", group), dynamic scales not powers of two), 0: not."""
    M, K = x.shape
    _check(x, weight, K, "norm_gemv")
    x, weight = _rows(x), _rows(weight)
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if residual is None:
        r = ro = x
        new_residual = x
    else:
        r = _rows(residual)
        new_residual = ro = torch.empty((M, K), dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    if M == 0 or N == 0:
        if residual is not None:
            torch.add(x, residual, out=new_residual)
        return y, new_residual
    fp8 = None if scale is None else (scale.contiguous(), tuple(block), int(group), False)
    _launch(x, r, ro, norm_weight, weight, bias, y, K, 0, eps, weight_offset, 1, 0, config, fp8)
    return y, new_residual


def act_gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, act: str = "silu",
             config: Optional[tuple] = None, scale: Optional[torch.Tensor] = None, block: Optional[tuple] = None,
             group: int = 0, pow2: bool = False) -> torch.Tensor:
    """W (act(x[:, :K]) * x[:, K:]) + bias for x [M <= 64, 2K] (gate | up), weight [N, K]; act one of ACT_CODES;
    config, a float8 weight's scale / block and the input quantization's group as norm_gemv's; pow2: the group
    scales rounded up to powers of two (ActQuant pow2)."""
    M = x.shape[0]
    K = x.shape[1] // 2
    _check(x, weight, K, "act_gemv")
    if x.shape[1] != 2 * K:
        raise ValueError(f"act_gemv: x {tuple(x.shape)} is not gate | up halves")
    x, weight = _rows(x), _rows(weight)
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(M, N))
    fp8 = None if scale is None else (scale.contiguous(), tuple(block), int(group), bool(pow2))
    _launch(x, x, x, weight, weight, bias, y, K, K, 0.0, 0.0, 2, ACT_CODES[act], config, fp8)
    return y
