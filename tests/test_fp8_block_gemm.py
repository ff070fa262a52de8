"""Which float8 layers' prefill GEMMs the block-scaled float8 GEMM takes, and the scales it is handed
(runtime/ops/fp8_block_gemm.py; its results are checked on the GPU, tests/gpu/test_gpu_quant.py).

kernel_scales must give, for every 128-column tile t of every row n, exactly the scale the layer's dequantized
weight uses there (layers/quant_linear.py PackedFp8: one per row and block_cols columns), in the kernel's 128 x 128
block form; and nothing where the kernel cannot be right."""
from __future__ import annotations

import pytest
import torch


def _expanded(scale, block_cols, N, K):
    return scale.repeat_interleave(block_cols, 1)[:, :K]            # the layer's scale of every weight element


def _kernel_expanded(ks, N, K):
    return ks.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]


@pytest.mark.parametrize("N,K,block_cols", [
    (256, 512, 128),            # the *-FP8 releases: 128 x 128 blocks, held per row
    (192, 512, 256),            # a scale per 128 rows and 256 columns, N not a multiple of 128
    (128, 384, 384),            # one scale per 128 rows for all columns
])
def test_kernel_scales_are_the_layers(N, K, block_cols):
    from xllm_gen.runtime.ops.fp8_block_gemm import kernel_scales
    g = torch.Generator().manual_seed(0)
    scale = torch.rand(-(-N // 128), -(-K // block_cols), generator=g).repeat_interleave(128, 0)[:N]
    ks = kernel_scales(scale, block_cols, N, K)
    assert ks is not None and ks.dtype == torch.float32 and ks.shape == (-(-N // 128), K // 128)
    assert torch.equal(_kernel_expanded(ks, N, K), _expanded(scale, block_cols, N, K))


@pytest.mark.parametrize("N,K,block_cols,shared_rows", [(256, 500, 500, True), (100, 512, 128, True),
                                                        (256, 512, 64, True), (256, 512, 128, False),
                                                        (128, 512, 512, False)])
def test_kernel_scales_refuse_what_the_kernel_cannot_take(N, K, block_cols, shared_rows):
    """K not a multiple of 128, N not of 64, a scale that changes inside a 128-column tile, or inside 128 rows
    (per row and 128 columns; per channel)."""
    from xllm_gen.runtime.ops.fp8_block_gemm import kernel_scales
    nb = -(-K // block_cols)
    scale = torch.rand(-(-N // 128), nb).repeat_interleave(128, 0)[:N] if shared_rows else torch.rand(N, nb)
    assert kernel_scales(scale, block_cols, N, K) is None


def test_takes_only_per_token_group_128_inputs():
    """The kernel quantizes its input per token and 128 columns: a layer whose input quantization is anything else
    (per token, per tensor, static, groups of 64, none: online fp8 is weight-only) keeps dequantize + cuBLAS; so
    does every CPU tensor (the tests' reference path)."""
    from xllm_gen.runtime.layers.quant import ActQuant
    from xllm_gen.runtime.ops import fp8_block_gemm as B
    x = torch.zeros(128, 256, dtype=torch.bfloat16)
    ks = torch.ones(2, 2)
    for aq in (None, ActQuant("token"), ActQuant("tensor"), ActQuant("static", scale=0.5), ActQuant("group", 64),
               ActQuant("group", 128)):
        assert not B.takes(aq, x, ks)          # CPU
    assert not B.takes(ActQuant("group", 128), x, None)


def test_decode_batches_take_the_kernel_from_decode_min_m_rows(monkeypatch):
    """A decode batch (at most GEMV_MAX_M rows) of a layer the kernel takes runs it from DECODE_MIN_M rows; one row
    keeps the float8-streaming GEMV (faster there), and so does any batch when XLLM_QUANT_GEMV forces a GEMV."""
    from xllm_gen.runtime.ops import fp8_block_gemm as B
    from xllm_gen.runtime.ops import quant_gemv as Q
    monkeypatch.setattr(B, "takes", lambda aq, x, ks: True)          # as on an sm 9.0 GPU with flashinfer
    assert not B.takes_decode(None, torch.zeros(1, 256), None)
    assert all(B.takes_decode(None, torch.zeros(m, 256), None) for m in range(B.DECODE_MIN_M, Q.GEMV_MAX_M + 1))
    monkeypatch.setattr(Q, "QUANT_GEMV_MODE", "fma")
    assert not B.takes_decode(None, torch.zeros(16, 256), None)
    monkeypatch.setattr(Q, "QUANT_GEMV_MODE", "auto")
    monkeypatch.setattr(B, "takes", lambda aq, x, ks: False)
    assert not B.takes_decode(None, torch.zeros(16, 256), None)
