"""Fused decode prologues over packed fp8 weights on the GPU (marker `gpu`; skipped without CUDA):
runtime/ops/fused_gemv_fp8.py, ops/fused_gemv.py, layers/fused.py.

- kernels (bf16 activations, Qwen3-8B shapes, 1-8 rows, float8 weights with per-channel and 128-column scales, the
  first and last of the fused fp8 launch candidates) against the unfused Triton ops with the same GEMM config:
  weight-only norm_gemv / act_gemv vs fused_add_rms_norm / silu_and_mul + the float8 skinny GEMM within bf16
  rounding, the residual bit for bit; inputs quantized per token and 128 columns: act_gemv vs silu_and_mul with its
  quant epilogue + the GEMM within bf16 rounding (the same codes and scales); norm_gemv vs fused_add_rms_norm with
  its quant epilogue + the GEMM: a different rounding of the same quantized layer (codes of the fp32 g h, not of the
  bf16 norm output), so its distance to the unfused output is bounded by a fraction of the quantization's own effect
  and it is no less accurate against the unquantized layer computed in float64;
- tuning: tune_decode_gemms on packed fp8 layers (weight-only per channel, and 128-column blocks with quantized
  inputs; qkv and down shapes, 1 and 4 rows) times the fused fp8 GEMVs against the plain pair per (prologue, rows, N,
  K, form), printed (pytest -s);
- engine: a tiny Qwen3 (dummy weights quantized fp8 / fp8_block, packed) with the fused kernels forced on
  (XLLM_FUSED_DECODE=1) against off: the fused fp8 kernels are called, greedy tokens part only at near-ties.
Numbers are printed and appended as JSON lines to $XLLM_TEST_REPORT when set.
"""
from __future__ import annotations

import pytest
import torch
from fixtures.report import report as _report

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = {"8B qkv": (6144, 4096), "8B down": (4096, 12288)}       # (N, K) of the linear after the prologue


def _fp8(W: torch.Tensor, bk: int):
    N, K = W.shape
    s = W.float().abs().reshape(N, K // bk, bk).amax(-1).clamp(min=1e-12) / 448.0
    return (W.float() / s.repeat_interleave(bk, 1)).to(torch.float8_e4m3fn), s.contiguous()


def _err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1.0)).item()


def _nrm(a, b):
    return (a.double() - b.double()).norm().item()


