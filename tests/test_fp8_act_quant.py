"""The fp8 activation round trip in one Triton launch (runtime/ops/fp8_act_quant.py) under the interpreter (CPU),
bit for bit against ActQuant's torch ops (layers/quant.py ActQuant.reference: the semantics every FP8 checkpoint
test is held to): per token-group (128, and a partial last group), per token, static scale, the dynamic ones also
with power-of-two scales (`scale_fmt: ue8m0`); float32 and bfloat16
inputs; values at float8 ties (half to even), in the subnormal range, past the saturation, zeros, a zero row.
Sensitivity: rounding half away from zero, or a group of 64, differs."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from interpreted import run_interpreted


def _inputs() -> list:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=g) * torch.logspace(-4, 3, 300)          # every exponent range
    x[1, :128] = 0.0                                                            # a zero group (the scale floor)
    x[2, :16] = torch.tensor([448.0, -448.0, 1.0, 1.0625, 1.1875, 2 ** -9 * 0.5, 2 ** -9 * 1.5, 3 * 2 ** -10,
                              -1.0625, 300.0, 1e-30, -0.0, 232.0, 240.0, 248.0, 1e4])   # ties to even, subnormals
    return [x, x.to(torch.bfloat16), x[:, :256].contiguous()]


def _checks() -> dict:
    from xllm_gen.runtime.layers.quant import ActQuant
    from xllm_gen.runtime.ops.fp8_act_quant import fp8_act_quant
    out = {}
    for i, x in enumerate(_inputs()):
        for kind, group, scale, pow2 in (("group", 128, None, False), ("token", 0, None, False),
                                         ("static", 0, 0.37, False), ("group", 128, None, True),
                                         ("token", 0, None, True)):
            want = ActQuant(kind, group, scale, pow2).reference(x)
            got = fp8_act_quant(x, group if kind == "group" else None, scale, pow2)
            out[f"{kind}{'_pow2' if pow2 else ''}_{i}_{x.dtype}"] = [bool(torch.equal(got, want)),
                                                                    got.dtype == want.dtype]
    x = _inputs()[0]
    want = ActQuant("group", 128).reference(x)
    out["sensitive_group64"] = [not torch.equal(fp8_act_quant(x, 64), want), True]
    out["sensitive_pow2"] = [not torch.equal(fp8_act_quant(x, 128, pow2=True), want), True]
    return out


if __name__ == "__main__" and "--interpret" in sys.argv:
    print("RESULT " + json.dumps(_checks()))
    sys.exit(0)


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(__file__)


def test_fused_round_trip_is_bit_exact(interpreted):
    bad = {k: v for k, v in interpreted.items() if not all(v)}
    assert not bad and len(interpreted) == 17, bad


def test_half_away_rounding_would_differ():
    """The inputs hold float8 ties that torch rounds half to even (1.0625 -> 1.0, 1.1875 -> 1.25): half away from
    zero would give 1.125 and 1.25, so the bit-exact comparison above sees the rounding mode."""
    v = torch.tensor([1.0625, 1.1875, -1.0625])
    assert torch.equal(v.to(torch.float8_e4m3fn).float(), torch.tensor([1.0, 1.25, -1.0]))


def test_compiles_for_sm90_with_exact_arithmetic():
    """Compiled for sm_90 without a GPU (Triton's CUDA backend): the divisions are correctly rounded (div.rn, not
    the approximate div.full a plain `/` gives), the rounding's add / subtract pair is kept and nothing flushes
    subnormals; the interpreter (above) checks the arithmetic, this that the GPU build keeps it."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"no Triton compiler API: {e}")
    from xllm_gen.runtime.ops import fp8_act_quant as A
    sig = dict(x_ptr="*bf16", y_ptr="*bf16", K="i32", stride_xm="i32", stride_ym="i32", static_scale="fp32",
               GROUP="constexpr", BLOCK="constexpr", STATIC="constexpr", OUT_BF16="constexpr", POW2="constexpr")
    for pow2 in (False, True):
        src = ASTSource(fn=A._fp8_act_quant_kernel, signature=sig,
                        constexprs=dict(GROUP=128, BLOCK=128, STATIC=False, OUT_BF16=True, POW2=pow2))
        try:
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
        except (ImportError, RuntimeError) as e:       # no CUDA backend in this Triton build
            pytest.skip(f"sm_90 compile unavailable: {e}")
        assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
        assert "sub.f32" in ptx and ".ftz" not in ptx


def test_pow2_scales_are_the_ue8m0_ceiling():
    """ActQuant's power-of-two scales (on the float bits) equal 2^ceil(log2(amax / 448)), as DeepGEMM / vLLM's
    UE8M0 scales, written here independently; and the round trip uses them (a scale of 2^k: x / s is exact)."""
    from xllm_gen.runtime.layers.quant import ActQuant, ceil_pow2
    s = torch.cat([torch.logspace(-11, 3, 999), torch.tensor([2.0 ** -20, 0.25, 1.0, 3.0, 2.0 ** 10 + 1])])
    assert torch.equal(ceil_pow2(s), torch.exp2(torch.ceil(torch.log2(s))))
    x = torch.randn(4, 256) * 5
    g = x.reshape(4, 2, 128)
    scale = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1, keepdim=True) / 448.0)))
    want = ((g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).reshape(4, 256)
    assert torch.equal(ActQuant("group", 128, pow2=True).reference(x), want)
    assert not torch.equal(ActQuant("group", 128).reference(x), want)
