"""The int4 decode GEMM on the tensor cores over the raw codes (runtime/ops/quant_int4_codes.py) against F.linear on
the dequantized weight, under the Triton interpreter on CPU (in a subprocess: the variable must be set before triton
is imported): 1-16 rows, a split K (serial tickets) and one program's whole K, partial N tiles, a bias, groups of 64
and 128. fp16 activations: the interpreter multiplies bfloat16 tensors in tl.dot as their raw 16-bit integers (its
numpy form), so the bf16 magic (0x4300: 128 + q) is checked on the GPU (tests/gpu/test_gpu_quant_int4_codes.py); the
arithmetic is the same with 0x6400 (1024 + q). Sensitivity: wrong zero points or scales move the output far past the
tolerance. Also: the dispatch (measured choice, the forced mode, shapes it refuses) and the sm_90 build (wgmma, no
spills) without a GPU."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from interpreted import run_interpreted

CASES = {   # name: (M, N, K, group, launch config or None for the table's)
    "table": (1, 128, 1024, 128, None),                  # a chunk of one group, split K 1
    "split": (3, 192, 1024, 128, (64, 32, 64, 4, 2)),    # split K 2 (serial tickets), half-group chunks
    "rows16": (16, 100, 1024, 64, (64, 32, 64, 4, 2)),   # 16 rows, a partial N tile, groups of 64
}


def _case(M, N, K, g, seed=0, dtype=torch.float16):
    from xllm_gen.runtime.ops import quant_gemv as Q
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), generator=gen)
    q = Q.pack_int4(codes)
    s = (torch.rand(N, K // g, generator=gen) * 0.02 + 0.01).to(dtype)
    z = torch.randint(0, 16, (N, K // g), generator=gen).to(torch.uint8)
    x = torch.randn(M, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype)
    ref = x.float() @ Q.dequant_int4(q, s, z, g, torch.float32).T + b.float()
    return x, q, s, z, b, ref


def _err(y, ref):
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def _checks() -> dict:
    """name -> (relative error, bound): positive bounds must hold, negative ones (sensitivity) must be exceeded."""
    from xllm_gen.runtime.ops import quant_gemv as Q
    from xllm_gen.runtime.ops import quant_int4_codes as C
    out = {}
    for name, (M, N, K, g, cfg) in CASES.items():
        x, q, s, z, b, ref = _case(M, N, K, g)
        y = C.int4_codes_gemm(x, q, s, z, g, bias=b, config=cfg)
        assert y.shape == (M, N) and y.dtype == x.dtype
        out[f"{name}_match"] = (_err(y, ref), 2e-3)                 # fp16 output rounding is 2^-11 ~ 4.9e-4
        out[f"{name}_zero"] = (_err(C.int4_codes_gemm(x, q, s, (z + 1) % 16, g, bias=b, config=cfg), ref), -0.05)
        out[f"{name}_scale"] = (_err(C.int4_codes_gemm(x, q, (s * 1.5).to(s.dtype), z, g, bias=b, config=cfg), ref),
                                -0.05)
    x, q, s, z, b, ref = _case(2, 64, 1024, 128, seed=1)       # through quant_gemv's entry point
    out["int4_gemm_match"] = (_err(Q.int4_gemm(x, q, s, z, 128, b, kernel="codes"), ref), 2e-3)
    return out


if __name__ == "__main__" and "--interpret" in sys.argv:
    print("RESULT " + json.dumps(_checks()))
    sys.exit(0)


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", [*CASES, "int4_gemm"])
def test_codes_gemm_interpreted_vs_dequantized_weight(interpreted, case):
    got = {k: v for k, v in interpreted.items() if k.startswith(case + "_")}
    assert got, interpreted.keys()
    for name, (e, tol) in got.items():
        assert (e <= tol) if tol >= 0 else (e > -tol), f"{name}: {e} against {tol}"


def test_codes_dispatch_and_refusals(monkeypatch):
    from xllm_gen.runtime.ops import quant_gemv as Q
    from xllm_gen.runtime.ops import quant_int4_codes as C
    bf = torch.bfloat16
    assert C.fits(1, 4096, 128, bf) and C.fits(16, 4096, 128, torch.float16)
    assert not C.fits(17, 4096, 128, bf)                      # more rows than one 16-row tile
    assert not C.fits(1, 4096, 128, torch.float32)            # the bf16 / fp16 magic only
    assert not C.fits(1, 1536, 128, bf)                       # K / 8 = 192 not a multiple of the group
    monkeypatch.setattr(Q, "QUANT_GEMV_CHOICE", {})
    monkeypatch.setattr(Q, "QUANT_GEMV_MODE", "auto")
    assert Q.gemv_choice("int4", 16, 4096, 4096, 128, bf)[0] == "mma"          # unmeasured: the tile
    Q.QUANT_GEMV_CHOICE[("int4", 16, 4096, 4096, 128, bf)] = ("codes", 64, 32, 128, 4, 3)
    assert Q.gemv_choice("int4", 16, 4096, 4096, 128, bf) == ("codes", (64, 32, 128, 4, 3))
    Q.QUANT_GEMV_CHOICE[("int4", 8, 1536, 1536, 128, bf)] = ("codes", 64, 32, 128, 4, 3)   # a stale decision
    assert Q.gemv_choice("int4", 8, 1536, 1536, 128, bf) == ("mma", None)
    monkeypatch.setattr(Q, "QUANT_GEMV_MODE", "codes")
    assert Q.gemv_choice("int4", 4, 4096, 4096, 128, bf) == ("codes", None)
    assert Q.gemv_choice("int4", 32, 4096, 4096, 128, bf)[0] != "codes"
    with pytest.raises(ValueError, match="codes"):
        Q._pick("int4", torch.zeros(1, 256), 256, 256, 128, None, "codes", False)     # fp32 rows
    with pytest.raises(ValueError, match="int4_codes_gemm"):
        C.int4_codes_gemm(torch.zeros(1, 1536, dtype=bf), torch.zeros(8, 192, dtype=torch.int32),
                          torch.zeros(8, 12, dtype=bf), torch.zeros(8, 12, dtype=torch.uint8), 128)


def test_codes_kernel_builds_for_sm90_on_the_tensor_cores_without_spills():
    """The launch table's config for an 8B model's qkv, compiled for sm_90 without a GPU: the dots are wgmma, and
    ptxas spills no register (64-word tiles used all 255 and were slower: the table takes 32)."""
    from fixtures.sm90 import assemble, compile_sm90, ptxas

    from xllm_gen.runtime.ops import quant_int4_codes as C
    path = ptxas()
    fn = C._int4_codes_kernel
    bn, bk, chunk, warps, stages = C.codes_config(1, 6144, 4096, 128)
    sig = {a: "i32" for a in fn.arg_names}
    sig.update(x_ptr="*bf16", q_ptr="*i32", s_ptr="*bf16", z_ptr="*u8", b_ptr="*bf16", y_ptr="*bf16",
               part_ptr="*fp32", lock_ptr="*i32")
    const = dict(HAS_BIAS=False, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, CHUNK=chunk, SPLIT_K=512 // chunk, OFF=128.0,
                 NUM_STAGES=stages)
    sig.update({k: "constexpr" for k in const})
    aligned = ["x_ptr", "q_ptr", "s_ptr", "z_ptr", "b_ptr", "y_ptr", "part_ptr", "lock_ptr", "N", "KW", "stride_xm",
               "stride_qn", "stride_sn", "stride_zn", "stride_ym", "GROUP"]     # what the JIT specializes on
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    k = compile_sm90(fn, sig, const, attrs, num_warps=warps, num_stages=stages)
    assert "wgmma" in k.asm["ptx"]
    rc, report, spill = assemble(k, path)
    assert rc == 0 and spill == 0, report[-2000:]
