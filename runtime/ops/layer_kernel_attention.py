"""The attention stage of the whole-layer decode kernel (ops/layer_kernel.py): per (row, KV head, split) the q/k
per-head RMSNorm + neox rotary of the step's token (the split owning the token's position also writes its k, v
into the paged cache), split-KV attention over the cache, the last program of (row, KV head) merging the splits
(ops/decode_attention.py's scheme).
"""
from __future__ import annotations

import triton
import triton.language as tl

from xllm_gen.runtime.ops.layer_kernel_gemm import _dot
from xllm_gen.runtime.ops.rope_kernels import _norm_rope_values


@triton.jit
def _attention_stage(qkv_ptr, o_ptr, kc_ptr, vc_ptr, qw_ptr, kw_ptr, eps, pos_ptr, cs_ptr, slot_ptr,
                     indptr_ptr, indices_ptr, last_ptr, part_o_ptr, part_lse_ptr, tick_ptr, sm_scale, window_left,
                     pid, P, M, NQKV,
                     H: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr,
                     G_PAD: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_NORM: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr):
    HALF: tl.constexpr = D // 2
    j = tl.arange(0, HALF)
    jm = j < HALF
    d = tl.arange(0, D)
    g = tl.arange(0, G_PAD)
    g_ok = g < GROUP
    n_off = tl.arange(0, BLOCK_N)
    for it in range(pid, M * HK * SPLITS, P):
        b = it // (HK * SPLITS)
        kh = (it // SPLITS) % HK
        s = it % SPLITS
        p0 = tl.load(indptr_ptr + b)
        npages = tl.load(indptr_ptr + b + 1) - p0
        last = tl.load(last_ptr + b)
        L = tl.where(npages > 0, (npages - 1) * PAGE + last, 0)
        start = 0
        if HAS_WINDOW:
            start = tl.maximum(L - 1 - window_left, 0)
        chunk = tl.cdiv(tl.cdiv(L - start, SPLITS), BLOCK_N) * BLOCK_N
        lo = start + s * chunk
        hi = tl.minimum(lo + chunk, L)
        pos = tl.load(pos_ptr + b).to(tl.int64)
        c = tl.load(cs_ptr + pos * D + j)
        sn = tl.load(cs_ptr + pos * D + HALF + j)
        row = qkv_ptr + b.to(tl.int64) * NQKV
        q1, q2 = _norm_rope_values(row + kh * GROUP * D, D, qw_ptr, GROUP, c, sn, j, jm, eps, D, G_PAD, HAS_NORM)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        if (lo <= L - 1) & (L - 1 < hi) & (slot >= 0):
            # the step's token is in this split's range: its k (normed, rotated) and v go to the cache first, read
            # back below by this program only (no other program reads position L-1)
            k1, k2 = _norm_rope_values(row + H * D + kh * D, D, kw_ptr, 1, c, sn, j, jm, eps, D, 1, HAS_NORM)
            dst = slot * HK * D + kh * D
            tl.store(kc_ptr + dst + j[None, :], k1)
            tl.store(kc_ptr + dst + HALF + j[None, :], k2)
            tl.store(vc_ptr + dst + d, tl.load(row + (H + HK) * D + kh * D + d))
            tl.debug_barrier()
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for t0 in range(lo, hi, BLOCK_N):
            t = t0 + n_off
            t_ok = t < hi
            page = tl.load(indices_ptr + p0 + t // PAGE, mask=t_ok, other=0).to(tl.int64)
            kv_row = (page * PAGE + t % PAGE) * HK * D + kh * D
            k1 = tl.load(kc_ptr + kv_row[:, None] + j[None, :], mask=t_ok[:, None], other=0.0, cache_modifier=".cg")
            k2 = tl.load(kc_ptr + kv_row[:, None] + HALF + j[None, :], mask=t_ok[:, None], other=0.0,
                         cache_modifier=".cg")
            v = tl.load(vc_ptr + kv_row[:, None] + d[None, :], mask=t_ok[:, None], other=0.0, cache_modifier=".cg")
            sc = (_dot(q1, tl.trans(k1), IEEE) + _dot(q2, tl.trans(k2), IEEE)) * sm_scale
            sc = tl.where(t_ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
            m_i = m_new
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        heads = kh * GROUP + g
        out = o_ptr + b.to(tl.int64) * H * D + heads[:, None] * D + d[None, :]
        if SPLITS == 1:
            tl.store(out, o.to(o_ptr.dtype.element_ty), mask=g_ok[:, None])
        else:
            row_h = b.to(tl.int64) * H + heads
            tl.store(part_o_ptr + (row_h[:, None] * SPLITS + s) * D + d[None, :], o, mask=g_ok[:, None] & has[:, None])
            tl.store(part_lse_ptr + row_h * SPLITS + s, tl.where(has, m_i + tl.log(l_i), float("-inf")), mask=g_ok)
            tl.debug_barrier()
            ticket = tl.atomic_add(tick_ptr + b * HK + kh, 1, sem="acq_rel")
            if ticket == SPLITS - 1:
                sidx = tl.arange(0, S_PAD)
                gs_ok = g_ok[:, None] & (sidx < SPLITS)[None, :]
                base = (b.to(tl.int64) * H + heads)[:, None] * SPLITS + sidx[None, :]
                lse = tl.load(part_lse_ptr + base, mask=gs_ok, other=float("-inf"), cache_modifier=".cg")
                o_s = tl.load(part_o_ptr + base[:, :, None] * D + d[None, None, :], mask=gs_ok[:, :, None],
                              other=0.0, cache_modifier=".cg")
                mx = tl.max(lse, axis=1)
                w = tl.exp(lse - tl.where(mx == float("-inf"), 0.0, mx)[:, None])
                o_s = tl.where((w > 0)[:, :, None], o_s, 0.0)
                den = tl.sum(w, axis=1)
                res = tl.sum(w[:, :, None] * o_s, axis=1) / tl.where(den > 0, den, 1.0)[:, None]
                tl.store(out, res.to(o_ptr.dtype.element_ty), mask=g_ok[:, None])
                tl.atomic_xchg(tick_ptr + b * HK + kh, 0)
