"""The GEMM stages' tiles of the whole-layer decode kernel (ops/layer_kernel.py): a [ROWS, BN] output tile of
x' @ W^T with the weights streamed in K chunks, x' the plain input or its RMSNorm prologue (the norm's per-row
scale factored out of the GEMV); the norm-prologue stages (qkv, gate | up with the activation) and the split-K
stages (o, down: fp32 partials summed in split order by the last program of a column block).
"""
from __future__ import annotations

import triton
import triton.language as tl

ROWS = 16                 # rows per tile (a tl.dot needs 16): up to 16 decode rows
BM = tl.constexpr(ROWS)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _w_chunk(w_ptr, row0, n0, k0, k_hi, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """Weight rows row0 + n0 .. + BN, columns k0 .. k0 + BK (masked at N and k_hi: past k_hi nothing is read)."""
    cols = n0 + tl.arange(0, BN)
    kk = k0 + tl.arange(0, BK)
    return tl.load(w_ptr + (row0 + cols[:, None]).to(tl.int64) * K + kk[None, :],
                   mask=(cols < N)[:, None] & (kk < k_hi)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _x_chunk(x_ptr, r_ptr, ro_ptr, g_ptr, g_offset, k0, k_hi, K, M, write_res, PRO: tl.constexpr,
             HAS_RES: tl.constexpr, BK: tl.constexpr):
    """Columns k0 .. k0 + BK of the GEMV input x' (see _tile_acc) and the rows' sums of squares of h there."""
    rows = tl.arange(0, BM)
    kk = k0 + tl.arange(0, BK)
    xm = (rows < M)[:, None] & (kk < k_hi)[None, :]
    x = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=xm, other=0.0, cache_modifier=".cg")
    ss = tl.zeros([BM], dtype=tl.float32)
    if PRO == 1:
        if HAS_RES:
            r = tl.load(r_ptr + rows[:, None] * K + kk[None, :], mask=xm, other=0.0, cache_modifier=".cg")
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(ro_ptr + rows[:, None] * K + kk[None, :], x, mask=xm & write_res)
        hf = x.to(tl.float32)
        ss = tl.sum(hf * hf, axis=1)
        g = tl.load(g_ptr + kk, mask=kk < k_hi, other=0.0).to(tl.float32) + g_offset
        x = (hf * g[None, :]).to(x.dtype)
    return x, ss


@triton.jit
def _tile_acc(x_ptr, r_ptr, ro_ptr, g_ptr, g_offset, w_ptr, w2_off, n0, k_lo, k_hi, N, K, M, write_res, w, w2,
              PRO: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              IEEE: tl.constexpr, PIPE: tl.constexpr):
    """acc [BM, BN] = x'[:, k_lo:k_hi] @ W[n0:n0+BN, k_lo:k_hi]^T (acc2: the rows w2_off further, the up half), with
    x' = x (PRO 0) or (h * g) for h = x (+ r) rounded to x's dtype (PRO 1; h stored to ro where write_res; ss: the
    rows' sums of squares of h). PIPE 0: `w` / `w2` are the first K chunk's weights, loaded by the caller (before a
    barrier where it can); each iteration loads the next chunk's into registers before using this one's. PIPE > 0:
    the loop is software-pipelined by the compiler through shared memory, PIPE chunks in flight (`w` unused)."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    ss = tl.zeros([BM], dtype=tl.float32)
    if PIPE > 0:
        for k0 in tl.range(k_lo, k_hi, BK, num_stages=PIPE):
            wc = _w_chunk(w_ptr, 0, n0, k0, k_hi, N, K, BN, BK)
            x, s2 = _x_chunk(x_ptr, r_ptr, ro_ptr, g_ptr, g_offset, k0, k_hi, K, M, write_res, PRO, HAS_RES, BK)
            ss += s2
            acc += _dot(x, tl.trans(wc), IEEE)
            if GATED:
                w2c = _w_chunk(w_ptr, w2_off, n0, k0, k_hi, N, K, BN, BK)
                acc2 += _dot(x, tl.trans(w2c), IEEE)
    else:
        for k0 in range(k_lo, k_hi, BK):
            wn = _w_chunk(w_ptr, 0, n0, k0 + BK, k_hi, N, K, BN, BK)
            if GATED:
                w2n = _w_chunk(w_ptr, w2_off, n0, k0 + BK, k_hi, N, K, BN, BK)
            x, s2 = _x_chunk(x_ptr, r_ptr, ro_ptr, g_ptr, g_offset, k0, k_hi, K, M, write_res, PRO, HAS_RES, BK)
            ss += s2
            acc += _dot(x, tl.trans(w), IEEE)
            w = wn
            if GATED:
                acc2 += _dot(x, tl.trans(w2), IEEE)
                w2 = w2n
    return acc, acc2, ss


@triton.jit
def _norm_tile(t, w, w2, x_ptr, r_ptr, ro_ptr, g_ptr, g_off, eps, w_ptr, b_ptr, y_ptr, N, K, M,
               HAS_RES: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, PIPE: tl.constexpr):
    """One column tile of a norm-prologue stage: y = W rmsnorm(x (+ r)) (+ bias) (stage 1), or with GATED
    y = act(gate) * up of gate | up = W rmsnorm(x) (stage 4; N = the intermediate width, up rows N further)."""
    rows = tl.arange(0, BM)
    n0 = t * BN
    cols = n0 + tl.arange(0, BN)
    om = (rows < M)[:, None] & (cols < N)[None, :]
    acc, acc2, ss = _tile_acc(x_ptr, r_ptr, ro_ptr, g_ptr, g_off, w_ptr, N, n0, 0, K, N, K, M, t == 0, w, w2,
                              1, HAS_RES, GATED, BN, BK, IEEE, PIPE)
    rstd = (1.0 / tl.sqrt(ss / K + eps))[:, None]
    if GATED:
        gt = (acc * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
        up = (acc2 * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
        if ACT == 0:        # silu
            sg = gt / (1.0 + tl.exp(-gt))
        elif ACT == 1:      # gelu, tanh approximation
            u = 0.7978845608028654 * (gt + 0.044715 * gt * gt * gt)
            sg = 0.5 * gt * (1.0 + (1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)))
        else:               # gelu, exact erf
            sg = 0.5 * gt * (1.0 + tl.erf(gt * 0.7071067811865476))
        y = (sg.to(y_ptr.dtype.element_ty).to(tl.float32) * up).to(y_ptr.dtype.element_ty)
    else:
        y = acc * rstd
        if HAS_BIAS:        # added in fp32, one rounding (as the linear's epilogue)
            y += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        y = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y, mask=om)


@triton.jit
def _splitk_tile(t, w, x_ptr, w_ptr, y_ptr, res_ptr, ws_ptr, cnt_ptr, N, K, M,
                 ADD_RES: tl.constexpr, SPLIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 IEEE: tl.constexpr, PIPE: tl.constexpr):
    """Tile t = (column block, K split) of y = (x @ W^T).to(dtype) (+ res, rounded again: the fused add of the next
    norm); the last program of a column block (ticket) sums the SPLIT fp32 partials in split order."""
    NB = tl.cdiv(N, BN)
    k_split = tl.cdiv(tl.cdiv(K, SPLIT), BK) * BK
    rows = tl.arange(0, BM)
    nb = t // SPLIT
    s = t % SPLIT
    n0 = nb * BN
    cols = n0 + tl.arange(0, BN)
    acc, _a, _s = _tile_acc(x_ptr, x_ptr, x_ptr, x_ptr, 0.0, w_ptr, 0, n0, s * k_split,
                            tl.minimum(K, (s + 1) * k_split), N, K, M, False, w, w, 0, False, False, BN, BK, IEEE, PIPE)
    last = True
    if SPLIT > 1:
        # workspace [SPLIT, NB * BN, BM]: slice s of column block nb
        tl.store(ws_ptr + (s * NB * BN + cols[None, :]) * BM + rows[:, None], acc)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + nb, 1, sem="acq_rel")
        last = ticket == SPLIT - 1
        if last:
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for j in range(0, SPLIT):
                acc += tl.load(ws_ptr + (j * NB * BN + cols[None, :]) * BM + rows[:, None], cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + nb, 0)
    if last:
        om = (rows < M)[:, None] & (cols < N)[None, :]
        y = acc.to(y_ptr.dtype.element_ty)
        if ADD_RES:
            r = tl.load(res_ptr + rows[:, None] * N + cols[None, :], mask=om, other=0.0, cache_modifier=".cg")
            y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], y, mask=om)


@triton.jit
def _splitk_first(pid, w_ptr, N, K, SPLIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The first K chunk of tile `pid` of a split-K stage (nothing read where the program has no tile)."""
    NB = tl.cdiv(N, BN)
    k_split = tl.cdiv(tl.cdiv(K, SPLIT), BK) * BK
    ok = pid < NB * SPLIT
    k0 = (pid % SPLIT) * k_split
    return _w_chunk(w_ptr, 0, (pid // SPLIT) * BN, k0, tl.where(ok, tl.minimum(K, k0 + k_split), 0), N, K, BN, BK)
