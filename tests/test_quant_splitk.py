"""The split-K weight-only GEMV (runtime/ops/quant_splitk.py) under the Triton interpreter (CPU), against F.linear on
the dequantized weight, and the dispatch between it and the tensor-core kernel (quant_gemv.gemv_choice).

Weight forms: int4 with AWQ-style zero points (any code) and GPTQ symmetric ones (zero 8), groups 32 / 64 / 128 and
one group a row, a K tail (K / 8 not a multiple of the tile); fp8 e4m3 with 128 x 128-style blocks, per channel,
per tensor, and 32 x 32 blocks (scales gathered per element). M = 1..4 and 8, odd N, bias; the table's launch
config, one without split (direct store), and both reductions of the splits (serial counters, two passes).
Tolerance: the reference rounds each dequantized element once to the activation dtype and sums in another order;
this kernel sums exact products in fp32: float32 activations agree to ~1e-7 relative (1e-5 allowed: K <= 1024
terms of eps 6e-8), float16 to the fp16 rounding of the weight and output (2e-3, as tests/test_quant_kernels.py).
Sensitivity: a zero off by one, a wrong scale or AWQ's interleaved nibble order are far from the reference.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch


def _checks(full: bool = True) -> dict:
    """full (--runslow): also 8 rows and float16 activations (the default run: float32 at 1 and 3 rows)."""
    import torch.nn.functional as F

    from xllm_gen.runtime.ops import quant_gemv as Q
    from xllm_gen.runtime.ops import quant_splitk as S
    g = torch.Generator().manual_seed(0)
    out = {}

    def err(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

    locks = torch.zeros(64, dtype=torch.int32)
    split_cfg, whole = (64, 16, 32, 1), lambda kw: (64, 16, triton_pow2(kw), 1)     # (BLOCK_N, BLOCK_K, CHUNK, warps)
    int4_cases = [(40, 1024, 128, "awq"), (24, 512, 64, "gptq"), (33, 256, 32, "awq"), (16, 96, 96, "awq"),
                  (20, 320, 64, "awq")]
    fp8_cases = [(48, 512, (16, 128)), (41, 384, (1, 384)), (33, 160, (33, 160)), (64, 384, (32, 32))]
    for dt, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3))[:2 if full else 1]:
        n = str(dt).split(".")[-1]
        for M in ((1, 3, 8)[:3 if full else 2] if dt == torch.float32 else (1,)):
            for N, K, grp, form in (int4_cases if M == 1 and dt == torch.float32 else
                                    int4_cases[1:3] if M == 3 else int4_cases[1:2]):
                codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
                qw = Q.pack_int4(codes)
                s = (torch.rand(N, K // grp, generator=g) * 0.1 + 0.01).to(torch.float16)
                z = (torch.randint(0, 16, (N, K // grp), generator=g, dtype=torch.uint8) if form == "awq"
                     else torch.full((N, K // grp), 8, dtype=torch.uint8))
                x = torch.randn(M, K + 8, generator=g).to(dt)[:, :K]          # strided rows
                b = torch.randn(N, generator=g).to(dt)
                ref = F.linear(x, Q.dequant_int4(qw, s, z, grp, torch.float32).to(dt), b)
                key = f"int4_M{M}_N{N}_K{K}_g{grp}_{form}_{n}"
                # split K, the serial reduction (scales per chunk where the group allows, else gathered)
                out[key] = (err(Q.int4_gemm(x, qw, s, z, grp, b, split_cfg, "splitk", locks), ref), tol)
                # one program over K (direct store; scales gathered per element unless one group a row)
                one = S.splitk_gemv(x, qw, s, z, b, N, K, 1, grp, True, whole(K // 8))
                out[f"int4whole_{key}"] = (err(one, ref), tol)
                if dt == torch.float32 and M in (1, 3) and K == 512:
                    table = S.splitk_config(M, N, K, True, grp, sms=4)        # the launch table's own config
                    out[f"int4table_{key}"] = (err(Q.int4_gemm(x, qw, s, z, grp, b, table, "splitk"), ref), tol)
                    two = S.splitk_gemv(x, qw, s, z, b, N, K, 1, grp, True, split_cfg, reduce="twopass")
                    out[f"int4twopass_{key}"] = (err(two, ref), tol)
                if M == 1 and dt == torch.float32 and grp < K and K <= 512:
                    order = [0, 2, 4, 6, 1, 3, 5, 7]     # nibbles in AWQ's interleaved order
                    swapped = Q.pack_int4(codes.reshape(N, 8, K // 8)[:, order].reshape(N, K))
                    run = lambda w, zz, ss: Q.int4_gemm(x, w, ss, zz, grp, b, split_cfg, "splitk")  # noqa: E731
                    out[f"sensitive_order_{key}"] = (-err(run(swapped, z, s), ref), -0.05)
                    out[f"sensitive_zero_{key}"] = (-err(run(qw, (z + 1) % 16, s), ref), -1e-3)
                    out[f"sensitive_scale_{key}"] = (-err(run(qw, z, s.flip(1)), ref), -1e-3)
            for N, K, blk in (fp8_cases if M == 1 else fp8_cases[::3]):
                w8 = (torch.randn(N, K, generator=g) * 3).to(torch.float8_e4m3fn)
                sc = torch.rand(-(-N // blk[0]), -(-K // blk[1]), generator=g) + 0.1
                x = torch.randn(M, K, generator=g).to(dt)
                b = torch.randn(N, generator=g).to(dt)
                ref = F.linear(x, Q.dequant_fp8(w8, sc, blk, torch.float32).to(dt), b)
                key = f"fp8_M{M}_N{N}_K{K}_b{blk[0]}x{blk[1]}_{n}"
                table = S.splitk_config(M, N, K, False, blk[1], sms=4)
                out[key] = (err(Q.fp8_gemm(x, w8, sc, blk, b, table, "splitk", locks), ref), tol)
                out[f"fp8whole_{key}"] = (err(S.splitk_gemv(x, w8, sc, None, b, N, K, blk[0], blk[1], False,
                                                            (64, 64, triton_pow2(K), 1)), ref), tol)
                # the skinny GEMM streaming the float8 weight (ops/skinny_fma.py fp8_skinny_gemm): the launch
                # table's config (one-byte elements) and a small one whose BLOCK_K leaves a masked tail where K allows
                for cfg in (None, (4, 128, 1, 1)):
                    got = Q.fp8_gemm(x, w8, sc, blk, b, cfg, "fma")
                    out[f"fp8fma_{key}_{cfg and cfg[1]}"] = (err(got, ref), tol)
                if M == 1 and dt == torch.float32:
                    out[f"sensitive_fp8fmascale_{key}"] = (
                        -err(Q.fp8_gemm(x, w8, sc.flip(0) if sc.shape[0] > 1 else sc * 1.5, blk, b, None, "fma"), ref),
                        -0.05)
                    out[f"fp8twopass_{key}"] = (err(S.splitk_gemv(x, w8, sc, None, b, N, K, blk[0], blk[1], False,
                                                                  (32, 16, 64, 1), reduce="twopass"), ref), tol)
                    if sc.numel() > 1:
                        bad = Q.fp8_gemm(x, w8, sc.flip(0) if sc.shape[0] > 1 else sc.flip(1), blk, b, table,
                                         "splitk")
                        out[f"sensitive_fp8scale_{key}"] = (-err(bad, ref), -0.05)
    out["locks_zero_after"] = (float(locks.abs().sum().item()), 0.0)
    return out


def triton_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if __name__ == "__main__" and "--interpret" in sys.argv:
    print("RESULT " + json.dumps(_checks(full=os.environ.get("XLLM_TEST_FULL") == "1")))
    sys.exit(0)


@pytest.fixture(scope="module")
def interpreted(request):
    full = request.config.getoption("--runslow") or os.environ.get("XLLM_RUN_SLOW") == "1"
    env = dict(os.environ, TRITON_INTERPRET="1", XLLM_TEST_FULL=str(int(bool(full))))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--interpret"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("case", ["int4", "int4whole", "int4table", "int4twopass", "fp8", "fp8whole", "fp8twopass",
                                  "fp8fma", "sensitive_order", "sensitive_zero", "sensitive_scale", "sensitive_fp8scale",
                                  "sensitive_fp8fmascale", "locks"])
def test_splitk_gemv_interpreted_vs_dequantized_reference(interpreted, case):
    got = {k: v for k, v in interpreted.items() if k.startswith(case + "_")}
    assert got, interpreted.keys()
    for name, (e, tol) in got.items():
        assert e <= tol, f"{name}: {abs(e)} {'>' if tol >= 0 else '<'} {abs(tol)}"


def test_splitk_config_fills_the_gpu_at_qwen3_shapes():
    """The launch table leaves >= 2 programs per SM (132, an H200) at Qwen3-8B and 0.6B decode shapes, with the
    scales constant over each chunk (group 128 / 128-blocks / per channel)."""
    from xllm_gen.runtime.ops import quant_splitk as S
    shapes = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288),                     # 8B
              (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]                         # 0.6B
    for N, K in shapes:
        for int4, s_cols in ((True, 128), (False, 128), (False, K)):
            bn, bk, chunk, warps = S.splitk_config(1, N, K, int4, s_cols)
            kw = K // 8 if int4 else K
            programs = -(-N // bn) * -(-kw // chunk)
            assert programs >= 264 or bn == 32, (N, K, int4, s_cols, programs)
            assert chunk % bk == 0 and (s_cols >= K or s_cols % chunk == 0), (N, K, int4, chunk)
            assert S.splitk_config(1, N, K, int4, s_cols) in S.splitk_candidates(1, N, K, int4, s_cols)


def test_gemv_choice_dispatch(monkeypatch):
    from xllm_gen.runtime.ops import quant_gemv as Q
    monkeypatch.setattr(Q, "QUANT_GEMV_CHOICE", {})
    monkeypatch.setattr(Q, "QUANT_GEMV_MODE", "auto")
    bf = torch.bfloat16
    assert Q.gemv_choice("int4", 1, 4096, 4096, 128, bf) == ("splitk", None)
    assert Q.gemv_choice("fp8", Q.FMA_AUTO_MAX_M + 1, 4096, 4096, 128, bf) == ("mma", None)
    assert Q.gemv_choice("fp8", 1, 4096, 4096, 128, bf) == ("fma", None)                 # unmeasured, one row
    assert Q.gemv_choice("fp8", 1, 4096, 4096, 24, bf) == ("mma", None)                  # blocks it cannot take
    assert Q.gemv_choice("int4", 17, 4096, 4096, 128, bf) == ("mma", None)
    Q.QUANT_GEMV_CHOICE[("int4", 2, 4096, 4096, 128, bf)] = "mma"                       # measured: mma won
    Q.QUANT_GEMV_CHOICE[("int4", 8, 4096, 4096, 128, bf)] = (64, 4, 32, 2)              # measured: split-K, this config
    assert Q.gemv_choice("int4", 2, 4096, 4096, 128, bf) == ("mma", None)
    assert Q.gemv_choice("int4", 8, 4096, 4096, 128, bf) == ("splitk", (64, 4, 32, 2))
    Q.QUANT_GEMV_CHOICE[("fp8", 1, 4096, 4096, 128, bf)] = ("fma", 2, 1024, 4, 1)       # measured: the fp8 skinny GEMM
    assert Q.gemv_choice("fp8", 1, 4096, 4096, 128, bf) == ("fma", (2, 1024, 4, 1))
    Q.QUANT_GEMV_CHOICE[("fp8", 1, 4096, 4096, 24, bf)] = ("fma", 2, 1024, 4, 1)        # a block it cannot take
    assert Q.gemv_choice("fp8", 1, 4096, 4096, 24, bf) == ("mma", None)
    monkeypatch.setattr(Q, "QUANT_GEMV_MODE", "fma")
    assert Q.gemv_choice("fp8", 8, 4096, 4096, 128, bf) == ("fma", None)
    assert Q.gemv_choice("fp8", 16, 4096, 4096, 128, bf) == ("mma", None)                # past SKINNY_MAX_M
    with pytest.raises(ValueError, match="kernel 'fma'"):
        Q.int4_gemm(torch.randn(1, 64), torch.zeros(8, 8, dtype=torch.int32), torch.ones(8, 1),
                    torch.zeros(8, 1, dtype=torch.uint8), 64, kernel="fma")
    monkeypatch.setattr(Q, "QUANT_GEMV_MODE", "splitk")
    assert Q.gemv_choice("int4", 2, 4096, 4096, 128, bf) == ("splitk", None)
    assert Q.gemv_choice("int4", 32, 4096, 4096, 128, bf) == ("mma", None)                # past SPLITK_MAX_M
    monkeypatch.setattr(Q, "QUANT_GEMV_MODE", "mma")
    assert Q.gemv_choice("int4", 1, 4096, 4096, 128, bf) == ("mma", None)
    with pytest.raises(ValueError, match="kernel 'fast'"):
        Q.int4_gemm(torch.randn(1, 64), torch.zeros(8, 8, dtype=torch.int32), torch.ones(8, 1),
                    torch.zeros(8, 1, dtype=torch.uint8), 64, kernel="fast")


def test_bad_env_value_is_refused():
    env = dict(os.environ, XLLM_QUANT_GEMV="fastest")
    p = subprocess.run([sys.executable, "-c", "import xllm_gen.runtime.ops.quant_gemv"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0 and "XLLM_QUANT_GEMV='fastest'" in p.stderr


def test_tinygemm_dispatch_and_zero_point_mapping(monkeypatch):
    """int4 layers that hold tinygemm's layout take it for 1-4 bf16 rows unless measured otherwise; its
    (q - 8) * s + zero form reproduces AWQ / GPTQ's (q - z) * s to bf16 rounding, and a wrong zero mapping is seen."""
    from xllm_gen.runtime.ops import quant_gemv as Q
    from xllm_gen.runtime.ops import quant_tinygemm as TG
    monkeypatch.setattr(Q, "QUANT_GEMV_CHOICE", {})
    monkeypatch.setattr(Q, "QUANT_GEMV_MODE", "auto")
    bf = torch.bfloat16
    assert Q.gemv_choice("int4", 1, 4096, 4096, 128, bf, tinygemm=True) == ("tinygemm", None)
    assert Q.gemv_choice("int4", 4, 4096, 4096, 128, bf, tinygemm=True) == ("tinygemm", None)
    assert Q.gemv_choice("int4", 8, 4096, 4096, 128, bf, tinygemm=True) == ("mma", None)
    assert Q.gemv_choice("int4", 32, 4096, 4096, 128, bf, tinygemm=True) == ("mma", None)
    Q.QUANT_GEMV_CHOICE[("int4", 2, 4096, 4096, 128, bf)] = "tinygemm"                 # measured on a layer with it
    assert Q.gemv_choice("int4", 2, 4096, 4096, 128, bf, tinygemm=False)[0] != "tinygemm"
    monkeypatch.setattr(Q, "QUANT_GEMV_MODE", "tinygemm")
    assert Q.gemv_choice("int4", 16, 4096, 4096, 128, bf, tinygemm=True) == ("tinygemm", None)
    assert Q.gemv_choice("int4", 1, 4096, 4096, 128, bf, tinygemm=False)[0] != "tinygemm"
    with pytest.raises(ValueError, match="tinygemm"):
        Q._pick("int4", torch.zeros(1, 256), 256, 256, 128, None, "tinygemm", False)

    torch.manual_seed(0)
    N, K, g = 64, 512, 128
    codes = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    scales = (torch.rand(N, K // g) * 0.004 + 0.001).to(torch.float16)
    zeros = torch.randint(0, 16, (N, K // g), dtype=torch.uint8)
    want = Q.dequant_int4(Q.pack_int4(codes), scales, zeros, g, torch.float32)
    got = TG.dequant_reference(codes, TG.scale_and_zero(scales, zeros), g)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < 2 ** -7, rel
    off = TG.dequant_reference(codes, TG.scale_and_zero(scales, (zeros + 1) % 16), g)
    assert ((off - want).abs().max() / want.abs().max()).item() > 0.05
    assert TG.pack(codes, scales, zeros, g) is None                      # no CUDA kernel on the CPU: None, no error
