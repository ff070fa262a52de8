"""Paged decode attention in one Triton kernel: split-KV ("flash decoding") with the merge done in the same
launch by the last program of each (sequence, KV head), so a decode step costs one kernel per layer where
FlashInfer's CUDA-graph decode costs two (attention + merge of the splits).

Grid (batch, KV heads, splits). Program (b, kh, s) takes the query heads of KV head kh together (the GQA group,
padded to 16 rows for tl.dot) and the s-th of `splits` equal chunks of the sequence's visible keys (a sliding
window, or the query's own chunk in chunked local attention, starts the range later). It writes its normalised partial output and log-sum-exp, then takes a ticket
from a per-(b, kh) counter; the program with the last ticket merges the partials, writes the output and resets
the counter to 0, so the counters are ready for the next launch (CUDA-graph replays included). The grid depends
only on (batch, splits), never on the lengths, so one capture serves every step of a bucket.

The page table is FlashInfer's CSR form (indptr [B+1], page indices, last-page length [B]); a row with no pages
is a padding row (length 0), its output is zeros. Cache layout NHD: [num_pages, page_size, Hk, D].
Attention sinks (GPT-OSS), where given: a logit per query head added to the softmax denominator (in the final
normalisation of a single split, in the merge of several). KV-cache scales (a float8 cache holding K / k_scale,
V / v_scale), per tensor or per KV head: k_scale folded into the softmax scale of the (row, KV head) program, the
output times v_scale.
With a `rope` prologue (ops/fused_rope_store.RopeStore: the step's q / k / v as the qkv projection left them) the
kernel also does what qk_norm_rope_store did before it, so a decode layer launches one kernel fewer: every program
norms and rotates its group's q heads itself (`_norm_rope_tile`, a few hundred flops), and the one program whose
split holds the row's new position (L - 1) norms and rotates k, writes it and v into the cache at the row's slot
(slot -1: a padding row, nothing written) and then reads its keys as always (a CTA barrier between: the same
program's threads read what it wrote); no other program reads that position. mRoPE (positions [axes, B] and the
rotary's axis map): each frequency's cos / sin come from its axis's position, as in rope_kernels.
Reference: ops.reference.paged_decode_attention.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops import pdl
from xllm_gen.runtime.ops.pdl import pdl_enter, pdl_trigger

MERGE_VEC_MAX_ELEMS = 8192     # float32 partials the vectorized merge holds at once (64 registers a thread at 4 warps)


@triton.jit
def _norm_rope_tile(src, dd, w_ptr, c, sn, eps, D: tl.constexpr, HAS_NORM: tl.constexpr, mask):
    """Per-head RMSNorm (weight w) then neox rotary of the heads at src ([rows, D] pointers; dims dd) in src's dtype,
    with rope_kernels._norm_rope_values' roundings: dim j of the first half pairs with j + D/2, c / sn the cos / sin of
    each dim's frequency."""
    HALF: tl.constexpr = D // 2
    first = dd < HALF
    partner = tl.where(first, dd + HALF, dd - HALF)
    x = tl.load(src + dd[None, :], mask=mask, other=0.0)
    xp = tl.load(src + partner[None, :], mask=mask, other=0.0)
    dt = x.dtype
    f = x.to(tl.float32)
    fp = xp.to(tl.float32)
    if HAS_NORM:
        rstd = (1.0 / tl.sqrt(tl.sum(f * f, axis=1) / D + eps))[:, None]
        w = tl.load(w_ptr + dd).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner).to(tl.float32)[None, :]
        f = (w * (f * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        fp = (wp * (fp * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    cc = c.to(dt).to(tl.float32)[None, :]
    ss = sn.to(dt).to(tl.float32)[None, :]
    o = (f * cc).to(dt).to(tl.float32) + (tl.where(first[None, :], -fp, fp) * ss).to(dt).to(tl.float32)
    return o.to(dt)


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, counter_ptr,
                         indptr_ptr, indices_ptr, last_ptr, sinks_ptr, ks_ptr, vs_ptr,
                         kr_ptr, vr_ptr, qw_ptr, kw_ptr, pos_ptr, cs_ptr, slot_ptr, ax_ptr,
                         stride_krb, stride_krh, stride_vrb, stride_vrh, stride_pos_axis, eps,
                         sm_scale, soft_cap, window_left, chunk_size, v_scale,
                         stride_qb, stride_qh, stride_ob, stride_oh, stride_kp, stride_kt, stride_kh,
                         H: tl.constexpr, HK: tl.constexpr, PAGE: tl.constexpr,
                         GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                         SPLITS: tl.constexpr, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_SOFT_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr,
                         HAS_SINKS: tl.constexpr = False, HAS_CHUNK: tl.constexpr = False,
                         MERGE_VEC: tl.constexpr = False, GM_PAD: tl.constexpr = 1,
                         V_SCALED: tl.constexpr = False, K_HEAD: tl.constexpr = False, V_HEAD: tl.constexpr = False,
                         ROPE: tl.constexpr = False, ROPE_NORM: tl.constexpr = False, MROPE: tl.constexpr = False,
                         PDL: tl.constexpr = 0):
    pdl_enter(PDL, LARGE=True)
    b = tl.program_id(0)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    if K_HEAD:              # per-KV-head K-cache scales: this program's head's, folded into the softmax scale
        sm_scale = sm_scale * tl.load(ks_ptr + kh)
    if V_HEAD:              # per-KV-head V-cache scales: this head's multiplies the output (V_SCALED is set)
        v_scale = tl.load(vs_ptr + kh)
    p0 = tl.load(indptr_ptr + b)
    npages = tl.load(indptr_ptr + b + 1) - p0
    last = tl.load(last_ptr + b)
    L = tl.where(npages > 0, (npages - 1) * PAGE + last, 0)
    start = 0
    if HAS_WINDOW:          # the query (position L-1) sees keys L-1-window_left .. L-1
        start = tl.maximum(L - 1 - window_left, 0)
    if HAS_CHUNK:           # chunked local attention: the keys of the query's own chunk, (L-1) // C * C .. L-1
        start = tl.maximum(start, tl.maximum(L - 1, 0) // chunk_size * chunk_size)
    # chunks of whole blocks: a short context leaves the later splits empty (they only post an empty partial)
    chunk = tl.cdiv(tl.cdiv(L - start, SPLITS), BLOCK_N) * BLOCK_N
    lo = start + s * chunk
    hi = tl.minimum(lo + chunk, L)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    heads = kh * GROUP + g
    # masks along D only when D is padded: a mask constant along the row keeps the loads vectorized
    if D == D_PAD:
        gd_mask = g_ok[:, None]
    else:
        gd_mask = g_ok[:, None] & (d < D)[None, :]
    if ROPE:                # q as the projection left it: normed and rotated here (D == D_PAD)
        HALF: tl.constexpr = D // 2
        fj = tl.where(d < HALF, d, d - HALF)
        if MROPE:           # positions [axes, B]: frequency j rotates by its axis's position (axis map [D/2])
            pos_j = tl.load(pos_ptr + tl.load(ax_ptr + fj).to(tl.int64) * stride_pos_axis + b).to(tl.int64)
        else:
            pos_j = tl.load(pos_ptr + b).to(tl.int64)
        c = tl.load(cs_ptr + pos_j * D + fj)
        sn = tl.load(cs_ptr + pos_j * D + HALF + fj)
        q = _norm_rope_tile(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh, d, qw_ptr, c, sn, eps,
                            D, ROPE_NORM, g_ok[:, None])
        slot = tl.load(slot_ptr + b).to(tl.int64)
        if (slot >= 0) & (lo <= L - 1) & (L - 1 < hi):     # this split holds the new position: write its k, v first
            kn = _norm_rope_tile(kr_ptr + b.to(tl.int64) * stride_krb + kh * stride_krh + tl.zeros([1, 1], tl.int64),
                                 d, kw_ptr, c, sn, eps, D, ROPE_NORM, d[None, :] < D)
            dst = (slot // PAGE) * stride_kp + (slot % PAGE) * stride_kt + kh * stride_kh
            tl.store(k_ptr + dst + d[None, :], kn.to(k_ptr.dtype.element_ty))
            vv = tl.load(vr_ptr + b.to(tl.int64) * stride_vrb + kh * stride_vrh + d)
            tl.store(v_ptr + dst + d, vv.to(v_ptr.dtype.element_ty))
        tl.debug_barrier()  # the stores above are seen by every thread's loads below
    else:
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gd_mask,
                    other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    n_off = tl.arange(0, BLOCK_N)
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + n_off
        t_ok = t < hi
        page = tl.load(indices_ptr + p0 + t // PAGE, mask=t_ok, other=0).to(tl.int64)
        row = page * stride_kp + (t % PAGE) * stride_kt + kh * stride_kh
        if D == D_PAD:
            kv_mask = t_ok[:, None]
        else:
            kv_mask = t_ok[:, None] & (d < D)[None, :]
        # a float8 cache is read as q's dtype (the dot's operands must match; a no-op for a cache of q's dtype; exact:
        # e4m3 values are bf16 / fp16 values); its scales are applied to the scores and the output, not per element
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = sc * sm_scale
        if HAS_SOFT_CAP:    # c * tanh(x / c), tanh written with exp (no tanh in every Triton backend)
            e = tl.exp(-2.0 * tl.abs(sc / soft_cap))
            th = (1.0 - e) / (1.0 + e)
            sc = soft_cap * tl.where(sc < 0, -th, th)
        sc = tl.where(t_ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    pdl_trigger(PDL)
    has = l_i > 0
    if SPLITS == 1:
        den = l_i
        if HAS_SINKS:       # attention sinks: each head's sink logit joins the softmax denominator
            sink = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0).to(tl.float32)
            den = l_i + tl.exp(sink - tl.where(has, m_i, 0.0))
        o = acc / tl.where(has, den, 1.0)[:, None]
    else:
        o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLITS == 1:
        if V_SCALED:        # a scaled cache holds V / v_scale: the output is the weighted sum times v_scale
            o = o * v_scale
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        # partials: o [B, H, SPLITS, D] (written only where the split had keys), lse [B, H, SPLITS]
        row_h = b.to(tl.int64) * H + heads
        tl.store(part_o_ptr + (row_h[:, None] * SPLITS + s) * D + d[None, :], o, mask=gd_mask & has[:, None])
        tl.store(part_lse_ptr + row_h * SPLITS + s, tl.where(has, m_i + tl.log(l_i), float("-inf")), mask=g_ok)
        tl.debug_barrier()      # every thread's partials are written before the ticket (release) is taken
        ticket = tl.atomic_add(counter_ptr + b * HK + kh, 1, sem="acq_rel")
        if ticket == SPLITS - 1:
            # the last program of (b, kh) merges: per head, all splits' partials in one load each
            sidx = tl.arange(0, S_PAD)
            s_ok = sidx < SPLITS
            if MERGE_VEC:
                # all heads of the group at once, the lse and partial loads issued together (one memory round
                # trip on the kernel's tail, not two per head); an empty split's stale partial is masked by w == 0
                gm = tl.arange(0, GM_PAD)
                gs_ok = (gm < GROUP)[:, None] & s_ok[None, :]
                base = (b.to(tl.int64) * H + kh * GROUP + gm)[:, None] * SPLITS + sidx[None, :]       # [GM, S]
                lse = tl.load(part_lse_ptr + base, mask=gs_ok, other=float("-inf"), cache_modifier=".cg")
                o_s = tl.load(part_o_ptr + base[:, :, None] * D + d[None, None, :],
                              mask=gs_ok[:, :, None] & (d < D)[None, None, :], other=0.0, cache_modifier=".cg")
                m = tl.max(lse, axis=1)
                m0 = tl.where(m == float("-inf"), 0.0, m)
                w = tl.exp(lse - m0[:, None])                                     # [GM, S], 0 for empty splits
                den = tl.sum(w, axis=1)
                if HAS_SINKS:
                    sink = tl.load(sinks_ptr + kh * GROUP + gm, mask=gm < GROUP, other=0.0).to(tl.float32)
                    den += tl.where(m == float("-inf"), 0.0, tl.exp(sink - m0))
                o_s = tl.where((w > 0)[:, :, None], o_s, 0.0)
                res = tl.sum(w[:, :, None] * o_s, axis=1) / tl.where(den > 0, den, 1.0)[:, None]   # [GM, D]
                if V_SCALED:
                    res = res * v_scale
                tl.store(out_ptr + b.to(tl.int64) * stride_ob + (kh * GROUP + gm)[:, None] * stride_oh + d[None, :],
                         res.to(out_ptr.dtype.element_ty), mask=(gm < GROUP)[:, None] & (d < D)[None, :])
            for gi in tl.static_range(0 if MERGE_VEC else GROUP):
                base = (b.to(tl.int64) * H + kh * GROUP + gi) * SPLITS
                lse = tl.load(part_lse_ptr + base + sidx, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
                m = tl.max(lse, axis=0)
                w = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m))      # 0 for empty splits
                if D == D_PAD:
                    o_mask = (lse > float("-inf"))[:, None]
                else:
                    o_mask = (lse > float("-inf"))[:, None] & (d < D)[None, :]
                o_s = tl.load(part_o_ptr + (base + sidx)[:, None] * D + d[None, :], mask=o_mask, other=0.0,
                              cache_modifier=".cg")
                den = tl.sum(w, axis=0)
                if HAS_SINKS:
                    sink = tl.load(sinks_ptr + kh * GROUP + gi).to(tl.float32)
                    den += tl.where(m == float("-inf"), 0.0, tl.exp(sink - tl.where(m == float("-inf"), 0.0, m)))
                res = tl.sum(w[:, None] * o_s, axis=0) / tl.where(den > 0, den, 1.0)
                if V_SCALED:
                    res = res * v_scale
                tl.store(out_ptr + b.to(tl.int64) * stride_ob + (kh * GROUP + gi) * stride_oh + d,
                         res.to(out_ptr.dtype.element_ty), mask=d < D)
            tl.atomic_xchg(counter_ptr + b * HK + kh, 0)


class DecodeScratch:
    """The per-launch scratch of paged_decode_attention for up to `max_batch` rows and `splits` splits:
    partial outputs / log-sum-exps (float32) and the (zeroed) per-(row, KV head) tickets. Reusable by every
    launch of a stream (each launch leaves the tickets at 0)."""

    def __init__(self, max_batch: int, num_heads: int, num_kv_heads: int, head_dim: int, splits: int,
                 device: torch.device | str):
        n = max(1, max_batch) * num_heads * max(splits, 1)
        self.max_batch, self.splits = max_batch, splits
        self.part_o = torch.empty(n * head_dim if splits > 1 else 1, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(n if splits > 1 else 1, dtype=torch.float32, device=device)
        self.counters = torch.zeros(max(1, max_batch) * num_kv_heads, dtype=torch.int32, device=device)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, indptr: torch.Tensor,
                           indices: torch.Tensor, last_page_len: torch.Tensor, sm_scale: float,
                           scratch: DecodeScratch, *, window_left: int = -1, soft_cap: Optional[float] = None,
                           block_n: int = 64, out: Optional[torch.Tensor] = None,
                           sinks: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None,
                           k_scale=1.0, v_scale=1.0, num_warps: int = 4,
                           num_stages: Optional[int] = None, merge_vec: Optional[bool] = None,
                           rope=None) -> torch.Tensor:
    """q [B, H, D] (one query token per row, the row's last position) -> [B, H, D] in q's dtype, attending to
    the row's keys in the paged cache (k_cache / v_cache [pages, page_size, Hk, D]) through the CSR page table
    (indptr [>= B+1] int32, indices int32, last_page_len [>= B] int32), in `scratch.splits` splits. `sinks` [H]
    (float32): attention sinks, a logit per head in the softmax denominator. `chunk_size` C: chunked local
    attention, the query at position L-1 sees the keys (L-1) // C * C .. L-1 (with a window too: the later start).
    k_scale / v_scale: per-tensor KV-cache scales (the cache holds K / k_scale, V / v_scale): k_scale is folded into
    the softmax scale (q . k_cache * sm_scale * k_scale), the output is multiplied by v_scale (as FlashInfer's run
    does with its k_scale / v_scale). Per KV head, k_scale / v_scale are float32 tensors [Hk] or [Hk, 1] on q's device:
    program (row, KV head kh) folds k_scale[kh] into its softmax scale and multiplies its heads' output by
    v_scale[kh]. `rope` (ops/fused_rope_store.RopeStore): q is the projection's, not yet normed and rotated; the kernel
    does that and writes the step's k (normed, rotated) and v into the caches (see the module docstring)."""
    B, H, D = q.shape
    _, page, Hk, Dk = k_cache.shape
    if Dk != D or v_cache.shape != k_cache.shape or H % Hk:
        raise ValueError(f"decode attention: q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if B > scratch.max_batch:
        raise ValueError(f"decode attention: batch {B} > the scratch's {scratch.max_batch} rows")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("decode attention: q and the caches need a contiguous last dimension (and equal strides)")
    if sinks is not None and (sinks.shape != (H,) or sinks.stride(0) != 1):
        raise ValueError(f"decode attention: sinks must be a contiguous [{H}] tensor, got {tuple(sinks.shape)}")
    head_scales = {}
    for name, sc in (("k", k_scale), ("v", v_scale)):
        if isinstance(sc, torch.Tensor):
            if sc.numel() != Hk or sc.dtype != torch.float32 or sc.device != q.device or not sc.is_contiguous():
                raise ValueError(f"decode attention: per-KV-head {name}_scale must be a contiguous float32 [{Hk}] "
                                 f"tensor on {q.device}, got {tuple(sc.shape)} {sc.dtype} on {sc.device}")
            head_scales[name] = sc.reshape(-1)
    if out is None:
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    r = rope.launch_args(q, k_cache, v_cache, k_scale, v_scale) if rope is not None else None
    k_head, v_head = "k" in head_scales, "v" in head_scales
    group = H // Hk
    gm_pad = triton.next_power_of_2(group)
    s_pad = max(2, triton.next_power_of_2(scratch.splits))
    # the group's merge in one [heads, splits, D] tile where it stays small in registers (else head by head)
    if merge_vec is None:
        merge_vec = gm_pad * s_pad * max(16, triton.next_power_of_2(D)) * 4 <= MERGE_VEC_MAX_ELEMS * num_warps
    _paged_decode_kernel[(B, Hk, scratch.splits)](
        q, k_cache, v_cache, out, scratch.part_o, scratch.part_lse, scratch.counters,
        indptr, indices, last_page_len, q if sinks is None else sinks, head_scales.get("k", q), head_scales.get("v", q),
        *(r or (q, q, q, q, q, q, q, q, 0, 0, 0, 0, 0, 0.0)),
        float(sm_scale) * (1.0 if k_head else float(k_scale)), float(soft_cap or 1.0), int(window_left),
        int(chunk_size or 1), 1.0 if v_head else float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        H=H, HK=Hk, PAGE=page, GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), D=D,
        D_PAD=max(16, triton.next_power_of_2(D)),
        SPLITS=scratch.splits, S_PAD=s_pad, BLOCK_N=block_n,
        HAS_SOFT_CAP=soft_cap is not None, HAS_WINDOW=window_left >= 0, IEEE=q.dtype == torch.float32,
        HAS_SINKS=sinks is not None, HAS_CHUNK=chunk_size is not None,
        V_SCALED=v_head or float(v_scale) != 1.0, K_HEAD=k_head, V_HEAD=v_head,
        MERGE_VEC=merge_vec, GM_PAD=gm_pad, ROPE=r is not None, ROPE_NORM=r is not None and rope.q_weight is not None,
        MROPE=r is not None and rope.axis_map is not None,
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}), **pdl.launch(q))
    return out