@pytest.mark.parametrize("name", list(SHAPES))
def test_fused_fp8_kernels_vs_unfused_triton(name):
    from xllm_gen.runtime import ops
    from xllm_gen.runtime.ops import fused_gemv as FG
    from xllm_gen.runtime.ops import fused_gemv_fp8 as F8
    from xllm_gen.runtime.ops import norm_act_kernels as NK
    from xllm_gen.runtime.ops import quant_gemv as Q
    N, K = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    W = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
    bias = torch.randn(N, device="cuda", generator=g).to(dt)
    stats = dict(cases=0, bit_exact=0, worst=0.0, worst_q_act=0.0, worst_ratio=0.0, worst_accuracy=0.0)
    quant = (128, None)
    for bk in (K, 128):
        w8, sc = _fp8(W, bk)
        block = (1, bk)
        wd = w8.double() * sc.double().repeat_interleave(bk, 1)
        for M in (1, 2, 4, 8):
            x = torch.randn(M, K, device="cuda", generator=g).to(dt)
            r = torch.randn(M, K, device="cuda", generator=g).to(dt)
            w = (1 + 0.1 * torch.randn(K, device="cuda", generator=g)).to(dt)
            gu = torch.randn(M, 2 * K, device="cuda", generator=g).to(dt)
            for group in (0, 128):
                cands = F8.candidates(M, N, K, group)
                for cfg in dict.fromkeys((cands[0], cands[-1])):
                    kw = dict(config=cfg, scale=sc, block=block, group=group)

                    def gemm(h):
                        return Q.fp8_gemm(h, w8, sc, block, bias, cfg[:4], "fma")     # (VEC: its default)
                    if "down" not in name:
                        h, want_r = ops.fused_add_rms_norm(x, r, w, 1e-6)
                        hq, _ = NK.fused_add_rms_norm(x, r, w, 1e-6, quant=quant)
                        y, nr = FG.norm_gemv(x, r, w, 1e-6, 0.0, w8, bias, **kw)
                        torch.cuda.synchronize()
                        assert torch.equal(nr, want_r), f"{name} M{M} {cfg}: residual differs"
                        want = gemm(hq if group else h)
                        if not group:
                            e = _err(y, want)
                            stats["worst"] = max(stats["worst"], e)
                            assert e < 2e-2, f"{name} bk{bk} M{M} {cfg}: fp8 norm_gemv error {e}"
                        else:       # a different rounding of the same quantized layer (ops/fused_gemv_fp8.py)
                            noq = gemm(h)
                            hd = want_r.double()
                            exact = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double() @ wd.T \
                                + bias.double()
                            ratio = _nrm(y, want) / _nrm(want, noq)
                            acc = _nrm(y, exact) / _nrm(want, exact)
                            stats["worst_ratio"] = max(stats["worst_ratio"], ratio)
                            stats["worst_accuracy"] = max(stats["worst_accuracy"], acc)
                            assert ratio < 0.8, f"{name} bk{bk} M{M} {cfg}: quantized norm_gemv ratio {ratio}"
                            assert acc < 1.15, f"{name} bk{bk} M{M} {cfg}: quantized norm_gemv accuracy {acc}"
                        stats["cases"] += 1
                        stats["bit_exact"] += torch.equal(y, want)
                    else:
                        a = NK.silu_and_mul(gu, quant=quant) if group else ops.silu_and_mul(gu)
                        y = FG.act_gemv(gu, w8, bias, "silu", **kw)
                        want = gemm(a)
                        e = _err(y, want)
                        key = "worst_q_act" if group else "worst"
                        stats[key] = max(stats[key], e)
                        stats["cases"] += 1
                        stats["bit_exact"] += torch.equal(y, want)
                        assert e < 2e-2, f"{name} bk{bk} M{M} {cfg} group {group}: fp8 act_gemv error {e}"
    _report(test=f"fused_fp8_kernels_{name}", **stats)
    print(f"{name}: {stats}")


