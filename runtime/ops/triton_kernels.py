"""Triton kernels of the fused ops, and their launchers.

The arithmetic follows ops/reference.py (and so HF): statistics in float32, and the same roundings to the
activation dtype at the same points (normalized x is cast to the input dtype before the weight product;
q*cos and rotate_half(q)*sin are each rounded before the sum), so bf16 results stay close to HF's modules.
The launchers accept CPU tensors when TRITON_INTERPRET=1 was set before triton was imported (tests).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops import pdl
from xllm_gen.runtime.ops.pdl import pdl_enter, pdl_trigger, prefetch_rows_l2


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


# ---------------------------------------------------------------------------------------------- rms_norm
@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, ro_ptr, stride_x, stride_r, D, eps, offset,
                     HAS_RESIDUAL: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
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
    tl.store(y_ptr + row * D + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def norm_out_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype, weight_offset: float) -> torch.dtype:
    """The output dtype of rms_norm: HF's `weight * x.to(dtype)` promotes (offset 0); the (offset + w) norm's `.type_as(x)`
    keeps the input dtype (offset != 0)."""
    return x_dtype if weight_offset else torch.promote_types(x_dtype, w_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    D = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=norm_out_dtype(x.dtype, weight.dtype, weight_offset), device=x.device)
    M = x2.shape[0]
    if M:
        B = triton.next_power_of_2(D)
        _rms_norm_kernel[(M,)](x2, x2, weight, y, y, x2.stride(0), 0, D, eps, float(weight_offset),
                               HAS_RESIDUAL=False, HAS_OFFSET=bool(weight_offset), BLOCK=B, num_warps=_warps(B), **pdl.launch(x2))
    return y


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       weight_offset: float = 0.0):
    D = x.shape[-1]
    x2, r2 = _rows(x), _rows(residual)
    rdt = torch.promote_types(x.dtype, residual.dtype)
    new_r = torch.empty(x.shape, dtype=rdt, device=x.device)
    y = torch.empty(x.shape, dtype=norm_out_dtype(rdt, weight.dtype, weight_offset), device=x.device)
    M = x2.shape[0]
    if M:
        B = triton.next_power_of_2(D)
        _rms_norm_kernel[(M,)](x2, r2, weight, y, new_r, x2.stride(0), r2.stride(0), D, eps, float(weight_offset),
                               HAS_RESIDUAL=True, HAS_OFFSET=bool(weight_offset), BLOCK=B, num_warps=_warps(B), **pdl.launch(x2))
    return y, new_r


# ---------------------------------------------------------------------------------------------- silu / gelu and mul
@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, stride_x, n, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    b = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0)
    af = a.to(tl.float32)
    s = (af / (1.0 + tl.exp(-af))).to(a.dtype).to(tl.float32)
    tl.store(y_ptr + row * n + offs, (s * b.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    x2 = _rows(x)
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    M = x2.shape[0]
    if M and n:
        B = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(M, triton.cdiv(n, B))](x2, y, x2.stride(0), n, BLOCK=B, num_warps=_warps(B), **pdl.launch(x2))
    return y


@triton.jit
def _gelu_and_mul_kernel(x_ptr, y_ptr, stride_x, n, TANH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
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
    tl.store(y_ptr + row * n + offs, (g * b.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    if approximate not in ("tanh", "none"):
        raise ValueError(f"gelu approximate must be 'tanh' or 'none', not {approximate!r}")
    n = x.shape[-1] // 2
    x2 = _rows(x)
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    M = x2.shape[0]
    if M and n:
        B = min(1024, triton.next_power_of_2(n))
        _gelu_and_mul_kernel[(M, triton.cdiv(n, B))](x2, y, x2.stride(0), n, TANH=approximate == "tanh", BLOCK=B,
                                                     num_warps=_warps(B), **pdl.launch(x2))
    return y


# ---------------------------------------------------------------------------------------------- q/k norm + rope
# One program per token: its cos / sin row (the token's position; per frequency for multi-axis rotary) is read
# once and applied to every q and k head, each a [heads, head_dim / 2] tile (one program per token and head
# was ~40 us per layer for a 1000-token prefill: tens of thousands of one-warp programs).
@triton.jit
def _norm_rope_values(src, sh, w_ptr, NH, c, s, j, jm, eps,
                      HEAD_DIM: tl.constexpr, BH: tl.constexpr, HAS_NORM: tl.constexpr):
    """The normed, rotated halves (o1, o2) [BH, HALF_BLOCK] of NH heads at src, in src's dtype."""
    HALF: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, BH)[:, None]
    m = (h < NH) & jm[None, :]
    x1 = tl.load(src + h * sh + j[None, :], mask=m, other=0.0)
    x2 = tl.load(src + h * sh + HALF + j[None, :], mask=m, other=0.0)
    dt = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    if HAS_NORM:
        var = (tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HEAD_DIM
        rstd = (1.0 / tl.sqrt(var + eps))[:, None]
        w1 = tl.load(w_ptr + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        f1 = (w1 * (f1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        f2 = (w2 * (f2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    cc = c.to(dt).to(tl.float32)[None, :]
    ss = s.to(dt).to(tl.float32)[None, :]
    o1 = (f1 * cc).to(dt).to(tl.float32) + (-f2 * ss).to(dt).to(tl.float32)
    o2 = (f2 * cc).to(dt).to(tl.float32) + (f1 * ss).to(dt).to(tl.float32)
    return o1.to(dt), o2.to(dt)


@triton.jit
def _norm_rope_heads(src, sh, w_ptr, dst, NH, c, s, j, jm, eps,
                     HEAD_DIM: tl.constexpr, BH: tl.constexpr, HAS_NORM: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    o1, o2 = _norm_rope_values(src, sh, w_ptr, NH, c, s, j, jm, eps, HEAD_DIM, BH, HAS_NORM)
    h = tl.arange(0, BH)[:, None]
    m = (h < NH) & jm[None, :]
    tl.store(dst + h * HEAD_DIM + j[None, :], o1, mask=m)
    tl.store(dst + h * HEAD_DIM + HALF + j[None, :], o2, mask=m)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, pos_ptr, cache_ptr, axis_ptr,
                         sqn, sqh, skn, skh, stride_pos_axis, H, Hk, eps,
                         HEAD_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr, QH_BLOCK: tl.constexpr,
                         KH_BLOCK: tl.constexpr, HAS_NORM: tl.constexpr, IS_MROPE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    j = tl.arange(0, HALF_BLOCK)
    jm = j < HALF
    if IS_MROPE:
        axis = tl.load(axis_ptr + j, mask=jm, other=0).to(tl.int64)
        p = tl.load(pos_ptr + axis * stride_pos_axis + n, mask=jm, other=0).to(tl.int64)
    else:
        p = tl.load(pos_ptr + n).to(tl.int64)
    c = tl.load(cache_ptr + p * HEAD_DIM + j, mask=jm, other=0.0)
    s = tl.load(cache_ptr + p * HEAD_DIM + HALF + j, mask=jm, other=0.0)
    _norm_rope_heads(q_ptr + n * sqn, sqh, qw_ptr, qo_ptr + n * H * HEAD_DIM, H, c, s, j, jm, eps,
                     HEAD_DIM, QH_BLOCK, HAS_NORM)
    _norm_rope_heads(k_ptr + n * skn, skh, kw_ptr, ko_ptr + n * Hk * HEAD_DIM, Hk, c, s, j, jm, eps,
                     HEAD_DIM, KH_BLOCK, HAS_NORM)


def _heads(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: Optional[torch.Tensor],
                 k_weight: Optional[torch.Tensor], eps: float, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, axis_map: Optional[torch.Tensor]):
    N, H, D = q.shape
    Hk = k.shape[1]
    q, k = _heads(q), _heads(k)
    qo = torch.empty((N, H, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((N, Hk, D), dtype=k.dtype, device=k.device)
    if N == 0:
        return qo, ko
    has_norm = q_weight is not None
    if has_norm != (k_weight is not None):
        raise ValueError("qk_norm_rope: give both q and k norm weights or neither")
    is_mrope = positions.dim() == 2
    if positions.stride(-1) != 1:
        positions = positions.contiguous()
    qw = q_weight if has_norm else q
    kw = k_weight if has_norm else k
    ax = axis_map if is_mrope else positions
    half_block = triton.next_power_of_2(D // 2)
    qh, kh = triton.next_power_of_2(H), triton.next_power_of_2(Hk)
    _qk_norm_rope_kernel[(N,)](
        q, k, qw, kw, qo, ko, positions, cos_sin_cache, ax,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), positions.stride(0) if is_mrope else 0, H, Hk, eps,
        HEAD_DIM=D, HALF_BLOCK=half_block, QH_BLOCK=qh, KH_BLOCK=kh, HAS_NORM=has_norm, IS_MROPE=is_mrope,
        num_warps=_warps(qh * half_block), **pdl.launch(q))
    return qo, ko


# ---------------------------------------------------------------------------------------------- KV-cache write
@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, skn, svn, k_scale, v_scale, ks_ptr, vs_ptr,
                          ROW: tl.constexpr, BLOCK: tl.constexpr, SCALED: tl.constexpr = False,
                          FP8: tl.constexpr = False, D: tl.constexpr = 1, K_HEAD: tl.constexpr = False,
                          V_HEAD: tl.constexpr = False, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = (offs < ROW) & (slot >= 0)
    kk = tl.load(k_ptr + n * skn + offs, mask=mask, other=0.0)
    vv = tl.load(v_ptr + n * svn + offs, mask=mask, other=0.0)
    if SCALED:          # KV-cache scales: the cache holds k / k_scale (correctly rounded, as torch's)
        ks = k_scale
        vs = v_scale
        if K_HEAD:      # per KV head: element (head h, d) of the row by k_scale[h]
            ks = tl.load(ks_ptr + offs // D, mask=offs < ROW, other=1.0)
        if V_HEAD:
            vs = tl.load(vs_ptr + offs // D, mask=offs < ROW, other=1.0)
        kk = tl.math.div_rn(kk.to(tl.float32), ks)
        vv = tl.math.div_rn(vv.to(tl.float32), vs)
    if FP8:             # float8 e4m3: saturate at +-448 (as the torch reference does)
        kk = tl.minimum(tl.maximum(kk.to(tl.float32), -448.0), 448.0)
        vv = tl.minimum(tl.maximum(vv.to(tl.float32), -448.0), 448.0)
    tl.store(kc_ptr + slot * ROW + offs, kk.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * ROW + offs, vv.to(vc_ptr.dtype.element_ty), mask=mask)


def _kv_rows(x: torch.Tensor) -> torch.Tensor:
    N, Hk, D = x.shape
    if x.stride(2) != 1 or x.stride(1) != D:
        x = x.contiguous()
    return x


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale=1.0, v_scale=1.0) -> None:
    """k_scale / v_scale: floats (per tensor) or float32 tensors [Hk] / [Hk, 1] on k's device (per KV head)."""
    N, Hk, D = k.shape
    if N == 0:
        return
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kvcache: caches must be contiguous [num_blocks, block_size, Hk, D]")
    if v.shape[-1] != D:
        raise ValueError(f"store_kvcache: k and v rows differ in width ({D} vs {v.shape[-1]})")
    k, v = _kv_rows(k), _kv_rows(v)
    row = Hk * D
    B = triton.next_power_of_2(row)
    heads = {}
    for name, sc in (("k", k_scale), ("v", v_scale)):
        if isinstance(sc, torch.Tensor):
            if sc.numel() != Hk or sc.dtype != torch.float32 or sc.device != k.device or not sc.is_contiguous():
                raise ValueError(f"store_kvcache: per-KV-head {name}_scale must be a contiguous float32 [{Hk}] tensor "
                                 f"on {k.device}, got {tuple(sc.shape)} {sc.dtype} on {sc.device}")
            heads[name] = sc.reshape(-1)
    ks = 1.0 if "k" in heads else float(k_scale)
    vs = 1.0 if "v" in heads else float(v_scale)
    scaled = bool(heads) or ks != 1.0 or vs != 1.0
    _store_kvcache_kernel[(N,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ks, vs,
                                heads.get("k", k), heads.get("v", k), ROW=row, BLOCK=B, SCALED=scaled,
                                FP8=k_cache.dtype == torch.float8_e4m3fn, D=D, K_HEAD="k" in heads,
                                V_HEAD="v" in heads, num_warps=_warps(B), **pdl.launch(k))


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
@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym,
                        M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        VEC: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr = 0,
                        KP: tl.constexpr = 1, LINE: tl.constexpr = 64):
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
        acc0 += tl.sum(w * x0, axis=2)
        if M > 1:
            acc1 += tl.sum(w * x1, axis=2)
        if M > 2:
            acc2 += tl.sum(w * x2, axis=2)
        if M > 3:
            acc3 += tl.sum(w * x3, axis=2)
        if M > 4:
            acc4 += tl.sum(w * x4, axis=2)
        if M > 5:
            acc5 += tl.sum(w * x5, axis=2)
        if M > 6:
            acc6 += tl.sum(w * x6, axis=2)
        if M > 7:
            acc7 += tl.sum(w * x7, axis=2)
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
    table's (which fits small K)."""
    table = skinny_gemm_config(M, N, K, elem_size)
    alts = [(2, 512, 4, 1), (2, 256, 2, 1)] if M <= 2 else [(4, 512, 2, 3), (2, 512, 2, 1)]
    out = [table]
    for bn, bk, warps, stages in alts:
        cfg = (bn, min(bk, table[1]), warps, stages)
        if cfg not in out:
            out.append(cfg)
    return out


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
    bn, bk, warps, stages = config or skinny_gemm_config(M, N, K, weight.element_size())
    bn = block_n or bn
    vec = min(16 // weight.element_size(), bk)
    has_bias = bias is not None
    _skinny_gemm_kernel[(triton.cdiv(N, bn),)](
        x, weight, bias if has_bias else weight, y, N, K, x.stride(0), weight.stride(0), y.stride(0),
        M=M, HAS_BIAS=has_bias, BLOCK_N=bn, BLOCK_K=bk, VEC=vec, EVEN_K=K % bk == 0, NUM_STAGES=stages,
        num_warps=warps, num_stages=stages, **pdl.launch(x),
        **pdl.prefetch_meta(K, weight.element_size()))
    return y


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


# ---------------------------------------------------------------------------------------------- vision rotary
# One program per patch row rotates that row's q and k, every head, in place: the halves x1, x2 of each head in
# float32, (x1 c1 - x2 s1, x2 c2 + x1 s2), stored in the input dtype. Replaces ~10 elementwise kernels per
# layer of the torch form (casts, rotate_half's neg + cat, mul, add).
@triton.jit
def _vision_rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, sq_p, sq_h, sk_p, sk_h, sc_p, H, HALF,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    m = (h < H) & dm[None, :]
    c1 = tl.load(cos_ptr + p * sc_p + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + p * sc_p + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + p * sc_p + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + p * sc_p + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    qp = q_ptr + p * sq_p + h * sq_h + d[None, :]
    q1 = tl.load(qp, mask=m, other=0.0).to(tl.float32)
    q2 = tl.load(qp + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(qp, (q1 * c1 - q2 * s1).to(q_ptr.dtype.element_ty), mask=m)
    tl.store(qp + HALF, (q2 * c2 + q1 * s2).to(q_ptr.dtype.element_ty), mask=m)
    kp = k_ptr + p * sk_p + h * sk_h + d[None, :]
    k1 = tl.load(kp, mask=m, other=0.0).to(tl.float32)
    k2 = tl.load(kp + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(kp, (k1 * c1 - k2 * s1).to(k_ptr.dtype.element_ty), mask=m)
    tl.store(kp + HALF, (k2 * c2 + k1 * s2).to(k_ptr.dtype.element_ty), mask=m)


def vision_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: q, k [P, H, D] (any row / head strides, contiguous D) rotated by cos, sin [P, D]."""
    P, H, D = q.shape
    assert k.shape == q.shape and q.stride(-1) == 1 and k.stride(-1) == 1 and D % 2 == 0
    cos, sin = cos.contiguous(), sin.contiguous()
    if P:
        BH, BD = triton.next_power_of_2(H), triton.next_power_of_2(D // 2)
        _vision_rope_kernel[(P,)](q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
                                  H, D // 2, BLOCK_H=BH, BLOCK_D=BD, num_warps=_warps(BH * BD))
