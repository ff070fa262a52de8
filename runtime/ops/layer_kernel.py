"""A whole pre-norm decoder layer at a small decode batch in ONE persistent kernel.

At batch 1 a graph decode step of a 0.6B model was ~6 launches per layer of 3-9 us each, for ~10 us of weight
bytes per layer (bench/results/h200_profile_2026-12-03_before.md): the fixed cost of each kernel (launch, ramp,
tail, the dependent loads at its start) dominates, not the bandwidth. Here one launch of P programs (one per SM,
all resident at once) runs the layer's five stages, separated by grid-wide barriers (a release counter every
program increments, then spins on with acquire loads), so a stage's first loads follow the previous stage's last
stores by one L2 round trip instead of a kernel boundary:

  1. h = x + residual; qkv = W_qkv (rmsnorm(h) * g1) (+ bias)           tiles of qkv's rows
  2. per (row, KV head, split): q/k per-head RMSNorm + neox rotary of the step's token (the split owning the
     token's position also writes its k, v into the paged cache), split-KV attention over the cache, the last
     program of (row, KV head) merging the splits (ops/decode_attention.py's scheme)
  3. r2 = W_o attn + h                                                    split-K, tickets
  4. act = silu(gate) * up with gate | up = W_gu (rmsnorm(r2) * g2)       tiles of the intermediate
  5. out = W_down act                                                     split-K, tickets
returns (out, r2): the layer's (hidden_states, residual), as the unfused ops give them.

Rounding: the norm's scale rsqrt(mean(h^2) + eps) is a per-row scalar, factored out of the GEMV (as in
ops/fused_gemv.py); every stage's output is rounded to the activation dtype where the unfused op rounds it. The
split-K sums and attention merges reduce in a fixed order, so a run is deterministic and a graph replay equals
the eager call bit for bit.

The barriers need every program resident: P <= the SM count, one program per SM's resources, nothing else on
the GPU in between (a CUDA-graph decode step). Under TRITON_INTERPRET=1 (the CPU tests) the programs of a launch run
one after another, so a barrier would never open: there the stages run as five launches of the same code
(`staged`), which the GPU can run too (XLLM_LAYER_KERNEL=staged) as the reference for the one-launch form.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops.triton_kernels import _norm_rope_values

BM = 16     # rows per tile (a tl.dot needs 16): up to 16 decode rows


@triton.jit
def _grid_sync(cnt_ptr, target):
    """All programs' stores before it are visible to all programs' loads after it (loads through L2: .cg)."""
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release")
    c = tl.atomic_add(cnt_ptr, 0, sem="acquire")
    while c < target:
        c = tl.atomic_add(cnt_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _norm_gemm(x_ptr, r_ptr, ro_ptr, g_ptr, g_offset, w_ptr, w2_off, n0, N, K, M, write_res,
               HAS_RES: tl.constexpr, GATED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """acc [BM, BN] = (h * g) @ W[n0:n0+BN]^T (and acc2 with the rows w2_off further: the up half), and the rows'
    sums of squares of h = x (+ r) (rounded to x's dtype; stored to ro where write_res)."""
    rows = tl.arange(0, BM)
    rm = rows < M
    cols = n0 + tl.arange(0, BN)
    cm = cols < N
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    ss = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        km = (k0 + kk) < K
        xm = rm[:, None] & km[None, :]
        x = tl.load(x_ptr + rows[:, None] * K + k0 + kk[None, :], mask=xm, other=0.0, cache_modifier=".cg")
        if HAS_RES:
            r = tl.load(r_ptr + rows[:, None] * K + k0 + kk[None, :], mask=xm, other=0.0, cache_modifier=".cg")
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(ro_ptr + rows[:, None] * K + k0 + kk[None, :], x, mask=xm & write_res)
        hf = x.to(tl.float32)
        ss += tl.sum(hf * hf, axis=1)
        g = tl.load(g_ptr + k0 + kk, mask=km, other=0.0).to(tl.float32) + g_offset
        xo = (hf * g[None, :]).to(x.dtype)
        wm = cm[:, None] & km[None, :]
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + k0 + kk[None, :], mask=wm, other=0.0,
                    eviction_policy="evict_first")
        acc += _dot(xo, tl.trans(w), IEEE)
        if GATED:
            w2 = tl.load(w_ptr + (w2_off + cols[:, None]).to(tl.int64) * K + k0 + kk[None, :], mask=wm, other=0.0,
                         eviction_policy="evict_first")
            acc2 += _dot(xo, tl.trans(w2), IEEE)
    return acc, acc2, ss


