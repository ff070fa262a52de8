"""The fp8 activation round trip as the epilogue of the op that makes a quantized linear's input
(ops/norm_act_kernels.py `quant`; layers/fused.py norm_linear / act_linear): under the Triton interpreter (CPU), bit
for bit the op followed by the one-launch round trip (ops/fp8_act_quant.py), and in float32 also ActQuant's torch
ops. RMSNorm with and without the residual add, silu / gelu and mul (one tile and several tiles of a row), per
token-group (128; also with power-of-two scales, `scale_fmt: ue8m0`), per token, static scale; widths that are not a power of two. The layer wiring: norm_linear /
act_linear of a linear with an ActQuant equal the plain ops, and differ where the quantization is left out
(sensitivity)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

QUANTS = {"group128": ("group", 128, None, False), "token": ("token", 0, None, False),
          "static": ("static", 0, 0.05, False), "group128_pow2": ("group", 128, None, True)}


def _q(kind, group, scale, pow2):
    return (group if kind == "group" else None, scale if kind == "static" else None, pow2)


# the shapes of the default run / of --runslow (one tile and several tiles of a row, widths no power of two)
NORM_WIDTHS, ACT_WIDTHS = {False: (300,), True: (256, 300, 1024)}, {False: (300,), True: (96, 300, 2048)}


def _checks(dev: str = "cpu", full: bool = True) -> dict:
    from xllm_gen.runtime.layers.quant import ActQuant
    from xllm_gen.runtime.ops import norm_act_kernels as K
    from xllm_gen.runtime.ops.fp8_act_quant import fp8_act_quant
    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for D in NORM_WIDTHS[full]:
            x = (torch.randn(3, D, generator=g) * 3).to(dev, dtype)
            r = torch.randn(3, D, generator=g).to(dev, dtype)
            w = (torch.rand(D, generator=g) + 0.5).to(dev, dtype)
            for name, (kind, group, scale, pow2) in QUANTS.items():
                aq, q = ActQuant(kind, group, scale, pow2), _q(kind, group, scale, pow2)
                for res in (False, True):
                    if res:
                        y, nr = K.fused_add_rms_norm(x, r, w, 1e-6, 0.0, quant=q)
                        p, pr = K.fused_add_rms_norm(x, r, w, 1e-6, 0.0)
                        ok = torch.equal(nr, pr)
                    else:
                        y, p, ok = K.rms_norm(x, w, 1e-6, quant=q), K.rms_norm(x, w, 1e-6), True
                    want = fp8_act_quant(p, group if kind == "group" else None, scale, pow2)
                    ok = ok and torch.equal(y, want) and (dtype != torch.float32 or torch.equal(y, aq.reference(p)))
                    out[f"norm_res{int(res)}_{D}_{name}_{dtype}"] = bool(ok and not torch.equal(y, p))
            for n in ACT_WIDTHS[full]:
                h = (torch.randn(2, 2 * n, generator=g) * 2).to(dev, dtype)
                for name, (kind, group, scale, pow2) in QUANTS.items():
                    aq, q = ActQuant(kind, group, scale, pow2), _q(kind, group, scale, pow2)
                    for act in ("silu", "gelu"):
                        y = K.silu_and_mul(h, quant=q) if act == "silu" else K.gelu_and_mul(h, "tanh", quant=q)
                        p = K.silu_and_mul(h) if act == "silu" else K.gelu_and_mul(h, "tanh")
                        want = fp8_act_quant(p, group if kind == "group" else None, scale, pow2)
                        ok = torch.equal(y, want) and (dtype != torch.float32 or torch.equal(y, aq.reference(p)))
                        out[f"{act}_{n}_{name}_{dtype}"] = bool(ok and not torch.equal(y, p))
    out.update(_layer_checks(dev))
    return out


def _layer_checks(dev: str) -> dict:
    """norm_linear / act_linear of a linear with an ActQuant: the epilogue path (XLLM_FUSED_DECODE=1 under the
    interpreter) against the plain ops run through the same kernels, and against the input left unquantized."""
    from xllm_gen.runtime.layers import fused
    from xllm_gen.runtime.layers.activation import SiluAndMul
    from xllm_gen.runtime.layers.linear import ReplicatedLinear
    from xllm_gen.runtime.layers.norm import RMSNorm
    from xllm_gen.runtime.layers.quant import ActQuant
    from xllm_gen.runtime.ops import norm_act_kernels as K
    torch.manual_seed(1)
    out = {}
    norm = RMSNorm(256, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(256) + 0.5)
    lin = ReplicatedLinear(256, 64)
    down = ReplicatedLinear(384, 64)
    for m in (lin, down):
        torch.nn.init.normal_(m.weight, std=0.05)
        m.act_quant = ActQuant("group", 128)
    norm, lin, down = norm.to(dev), lin.to(dev), down.to(dev)
    x, r, h = (t.to(dev) for t in (torch.randn(4, 256) * 3, torch.randn(4, 256), torch.randn(4, 768) * 2))
    with torch.no_grad():
        y, nr = fused.norm_linear(norm, lin, x, r)
        p, pr = K.fused_add_rms_norm(x, r, norm.weight, 1e-6)
        out["norm_linear"] = bool(torch.equal(y, lin(p)) and torch.equal(nr, pr))
        out["norm_linear_sensitive"] = not torch.equal(y, lin(p, quantized=True))
        y0, r0 = fused.norm_linear(norm, lin, x, None)
        out["norm_linear_no_residual"] = bool(torch.equal(y0, lin(K.rms_norm(x, norm.weight, 1e-6))) and r0 is x)
        a = fused.act_linear(SiluAndMul(), down, h)
        out["act_linear"] = bool(torch.equal(a, down(K.silu_and_mul(h))))
        out["act_linear_sensitive"] = not torch.equal(a, down(K.silu_and_mul(h), quantized=True))
    return out


if __name__ == "__main__" and "--interpret" in sys.argv:
    print("RESULT " + json.dumps(_checks(full=os.environ.get("XLLM_TEST_FULL") == "1")))
    sys.exit(0)


def _full(config) -> bool:
    return bool(config.getoption("--runslow") or os.environ.get("XLLM_RUN_SLOW") == "1")


@pytest.fixture(scope="module")
def interpreted(request):
    env = dict(os.environ, TRITON_INTERPRET="1", XLLM_FUSED_DECODE="1", XLLM_TEST_FULL=str(int(_full(request.config))))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--interpret"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])


def test_epilogue_round_trip_is_bit_exact(interpreted, request):
    """(the default run: one width of each op; --runslow: three)"""
    kernels = {k: v for k, v in interpreted.items() if not k.startswith(("norm_linear", "act_linear"))}
    bad = [k for k, v in kernels.items() if not v]
    full = _full(request.config)
    assert not bad and len(kernels) == 2 * len(QUANTS) * 2 * (len(NORM_WIDTHS[full]) + len(ACT_WIDTHS[full])), bad


def test_layer_wiring_quantizes_once(interpreted):
    layer = {k: v for k, v in interpreted.items() if k.startswith(("norm_linear", "act_linear"))}
    assert layer and all(layer.values()), layer


def test_quant_fits_widths():
    from xllm_gen.runtime.ops.norm_act_kernels import quant_fits
    assert quant_fits((128, None), 4096) and quant_fits((128, None), 12288, gated=True)
    assert quant_fits((None, None), 4096) and quant_fits((None, 0.5), 30000, gated=True)
    assert not quant_fits((None, None), 29568, gated=True)       # a per-token scale over a row wider than a program
    assert not quant_fits((96, None), 4096)                       # a group that is no power of two