@pytest.mark.parametrize("kind", ["fp8", "fp8_block"])
def test_fused_fp8_tuning(monkeypatch, kind):
    """tune_quant_gemvs then tune_decode_gemms (the runner's order) on packed fp8 layers of two Qwen3-8B shapes:
    every (prologue, rows) is measured under the layer's form; the choice table holds it; the layers then
    run the chosen path."""
    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.layers import fused as FU
    from xllm_gen.runtime.layers import linear as LL
    from xllm_gen.runtime.layers.quant_linear import quantize_dummy
    from xllm_gen.runtime.layers.quant_tuning import tune_quant_gemvs
    from xllm_gen.runtime.ops import quant_gemv as Q
    monkeypatch.setenv("XLLM_TUNING_CACHE", "0")
    monkeypatch.setattr(LL, "_FORCE", None)
    monkeypatch.setattr(LL, "DECODE_GEMM_CHOICE", {})
    monkeypatch.setattr(Q, "QUANT_GEMV_CHOICE", {})
    monkeypatch.setattr(FU, "FUSED_GEMV_CHOICE", {"norm": {}, "act": {}})
    monkeypatch.setattr(FU, "FUSED_TUNING", {})
    monkeypatch.setattr(FU, "MODE", "")
    torch.manual_seed(3)
    model = torch.nn.Sequential(LL.ReplicatedLinear(4096, 6144), LL.ReplicatedLinear(12288, 4096)
                                ).to("cuda", torch.bfloat16)
    for m in model:
        torch.nn.init.normal_(m.weight, std=0.02)
    assert quantize_dummy(model, kind) == 2
    rows = [1, 4]           # (each candidate of each row count is a Triton compile on a fresh host)
    tune_quant_gemvs(model, rows)
    LL.tune_decode_gemms(model, rows)
    print(f"\n[fused fp8 GEMV tuning, {kind}] (prologue, M, N, K, form): plain us / fused us, config")
    for k, v in sorted(FU.FUSED_TUNING.items(), key=str):
        print(f"  {k}: {v[0]:.2f} / {v[1]:.2f} us ({v[0] / v[1]:.2f}x) {v[2]}")
    group = 128 if kind == "fp8_block" else 0
    forms = {k[4:] for k in FU.FUSED_TUNING}
    assert len(forms) == (2 if kind == "fp8" else 1), forms       # per channel: K 4096 and K 12288 columns
    assert all(f[0] == "fp8" and f[2] == group for f in forms), forms
    assert {k[:2] for k in FU.FUSED_TUNING} == {(p, M) for p in ("norm", "act") for M in rows}
    for (p, M, N, K, *form), (tp, tf, cfg) in FU.FUSED_TUNING.items():
        assert tp > 0 and tf > 0 and cfg in FU.fused_candidates(M, N, K, 1, group)
        key = (M, N, K, torch.bfloat16) + tuple(form)
        assert FU.FUSED_GEMV_CHOICE[p][key] == (cfg, tf < tp)
        if M == 4:
            assert FU.FUSED_GEMV_CHOICE[p][(3,) + key[1:]] == FU.FUSED_GEMV_CHOICE[p][key]
    _report(test=f"fused_fp8_tuning_{kind}", tuning={str(k): v for k, v in FU.FUSED_TUNING.items()})
    norm = L.RMSNorm(4096, 1e-6).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    x, r = (torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    y, nr = L.norm_linear(norm, model[0], x, r)
    h, want_r = norm(x, r)
    assert torch.equal(nr, want_r) and _err(y, model[0](h)) < (2e-2 if group == 0 else 0.1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from fixtures.tiny_hf import make_tiny_qwen3
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_fused_fp8"), hidden_size=256, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=512,
                           max_position_embeddings=2048, seed=0)


@pytest.mark.parametrize("kind", ["fp8", "fp8_block"])
def test_fused_fp8_engine(tiny_dir, kind):
    from test_gpu_fused_decode import _compare, _params, _prompts

    from xllm_gen import LLM
    from xllm_gen.runtime.layers import fused as FU
    from xllm_gen.runtime.ops import fused_gemv as FG
    saved, calls = FU.MODE, {"n": 0}
    orig = FG.norm_gemv, FG.act_gemv

    def counted(f):
        def g(*a, **kw):
            calls["n"] += kw.get("scale") is not None
            return f(*a, **kw)
        return g
    out = {}
    try:
        for mode in ("0", "1"):
            FU.MODE = mode
            FG.norm_gemv, FG.act_gemv = (counted(f) for f in orig)
            llm = LLM(str(tiny_dir), dtype="bfloat16", load_format="dummy", _debug={"dummy_quantize": kind},
                      max_num_seqs=16, num_kv_blocks=1024, max_model_len=256, enable_prefix_caching=False)
            prompts = {B: _prompts(B, llm.engine.vocab_size, 7 + B) for B in (1, 3, 8)}
            out[mode] = {B: llm.generate(p, _params()) for B, p in prompts.items()}
            out[f"calls_{mode}"] = calls["n"]
            llm.shutdown()
            FG.norm_gemv, FG.act_gemv = orig
    finally:
        FU.MODE = saved
        FG.norm_gemv, FG.act_gemv = orig
    assert out["calls_0"] == 0 and out["calls_1"] > 0, out
    for B in out["0"]:
        _compare(out["0"][B], out["1"][B], f"fused_fp8_{kind}_b{B}", max_diff=None)