@triton.jit
def _gemm_part(x_ptr, w_ptr, n0, k_lo, k_hi, N, K, M, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """x[:, k_lo:k_hi] @ W[n0:n0+BN, k_lo:k_hi]^T as fp32 [BM, BN] (x written earlier in this launch: .cg)."""
    rows = tl.arange(0, BM)
    rm = rows < M
    cols = n0 + tl.arange(0, BN)
    cm = cols < N
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        km = (k0 + kk) < k_hi
        x = tl.load(x_ptr + rows[:, None] * K + k0 + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0,
                    cache_modifier=".cg")
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + k0 + kk[None, :], mask=cm[:, None] & km[None, :],
                    other=0.0, eviction_policy="evict_first")
        acc += _dot(x, tl.trans(w), IEEE)
    return acc


@triton.jit
def _splitk_stage(x_ptr, w_ptr, y_ptr, res_ptr, ws_ptr, cnt_ptr, pid, P, N, K, M,
                  ADD_RES: tl.constexpr, SPLIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  IEEE: tl.constexpr):
    """y = (x @ W^T).to(dtype) (+ res, rounded again: the fused add of the next norm), tiles (column block, K
    split); the last program of a column block (ticket) sums the SPLIT fp32 partials in split order."""
    NB = tl.cdiv(N, BN)
    k_split = tl.cdiv(tl.cdiv(K, SPLIT), BK) * BK
    rows = tl.arange(0, BM)
    rm = rows < M
    for t in range(pid, NB * SPLIT, P):
        nb = t // SPLIT
        s = t % SPLIT
        n0 = nb * BN
        cols = n0 + tl.arange(0, BN)
        cm = cols < N
        acc = _gemm_part(x_ptr, w_ptr, n0, s * k_split, tl.minimum(K, (s + 1) * k_split), N, K, M, BN, BK, IEEE)
        last = True
        if SPLIT > 1:
            # workspace [SPLIT, NB * BN, BM]: slice s of column block nb
            wp = ws_ptr + (s * NB * BN + cols[None, :]) * BM + rows[:, None]
            tl.store(wp, acc)
            tl.debug_barrier()
            ticket = tl.atomic_add(cnt_ptr + nb, 1, sem="acq_rel")
            last = ticket == SPLIT - 1
            if last:
                acc = tl.zeros([BM, BN], dtype=tl.float32)
                for j in range(0, SPLIT):
                    acc += tl.load(ws_ptr + (j * NB * BN + cols[None, :]) * BM + rows[:, None], cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + nb, 0)
        if last:
            om = rm[:, None] & cm[None, :]
            y = acc.to(y_ptr.dtype.element_ty)
            if ADD_RES:
                r = tl.load(res_ptr + rows[:, None] * N + cols[None, :], mask=om, other=0.0, cache_modifier=".cg")
                y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + rows[:, None] * N + cols[None, :], y, mask=om)


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


