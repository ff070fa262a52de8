"""Packed low-precision weights of a linear layer (runtime/layers/linear.py `_Linear.packed`), set at load.

On CUDA a quantized checkpoint's 4-bit (AWQ / GPTQ) or fp8 layer keeps its weights packed, with no dequantized copy:
`PackedInt4` (qweight int32 [N, K / 8], scales [N, K / g], zeros uint8 [N, K / g]) and `PackedFp8` (float8_e4m3fn
[N, K], float32 scales [N, ceil(K / bk)], one per row and bk columns). Their forward is the weight-only GEMM of
runtime/ops/quant_gemv.py (bf16 / fp16 activations on CUDA, up to GEMV_MAX_M rows: decode; more rows, a prefill
chunk: the weight dequantized for the call, then cuBLAS), or, on the CPU (tests), F.linear on the dequantized
weight: the same values the reference layer holds (dequant_int4 / dequant_fp8 round (q - z) * s and
q * s once to the activation dtype), so a packed model on the CPU must give the reference model's tokens.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.ops import quant_gemv as Q

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


class PackedInt4(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.group = int(group)
        self.out_features, self.in_features = qweight.shape[0], qweight.shape[1] * 8

    def dequantized(self, dtype) -> torch.Tensor:
        return Q.dequant_int4(self.qweight, self.scales, self.zeros, self.group, dtype)

    def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.is_cuda and x.dtype in _KERNEL_DTYPES and x.numel() <= Q.GEMV_MAX_M * self.in_features:
            x2 = x.reshape(-1, self.in_features)
            y = Q.int4_gemm(x2, self.qweight, self.scales, self.zeros, self.group, bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantized(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"int4, N={self.out_features}, K={self.in_features}, group={self.group}"


class PackedFp8(nn.Module):
    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block_cols: int):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.block = (1, int(block_cols))
        self.out_features, self.in_features = weight.shape

    def dequantized(self, dtype) -> torch.Tensor:
        return Q.dequant_fp8(self.weight, self.scale, self.block, dtype)

    def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.is_cuda and x.dtype in _KERNEL_DTYPES and x.numel() <= Q.GEMV_MAX_M * self.in_features:
            x2 = x.reshape(-1, self.in_features)
            y = Q.fp8_gemm(x2, self.weight, self.scale, self.block, bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantized(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"fp8 e4m3, N={self.out_features}, K={self.in_features}, scale per row and {self.block[1]} columns"


def pack_fp8_components(codes: torch.Tensor, scales: torch.Tensor) -> Optional[tuple]:
    """This rank's [N, K] fp8 values and per-element scales (float32) -> (float8 weight, scales [N, ceil(K / bk)],
    bk), bk the widest of 128-multiples / K over which every row's scale is constant from column 0; None if none
    (a TP split that cuts a scale block: the layer keeps its dequantized weight)."""
    N, K = codes.shape
    for bk in (K,) + tuple(b for b in (512, 256, 128) if b < K):
        s = scales[:, ::bk]
        if torch.equal(scales, s.repeat_interleave(bk, 1)[:, :K]):
            return codes.to(torch.float8_e4m3fn), s.contiguous(), bk
    return None
