"""Prefill GEMMs of float8 layers on the float8 tensor cores: FlashInfer's block-scaled GEMM for Hopper.

The reference semantics (layers/quant.py) quantize a layer's input per token and 128 columns (ActQuant "group",
the official *-FP8 releases' activations) and hold the weight dequantized. Below GEMV_MAX_M rows the weight-only
GEMVs (quant_gemv.py) read the float8 weight; above, a prefill chunk used to dequantize the whole weight to bf16
for cuBLAS: a full weight written and read again per chunk, then a bf16 GEMM. Here, instead, FlashInfer's
`fp8_blockscale_gemm_sm90` (DeepGEMM's kernel, sm 9.0): it quantizes the bf16 input per token and 128 columns
itself and multiplies float8 by float8 with a scale per 128-column tile on each side. FlashInfer builds it on first
use (about a minute, once per host: kept in its cache folder); with CUDA graphs that first use is a bucket's
warm-up run at engine start (executor/prefill_graphs.py), never a capture or a request.

The input it gets already went through ActQuant's round trip (fused into the norm before the layer: bf16(q * s)),
so its own quantization finds the same codes (bf16 moves a value by at most 2^-9 of itself, an e4m3 step is 2^-3)
and the scale within a bf16 ulp. The product then skips the reference's bf16 rounding of q * s on either side:
the same quantized operands, as close to their exact product as the reference layer is up to bf16 rounding (on the
H200 4-6e-3 of the output's max against the reference's 3-4e-3), not bit-identical (tests/gpu/test_gpu_quant.py
bounds both).

Measured on an H100 at an 8B model's shapes (bench/bench_fp8_prefill.py, bench/results/h100_2026-12-05_session26.md):
0.65-0.89x the time of bf16 cuBLAS, where dequantize + cuBLAS took 1.05-1.79x. A Triton block-scaled GEMM (tl.dot
of float8 tiles, each 128-column partial product scaled before it is added) was measured too: 1.2-1.4x the time of
bf16 cuBLAS at its best launch config (the per-tile scaling waits on each wgmma), so it was not kept.

Taken for: bf16 activations on sm 9.0 with flashinfer installed; a layer whose input quantization is per token and
128 columns; K a multiple of 128 and N of 64 (the kernel's); a weight scale constant over each 128 x 128 block.
Anything else keeps dequantize + cuBLAS; XLLM_FP8_PREFILL=dequant keeps it everywhere (a benchmark's baseline).

Decode batches of DECODE_MIN_M rows or more take it as well (`takes_decode`): below 64 rows the weight-only GEMVs'
tensor-core tile dequantizes every element and falls behind (measured below DECODE_MIN_M's definition); a single
row keeps the float8-streaming GEMV, which reads the weight faster than this kernel at one row.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional

import torch

from xllm_gen.runtime.ops import quant_gemv

TILE = 128          # input columns per activation scale, and the kernel's K tile
# Decode batches from this many rows take the kernel too (XLLM_QUANT_GEMV=auto). H100, an 8B model's four shapes
# (bench/bench_quant.py --only "fp8 block128", bench/results/h100_2026-12-06_session27.md): at 4 / 16 / 64 rows it
# takes 0.53-0.69 / 0.54-0.68 / 0.55-0.78x the time of bf16 cuBLAS, where the weight-only GEMVs' best took 0.56-0.87
# / 0.57-0.88 / 1.8-1.9x (the tensor-core tile dequantizing every element); at one row the float8-streaming FMA
# GEMV stays ahead (0.49-0.51x against the kernel's 0.53-0.68x)
DECODE_MIN_M = 2
PREFILL_MODE = os.environ.get("XLLM_FP8_PREFILL", "block").strip().lower() or "block"
if PREFILL_MODE not in ("block", "dequant"):
    raise ValueError(f"XLLM_FP8_PREFILL={PREFILL_MODE!r}: 'block' or 'dequant'")


@functools.lru_cache(maxsize=None)
def _device_has_kernel(index: int) -> bool:
    return (torch.cuda.get_device_capability(index) == (9, 0)
            and importlib.util.find_spec("flashinfer") is not None)


def kernel_scales(scale: torch.Tensor, block_cols: int, N: int, K: int) -> Optional[torch.Tensor]:
    """A float8 layer's scale [N, ceil(K / block_cols)] (one per row and block_cols columns) in the kernel's form,
    one per 128 x 128 block [ceil(N / 128), K / 128], where every 128 rows share their scales (the *-FP8
    releases); None where the kernel cannot take the layer: K not a multiple of 128, N not of 64, a scale that
    changes inside a 128 x 128 block (per channel: those checkpoints quantize their inputs per token anyway).
    The kernel's other documented form, per row and 128 columns, gave wrong products on an H100 (flashinfer
    0.6.14: 0.6 of the output's max off; tests/gpu/test_gpu_quant.py), so it is not used."""
    if K % TILE or N % 64 or (block_cols % TILE and block_cols < K):
        return None
    cols = (torch.arange(K // TILE, device=scale.device) * TILE) // block_cols      # tile t's scale column
    per_row = scale[:, cols].float()
    per_block = per_row[::TILE].contiguous()
    return per_block if torch.equal(per_block.repeat_interleave(TILE, 0)[:N], per_row) else None


def takes(act_quant, x: torch.Tensor, kernel_scale: Optional[torch.Tensor]) -> bool:
    """Whether this call runs the block-scaled GEMM (see the module docstring)."""
    return (PREFILL_MODE == "block" and kernel_scale is not None and x.dtype == torch.bfloat16 and x.is_cuda
            and act_quant is not None and act_quant.kind == "group" and act_quant.group == TILE
            and _device_has_kernel(x.device.index if x.device.index is not None else torch.cuda.current_device()))


def takes_decode(act_quant, x: torch.Tensor, kernel_scale: Optional[torch.Tensor]) -> bool:
    """Whether a decode batch of x's rows (at most the GEMVs' GEMV_MAX_M) runs the block-scaled GEMM instead of a
    weight-only GEMV: from DECODE_MIN_M rows, where `takes`, unless XLLM_QUANT_GEMV forces a GEMV kernel."""
    return x.shape[0] >= DECODE_MIN_M and quant_gemv.QUANT_GEMV_MODE == "auto" and takes(act_quant, x, kernel_scale)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, kernel_scale: torch.Tensor,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] bf16 (quantized per token and 128 columns inside) @ (weight float8 [N, K] * scale)^T (+ bias)."""
    from flashinfer.gemm import fp8_blockscale_gemm_sm90
    y = fp8_blockscale_gemm_sm90(x.contiguous(), weight, None, kernel_scale, out_dtype=torch.bfloat16)
    return y.add_(bias) if bias is not None else y