@triton.jit
def _layer_kernel(x_ptr, r_ptr, r1_ptr, g1_ptr, g1_off, wqkv_ptr, bqkv_ptr, qkv_ptr,
                  qw_ptr, kw_ptr, qk_eps, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr, indptr_ptr, indices_ptr,
                  last_ptr, part_o_ptr, part_lse_ptr, sm_scale, window_left, attn_ptr,
                  wo_ptr, r2_ptr, g2_ptr, g2_off, wgu_ptr, act_ptr, wd_ptr, out_ptr, ws_ptr, cnt_ptr,
                  M, D, NQKV, I, eps1, eps2,
                  H: tl.constexpr, HK: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr,
                  G_PAD: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_RES: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, ACT: tl.constexpr,
                  BN1: tl.constexpr, BN3: tl.constexpr, S3: tl.constexpr, BN4: tl.constexpr, BN5: tl.constexpr,
                  S5: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, STAGE: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    rows = tl.arange(0, BM)
    rm = rows < M
    # counters: [0] the barrier, [1] the exit tickets, [2 : 2 + 16 HK] attention tickets, then split-K tickets of
    # stage 3 (cdiv(D, BN3)) and stage 5
    bar = cnt_ptr
    att_tick = cnt_ptr + 2
    k3_tick = att_tick + BM * HK
    k5_tick = k3_tick + tl.cdiv(D, BN3)
    ws3 = ws_ptr
    ws5 = ws_ptr + S3 * tl.cdiv(D, BN3) * BN3 * BM
    if (STAGE == 0) | (STAGE == 1):
        # 1. qkv = W_qkv rmsnorm(x + r): column tiles of qkv; program 0's first tile stores h = x + r
        for t in range(pid, tl.cdiv(NQKV, BN1), P):
            n0 = t * BN1
            acc, _a, ss = _norm_gemm(x_ptr, r_ptr, r1_ptr, g1_ptr, g1_off, wqkv_ptr, 0, n0, NQKV, D, M, t == 0,
                                     HAS_RES, False, BN1, BK, IEEE)
            y = acc * (1.0 / tl.sqrt(ss / D + eps1))[:, None]
            cols = n0 + tl.arange(0, BN1)
            cm = cols < NQKV
            if HAS_QKV_BIAS:    # added in fp32, one rounding (as the linear's epilogue)
                y += tl.load(bqkv_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
            tl.store(qkv_ptr + rows[:, None] * NQKV + cols[None, :], y.to(qkv_ptr.dtype.element_ty),
                     mask=rm[:, None] & cm[None, :])
    if STAGE == 0:
        _grid_sync(bar, P)
    if (STAGE == 0) | (STAGE == 2):
        _attention_stage(qkv_ptr, attn_ptr, kc_ptr, vc_ptr, qw_ptr, kw_ptr, qk_eps, pos_ptr, cs_ptr, slot_ptr,
                         indptr_ptr, indices_ptr, last_ptr, part_o_ptr, part_lse_ptr, att_tick, sm_scale,
                         window_left, pid, P, M, NQKV, H, HK, HD, PAGE, GROUP, G_PAD, SPLITS, S_PAD, BLOCK_N,
                         HAS_NORM, HAS_WINDOW, IEEE)
    if STAGE == 0:
        _grid_sync(bar, 2 * P)
    if (STAGE == 0) | (STAGE == 3):
        # 3. r2 = W_o attn + h
        res = r1_ptr if HAS_RES else x_ptr
        _splitk_stage(attn_ptr, wo_ptr, r2_ptr, res, ws3, k3_tick, pid, P, D, H * HD, M, True, S3, BN3, BK, IEEE)
    if STAGE == 0:
        _grid_sync(bar, 3 * P)
    if (STAGE == 0) | (STAGE == 4):
        # 4. act = act(gate) * up, gate | up = W_gu rmsnorm(r2)
        for t in range(pid, tl.cdiv(I, BN4), P):
            n0 = t * BN4
            a_g, a_u, ss = _norm_gemm(r2_ptr, r2_ptr, r2_ptr, g2_ptr, g2_off, wgu_ptr, I, n0, I, D, M, False,
                                      False, True, BN4, BK, IEEE)
            rstd = (1.0 / tl.sqrt(ss / D + eps2))[:, None]
            gt = (a_g * rstd).to(act_ptr.dtype.element_ty).to(tl.float32)
            up = (a_u * rstd).to(act_ptr.dtype.element_ty).to(tl.float32)
            if ACT == 0:        # silu
                sg = gt / (1.0 + tl.exp(-gt))
            elif ACT == 1:      # gelu, tanh approximation
                u = 0.7978845608028654 * (gt + 0.044715 * gt * gt * gt)
                sg = 0.5 * gt * (1.0 + (1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)))
            else:               # gelu, exact erf
                sg = 0.5 * gt * (1.0 + tl.erf(gt * 0.7071067811865476))
            a = (sg.to(act_ptr.dtype.element_ty).to(tl.float32) * up).to(act_ptr.dtype.element_ty)
            cols = n0 + tl.arange(0, BN4)
            tl.store(act_ptr + rows[:, None] * I + cols[None, :], a, mask=rm[:, None] & (cols < I)[None, :])
    if STAGE == 0:
        _grid_sync(bar, 4 * P)
    if (STAGE == 0) | (STAGE == 5):
        # 5. out = W_down act
        _splitk_stage(act_ptr, wd_ptr, out_ptr, out_ptr, ws5, k5_tick, pid, P, D, I, M, False, S5, BN5, BK, IEEE)
    if STAGE == 0:
        # the last program out resets the barrier for the next launch (every program is past its last wait)
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel") == P - 1:
            tl.atomic_xchg(bar, 0)
            tl.atomic_xchg(cnt_ptr + 1, 0)


@dataclass(frozen=True)
class LayerDims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    page: int


def _tile_n(N: int, P: int, choices=(16, 32, 64)) -> int:
    """The column tile with the fewest rows per program (rounds of tiles x tile rows), the wider on ties."""
    return min(choices, key=lambda bn: (triton.cdiv(triton.cdiv(N, bn), P) * bn, -bn))


def _split_k(N: int, K: int, P: int, bn: int, bk: int) -> int:
    """K splits so that (column blocks x splits) is about P tiles."""
    nb = triton.cdiv(N, bn)
    chunks = triton.cdiv(K, bk)
    s = max(1, min(chunks, P // nb))
    return triton.cdiv(chunks, triton.cdiv(chunks, s))


class LayerScratch:
    """What a launch writes and later stages of the same launch read (shared by every layer of a model: layers run
    one after another), and the zeroed counters (each launch leaves them at 0)."""

    def __init__(self, dims: LayerDims, programs: int, dtype: torch.dtype, device, block_k: int = 128):
        d = dims
        self.dims, self.programs, self.block_k = d, programs, block_k
        nqkv = (d.heads + 2 * d.kv_heads) * d.head_dim
        self.bn1 = _tile_n(nqkv, programs)
        self.bn3 = _tile_n(d.hidden, programs, (16, 32))
        self.s3 = _split_k(d.hidden, d.heads * d.head_dim, programs, self.bn3, block_k)
        self.bn4 = _tile_n(d.intermediate, programs)
        self.bn5 = _tile_n(d.hidden, programs, (16, 32))
        self.s5 = _split_k(d.hidden, d.intermediate, programs, self.bn5, block_k)
        self.splits = max(1, min(32, programs // max(1, d.kv_heads)))      # at 1 row; fewer per row at more rows
        e = dict(dtype=dtype, device=device)
        self.r1 = torch.empty(BM, d.hidden, **e)
        self.qkv = torch.empty(BM, nqkv, **e)
        self.attn = torch.empty(BM, d.heads * d.head_dim, **e)
        self.act = torch.empty(BM, d.intermediate, **e)
        f = dict(dtype=torch.float32, device=device)
        self.part_o = torch.empty(BM * d.heads * self.splits * d.head_dim, **f)
        self.part_lse = torch.empty(BM * d.heads * self.splits, **f)
        nb3, nb5 = triton.cdiv(d.hidden, self.bn3), triton.cdiv(d.hidden, self.bn5)
        self.ws = torch.empty(self.s3 * nb3 * self.bn3 * BM + self.s5 * nb5 * self.bn5 * BM, **f)
        self.counters = torch.zeros(2 + BM * d.kv_heads + nb3 + nb5, dtype=torch.int32, device=device)

    def splits_for(self, rows: int) -> int:
        return max(1, min(self.splits, self.programs // max(1, rows * self.dims.kv_heads)))


ACT_CODES = {"silu": 0, "gelu_tanh": 1, "gelu": 2}


def decoder_layer(x, residual, g1, g1_off, eps1, w_qkv, b_qkv, q_w, k_w, qk_eps, positions, cos_sin, slots,
                  k_cache, v_cache, indptr, indices, last_page_len, sm_scale, window_left, w_o, g2, g2_off, eps2,
                  w_gu, act, w_down, scratch: LayerScratch, staged: bool = False):
    """(out, r2) of one pre-norm attention + gated-MLP decoder layer for x [M <= 16, hidden] (see the module
    docstring): residual [M, hidden] or None; k_cache / v_cache [pages, page, kv_heads, head_dim] (the step's k, v
    are written at `slots`); the page table in FlashInfer's CSR form (indptr, indices, last_page_len); q_w / k_w the
    per-head q / k RMSNorm weights or None; act "silu" | "gelu_tanh" | "gelu"."""
    d = scratch.dims
    M = x.shape[0]
    if not 0 < M <= BM:
        raise ValueError(f"decoder_layer: {M} rows (1..{BM})")
    out = torch.empty_like(x)
    r2 = torch.empty_like(x)
    group = d.heads // d.kv_heads
    splits = scratch.splits_for(M)
    ieee = x.dtype == torch.float32
    s = scratch
    args = (x, x if residual is None else residual, s.r1, g1, float(g1_off), w_qkv, w_qkv if b_qkv is None else b_qkv,
            s.qkv, q_w if q_w is not None else g1, k_w if k_w is not None else g1, float(qk_eps), positions, cos_sin,
            slots, k_cache, v_cache, indptr, indices, last_page_len, s.part_o, s.part_lse, float(sm_scale),
            int(window_left), s.attn, w_o, r2, g2, float(g2_off), w_gu, s.act, w_down, out, s.ws, s.counters,
            M, d.hidden, s.qkv.shape[1], d.intermediate, float(eps1), float(eps2))
    meta = dict(H=d.heads, HK=d.kv_heads, HD=d.head_dim, PAGE=d.page, GROUP=group,
                G_PAD=max(16, triton.next_power_of_2(group)), SPLITS=splits, S_PAD=max(2, triton.next_power_of_2(splits)),
                BLOCK_N=32, HAS_RES=residual is not None, HAS_QKV_BIAS=b_qkv is not None, HAS_NORM=q_w is not None,
                HAS_WINDOW=window_left >= 0, ACT=ACT_CODES[act], BN1=s.bn1, BN3=s.bn3, S3=s.s3, BN4=s.bn4,
                BN5=s.bn5, S5=s.s5, BK=s.block_k, IEEE=ieee, num_warps=4)
    if staged:
        for stage in range(1, 6):
            _layer_kernel[(s.programs,)](*args, STAGE=stage, **meta)
    else:
        _layer_kernel[(s.programs,)](*args, STAGE=0, **meta)
    return out, r2
