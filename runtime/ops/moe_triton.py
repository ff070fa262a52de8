"""Triton fused mixture-of-experts: the (token, slot) pairs aligned by expert (ops.moe.moe_align), then two
grouped GEMMs over blocks of BLOCK_M sorted rows, each block one expert's:

  1. h[row] = silu(x[token] @ w13[e, :I].T) * (x[token] @ w13[e, I:].T)     (SiLU-and-mul fused in the epilogue)
  2. y[pair] = weight[pair] * (h[row] @ w2[e].T)                             (routing weight fused)

and out[t] = sum_k y[t * K + k]. Shapes are static for a given number of tokens (padded rows and blocks past
the used ones do no work: their loop bound is 0), nothing is read on the host: capturable in a CUDA graph.
Pairs routed nowhere (ids outside 0..E-1: padding rows, other ranks' experts) contribute zero. The launcher
accepts CPU tensors under TRITON_INTERPRET=1 (tests compare it with ops.moe.fused_moe_reference).

The tiles and launch parameters are a MoeConfig (BLOCK_M rows per block, BLOCK_N x BLOCK_K tiles of each GEMM,
num_warps, num_stages); `default_config` picks one from the shapes (bench/bench_moe.py's sweep measures the
candidates on a GPU and reports the best per number of tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops.moe import Alignment, padded_rows


@triton.jit
def _group_values(p_row, mask_rows, k0, offs_k, mask, Kdim, BLOCK_K: tl.constexpr, SBK: tl.constexpr,
                  SCALES: tl.constexpr):
    """A value per row and SBK columns (scales, zeros) for the [BLOCK_K, BLOCK_N] tile at k0, in float32, shaped to
    multiply it: [BLOCK_N] (SCALES 1: the tile lies in one group), [G, BLOCK_N] (2: BLOCK_K / SBK whole groups) or
    [BLOCK_K, BLOCK_N] (0: gathered per element, any other SBK)."""
    if SCALES == 1:
        v = tl.load(p_row + k0 // SBK, mask=mask_rows, other=0.0)
    elif SCALES == 2:
        G: tl.constexpr = BLOCK_K // SBK
        g = tl.arange(0, G)
        v = tl.load(p_row[None, :] + (k0 // SBK + g)[:, None], mask=mask_rows[None, :] & (k0 + g * SBK < Kdim)[:, None],
                    other=0.0)
    else:
        v = tl.load(p_row[None, :] + (offs_k // SBK)[:, None], mask=mask, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _dequant_groups(w, s, z, BLOCK_K: tl.constexpr, SBK: tl.constexpr, SCALES: tl.constexpr, HAS_Z: tl.constexpr):
    """w [BLOCK_K, BLOCK_N] (float32) times its scales s, less its zeros z first where HAS_Z, (w - z) x s: s and z as
    _group_values reads them. (One exit: code after a `return` under a constexpr `if` is still compiled for the GPU.)"""
    if SCALES == 2:
        w3 = tl.reshape(w, (BLOCK_K // SBK, SBK, w.shape[1]))
        if HAS_Z:
            w3 = w3 - z[:, None, :]
        out = tl.reshape(w3 * s[:, None, :], (BLOCK_K, w.shape[1]))
    elif SCALES == 1:
        if HAS_Z:
            w = w - z[None, :]
        out = w * s[None, :]
    else:
        if HAS_Z:
            w = w - z
        out = w * s
    return out


@triton.jit
def _weight_tile(w_ptr, s_ptr, z_ptr, e, rows, mask_rows, k0, offs_k, mask, stride_we, stride_wn, stride_se,
                 stride_sn, Kdim, dtype, BLOCK_K: tl.constexpr, WQ: tl.constexpr, SBK: tl.constexpr,
                 SCALES: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of expert e's rows `rows` x columns `offs_k` (from k0), as `dtype`: the values the
    dequantized weight holds. WQ 0: the weights as they are; 1: float8 times a scale per row and SBK columns; 2:
    4-bit codes two to a byte (column k in the low nibble of byte k // 2 when k is even), (q - zero) x scale with a
    zero and a scale per row and SBK columns, in float32, rounded once (ops/moe.py dequantize_experts).
    How the per-group values are read (SCALES, chosen on the host by _scale_mode): see _group_values; the gathered
    form (0) costs an index and a load per weight value (slow)."""
    if WQ == 2:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        b = tl.load(w_ptr + e * stride_we + rows[None, :] * stride_wn + offs_b[:, None],
                    mask=mask_rows[None, :] & (offs_b < Kdim // 2)[:, None], other=0)
        b = b.to(tl.int32)
        q = tl.reshape(tl.permute(tl.join(b & 0xF, b >> 4), (0, 2, 1)), (BLOCK_K, b.shape[1]))
        # q as a float without an int-to-float conversion (a slow pipe): the bits of 2^23 + q, less 2^23 (exact)
        q = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        s = _group_values(s_ptr + e * stride_se + rows * stride_sn, mask_rows, k0, offs_k, mask, Kdim, BLOCK_K, SBK,
                          SCALES)
        z = _group_values(z_ptr + e * stride_se + rows * stride_sn, mask_rows, k0, offs_k, mask, Kdim, BLOCK_K, SBK,
                          SCALES)
        w = _dequant_groups(q, s, z, BLOCK_K, SBK, SCALES, True).to(dtype)
    elif WQ == 1:
        w = tl.load(w_ptr + e * stride_we + rows[None, :] * stride_wn + offs_k[:, None], mask=mask, other=0.0)
        s = _group_values(s_ptr + e * stride_se + rows * stride_sn, mask_rows, k0, offs_k, mask, Kdim, BLOCK_K, SBK,
                          SCALES)
        w = _dequant_groups(w.to(tl.float32), s, s, BLOCK_K, SBK, SCALES, False).to(dtype)
    else:
        w = tl.load(w_ptr + e * stride_we + rows[None, :] * stride_wn + offs_k[:, None], mask=mask, other=0.0)
    return w


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, h_ptr, pairs_ptr, block_expert_ptr,
                        num_pairs, top_k, E, N, Kdim,
                        stride_xm, stride_we, stride_wn, stride_hm,
                        s_ptr, z_ptr, stride_se, stride_sn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                        WQ: tl.constexpr = 0, SBK: tl.constexpr = 1, SCALES: tl.constexpr = 0):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows).to(tl.int64)
    valid = (pair < num_pairs) & (expert < E)
    token = tl.where(valid, pair // top_k, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    e = tl.minimum(expert, E - 1)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(expert < E, Kdim, 0)                       # blocks past the used rows: no work
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < Kdim
        a = tl.load(x_ptr + token[:, None] * stride_xm + offs_k[None, :],
                    mask=valid[:, None] & mask_k[None, :], other=0.0)
        mask = mask_n[None, :] & mask_k[:, None]
        wg = _weight_tile(w_ptr, s_ptr, z_ptr, e, offs_n, mask_n, k0, offs_k, mask, stride_we, stride_wn, stride_se,
                          stride_sn, Kdim, a.dtype, BLOCK_K, WQ, SBK, SCALES)
        wu = _weight_tile(w_ptr, s_ptr, z_ptr, e, offs_n + N, mask_n, k0, offs_k, mask, stride_we, stride_wn,
                          stride_se, stride_sn, Kdim, a.dtype, BLOCK_K, WQ, SBK, SCALES)
        acc_g += tl.dot(a, wg, input_precision=PREC)
        acc_u += tl.dot(a, wu, input_precision=PREC)
    # the projections round to the activation dtype (as a linear layer's output does), then silu(gate) * up
    g = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
    h = (g / (1.0 + tl.exp(-g))).to(h_ptr.dtype.element_ty).to(tl.float32) * u
    tl.store(h_ptr + rows[:, None] * stride_hm + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, w_ptr, y_ptr, pairs_ptr, block_expert_ptr, weights_ptr,
                     num_pairs, E, N, Kdim,
                     stride_hm, stride_we, stride_wn, stride_ym,
                     s_ptr, z_ptr, stride_se, stride_sn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                     WQ: tl.constexpr = 0, SBK: tl.constexpr = 1, SCALES: tl.constexpr = 0):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows).to(tl.int64)
    valid = (pair < num_pairs) & (expert < E)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    e = tl.minimum(expert, E - 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(expert < E, Kdim, 0)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < Kdim
        a = tl.load(h_ptr + rows[:, None] * stride_hm + offs_k[None, :],
                    mask=valid[:, None] & mask_k[None, :], other=0.0)
        w = _weight_tile(w_ptr, s_ptr, z_ptr, e, offs_n, mask_n, k0, offs_k, mask_n[None, :] & mask_k[:, None],
                         stride_we, stride_wn, stride_se, stride_sn, Kdim, a.dtype, BLOCK_K, WQ, SBK, SCALES)
        acc += tl.dot(a, w, input_precision=PREC)
    wt = tl.load(weights_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
    y = acc.to(y_ptr.dtype.element_ty).to(tl.float32) * wt[:, None]
    tl.store(y_ptr + tl.where(valid, pair, 0)[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & mask_n[None, :])


# Routing in one launch: softmax over the experts (float32), top-k by repeated max (ties: the lower expert, as a
# stable sort would give), renormalization, and the pairs this rank does not compute routed nowhere (experts outside
# [first_expert, first_expert + num_local), rows of a decode batch without a KV slot). torch took ~10 kernels for
# this (softmax, topk's sort, sum, div, casts, compare, where, fill): 0.9 ms of a 4.8 ms 30B-A3B decode step on an
# H200 at batch 1.
@triton.jit
def _moe_route_kernel(logits_ptr, slots_ptr, weights_ptr, ids_ptr, T, E, stride_l, first_expert, num_local,
                      TOP_K: tl.constexpr, RENORM: tl.constexpr, HAS_SLOTS: tl.constexpr,
                      E_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < T
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + cols[None, :],
                mask=row_ok[:, None] & (cols[None, :] < E), other=0.0).to(tl.float32)
    x = tl.where(cols[None, :] < E, x, float("-inf"))
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    p = tl.where(cols[None, :] < E, p, -1.0)                           # padded columns: never picked
    kcols = tl.arange(0, K_PAD)
    w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        pick = tl.min(tl.where(p == best[:, None], cols[None, :], E_PAD), axis=1)
        w = tl.where(kcols[None, :] == k, best[:, None], w)
        ids = tl.where(kcols[None, :] == k, pick[:, None], ids)
        p = tl.where(cols[None, :] == pick[:, None], -1.0, p)
    if RENORM:
        w = w / tl.sum(w, axis=1)[:, None]                            # columns past TOP_K hold 0
    local = ids - first_expert
    keep = (local >= 0) & (local < num_local)
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + rows, mask=row_ok, other=0)
        keep = keep & (slot >= 0)[:, None]
    out = rows[:, None].to(tl.int64) * TOP_K + kcols[None, :]
    ok = row_ok[:, None] & (kcols[None, :] < TOP_K)
    tl.store(weights_ptr + out, w.to(weights_ptr.dtype.element_ty), mask=ok)
    tl.store(ids_ptr + out, tl.where(keep, local, num_local).to(tl.int64), mask=ok)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool, first_expert: int = 0,
               num_local: int | None = None, padding_slots: torch.Tensor | None = None):
    """ops.moe.route in one Triton launch: (weights [T, K] in the logits' dtype, ids [T, K] int64, local)."""
    T, E = router_logits.shape
    num_local = E if num_local is None else num_local
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    e_pad = triton.next_power_of_2(E)
    block_t = max(1, min(16, 4096 // e_pad))
    slots = padding_slots if padding_slots is not None else ids
    _moe_route_kernel[(triton.cdiv(T, block_t),)](
        logits, slots, weights, ids, T, E, logits.stride(0), first_expert, num_local,
        TOP_K=top_k, RENORM=bool(renormalize), HAS_SLOTS=padding_slots is not None, E_PAD=e_pad,
        K_PAD=triton.next_power_of_2(top_k), BLOCK_T=block_t, num_warps=4)
    return weights, ids


# The alignment (ops.moe.moe_align's exact output) in one launch of E + 1 programs. Each program counts every
# expert's pairs (a histogram of all the ids: the pairs are few, and reading them again is cheaper than a second
# launch), so it knows where each expert's padded group of rows starts; program e < E then writes its own group (its
# pairs in order: a running cumsum over chunks of the ids, then padding rows) and its blocks' expert, and program E the
# rows and blocks past the last group. The programs' rows are disjoint: no ordering between them is needed. The first
# version was one program doing all of it: 5 us at one token, but 50 us at 64 (512 pairs) on an H200.
@triton.jit
def _moe_align_kernel(ids_ptr, pairs_ptr, block_expert_ptr, num_rows_ptr, n, E, P, NB,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    e_idx = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=E)
        counts += tl.histogram(tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32), E_PAD)   # bin E: nowhere
    padded = tl.where(e_idx < E, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, axis=0)
    start = tl.sum(tl.where(e_idx == e, ends - padded, 0))             # program E: the end of the last group
    count = tl.sum(tl.where((e_idx == e) & (e_idx < E), counts, 0))
    stop = tl.where(e < E, tl.sum(tl.where(e_idx == e, ends, 0)), P)    # rows [start, stop) are this program's
    seen = count * 0
    for c0 in range(0, n, BLOCK):                                      # this expert's pairs, in order
        offs = c0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
        hit = ((ids == e) & (e < E)).to(tl.int32)
        tl.store(pairs_ptr + start + seen + tl.cumsum(hit, axis=0) - hit, offs.to(tl.int64), mask=hit > 0)
        seen += tl.sum(hit)
    for r0 in range(start + count, stop, BLOCK):                       # padding rows
        r = r0 + tl.arange(0, BLOCK)
        tl.store(pairs_ptr + r, tl.zeros([BLOCK], dtype=tl.int64) + n, mask=r < stop)
    for b0 in range(start // BLOCK_M, stop // BLOCK_M, BLOCK):         # the blocks' expert (E: unused)
        b = b0 + tl.arange(0, BLOCK)
        tl.store(block_expert_ptr + b, tl.zeros([BLOCK], dtype=tl.int64) + e, mask=b < stop // BLOCK_M)
    if e == E:
        tl.store(num_rows_ptr, start.to(tl.int64))


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """ops.moe.moe_align in one Triton launch (same outputs, exactly)."""
    flat = topk_ids.reshape(-1).contiguous()
    n, E = flat.numel(), num_experts
    P = padded_rows(n, E, block_m)
    NB = P // block_m
    dev = flat.device
    pairs = torch.empty(P, dtype=torch.int64, device=dev)
    block_expert = torch.empty(NB, dtype=torch.int64, device=dev)
    num_rows = torch.empty(1, dtype=torch.int64, device=dev)
    _moe_align_kernel[(E + 1,)](flat, pairs, block_expert, num_rows, n, E, P, NB, BLOCK_M=block_m,
                                E_PAD=triton.next_power_of_2(E + 1), BLOCK=max(16, min(1024, triton.next_power_of_2(n))),
                                num_warps=4)
    return Alignment(pairs, block_expert, num_rows)


# out[t] = sum_k y[t * K + k] over the pairs routed somewhere (rows of pairs routed nowhere were never written): one
# launch instead of a zero fill of y and a reduction.
@triton.jit
def _moe_sum_kernel(y_ptr, ids_ptr, out_ptr, H, E, stride_y, stride_o,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + k)
        acc += tl.load(y_ptr + (t * TOP_K + k) * stride_y + cols, mask=(cols < H) & (e >= 0) & (e < E),
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class MoeConfig:
    """Tiles and launch parameters of the two grouped GEMMs: block_m sorted rows per block (each expert's group is
    padded to a multiple of it), the gate/up GEMM's BLOCK_N (of I) x BLOCK_K (of H) tile (block_n1, block_k1),
    the down GEMM's (of H x of I: block_n2, block_k2), and num_warps / num_stages of both launches. Block sizes
    are powers of two >= 16 (tl.dot's minimum); a tile larger than its dimension is masked (correct, wasted)."""
    block_m: int = 16
    block_n1: int = 64
    block_k1: int = 64
    block_n2: int = 64
    block_k2: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n1", "block_k1", "block_n2", "block_k2"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 16 and _pow2(v)):
                raise ValueError(f"MoeConfig.{name} must be a power of two >= 16, got {v!r}")
        if not (isinstance(self.num_warps, int) and _pow2(self.num_warps)):
            raise ValueError(f"MoeConfig.num_warps must be a power of two, got {self.num_warps!r}")
        if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"MoeConfig.num_stages must be >= 1, got {self.num_stages!r}")


def default_config(T: int, E: int, top_k: int, H: int, I: int) -> MoeConfig:
    """The config for T tokens of top_k of E experts, hidden H and (this rank's) intermediate I, tiles capped by
    the dimensions. From bench/bench_moe.py's sweep on an H200 at a 30B-A3B MoE's shapes (H 2048, I 768, 128
    experts, top-8; bench/results/h200_moe.md): up to 64 tokens 16 rows per block with narrow, deep gate/up tiles
    (32 x 256) was best (4-8% over 64 x 64 tiles); at 512 tokens 64 rows per block, 128 x 64 tiles, 8 warps
    (16% better). The crossover between 64 and 512 tokens was not measured; 128 splits it."""
    del E, top_k
    if T <= 128:
        return MoeConfig(block_m=16, block_n1=_block(I, 32), block_k1=_block(H, 256),
                         block_n2=_block(H, 64), block_k2=_block(I, 128), num_warps=4, num_stages=3)
    return MoeConfig(block_m=64, block_n1=_block(I, 128), block_k1=_block(H, 64),
                     block_n2=_block(H, 128), block_k2=_block(I, 64), num_warps=8, num_stages=3)


def _scale_mode(sbk: int, block_k: int, kdim: int) -> int:
    """How _weight_tile reads the scales of SBK-column groups with BLOCK_K-column tiles (see its doc)."""
    if sbk % block_k == 0 or sbk >= kdim:
        return 1
    if block_k % sbk == 0:
        return 2
    return 0


def _scale_args(scales: tuple | None, x: torch.Tensor, block_k: int, kdim: int) -> tuple:
    """(scale pointer, zero pointer, their expert / row strides) and the constexprs (WQ, SBK, SCALES) of packed
    weights: (scale, bk) float8, (scale, bk, zeros) 4-bit codes; or placeholders."""
    if scales is None:
        return (x, x, 0, 0), {}
    s, bk, z = (*scales, None)[:3]
    bk = int(bk)
    if z is not None and z.stride() != s.stride():
        raise ValueError(f"fused_moe_silu: zeros {tuple(z.shape)} and scales {tuple(s.shape)} of one layout expected")
    return (s, s if z is None else z, s.stride(0), s.stride(1)), dict(WQ=1 if z is None else 2, SBK=bk,
                                                                      SCALES=_scale_mode(bk, block_k, kdim))


def fused_moe_silu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, config: MoeConfig | None = None, mid=None,
                   scales13: tuple | None = None, scales2: tuple | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights / topk_ids [T, K] -> [T, H] (see the module doc).
    `config`: the tiles and launch parameters (None: default_config of the shapes). `mid`: a row-wise map of the
    intermediate [pairs, I] between the two kernels (a quantized checkpoint's activation quantization).
    `scales13` / `scales2`: float8 e4m3 weights' (scale [E, rows, ceil(K / bk)] float32, bk): each weight value is
    read as bf16/fp16/fp32(value x its scale), the dequantized weight's values, so the result is that of the
    dequantized experts bit for bit, with half their bytes read; or 4-bit codes two to a byte (w13 [E, 2I, H / 2],
    w2 [E, H, I / 2] uint8) with (scale, bk, zeros) per row and group of bk columns, read as (q - zero) x scale
    (ops/moe.py dequantize_experts), a quarter of the bytes: the dequantized experts' values, their result bit for
    bit interpreted; on the GPU up to the fp32 summation order (the compiler orders k differently for a tile
    dequantized in registers: one bf16 step at most, tests/gpu/test_gpu_moe.py)."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    K = topk_ids.shape[1]
    cfg = config if config is not None else default_config(T, E, K, H, I)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    scales13 = None if scales13 is None else tuple(t.contiguous() if torch.is_tensor(t) else t for t in scales13)
    scales2 = None if scales2 is None else tuple(t.contiguous() if torch.is_tensor(t) else t for t in scales2)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"      # float32 stays float32 (no TF32 rounding)
    topk_ids = topk_ids.contiguous()
    al = moe_align_triton(topk_ids, E, cfg.block_m)
    P = al.sorted_pairs.numel()
    nb = al.block_expert.numel()
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    s13, wq13 = _scale_args(scales13, x, cfg.block_k1, H)
    _moe_gate_up_kernel[(nb, triton.cdiv(I, cfg.block_n1))](
        x, w13, h, al.sorted_pairs, al.block_expert, T * K, K, E, I, H,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), *s13,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1, PREC=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **wq13)
    if mid is not None:                 # rows are independent: padding rows (zeros) stay zeros, never read
        h = mid(h)
    y = torch.empty(T * K, H, dtype=x.dtype, device=x.device)      # rows of pairs routed nowhere: never read
    weights = topk_weights.reshape(-1).contiguous()
    s2, wq2 = _scale_args(scales2, x, cfg.block_k2, I)
    _moe_down_kernel[(nb, triton.cdiv(H, cfg.block_n2))](
        h, w2, y, al.sorted_pairs, al.block_expert, weights, T * K, E, H, I,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0), *s2,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2, PREC=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **wq2)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T:
        block_h = min(1024, triton.next_power_of_2(H))
        _moe_sum_kernel[(T, triton.cdiv(H, block_h))](y, topk_ids, out, H, E, y.stride(0), out.stride(0),
                                                      TOP_K=K, BLOCK_H=block_h, num_warps=4)
    return out
