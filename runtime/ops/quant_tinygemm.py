"""int4 decode GEMM through torch's tinygemm kernel (aten._weight_int4pack_mm: gpt-fast's and torchao's int4
weight-only path), for 1-4 rows of bf16 activations on CUDA.

Measured on an H200 at an 8B model's decode shapes (bench/results/h200_quant_int4.md, bench/bench_quant.py
--only int4): at M = 1 it takes 0.53-0.62x the time of bf16 cuBLAS (qkv 6144 x 4096: 9.8 us against 15.8; the
project's split-K GEMV 12.9, the tensor-core tile 24.8), at M = 4 0.69-0.87x; at M = 16 it is 2x cuBLAS and
past that far slower, so quant_gemv.gemv_choice takes it only for few rows (or where start-up measurement says so).

tinygemm holds its own layout: the codes packed by aten._convert_weight_to_int4pack, and one [K / g, N, 2] bf16
tensor of (scale, zero) with w = (q - 8) * scale + zero. An AWQ / GPTQ weight (q - z) * s maps exactly onto it with
zero = (8 - z) * s; both are rounded to bf16 (fp16 checkpoint scales lose 3 mantissa bits: the rounding a bf16
copy of the weight has anyway). A layer keeps this layout beside its own (quant_linear.PackedInt4): the other
kernels serve 5+ rows and the prefill's dequantize. XLLM_INT4_TINYGEMM=0 leaves it out (half the int4 memory).
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

logger = logging.getLogger("xllm_gen")
ENABLED = os.environ.get("XLLM_INT4_TINYGEMM", "1").strip() != "0"
INNER_K_TILES = 8
GROUPS = (32, 64, 128, 256)            # the group sizes the kernel is built for


def supported(N: int, K: int, group: int, device) -> bool:
    """Whether this torch has the kernel for this device and shape (N a multiple of 8, K of 16 x inner k-tiles)."""
    return (ENABLED and torch.device(device).type == "cuda" and hasattr(torch.ops.aten, "_weight_int4pack_mm")
            and group in GROUPS and N % 8 == 0 and K % (16 * INNER_K_TILES) == 0 and K % group == 0
            and torch.cuda.get_device_capability(device) >= (8, 0))


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> Optional[tuple]:
    """codes uint8 [N, K] (0..15), scales [N, K / g], zeros [N, K / g] (w = (q - z) * s) -> (packed weight,
    scale-and-zero [K / g, N, 2] bf16), or None where the kernel is not available (logged)."""
    N, K = codes.shape
    if not supported(N, K, group, codes.device):
        return None
    try:
        c = codes.to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack((c[:, ::2] << 4 | c[:, 1::2]).contiguous(), INNER_K_TILES)
        return packed, scale_and_zero(scales, zeros)
    except Exception as e:  # noqa: BLE001 - keep the project's kernels, say why
        logger.warning("int4 tinygemm layout not built for N %d K %d group %d (%s: %s): split-K / tensor-core "
                       "kernels only", N, K, group, type(e).__name__, str(e)[:200])
        return None


def scale_and_zero(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[N, K / g] scales and integer zero points -> tinygemm's [K / g, N, 2] bf16 (scale, (8 - z) * scale)."""
    zero = (8 - zeros.float()) * scales.float()
    return torch.stack([scales.to(torch.bfloat16), zero.to(torch.bfloat16)], dim=-1).transpose(0, 1).contiguous()


def dequant_reference(codes: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """What tinygemm computes with: w = (q - 8) * scale + zero, per group of columns (float32; tests)."""
    s = sz[..., 0].t().float().repeat_interleave(group, 1)
    z = sz[..., 1].t().float().repeat_interleave(group, 1)
    return (codes.float() - 8) * s + z


def gemm(x: torch.Tensor, layout: tuple, group: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] bf16 @ W^T (+ bias) with W in tinygemm's layout (`pack`)."""
    y = torch.ops.aten._weight_int4pack_mm(x, layout[0], group, layout[1])
    return y if bias is None else y + bias
