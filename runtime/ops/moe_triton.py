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

from xllm_gen.runtime.ops.moe import Alignment, moe_align, padded_rows


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, h_ptr, pairs_ptr, block_expert_ptr,
                        num_pairs, top_k, E, N, Kdim,
                        stride_xm, stride_we, stride_wn, stride_hm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
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
        wg = tl.load(w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
                     mask=mask_n[None, :] & mask_k[:, None], other=0.0)
        wu = tl.load(w_ptr + e * stride_we + (offs_n[None, :] + N) * stride_wn + offs_k[:, None],
                     mask=mask_n[None, :] & mask_k[:, None], other=0.0)
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
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
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
        w = tl.load(w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0)
        acc += tl.dot(a, w, input_precision=PREC)
    wt = tl.load(weights_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
    y = acc.to(y_ptr.dtype.element_ty).to(tl.float32) * wt[:, None]
    tl.store(y_ptr + tl.where(valid, pair, 0)[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & mask_n[None, :])


# One program aligns a small step's (token, slot) pairs: ops.moe.moe_align's ~15 torch kernels (histogram, cumsum,
# stable argsort, scatter, searchsorted) took 53 us of a 95 us MoE layer at one token on an H200; this is one launch.
# Pairs are read in chunks of BLOCK in order; `seen[e]` counts expert e's pairs of earlier chunks, so a pair's row is
# starts[e] + seen[e] + its rank among the chunk's pairs of e (an exclusive cumsum down the [BLOCK, E_PAD] one-hot),
# which keeps tokens in order within an expert (stable, as the torch version). E_PAD holds experts 0..E-1 and "E"
# (nowhere). The padding fill and the scatter are ordered by a barrier (one program, so one thread block).
@triton.jit
def _moe_align_kernel(ids_ptr, pairs_ptr, block_expert_ptr, num_rows_ptr, n, E, P, NB,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    e_idx = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int32)
        ids = tl.where((ids >= 0) & (ids < E), ids, E)
        ids = tl.where(offs < n, ids, E_PAD)                          # past the end: no column
        counts += tl.sum((ids[:, None] == e_idx[None, :]).to(tl.int32), axis=0)
    padded = tl.where(e_idx < E, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    for p0 in range(0, P, BLOCK):                                     # every row a padding row first
        offs = p0 + tl.arange(0, BLOCK)
        tl.store(pairs_ptr + offs, tl.zeros([BLOCK], dtype=tl.int64) + n, mask=offs < P)
    tl.debug_barrier()
    seen = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int32)
        ids = tl.where((ids >= 0) & (ids < E), ids, E)
        ids = tl.where(offs < n, ids, E_PAD)
        onehot = (ids[:, None] == e_idx[None, :]).to(tl.int32)        # [BLOCK, E_PAD]
        rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
        base = tl.sum((starts + seen)[None, :] * onehot, axis=1)
        tl.store(pairs_ptr + base + rank, offs.to(tl.int64), mask=(offs < n) & (ids < E))
        seen += tl.sum(onehot, axis=0)
    end_rows = tl.where(e_idx < E, ends, 2147483647)                 # searchsorted(ends[:E], block start, right)
    for b0 in range(0, NB, BLOCK):
        blocks = b0 + tl.arange(0, BLOCK)
        start = blocks * BLOCK_M
        expert = tl.sum((end_rows[None, :] <= start[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, expert.to(tl.int64), mask=blocks < NB)
    tl.store(num_rows_ptr + e_idx * 0, tl.max(tl.where(e_idx < E, ends, 0), axis=0).to(tl.int64), mask=e_idx == 0)


TRITON_ALIGN_MAX_PAIRS = 2048   # one program (one SM) aligns up to this many pairs (decode sizes); larger steps: torch path


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """ops.moe.moe_align in one Triton program (same outputs, exactly): for decode-sized steps."""
    flat = topk_ids.reshape(-1).contiguous()
    n, E = flat.numel(), num_experts
    P = padded_rows(n, E, block_m)
    NB = P // block_m
    dev = flat.device
    pairs = torch.empty(P, dtype=torch.int64, device=dev)
    block_expert = torch.empty(NB, dtype=torch.int64, device=dev)
    num_rows = torch.empty(1, dtype=torch.int64, device=dev)
    e_pad = triton.next_power_of_2(E + 1)
    block = max(16, min(256, 8192 // e_pad))
    _moe_align_kernel[(1,)](flat, pairs, block_expert, num_rows, n, E, P, NB,
                            BLOCK_M=block_m, E_PAD=e_pad, BLOCK=block, num_warps=4)
    return Alignment(pairs, block_expert, num_rows)


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


def fused_moe_silu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, config: MoeConfig | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights / topk_ids [T, K] -> [T, H] (see the module doc).
    `config`: the tiles and launch parameters (None: default_config of the shapes)."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    K = topk_ids.shape[1]
    cfg = config if config is not None else default_config(T, E, K, H, I)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"      # float32 stays float32 (no TF32 rounding)
    al = (moe_align_triton(topk_ids, E, cfg.block_m) if topk_ids.numel() <= TRITON_ALIGN_MAX_PAIRS
          else moe_align(topk_ids, E, cfg.block_m))
    P = al.sorted_pairs.numel()
    nb = al.block_expert.numel()
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(nb, triton.cdiv(I, cfg.block_n1))](
        x, w13, h, al.sorted_pairs, al.block_expert, T * K, K, E, I, H,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1, PREC=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    y = torch.zeros(T * K, H, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _moe_down_kernel[(nb, triton.cdiv(H, cfg.block_n2))](
        h, w2, y, al.sorted_pairs, al.block_expert, weights, T * K, E, H, I,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2, PREC=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.view(T, K, H).sum(dim=1)
