"""Fused decode prologues over float8 weights (runtime/ops/fused_gemv_fp8.py, ops/fused_gemv.py, layers/fused.py), on
CPU under TRITON_INTERPRET=1 (in a subprocess: the variable must be set before triton is imported):

- weight-only fp8 (a packed layer, PackedFp8, bf16 / fp32 input): norm_gemv / act_gemv with the float8 weight and its
  scales (per channel, and per row and 128 columns) against the unfused ops (RMSNorm, resp. silu-and-mul, then the
  PackedFp8 layer's GEMM) at 1, 2, 5 and 8 rows, with and without residual, bias, (1 + w) norm; a masked K tail;
- activation-quantized fp8 (ActQuant("group", 128), the *-FP8 releases): the unfused path quantizes the norm's /
  activation's output per token and 128 columns, then the GEMM. The act prologue's codes are the unfused path's
  (fp32: equal to 1e-6; bf16: within bf16 rounding). The norm prologue quantizes g h before the row's RMSNorm factor
  (which cancels): against the exactly computed quantized layer (float64, the same codes computed from g h) it is
  within fp32 / bf16 output rounding, and its distance to the unfused path (whose codes come from the bf16-rounded
  norm output: some flip by one fp8 step) is at most half the quantization's own effect (unfused with vs without
  the input quantization);
- sensitivity: the weight scales dropped (ones) or shifted (rolled by one block / row), or the input quantization
  left out, are far outside those bounds;
- layers: L.norm_linear / L.act_linear on a packed layer (XLLM_FUSED_DECODE=1) call the fused kernel and equal the
  plain pair; a row-parallel down projection at (faked) TP 2 adds its bias after the reduction;
- refusals (no interpreter): power-of-two scales in the norm prologue, per-token / static kinds, a group that is no
  power of two, scale columns that split a 16-wide slice, more than 8 rows; a BLOCK_K without whole groups raises;
- tuning: tune_fused_gemvs keys packed fp8 shapes apart from bf16 ones of the same N, K (its own tuning-cache keys);
- engine: a tiny Qwen3 with every linear layer packed fp8 (weights per row and 32 columns, inputs quantized per
  token and 32 columns) decoded on CPU with XLLM_FUSED_DECODE=1 calls the fused kernels with the float8 weights and
  gives the unfused engine's tokens; (slow) the same for per-channel weight-only fp8, and rolled scales given to the
  fused kernel alone change the tokens.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 6


def _fp8(W: torch.Tensor, bk: int):
    """W [N, K] as float8 e4m3 with a float32 scale per row and bk columns (amax / 448)."""
    N, K = W.shape
    s = W.abs().reshape(N, K // bk, bk).amax(-1).clamp(min=1e-12) / 448.0
    return (W / s.repeat_interleave(bk, 1)).to(torch.float8_e4m3fn), s.contiguous()


def _kernel_checks() -> dict:
    from xllm_gen.runtime.layers.quant import ActQuant
    from xllm_gen.runtime.layers.quant_linear import PackedFp8
    from xllm_gen.runtime.ops import fused_gemv as FG
    from xllm_gen.runtime.ops import reference as R

    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    def err(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1.0)).item()

    def rel(a, b, c):       # ||a - b|| / ||b - c||: a difference measured against another one
        return ((a.double() - b.double()).norm() / (b.double() - c.double()).norm()).item()

    aq = ActQuant("group", 128)
    out = {}
    N, K = 40, 384
    # (M, dtype, weight scale columns, config, residual, bias, norm weight offset); config (BLOCK_N, BLOCK_K, warps,
    # stages[, VEC]): few programs (the interpreter runs them one by one), BLOCK_K 128 (one group a chunk) or 256 (two, and a
    # masked tail: K 384)
    cases = [(1, torch.float32, K, (64, 128, 1, 1), True, False, 0.0),
             (2, torch.float32, 128, (64, 256, 1, 1), False, True, 1.0),
             (5, torch.float32, 128, (16, 128, 1, 1, 4), True, True, 0.0),      # VEC 4
             (8, torch.float32, K, (64, 256, 1, 1), True, False, 1.0),
             (1, torch.bfloat16, 128, (64, 256, 1, 1), True, True, 0.0),
             (5, torch.bfloat16, K, (64, 128, 1, 1), False, False, 1.0),
             (8, torch.bfloat16, 128, (64, 128, 1, 1, 8), True, True, 1.0)]     # VEC 8
    for M, dt, bk, cfg, res, bias, off in cases:
        f32 = dt == torch.float32
        tol = 2e-6 if f32 else 2e-2
        name = f"M{M}_{str(dt)[6:]}_s{'ch' if bk == K else bk}_bk{cfg[1]}_{'res' if res else 'nores'}_" \
               f"{'bias' if bias else 'nobias'}_off{off:g}"
        wq, sc = _fp8(rnd(N, K), bk)
        p = PackedFp8(wq, sc, bk)
        x, r, w = rnd(M, K).to(dt), rnd(M, K).to(dt) if res else None, (1 + 0.3 * rnd(K)).to(dt)
        b = rnd(N).to(dt) if bias else None
        gu = rnd(M, 2 * K).to(dt)
        if r is None:
            h, want_r = R.rms_norm(x, w, 1e-6, off), x
        else:
            h, want_r = R.fused_add_rms_norm(x, r, w, 1e-6, off)
        a = R.silu_and_mul(gu)
        kw = dict(config=cfg, scale=p.scale, block=p.block)
        # weight-only: the norm / activation kernel's output, then the packed layer's GEMM
        y, nr = FG.norm_gemv(x, r, w, 1e-6, off, p.weight, b, **kw)
        out[f"wo_norm_{name}"] = (err(y, p(h, b)), tol)
        out[f"wo_norm_residual_{name}"] = (err(nr, want_r), 0.0 if f32 else 1e-2)
        out[f"wo_act_{name}"] = (err(FG.act_gemv(gu, p.weight, b, "silu", **kw), p(a, b)), tol)
        # the input quantized per token and 128 columns (ActQuant.reference: the unfused CPU path)
        plain, plain_noq = p(aq(h), b, aq), p(h, b)
        y, _ = FG.norm_gemv(x, r, w, 1e-6, off, p.weight, b, group=128, **kw)
        # the exactly computed quantized layer whose codes come from g h (the fused kernel's), in float64
        hs = (x.float() if r is None else want_r.float()).double()
        gh = hs * (off + w.double())
        amax = gh.reshape(M, -1, 128).abs().amax(-1, keepdim=True)
        codes = (gh.reshape(M, -1, 128) * (448.0 / amax)).float().to(torch.float8_e4m3fn).double()
        rn = torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + 1e-6)
        wd = wq.double() * sc.double().repeat_interleave(bk, 1)
        bd = 0 if b is None else b.double()
        ideal = (codes * amax / 448.0).reshape(M, K) * rn @ wd.T + bd
        out[f"q_norm_ideal_{name}"] = (err(y, ideal), tol if f32 else 3e-2)
        if f32:     # the same codes as the unfused path but at fp8 rounding ties
            out[f"q_norm_vs_unfused_{name}"] = (rel(y, plain, plain_noq), 1e-3)
            out[f"sensitive_noquant_{name}"] = (-rel(FG.norm_gemv(x, r, w, 1e-6, off, p.weight, b, **kw)[0], plain,
                                                     plain_noq), -0.5)
        else:       # bf16: codes of the fp32 g h, not of the rounded norm output: a different rounding of the same
            # layer, as accurate against the unquantized one in float64 (the interpreter truncates bf16 casts: some
            # noise of its own)
            exact = gh * rn @ wd.T + bd
            e_fused, e_plain = ((y.double() - exact).norm() / exact.norm()).item(), \
                ((plain.double() - exact).norm() / exact.norm()).item()
            out[f"q_norm_accuracy_{name}"] = (e_fused / e_plain, 1.25)
        ya = FG.act_gemv(gu, p.weight, b, "silu", group=128, **kw)
        out[f"q_act_{name}"] = (err(ya, p(aq(a), b, aq)), tol if f32 else 4e-2)
        if M in (1, 5):
            bad = [("drop", torch.ones_like(sc)), ("shift", sc.roll(1, 1 if sc.shape[1] > 1 else 0))]
            for what, s_bad in bad:
                yb, _ = FG.norm_gemv(x, r, w, 1e-6, off, p.weight, b, config=cfg, scale=s_bad, block=p.block)
                out[f"sensitive_scale_{what}_{name}"] = (-err(yb, p(h, b)), -0.1)
                yb, _ = FG.norm_gemv(x, r, w, 1e-6, off, p.weight, b, config=cfg, scale=s_bad, block=p.block,
                                     group=128)
                out[f"sensitive_scale_{what}_q_{name}"] = (-err(yb, plain), -0.1)
    # power-of-two group scales (ue8m0), the act prologue: ActQuant's codes and scales
    wq, sc = _fp8(rnd(N, K), 128)
    p, aq2 = PackedFp8(wq, sc, 128), ActQuant("group", 128, pow2=True)
    gu = rnd(3, 2 * K)
    ya = FG.act_gemv(gu, p.weight, None, "silu", config=(64, 256, 1, 1), scale=p.scale, block=p.block, group=128,
                     pow2=True)
    out["q_act_pow2_M3_float32"] = (err(ya, p(aq2(R.silu_and_mul(gu)), None, aq2)), 2e-6)
    return out


def _layer_checks() -> dict:
    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.layers import fused as FU
    from xllm_gen.runtime.layers import linear as LL
    from xllm_gen.runtime.layers.quant import ActQuant
    from xllm_gen.runtime.layers.quant_linear import PackedFp8
    from xllm_gen.runtime.ops import fused_gemv as FG
    torch.manual_seed(1)
    calls = {"norm_gemv": 0, "act_gemv": 0}
    orig = {k: getattr(FG, k) for k in calls}

    def counted(name):
        def f(*a, **kw):
            calls[name] += kw.get("scale") is not None
            return orig[name](*a, **kw)
        return f
    for k in calls:
        setattr(FG, k, counted(k))

    def pack(lin, bk, quant):
        lin.packed = PackedFp8(*_fp8(torch.randn(lin.weight.shape), bk), bk)
        lin.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        lin.act_quant = ActQuant("group", 128) if quant else None
        return lin

    def err(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1.0)).item()

    out = {}
    norm = L.RMSNorm(256, 1e-6)
    norm.weight.data = 1 + 0.2 * torch.randn(256)
    FU.all_reduce = LL.all_reduce = lambda y: 2 * y
    for quant in (False, True):
        qkv = pack(L.ReplicatedLinear(256, 48, bias=True), 128, quant)
        qkv.bias.data = torch.randn(48)
        down = pack(L.RowParallelLinear(256, 24, bias=True), 256, quant)
        down.bias.data, down.tp_size = torch.randn(24), 2
        x, r, gu = torch.randn(3, 256), torch.randn(3, 256), torch.randn(3, 512)
        act = L.gated_act("silu")
        FU.MODE = "0"
        (y0, r0), d0 = L.norm_linear(norm, qkv, x, r), L.act_linear(act, down, gu)
        FU.MODE = "1"
        before = dict(calls)
        (y1, r1), d1 = L.norm_linear(norm, qkv, x, r), L.act_linear(act, down, gu)
        tag = "quant" if quant else "weight_only"
        out[f"layer_norm_linear_{tag}"] = (err(y1, y0) if calls["norm_gemv"] > before["norm_gemv"] else 1.0, 1e-5)
        out[f"layer_residual_{tag}"] = (err(r1, r0), 0.0)
        out[f"layer_act_linear_tp2_{tag}"] = (err(d1, d0) if calls["act_gemv"] > before["act_gemv"] else 1.0, 1e-5)
    return out


def _pack_model(model, bk, group) -> int:
    """Every linear layer of the model (not the lm head) packed as float8 with scales per row and bk columns (bk 0: per
    channel), its input quantized per token and `group` columns (0: not)."""
    from xllm_gen.runtime.layers.linear import _Linear
    from xllm_gen.runtime.layers.quant import ActQuant
    from xllm_gen.runtime.layers.quant_linear import PackedFp8
    n = 0
    for m in model.modules():
        if isinstance(m, _Linear) and m.weight.dim() == 2:
            cols = bk or m.weight.shape[1]
            m.packed = PackedFp8(*_fp8(m.weight.data.float(), cols), cols)
            m.weight = torch.nn.Parameter(m.weight.new_empty(0), requires_grad=False)
            m.act_quant = ActQuant("group", group) if group else None
            n += 1
    return n


def _model_checks(ckpt: str, bk: int, group: int, sensitivity: bool) -> dict:
    from xllm_gen import LLM, SamplingParams
    from xllm_gen.runtime.layers import fused as FU
    from xllm_gen.runtime.ops import fused_gemv as FG
    calls = {"norm_gemv": 0, "act_gemv": 0}
    orig = {k: getattr(FG, k) for k in calls}

    def counted(name):
        def f(*a, **kw):
            calls[name] += kw.get("scale") is not None         # a float8 weight's call
            return orig[name](*a, **kw)
        return f
    for k in calls:
        setattr(FG, k, counted(k))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 3]}, {"prompt_token_ids": [9, 2, 44, 7, 31, 12, 8, 1, 6, 70, 3]}]
    out = {}
    with LLM(model=ckpt, device="cpu", dtype="float32", block_size=4) as llm:
        out["packed"] = _pack_model(llm.engine.runner.model, bk, group)

        def run():
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        FU.MODE = "0"
        out["unfused"] = run()
        out["unfused_calls"] = dict(calls)
        FU.MODE = "1"
        out["fused"] = run()
        out["fused_calls"] = dict(calls)
        if sensitivity:
            form = FU._weight_form

            def rolled(linear, x, prologue):      # the fused kernel alone gets the scales of the next row
                f = form(linear, x, prologue)
                if f is None or not f[1]:
                    return f
                return f[0], dict(f[1], scale=f[1]["scale"].roll(1, 0)), f[2]
            FU._weight_form = rolled
            out["rolled_scales"] = run()
            FU._weight_form = form
    return out


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--interpret":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    what = sys.argv[2]
    res = (_kernel_checks() if what == "kernels" else _layer_checks() if what == "layers" else
           _model_checks(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"))
    print("RESULT " + json.dumps(res))
    sys.exit(0)


def _interpret(*args) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", XLLM_FUSED_DECODE="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--interpret", *map(str, args)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _check(res: dict, prefixes: tuple) -> None:
    for pre in prefixes:
        assert any(k.startswith(pre) for k in res), (pre, sorted(res))
    bad = {k: v for k, v in res.items() if not v[0] <= v[1]}       # (NaN too)
    assert not bad, bad


def test_fused_fp8_kernels_match_unfused_ops():
    res = _interpret("kernels")
    _check(res, ("wo_norm_M1", "wo_norm_M2", "wo_norm_M5", "wo_norm_M8", "wo_act_", "wo_norm_residual_",
                 "q_norm_ideal_", "q_norm_vs_unfused_", "q_norm_accuracy_", "q_act_M", "q_act_pow2",
                 "sensitive_noquant_", "sensitive_scale_drop_", "sensitive_scale_shift_q_"))
    assert len(res) >= 60, len(res)


def test_fused_fp8_layers():
    res = _interpret("layers")
    _check(res, ("layer_norm_linear_weight_only", "layer_norm_linear_quant", "layer_act_linear_tp2_quant"))


def test_fused_fp8_refusals():
    """Where the fp8 fused GEMV cannot run, _weight_form says so (the plain ops run) and the launcher refuses."""
    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.layers import fused as FU
    from xllm_gen.runtime.layers.quant import ActQuant
    from xllm_gen.runtime.layers.quant_linear import PackedFp8
    from xllm_gen.runtime.ops import fused_gemv as FG
    from xllm_gen.runtime.ops import fused_gemv_fp8 as F8
    lin = L.ReplicatedLinear(256, 32)
    lin.packed = PackedFp8(*_fp8(torch.randn(32, 256), 128), 128)
    x = torch.randn(2, 256)
    assert FU._weight_form(lin, x, "norm")[2] == ("fp8", 128, 0, False)
    lin.act_quant = ActQuant("group", 128)
    assert FU._weight_form(lin, x, "norm")[1]["group"] == 128
    assert FU._weight_form(lin, torch.randn(9, 256), "norm") is None                 # 9 rows: the MMA form is bf16
    for aq in (ActQuant("group", 128, pow2=True), ActQuant("token"), ActQuant("static", scale=0.5),
               ActQuant("group", 96), ActQuant("group", 8), ActQuant("int8_token")):
        lin.act_quant = aq
        assert FU._weight_form(lin, x, "norm") is None, aq
    lin.act_quant = ActQuant("group", 128, pow2=True)
    assert FU._weight_form(lin, x, "act")[1]["pow2"] is True                         # the act prologue takes ue8m0
    lin.act_quant = None
    lin.packed = PackedFp8(*_fp8(torch.randn(32, 240), 24), 24)                      # 24 columns: splits a slice
    assert FU._weight_form(lin, torch.randn(2, 240), "norm") is None
    assert F8.candidates(1, 4096, 4096, 128) and all(c[1] % 128 == 0 for c in F8.candidates(4, 4096, 4096, 128))
    assert F8.default_config(1, 64, 64, 128)[1] == 128
    p = PackedFp8(*_fp8(torch.randn(32, 256), 128), 128)
    with pytest.raises(ValueError, match="whole groups"):
        FG.norm_gemv(x, None, torch.ones(256), 1e-6, 0.0, p.weight, None, config=(8, 64, 1, 1), scale=p.scale,
                     block=p.block, group=128)
    with pytest.raises(ValueError, match="do not fit"):
        FG.norm_gemv(torch.randn(9, 256), None, torch.ones(256), 1e-6, 0.0, p.weight, None, scale=p.scale,
                     block=p.block)


def test_fused_fp8_tuning_keys(monkeypatch):
    """tune_fused_gemvs keys a packed fp8 shape by its form, apart from a bf16 weight of the same N, K, in the choice
    table and in the tuning cache; rows past 8 are not tuned for it; a decision the cache holds is not measured."""
    from xllm_gen.runtime.layers import fused as FU
    from xllm_gen.runtime.layers import linear as LIN
    from xllm_gen.runtime.layers.quant_linear import PackedFp8
    from xllm_gen.runtime.ops import tuning_cache as TC
    N, K, dt = 64, 256, torch.bfloat16
    p = PackedFp8(*_fp8(torch.randn(N, K), 128), 128)
    form = ("fp8", 128, 128, False)
    cached = {TC.key(f"fused_{pr}_fp8_128_g128", M, N, K, dt): ((2, 1024, 2, 1), M == 1)
              for pr in ("norm", "act") for M in (1, 2, 4, 8)}
    monkeypatch.setattr(FU, "MODE", "")
    monkeypatch.setattr(FU, "FUSED_GEMV_CHOICE", {"norm": {}, "act": {}})

    def no_timing(*a, **k):
        raise AssertionError("measured a decision the cache holds")
    monkeypatch.setattr(LIN, "graph_time_ms", no_timing)
    FU.tune_fused_gemvs({}, [1, 2, 4, 8, 16], (cached, {}), {(N, K, dt) + (form,): [(p.weight, None, p, None)]})
    assert FU.FUSED_GEMV_CHOICE["norm"][(1, N, K, dt) + form] == ((2, 1024, 2, 1), True)
    assert FU.FUSED_GEMV_CHOICE["act"][(3, N, K, dt) + form] == ((2, 1024, 2, 1), False)      # its bucket of 4
    assert (1, N, K, dt) not in FU.FUSED_GEMV_CHOICE["norm"]                       # never a bf16 weight's entry
    assert not any(k[0] > 8 for t in FU.FUSED_GEMV_CHOICE.values() for k in t)    # the MMA form is bf16 only


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from fixtures.tiny_hf import make_tiny_qwen3
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_fp8"))


def _assert_model(res: dict, sensitivity: bool) -> None:
    assert res["packed"] >= 8, res                      # 2 layers x (qkv, o, gate_up, down)
    assert set(res["unfused_calls"].values()) == {0}, "XLLM_FUSED_DECODE=0 must run the plain ops"
    calls, steps = res["fused_calls"], NEW_TOKENS - 1
    assert calls["norm_gemv"] >= 2 * 2 * steps and calls["act_gemv"] >= 2 * steps, res
    assert res["fused"] == res["unfused"], f"fused {res['fused']} != unfused {res['unfused']}"
    if sensitivity:
        assert res["rolled_scales"] != res["fused"], "rolled scales in the fused kernel must change the tokens"


@pytest.mark.slow     # ~8 s; the kernels and layer arms run by default (XLLM_FUSED_DECODE=auto keeps fp8 plain on the GPUs measured)
def test_fused_fp8_decode_model_tokens_quantized_input(tiny_qwen3):
    res = _interpret("model", tiny_qwen3, 32, 32, 0)
    _assert_model(res, False)


@pytest.mark.slow
def test_fused_fp8_decode_model_tokens_weight_only(tiny_qwen3):
    res = _interpret("model", tiny_qwen3, 0, 0, 1)
    _assert_model(res, True)


def test_a_fused_form_that_cannot_run_leaves_the_plain_ops(monkeypatch, caplog):
    """Start-up tuning never keeps a model from serving: a fused GEMV that fails to build or run for a shape is
    logged and that shape keeps the plain ops."""
    from xllm_gen.runtime.layers import fused

    def broken(*a, **k):
        raise RuntimeError("no kernel for this geometry")
    monkeypatch.setattr(fused, "_measure", broken)
    monkeypatch.setattr(fused, "FUSED_GEMV_CHOICE", {"norm": {}, "act": {}})
    w = torch.randn(64, 128)
    with caplog.at_level("WARNING", logger="xllm_gen"):
        fused.tune_fused_gemvs({(64, 128, w.dtype): [(w, None)]}, [1], ({}, {}))
    assert fused.FUSED_GEMV_CHOICE["norm"][(1, 64, 128, w.dtype)] == (None, False)
    assert "no kernel for this geometry" in caplog.text
