"""The tensor-core weight-only GEMM (runtime/ops/quant_gemv.py, kernel="mma"; the split-K GEMV:
tests/test_quant_splitk.py) under the Triton interpreter (CPU), against F.linear on the dequantized weight. The int4
weights are packed here with explicit bit loops (independent of quant_gemv.pack_int4); fp8 weights are float8_e4m3fn
with block / channel / tensor scales.

Cases: M 1, 3, 5 and 17 (two row blocks); a K tail (masked tile); groups / blocks that tile K (int4: K/8 a multiple
of the group: codes through tl.dot, scales and zeros on the partial sums) and narrower ones (dequantized per
element); bias. Sensitivity: the nibbles read in the wrong order, or the zeros off by one, are far from the reference.
float32 and float16 (the interpreter's bfloat16 dot is wrong on CPU; bfloat16 runs in tests/gpu/test_gpu_quant.py).
"""
from __future__ import annotations

import json
import sys

import pytest
import torch
from interpreted import run_interpreted


def pack_bits(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 -> int32 [N, K / 8]: column j K/8 + w in bits 4j..4j+3 of word w (bit by bit)."""
    N, K = codes.shape
    out = torch.zeros(N, K // 8, dtype=torch.int64)
    for j in range(8):
        c = codes[:, j * (K // 8):(j + 1) * (K // 8)].to(torch.int64)
        for bit in range(4):
            out |= ((c >> bit) & 1) << (4 * j + bit)
    out[out >= 2**31] -= 2**32
    return out.to(torch.int32)


def _checks() -> dict:
    import torch.nn.functional as F

    from xllm_gen.runtime.ops import quant_gemv as Q
    g = torch.Generator().manual_seed(0)
    out = {}

    def err(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

    for dt, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        n = str(dt).split(".")[-1]
        for M in (1, 3, 5, 17):
            for N, K, grp in ((40, 256, 128), (24, 192, 32), (16, 96, 96), (24, 1024, 128), (16, 512, 64)):
                codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
                qw = pack_bits(codes)
                s = (torch.rand(N, K // grp, generator=g) * 0.1 + 0.01).to(torch.float16)
                z = torch.randint(0, 16, (N, K // grp), generator=g, dtype=torch.uint8)
                x = torch.randn(M, K + 8, generator=g).to(dt)[:, :K]          # strided rows
                b = torch.randn(N, generator=g).to(dt)
                w = ((codes.float() - z.float().repeat_interleave(grp, 1)) * s.float().repeat_interleave(grp, 1))
                ref = F.linear(x, w.to(dt), b)
                key = f"int4_M{M}_N{N}_K{K}_g{grp}_{n}"
                out[key] = (err(Q.int4_gemm(x, qw, s, z, grp, b, kernel="mma"), ref), tol)
                if M == 1:      # the prefill path's dequantize kernel: bit for bit the reference
                    out[f"dequant_{key}"] = (float(not torch.equal(Q.int4_dequantize(qw, s, z, grp, dt), w.to(dt))), 0.0)
                if M == 1 and dt == torch.float32:
                    out[f"packer_{key}"] = (float(not torch.equal(Q.pack_int4(codes), qw)), 0.0)
                    order = [0, 2, 4, 6, 1, 3, 5, 7]     # nibbles in AWQ's interleaved order: must be far off
                    swapped = pack_bits(codes.reshape(N, 8, K // 8)[:, order].reshape(N, K))
                    out[f"sensitive_order_{key}"] = (-err(Q.int4_gemm(x, swapped, s, z, grp, b, kernel="mma"), ref), -0.05)
                    out[f"sensitive_zero_{key}"] = (-err(Q.int4_gemm(x, qw, s, z + 1, grp, b, kernel="mma"), ref), -1e-3)
            for N, K, blk in ((48, 256, (16, 128)), (40, 192, (1, 192)), (33, 160, (33, 160)), (64, 384, (32, 32))):
                w8 = (torch.randn(N, K, generator=g) * 3).to(torch.float8_e4m3fn)
                sc = torch.rand(-(-N // blk[0]), -(-K // blk[1]), generator=g) + 0.1
                x = torch.randn(M, K, generator=g).to(dt)
                b = torch.randn(N, generator=g).to(dt)
                wd = w8.float() * sc.repeat_interleave(blk[0], 0)[:N].repeat_interleave(blk[1], 1)[:, :K]
                ref = F.linear(x, wd.to(dt), b)
                key = f"fp8_M{M}_N{N}_K{K}_b{blk[0]}x{blk[1]}_{n}"
                out[key] = (err(Q.fp8_gemm(x, w8, sc, blk, b, kernel="mma"), ref), tol)
                if M == 1:
                    out[f"dequant_{key}"] = (float(not torch.equal(Q.fp8_dequantize(w8, sc, blk, dt), wd.to(dt))), 0.0)
                if M == 1 and dt == torch.float32 and blk == (16, 128):
                    out[f"sensitive_scale_{key}"] = (-err(Q.fp8_gemm(x, w8, torch.ones_like(sc) * sc.mean(), blk, b, kernel="mma"),
                                                          ref), -0.05)
    return out


if __name__ == "__main__" and "--interpret" in sys.argv:
    print("RESULT " + json.dumps(_checks()))
    sys.exit(0)


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", ["int4", "fp8", "dequant", "packer", "sensitive_order", "sensitive_zero",
                                  "sensitive_scale"])
def test_quant_gemm_interpreted_vs_dequantized_reference(interpreted, case):
    got = {k: v for k, v in interpreted.items() if k.startswith(case + "_")}
    assert got, interpreted.keys()
    for name, (e, tol) in got.items():
        assert e <= tol, f"{name}: {abs(e)} {'>' if tol >= 0 else '<'} {abs(tol)}"


def test_quant_gemm_refuses_misfit_shapes():
    from xllm_gen.runtime.ops import quant_gemv as Q
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="int4_gemm"):
        Q.int4_gemm(x, torch.zeros(8, 4, dtype=torch.int32), torch.ones(8, 1), torch.zeros(8, 1, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="fp8_gemm"):
        Q.fp8_gemm(x, torch.zeros(8, 64).to(torch.float8_e4m3fn), torch.ones(2, 2), (128, 128))
