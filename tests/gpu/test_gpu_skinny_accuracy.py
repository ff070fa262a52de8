"""Accuracy of every skinny-GEMM launch config the decode tuning may pick (marker `gpu`; skipped without CUDA).

tune_decode_gemms keeps whichever candidate is fastest, so each candidate must be as accurate as cuBLAS: for
rows 1 ... 64 and small / 0.6B-model shapes, every config of skinny_gemm_candidates (FMA, <= 8 rows) and
skinny_mma_candidates (tensor cores, split-K, 9 ... 64 rows) against a float64 product of the same bf16 inputs,
with an error bound of 2x cuBLAS's own error on the same inputs (plus one bf16 ulp of the output's scale)."""
from __future__ import annotations

import pytest
import torch
from fixtures.report import report as _report

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = [(1024, 256), (256, 512), (512, 256), (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
ROWS = [1, 2, 3, 8, 9, 16, 17, 24, 31, 33, 48, 64]


@pytest.mark.parametrize("N,K", SHAPES)
def test_every_skinny_config_as_accurate_as_cublas(N, K):
    from xllm_gen.runtime.ops.skinny_fma import SKINNY_MAX_M, skinny_gemm, skinny_gemm_candidates
    from xllm_gen.runtime.ops.skinny_mma import skinny_mma_candidates
    g = torch.Generator(device="cuda").manual_seed(N * 7 + K)
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.05).bfloat16()
    bad, worst = [], 0.0
    for M in ROWS:
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        ref = x.double() @ w.double().T
        scale = ref.abs().max().item()
        err_cublas = (torch.nn.functional.linear(x, w).double() - ref).abs().max().item()
        cfgs = skinny_gemm_candidates(M, N, K, 2) if M <= SKINNY_MAX_M else skinny_mma_candidates(M, N, K)
        for cfg in cfgs:
            for rep in range(3):                # the split-K reduction's ordering is checked by repetition
                err = (skinny_gemm(x, w, None, config=cfg).double() - ref).abs().max().item()
                worst = max(worst, err / scale)
                if err > 2 * err_cublas + scale * 2 ** -8:
                    bad.append((M, cfg, rep, err, err_cublas))
    _report(test="skinny_accuracy", N=N, K=K, worst_rel=worst, bad=bad[:5])
    assert not bad, f"N={N} K={K}: configs less accurate than cuBLAS: {bad[:5]}"
