"""Triton fused mixture-of-experts: the (token, slot) pairs aligned by expert (ops.moe.moe_align), then two
grouped GEMMs over blocks of BLOCK_M sorted rows, each block one expert's:

  1. h[row] = silu(x[token] @ w13[e, :I].T) * (x[token] @ w13[e, I:].T)     (SiLU-and-mul fused in the epilogue)
  2. y[pair] = weight[pair] * (h[row] @ w2[e].T)                             (routing weight fused)

and out[t] = sum_k y[t * K + k]. Shapes are static for a given number of tokens (padded rows and blocks past
the used ones do no work: their loop bound is 0), nothing is read on the host: capturable in a CUDA graph.
Pairs routed nowhere (ids outside 0..E-1: padding rows, other ranks' experts) contribute zero. The launcher
accepts CPU tensors under TRITON_INTERPRET=1 (tests compare it with ops.moe.fused_moe_reference).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops.moe import moe_align


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


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def fused_moe_silu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, block_m: int = 16) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights / topk_ids [T, K] -> [T, H] (see the module doc)."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    K = topk_ids.shape[1]
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"      # float32 stays float32 (no TF32 rounding)
    al = moe_align(topk_ids, E, block_m)
    P = al.sorted_pairs.numel()
    nb = al.block_expert.numel()
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    bn1, bk1 = _block(I, 64), _block(H, 64)
    _moe_gate_up_kernel[(nb, triton.cdiv(I, bn1))](
        x, w13, h, al.sorted_pairs, al.block_expert, T * K, K, E, I, H,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn1, BLOCK_K=bk1, PREC=prec)
    y = torch.zeros(T * K, H, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    bn2, bk2 = _block(H, 64), _block(I, 64)
    _moe_down_kernel[(nb, triton.cdiv(H, bn2))](
        h, w2, y, al.sorted_pairs, al.block_expert, weights, T * K, E, H, I,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn2, BLOCK_K=bk2, PREC=prec)
    return y.view(T, K, H).sum(dim=1)
