"""Fused decode prologues (runtime/ops/fused_gemv.py, runtime/layers/fused.py; generated code's L.norm_linear and
L.act_linear), on CPU under TRITON_INTERPRET=1 (in a subprocess: the variable must be set before triton is
imported):

- kernels: norm_gemv (RMSNorm of x + residual, weight_offset 0 and 1, no residual, bias) and act_gemv (silu, gelu
  tanh, gelu erf) against the unfused torch ops in float32 and bfloat16, for 1, 3 and 8 rows (FMA) and 9, 12 and 16
  rows (tensor cores, split-K or not), K a multiple of BLOCK_K or not (masked tail); the residual written by the
  kernel is exactly x + r;
- qk_norm_rope_store (q/k norm + rotary + the KV-cache write, runtime/ops/fused_rope_store.py) equals
  qk_norm_rope + store_kvcache bit for bit (neox and mRoPE, with and without norms, a padding row with slot -1);
- model: a tiny Qwen3 greedy decode with the fused kernels forced on (XLLM_FUSED_DECODE=1) gives the tokens of the
  unfused path; the fused kernels were called (counted; the rotary + KV store at decode only); a wrong norm weight
  given to the fused kernel only (its weight_offset shifted by 0.5) changes the tokens, and so does a rotary kernel
  that skips the KV write (the attention reads what the fused kernel stores);
- (slow) the same for a tiny Gemma 2 ((1 + w) norms, sandwich post-norms, GELU-tanh, rotary without q/k norm);
- generated code: the compiler emits the fused calls exactly where the pattern holds (an RMSNorm step before an
  attention / MLP block; a gated MLP's activation), and the plain code elsewhere.
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
NEW_TOKENS = 8


def _kernel_checks() -> dict:
    import torch.nn.functional as F

    from xllm_gen.runtime.ops import fused_gemv as FG
    from xllm_gen.runtime.ops import reference as R

    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    def err(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1.0)).item()

    out = {}
    # (M, N, K, config): K 64 / 128 mask-free; K 96, 160 with a masked tail; 8 rows per program but one case
    # (the interpreter runs the programs one by one)
    # 9..64 rows: the tensor-core form, config (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K): no split; split
    # K with a masked tail (K 160 in two ranges of 128 and 32); four even ranges
    for M, N, K, cfg in [(1, 24, 64, (8, 32, 1, 1)), (3, 17, 96, (8, 64, 1, 1)), (8, 12, 160, (8, 128, 4, 3)),
                         (2, 5, 128, (1, 64, 2, 2)), (12, 40, 96, (16, 16, 32, 1, 1, 1)),
                         (16, 24, 160, (16, 16, 64, 1, 1, 2)), (9, 20, 128, (16, 16, 32, 1, 1, 4))]:
        # the interpreter's tl.dot of bf16 tiles is wrong (triton_kernels.skinny_mma_gemm's too): the tensor-core
        # form is checked in float32 here, in bf16 on a GPU (tests/gpu/test_gpu_fused_decode.py)
        for dt, tol, rtol in ((torch.float32, 2e-6, 0.0), (torch.bfloat16, 2e-2, 1e-2))[:1 if M > 8 else 2]:
            # bf16 residual: the interpreter's float32 -> bfloat16 cast may differ by one ulp from torch's
            name = f"M{M}_N{N}_K{K}_{str(dt)[6:]}"
            x, r, w, W, b = rnd(M, K).to(dt), rnd(M, K).to(dt), (1 + 0.3 * rnd(K)).to(dt), rnd(N, K).to(dt), \
                rnd(N).to(dt)
            for off, res, bias in ((0.0, r, None), (1.0, None, b), (1.0, r, b)):
                y, nr = FG.norm_gemv(x, res, w, 1e-6, off, W, bias, config=cfg)
                if res is None:
                    h, want_r = R.rms_norm(x, w, 1e-6, off), x
                else:
                    h, want_r = R.fused_add_rms_norm(x, res, w, 1e-6, off)
                want = F.linear(h, W, bias)
                key = f"norm_{name}_off{off:g}_{'res' if res is not None else 'nores'}_" \
                      f"{'bias' if bias is not None else 'nobias'}"
                out[key] = (err(y, want), tol)
                out[key + "_residual"] = (err(nr, want_r), rtol)
            gu, W2 = rnd(M, 2 * K).to(dt), rnd(N, K).to(dt)
            for act, ref, bias in (("silu", R.silu_and_mul, b), ("gelu_tanh", lambda t: R.gelu_and_mul(t, "tanh"), None),
                                   ("gelu", lambda t: R.gelu_and_mul(t, "none"), b)):
                y = FG.act_gemv(gu, W2, bias, act, config=cfg)
                out[f"act_{act}_{name}_{'bias' if bias is not None else 'nobias'}"] = (
                    err(y, F.linear(ref(gu), W2, bias)), tol)
    # a strided x (a view of a wider buffer, as q/k/v splits give) is read through its row stride
    xs = rnd(4, 200)[:, :64]
    W = rnd(8, 64)
    y, _ = FG.norm_gemv(xs, None, torch.ones(64), 1e-6, 0.0, W)
    out["norm_strided_x"] = (err(y, F.linear(R.rms_norm(xs, torch.ones(64), 1e-6), W)), 2e-6)
    # q/k norm + rotary + KV-cache store in one kernel vs qk_norm_rope + store_kvcache; v a strided view, a padding
    # row (slot -1), mRoPE positions, and no norms
    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.ops import triton_kernels as T
    from xllm_gen.runtime.ops.fused_rope_store import qk_norm_rope_store
    N, H, Hk, D = 5, 4, 2, 16
    for kind, sections in (("neox", None), ("mrope_interleaved", [4, 2, 2])):
        rot = L.Rotary(D, 1e4, 64, kind, sections) if sections else L.Rotary(D, 1e4, 64, kind)
        rot._to(torch.device("cpu"))
        pos = torch.tensor([3, 0, 7, 1, 9]) if not sections else torch.randint(0, 40, (3, N), generator=g)
        for norms in (True, False):
            qkv = rnd(N, (H + 2 * Hk) * D)
            q, k, v = qkv.split([H * D, Hk * D, Hk * D], dim=-1)
            q, k, v = q.view(N, H, D), k.view(N, Hk, D), v.view(N, Hk, D)
            qw, kw = (rnd(D), rnd(D)) if norms else (None, None)
            slots = torch.tensor([6, -1, 0, 11, 5])
            kc, vc = rnd(3, 4, Hk, D), rnd(3, 4, Hk, D)
            kc2, vc2 = kc.clone(), vc.clone()
            qo, ko = qk_norm_rope_store(q, k, v, qw, kw, 1e-6, pos, rot.cos_sin_cache, rot.axis_map, kc, vc, slots)
            wq, wk = T.qk_norm_rope(q, k, qw, kw, 1e-6, pos, rot.cos_sin_cache, rot.axis_map)
            R.store_kvcache(wk, v, kc2, vc2, slots)
            name = f"rope_store_{kind}_{'norm' if norms else 'nonorm'}"
            out[name] = (max(err(qo, wq), err(ko, wk), err(kc, kc2), err(vc, vc2)), 0.0)
    # TP: a row-parallel down projection at tp 2 adds its bias after the all-reduce (faked as the sum of two equal
    # ranks), as RowParallelLinear.forward does
    from xllm_gen.runtime.layers import fused as FU
    from xllm_gen.runtime.layers import linear as LL
    down = L.RowParallelLinear(32, 8, bias=True)
    down.weight.data, down.bias.data = rnd(8, 32), rnd(8)
    down.tp_size = 2
    FU.all_reduce = LL.all_reduce = lambda y: 2 * y
    gu, act = rnd(3, 64), L.gated_act("silu")
    out["act_linear_row_parallel_tp2"] = (err(FU.act_linear(act, down, gu), down(act(gu))), 2e-6)
    return out


def _model_checks(ckpt: str) -> dict:
    from xllm_gen import LLM, SamplingParams
    from xllm_gen.runtime.layers import fused as FU
    from xllm_gen.runtime.ops import fused_gemv as FG
    from xllm_gen.runtime.ops import fused_rope_store as FR
    from xllm_gen.runtime.ops import triton_kernels as T
    calls = {"norm_gemv": 0, "act_gemv": 0, "qk_norm_rope_store": 0}
    mods = {"norm_gemv": FG, "act_gemv": FG, "qk_norm_rope_store": FR}
    orig = {k: getattr(mods[k], k) for k in calls}

    def counted(name):
        def f(*a, **kw):
            calls[name] += 1
            return orig[name](*a, **kw)
        return f

    for k in calls:
        setattr(mods[k], k, counted(k))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 3]}, {"prompt_token_ids": [9, 2, 44, 7, 31, 12, 8, 1, 6, 70, 3]}]
    out = {}
    with LLM(model=ckpt, device="cpu", dtype="float32", block_size=4) as llm:
        def run():
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        FU.MODE = "0"
        out["unfused"] = run()
        out["unfused_calls"] = dict(calls)
        FU.MODE = "1"
        FU.ATTENTION_ROPE = False     # the rotary + KV store in its own kernel (below: handed to the attention)
        out["fused"] = run()
        out["fused_calls"] = dict(calls)
        # the rotary + KV store handed to the attention (XLLM_ATTENTION_ROPE): the CPU backend runs it first itself
        made, rope_store = [], FR.RopeStore
        FR.RopeStore = lambda *a, **kw: made.append(1) or rope_store(*a, **kw)
        FU.ATTENTION_ROPE = True
        out["deferred"] = run()
        out["deferred_made"] = len(made)
        FU.ATTENTION_ROPE, FR.RopeStore = False, rope_store     # the arms below: the rotary's own kernel
        norm_args = FU._norm_args

        def wrong(norm):          # the fused kernel alone gets a wrong norm weight: (0.5 + w) for w
            a = norm_args(norm)
            return None if a is None else (a[0], a[1], a[2] + 0.5)
        FU._norm_args = wrong
        out["wrong_norm"] = run()
        FU._norm_args = norm_args

        def no_store(q, k, v, qw, kw, eps, pos, cache, axis_map, kc, vc, slots):   # the rotary alone, no KV write
            return T.qk_norm_rope(q, k, qw, kw, eps, pos, cache, axis_map)
        FR.qk_norm_rope_store = no_store
        out["no_kv_store"] = run()
        FR.qk_norm_rope_store = orig["qk_norm_rope_store"]
    return out


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--interpret":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    res = _kernel_checks() if sys.argv[2] == "kernels" else _model_checks(sys.argv[3])
    print("RESULT " + json.dumps(res))
    sys.exit(0)


def _interpret(*args) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", XLLM_FUSED_DECODE="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--interpret", *args], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_fused_kernels_match_unfused_ops():
    res = _interpret("kernels")
    kinds = {k.split("_")[0] for k in res}
    assert {"norm", "act"} <= kinds and len(res) > 60, sorted(res)[:5]
    bad = {k: v for k, v in res.items() if v[0] > v[1]}
    assert not bad, bad


@pytest.mark.slow     # the default run keeps the kernels-vs-plain-ops test above; the GPU tests run the model
def test_fused_decode_model_tokens(qwen3_tied):
    res = _interpret("model", str(qwen3_tied))
    assert set(res["unfused_calls"].values()) == {0}, "XLLM_FUSED_DECODE=0 must run the plain ops"
    # 2 layers x (2 norm prologues, 1 activation prologue, 1 rotary + KV store) per decode step (of 2 rows)
    calls, steps = res["fused_calls"], NEW_TOKENS - 1
    assert calls["norm_gemv"] >= 2 * 2 * steps and calls["act_gemv"] >= 2 * steps, res
    assert calls["qk_norm_rope_store"] == 2 * steps, res                     # decode only: prefill unchanged
    assert res["fused"] == res["unfused"], f"fused {res['fused']} != unfused {res['unfused']}"
    assert res["deferred"] == res["unfused"] and res["deferred_made"] == 2 * steps, res
    assert res["wrong_norm"] != res["fused"], "a wrong norm weight in the fused kernel must change the tokens"
    assert res["no_kv_store"] != res["fused"], "the attention must read the K/V the fused rotary kernel stores"


@pytest.mark.slow
def test_fused_decode_model_tokens_gemma2(tiny_checkpoint):
    """Another family through the same primitives: (1 + w) RMSNorms before blocks with sandwich post-norms, a GELU
    (tanh) gated MLP, rotary without q/k norm (the rotary + KV store kernel), logit soft-capping."""
    res = _interpret("model", str(tiny_checkpoint("Gemma2ForCausalLM")))
    assert set(res["unfused_calls"].values()) == {0}
    assert min(res["fused_calls"].values()) > 0, res
    assert res["fused"] == res["unfused"], f"fused {res['fused']} != unfused {res['unfused']}"
    assert res["wrong_norm"] != res["fused"] and res["no_kv_store"] != res["fused"], res


@pytest.mark.slow
def test_fused_decode_model_tokens_mrope(qwen3_vl_tied):
    """mRoPE (positions [3, N], the axis map): the rotary + KV store handed to the attention as a RopeStore too."""
    res = _interpret("model", str(qwen3_vl_tied))
    assert res["fused"] == res["unfused"] and res["deferred"] == res["unfused"], res
    assert res["deferred_made"] > 0 and res["deferred_made"] == res["fused_calls"]["qk_norm_rope_store"], res
    assert res["wrong_norm"] != res["fused"] and res["no_kv_store"] != res["fused"], res


def test_generated_code_fuses_where_the_pattern_holds():
    qwen3 = (ROOT / "generated/qwen3/model.py").read_text()
    assert "L.norm_linear(norm, self.qkv_proj, hidden_states, residual)" in qwen3
    assert "L.norm_linear(norm, self.gate_up_proj, hidden_states, residual)" in qwen3
    assert "L.act_linear(self.act_fn, self.down_proj, gate_up)" in qwen3
    assert "self.self_attn(positions, hidden_states, residual, self.input_layernorm)" in qwen3
    # LayerNorm families (parallel residual or not) and post-norm-only layers keep the plain code
    for name in ("gpt_neox", "phi", "olmo2", "starcoder2"):
        src = (ROOT / f"generated/{name}/model.py").read_text()
        assert "L.norm_linear" not in src, name


def test_fusion_plan_rules():
    import dataclasses

    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.fusion import fusion_plan
    from xllm_gen.codegen.ir import GatedMLPIR, NormIR, Value
    ir = compile_spec(str(ROOT / "specs/qwen3.yaml")).ir
    plan = fusion_plan(ir)
    assert plan.norm_prologue == frozenset({"self_attn", "mlp"})
    mlp = next(b for b in ir.layer.blocks if isinstance(b, GatedMLPIR))
    assert plan.act_prologue(mlp)                                  # a config symbol: decided at load
    assert plan.act_prologue(dataclasses.replace(mlp, activation=Value(literal="gelu_pytorch_tanh")))
    assert not plan.act_prologue(dataclasses.replace(mlp, activation=Value(literal="relu2")))
    # a LayerNorm step is not fused
    blocks = tuple(dataclasses.replace(b, kind="layernorm") if isinstance(b, NormIR) and b.name == "input_layernorm"
                   else b for b in ir.layer.blocks)
    ir2 = dataclasses.replace(ir, layer=dataclasses.replace(ir.layer, blocks=blocks))
    assert fusion_plan(ir2).norm_prologue == frozenset({"mlp"})


def test_fusion_of_a_per_layer_choice_is_per_alternative():
    """A per-layer choice fuses its step's norm into the alternatives that take the prologue (a dense MLP), not the
    others (a MoE, a linear): the layer records which one it built (`self.<module>_fused`) and calls accordingly."""
    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.fusion import fusion_plan
    plan = fusion_plan(compile_spec(str(ROOT / "specs/qwen3_moe.yaml")).ir)
    assert plan.norm_prologue == frozenset({"self_attn", "mlp"})        # not the MoE alternative
    src = (ROOT / "generated/qwen3_moe/model.py").read_text()
    assert "self.mlp_fused = True" in src and "self.mlp_fused = False" in src
    assert "if self.mlp_fused:" in src
    decilm = (ROOT / "generated/decilm/model.py").read_text()     # attention / linear / absent per layer
    assert "self.self_attn_fused = False" in decilm and "if self.self_attn_fused:" in decilm
    assert "L.RowParallelLinear(config.hidden_size, config.hidden_size, bias=False, input_is_parallel=False)" in decilm


def test_fused_helpers_fall_back_to_plain_ops_on_cpu():
    """Without the interpreter (or with XLLM_FUSED_DECODE=0) the helpers are exactly the plain ops."""
    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.layers import fused as FU
    torch.manual_seed(0)
    norm = L.RMSNorm(16, 1e-6)
    norm.weight.data = torch.randn(16)
    lin = L.ReplicatedLinear(16, 8)
    lin.weight.data = torch.randn(8, 16)
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    y, nr = L.norm_linear(norm, lin, x, r)
    h, want_r = norm(x, r)
    assert torch.equal(y, lin(h)) and torch.equal(nr, want_r)
    act = L.gated_act("silu")
    down = L.RowParallelLinear(16, 8)
    down.weight.data = torch.randn(8, 16)
    gu = torch.randn(3, 32)
    assert torch.equal(L.act_linear(act, down, gu), down(act(gu)))
    assert FU.gemv_config(lin, x, "norm") is False


def test_fused_candidates():
    from xllm_gen.runtime.layers.fused import fused_candidates
    from xllm_gen.runtime.ops.triton_kernels import skinny_gemm_candidates
    assert fused_candidates(1, 1024, 3072) == skinny_gemm_candidates(1, 1024, 3072)[1:]
    assert fused_candidates(8, 1024, 3072) == skinny_gemm_candidates(8, 1024, 3072)[1:] + [(8, 512, 4, 1)]
    assert all(c[1] <= 64 for c in fused_candidates(4, 24, 64))     # BLOCK_K never beyond the table's for small K
