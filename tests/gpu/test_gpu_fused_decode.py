"""Fused decode prologues on the GPU (marker `gpu`; skipped without CUDA): runtime/ops/fused_gemv.py and the
generated code's L.norm_linear / L.act_linear.

- kernels (bf16, Qwen3-0.6B and -8B shapes, 1-8 rows with every candidate launch config of the skinny GEMM, 12-64
  rows with every one of the tensor-core skinny GEMM) against the unfused Triton ops with the same GEMM config: norm_gemv vs fused_add_rms_norm + skinny_gemm within bf16
  rounding (the fused kernel keeps the normalized x in fp32), its residual output bit for bit; act_gemv vs
  silu_and_mul / gelu_and_mul + skinny_gemm within bf16 rounding (bit-exact counts are printed);
- a tiny bf16 Qwen3 (head_dim 128) decode with the fused kernels forced on (XLLM_FUSED_DECODE=1) against the plain
  ops (=0): greedy tokens equal up to bf16 near-ties, logprobs close; the kernels are actually called;
- the q/k norm + rotary kernel with the KV-cache write (runtime/ops/fused_rope_store.py) == qk_norm_rope +
  store_kvcache bit for bit;
- fused on: CUDA-graph decode == eager decode (same kernels and launch configs): tokens equal, logprob difference
  printed (expected 0.0).
Numbers are printed (pytest -s) and appended as JSON lines to $XLLM_TEST_REPORT when set.
"""
from __future__ import annotations

import random

import pytest
import torch
from fixtures.report import report as _report

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NEAR_TIE = 0.05
BF16_LOGIT_ULP = 0.0625     # one bf16 step of a logit in [8, 16): two logits one step apart are a tie
MAX_LOGPROB_DIFF = 0.1
SHAPES = {  # name: (N, K) of the linear after the prologue
    "0.6B qkv": (4096, 1024), "0.6B gate_up": (6144, 1024), "0.6B down": (1024, 3072),
    "8B qkv": (6144, 4096), "8B down": (4096, 12288),
}


def _err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1.0)).item()


@pytest.mark.parametrize("name", list(SHAPES))
def test_fused_kernels_vs_unfused_triton(name):
    from xllm_gen.runtime import ops
    from xllm_gen.runtime.ops import fused_gemv as FG
    from xllm_gen.runtime.ops import triton_kernels as T
    N, K = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    W = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dt)
    bias = torch.randn(N, device="cuda", generator=g).to(dt)
    worst, exact, cases = 0.0, 0, 0
    for M in (1, 2, 3, 4, 8, 12, 16, 32, 64):
        x = torch.randn(M, K, device="cuda", generator=g).to(dt)
        r = torch.randn(M, K, device="cuda", generator=g).to(dt)
        w = (1 + 0.1 * torch.randn(K, device="cuda", generator=g)).to(dt)
        gu = torch.randn(M, 2 * K, device="cuda", generator=g).to(dt)
        # 9..64 rows: the tensor-core form against the tensor-core skinny GEMM with the same config
        gemm = T.skinny_gemm if M <= 8 else T.skinny_mma_gemm
        for cfg in (T.skinny_gemm_candidates(M, N, K) + [(8, 512, 4, 1)] if M <= 8 else T.skinny_mma_candidates(M, N, K)):
            if "down" not in name:
                for off in (0.0, 1.0):
                    h, want_r = ops.fused_add_rms_norm(x, r, w, 1e-6, off)
                    want = gemm(h, W, bias, config=cfg)
                    y, nr = FG.norm_gemv(x, r, w, 1e-6, off, W, bias, config=cfg)
                    torch.cuda.synchronize()
                    assert torch.equal(nr, want_r), f"{name} M{M} {cfg}: residual differs"
                    e = _err(y, want)
                    worst, exact, cases = max(worst, e), exact + torch.equal(y, want), cases + 1
                    assert e < 2e-2, f"{name} M{M} {cfg} offset {off}: norm_gemv error {e}"
            for act in (("silu", "gelu_tanh") if "down" in name else ()):
                a = ops.silu_and_mul(gu) if act == "silu" else ops.gelu_and_mul(gu, "tanh")
                want = gemm(a, W, bias, config=cfg)
                y = FG.act_gemv(gu, W, bias, act, config=cfg)
                e = _err(y, want)
                worst, exact, cases = max(worst, e), exact + torch.equal(y, want), cases + 1
                assert e < 2e-2, f"{name} M{M} {cfg} {act}: act_gemv error {e}"
    _report(test=f"fused_kernels_{name}", cases=cases, bit_exact=exact, max_err=worst)
    print(f"{name}: {cases} cases, {exact} bit-exact, max error {worst:.2e}")


def test_fused_gemv_tuning(monkeypatch):
    """tune_fused_gemvs (called by tune_decode_gemms) times the plain op + GEMM against the fused kernel per (rows, N,
    K): every entry is a candidate config; 3 rows take the choice of their bucket of 4; the layers then run the
    chosen path (fused where it won: the norm_linear output differs from the plain pair only by rounding)."""
    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.layers import fused as FU
    from xllm_gen.runtime.layers import linear as LL
    monkeypatch.setenv("XLLM_TUNING_CACHE", "0")       # measure, not read a previous process's decisions
    monkeypatch.setattr(LL, "_FORCE", None)
    monkeypatch.setattr(LL, "DECODE_GEMM_CHOICE", {})
    monkeypatch.setattr(FU, "FUSED_GEMV_CHOICE", {"norm": {}, "act": {}})
    monkeypatch.setattr(FU, "FUSED_TUNING", {})
    monkeypatch.setattr(FU, "MODE", "")
    torch.manual_seed(3)
    model = torch.nn.Sequential(LL.ReplicatedLinear(1024, 4096, bias=False), LL.ReplicatedLinear(3072, 1024, bias=False)
                                ).to("cuda", torch.bfloat16)
    for m in model:
        torch.nn.init.normal_(m.weight, std=0.02)
    LL.tune_decode_gemms(model, [1, 2, 4, 8, 16])
    print("\n[fused GEMV tuning] (prologue, M, N, K): (plain us, fused us, config)")
    for k, v in sorted(FU.FUSED_TUNING.items(), key=str):
        print(f"  {k}: {v[0]:.2f} / {v[1]:.2f} us {v[2]}")
    assert {k[:2] for k in FU.FUSED_TUNING} == {(p, M) for p in ("norm", "act") for M in (1, 2, 4, 8, 16)}
    for (p, M, N, K), (tp, tf, cfg) in FU.FUSED_TUNING.items():
        assert tp > 0 and tf > 0 and cfg in FU.fused_candidates(M, N, K)
        assert FU.FUSED_GEMV_CHOICE[p][(M, N, K, torch.bfloat16)] == (cfg, tf < tp)
        assert FU.FUSED_GEMV_CHOICE[p][(3, N, K, torch.bfloat16)] == FU.FUSED_GEMV_CHOICE[p][(4, N, K, torch.bfloat16)]
    _report(test="fused_gemv_tuning", tuning={str(k): v for k, v in FU.FUSED_TUNING.items()})
    norm = L.RMSNorm(1024, 1e-6).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    x, r = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16), torch.randn(4, 1024, device="cuda",
                                                                                  dtype=torch.bfloat16)
    y, nr = L.norm_linear(norm, model[0], x, r)
    h, want_r = norm(x, r)
    assert torch.equal(nr, want_r) and _err(y, model[0](h)) < 2e-2


@pytest.mark.parametrize("norms", [True, False])
def test_rope_store_kernel_vs_unfused(norms):
    """qk_norm_rope_store == qk_norm_rope + store_kvcache bit for bit (Qwen3 head shapes, bf16, padding rows)."""
    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.ops import triton_kernels as T
    from xllm_gen.runtime.ops.fused_rope_store import qk_norm_rope_store
    H, Hk, D = 16, 8, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    rot = L.Rotary(D, 1e6, 4096, "neox")
    rot._to(torch.device("cuda"))
    diffs = []
    for N in (1, 3, 8, 16, 100):
        qkv = torch.randn(N, (H + 2 * Hk) * D, device="cuda", generator=g).to(torch.bfloat16)
        q, k, v = (t.view(N, -1, D) for t in qkv.split([H * D, Hk * D, Hk * D], dim=-1))
        qw, kw = ((1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16) for _ in range(2)) \
            if norms else (None, None)
        pos = torch.randint(0, 4000, (N,), device="cuda", generator=g)
        slots = torch.randperm(64 * 16, device="cuda", generator=g)[:N]
        slots[N // 2] = -1
        kc = torch.randn(64, 16, Hk, D, device="cuda", generator=g).to(torch.bfloat16)
        vc = torch.randn_like(kc)
        kc2, vc2 = kc.clone(), vc.clone()
        qo, ko = qk_norm_rope_store(q, k, v, qw, kw, 1e-6, pos, rot.cos_sin_cache, None, kc, vc, slots)
        wq, wk = T.qk_norm_rope(q, k, qw, kw, 1e-6, pos, rot.cos_sin_cache, None)
        T.store_kvcache(wk, v, kc2, vc2, slots)
        torch.cuda.synchronize()
        for name, a, b in (("q", qo, wq), ("k", ko, wk), ("k_cache", kc, kc2), ("v_cache", vc, vc2)):
            if not torch.equal(a, b):
                d = (a.float() - b.float()).abs()
                where = (d > 0).nonzero()[:4].tolist()
                diffs.append(f"N={N} {name}: {int((d > 0).sum())} of {d.numel()} differ, max {d.max().item():.3g}, "
                             f"first at {where}")
    _report(test=f"rope_store_kernel_norms{int(norms)}", bit_exact=not diffs, diffs=diffs)
    assert not diffs, f"norms={norms}: " + "; ".join(diffs)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from fixtures.tiny_hf import make_tiny_qwen3
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_fused"), hidden_size=256, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=512,
                           max_position_embeddings=2048, seed=0)


def _llm(tiny_dir, mode: str, dtype: str = "bfloat16"):
    from xllm_gen import LLM
    from xllm_gen.runtime.layers import fused as FU
    FU.MODE = mode
    llm = LLM(str(tiny_dir), dtype=dtype, max_num_seqs=16, num_kv_blocks=1024, max_model_len=256,
              enable_prefix_caching=False)
    # float32 on CUDA runs eagerly with torch attention (FlashInfer has no float32 kernels): the reference run
    assert (llm.engine.runner.graphs is not None) == (dtype != "float32")
    return llm


def _params(n=20):
    from xllm_gen import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)


def _prompts(n, vocab, seed):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(9, 60))]} for _ in range(n)]


def _error_vs(ref, test):
    """The worst |logprob| difference of test's chosen tokens from ref's, over the steps where both chose the same
    tokens so far (ref: the float32 run of the same engine)."""
    worst = 0.0
    for r, t in zip(ref, test):
        a, b = r.outputs[0], t.outputs[0]
        for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                break
            worst = max(worst, abs(a.logprobs[j][x].logprob - b.logprobs[j][x].logprob))
    return worst


def _compare(ref, test, what, max_diff=MAX_LOGPROB_DIFF):
    """Greedy runs ref vs test: they may part only at a near-tie, a top-2 gap within the rounding noise the two
    runs show on their shared steps (twice the worst logprob difference there), never less than NEAR_TIE nor than
    one bf16 step of the logits (they leave the lm_head in bf16: a rounding change upstream moves a logit by one
    step, so two logits one step apart are a tie)."""
    diverged, worst, parted = 0, 0.0, []
    for i, (r, t) in enumerate(zip(ref, test)):
        a, b = r.outputs[0], t.outputs[0]
        n = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        for j in range(len(a.token_ids) if n is None else n):
            tok = a.token_ids[j]
            worst = max(worst, abs(a.logprobs[j][tok].logprob - b.logprobs[j][tok].logprob))
        if n is not None:
            diverged += 1
            vals = sorted((lp.logprob for lp in a.logprobs[n].values()), reverse=True)
            if len(vals) > 1:
                parted.append((i, n, vals[0] - vals[1]))
    near_tie = max(NEAR_TIE, 2 * worst, BF16_LOGIT_ULP)
    bad = [p for p in parted if p[2] > near_tie]
    res = dict(test=what, requests=len(ref), diverged=diverged, max_logprob_diff=worst, parted=parted,
               near_tie=near_tie, bad=bad)
    _report(**res)
    print(res)
    assert not bad, f"{what}: diverged away from a near tie: {bad}"
    if max_diff is not None:
        assert worst < max_diff, f"{what}: logprobs differ by {worst}"
    return res


def test_fused_vs_unfused_and_graph_vs_eager(tiny_dir):
    from xllm_gen.runtime.layers import fused as FU
    from xllm_gen.runtime.ops import fused_gemv as FG
    saved = FU.MODE
    try:
        llm = _llm(tiny_dir, "0", "float32")
        prompts = {B: _prompts(B, llm.engine.vocab_size, B) for B in (1, 3, 8)}
        fp32 = {B: llm.generate(p, _params()) for B, p in prompts.items()}
        llm.shutdown()
        llm = _llm(tiny_dir, "0")
        plain = {B: llm.generate(p, _params()) for B, p in prompts.items()}
        llm.shutdown()
        llm = _llm(tiny_dir, "1")
        from xllm_gen.runtime.ops import fused_rope_store as FR
        calls = {"n": 0, "rope_store": 0}
        orig, orig_rs = FG.norm_gemv, FR.qk_norm_rope_store

        def counted(*a, **kw):
            calls["n"] += 1
            return orig(*a, **kw)

        def counted_rs(*a, **kw):
            calls["rope_store"] += 1
            return orig_rs(*a, **kw)
        FG.norm_gemv, FR.qk_norm_rope_store = counted, counted_rs
        runner = llm.engine.runner
        for B, p in prompts.items():
            fused = llm.generate(p, _params())
            # the two bf16 runs differ by rounding (norm_linear keeps the normalized x in fp32): they may part only
            # at near-ties, and the fused run is no less accurate than the plain one against the float32 run (up
            # to one bf16 step of a logit, the quantum of both)
            _compare(plain[B], fused, f"fused_vs_unfused_b{B}", max_diff=None)
            err_plain, err_fused = _error_vs(fp32[B], plain[B]), _error_vs(fp32[B], fused)
            _report(test=f"fused_accuracy_b{B}", err_plain_vs_fp32=err_plain, err_fused_vs_fp32=err_fused)
            assert err_fused <= 1.5 * err_plain + BF16_LOGIT_ULP, \
                f"b{B}: fused logprobs are {err_fused:.4f} from float32's, the plain ops' {err_plain:.4f}"
            graphs, runner.graphs = runner.graphs, None
            prefill, runner.prefill_graphs = getattr(runner, "prefill_graphs", None), None
            try:
                eager = llm.generate(p, _params())
            finally:
                runner.graphs, runner.prefill_graphs = graphs, prefill
            res = _compare(eager, fused, f"fused_graph_vs_eager_b{B}")
            assert res["diverged"] == 0, res
        FG.norm_gemv, FR.qk_norm_rope_store = orig, orig_rs
        _report(test="fused_calls_eager", **calls)
        assert calls["n"] > 0 and calls["rope_store"] > 0, f"fused kernels not called in eager decode: {calls}"
        llm.shutdown()
    finally:
        FU.MODE = saved


@pytest.mark.parametrize("launch", ["1", "wait"])
def test_pdl_bit_exact(tiny_dir, launch):
    """Programmatic dependent launch (runtime/ops/pdl.py) changes only when a kernel may start, never what it
    computes: with XLLM_PDL on, graph decode (fused kernels on, batches 1, 3, 8 and 16: the skinny and the cuBLAS
    GEMM paths) gives the same tokens and the same logprobs, bit for bit, as with it off."""
    from xllm_gen.runtime.layers import fused as FU
    from xllm_gen.runtime.ops import pdl as PDL
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    saved = FU.MODE, PDL.MODE
    try:
        out = {}
        for mode in ("0", launch):
            PDL.MODE = mode
            llm = _llm(tiny_dir, "1")
            prompts = {B: _prompts(B, llm.engine.vocab_size, 100 + B) for B in (1, 3, 8, 16)}
            out[mode] = {B: llm.generate(p, _params(24)) for B, p in prompts.items()}
            llm.shutdown()
        for B in out["0"]:
            for i, (a, b) in enumerate(zip(out["0"][B], out[launch][B])):
                a, b = a.outputs[0], b.outputs[0]
                assert a.token_ids == b.token_ids, f"PDL={launch} b{B} request {i}: tokens differ"
                for j, tok in enumerate(a.token_ids):
                    assert a.logprobs[j][tok].logprob == b.logprobs[j][tok].logprob, \
                        f"PDL={launch} b{B} request {i} step {j}: logprob differs"
        _report(test=f"pdl_bit_exact_{launch}", batches=list(out["0"]), bit_exact=True)
    finally:
        FU.MODE, PDL.MODE = saved


def test_attention_rope_prologue_kernel():
    """The decode-attention kernel with the q/k norm + rotary + KV-store prologue (XLLM_ATTENTION_ROPE) against the
    two launches it replaces, bf16 at Qwen3-0.6B's attention shape (16 / 8 heads of 128, pages of 16): outputs within
    bf16 rounding, the caches equal, for 1-4 splits and a padding row; 1-D rotary and mRoPE (positions [3, B])."""
    from test_decode_attention_rope import decode_rows

    from xllm_gen.runtime.ops.decode_attention import DecodeScratch, paged_decode_attention
    from xllm_gen.runtime.ops.fused_rope_store import RopeStore, qk_norm_rope_store
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    H, Hk, D, page = 16, 8, 128, 16
    lens = [1, 200, 0, 1025, 17]
    pool = sum((L + page - 1) // page for L in lens) + 4
    ip, ix, lp, slot_mapping, positions = decode_rows(lens, page, pool, dev)
    B = len(lens)
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev).float() / D))
    ang = torch.arange(2048, device=dev).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1)
    qkv = torch.randn(B, (H + 2 * Hk) * D, device=dev, generator=g).to(dt)
    q, k, v = (qkv[:, a * D:b * D].view(B, -1, D) for a, b in ((0, H), (H, H + Hk), (H + Hk, H + 2 * Hk)))
    qw = (1 + 0.3 * torch.randn(D, device=dev, generator=g)).to(dt)
    kw = (1 + 0.3 * torch.randn(D, device=dev, generator=g)).to(dt)
    kc0 = torch.randn(pool, page, Hk, D, device=dev, generator=g).to(dt)
    vc0 = torch.randn(pool, page, Hk, D, device=dev, generator=g).to(dt)
    from xllm_gen.runtime.layers.rotary import mrope_axis_map
    # mRoPE (Qwen3-VL's interleaved [24, 20, 20]) at rows whose three positions differ, and the 1-D rotary
    axes = {"rope": (positions, None),
            "mrope": (torch.stack([positions, positions // 2, positions // 3]),
                      mrope_axis_map("mrope_interleaved", [24, 20, 20], D // 2).to(dev))}
    worst = {}
    for (kind, (pos, ax)), splits in [(a, s) for a in axes.items() for s in (1, 2, 4)]:
        scratch = DecodeScratch(8, H, Hk, D, splits, dev)
        kc_ref, vc_ref = kc0.clone(), vc0.clone()
        q_rot, _ = qk_norm_rope_store(q, k, v, qw, kw, 1e-6, pos, cos_sin, ax, kc_ref, vc_ref, slot_mapping)
        want = paged_decode_attention(q_rot, kc_ref, vc_ref, ip, ix, lp, D ** -0.5, scratch)
        kc, vc = kc0.clone(), vc0.clone()
        got = paged_decode_attention(q, kc, vc, ip, ix, lp, D ** -0.5, scratch,
                                     rope=RopeStore(k, v, qw, kw, 1e-6, pos, cos_sin, slot_mapping, axis_map=ax))
        torch.cuda.synchronize()
        worst[f"{kind}_splits{splits}"] = (_err(got, want), _err(kc, kc_ref), (vc != vc_ref).sum().item(),
                                           int(scratch.counters.abs().sum()))
    _report(test="attention_rope_prologue_kernel", worst=worst)
    print(worst)
    for splits, (e_out, e_k, v_diff, tickets) in worst.items():
        assert e_out < 2e-2 and e_k < 2e-2 and v_diff == 0 and tickets == 0, (splits, worst)


def test_attention_rope_in_the_engine(tiny_dir, monkeypatch):
    """XLLM_ATTENTION_ROPE on, with the Triton decode kernel (XLLM_DECODE_ATTENTION=triton): greedy tokens equal the
    separate-launch path's up to bf16 near-ties and no less accurate against the float32 run (the criterion of
    test_fused_vs_unfused_and_graph_vs_eager: the q norm's sum runs in another order, so bf16 roundings differ; on
    an H100 the two bf16 runs' logprobs differed by up to 0.111 at batch 8), graph decode == eager decode bit for
    bit, and the kernel ran with the prologue."""
    from xllm_gen.runtime.layers import fused as FU
    from xllm_gen.runtime.ops import decode_attention as DA
    monkeypatch.setenv("XLLM_DECODE_ATTENTION", "triton")
    saved = FU.MODE, FU.ATTENTION_ROPE
    calls = {"rope": 0}
    orig = DA.paged_decode_attention

    def counted(*a, **kw):
        calls["rope"] += kw.get("rope") is not None
        return orig(*a, **kw)
    try:
        FU.ATTENTION_ROPE = False
        llm = _llm(tiny_dir, "0", "float32")
        prompts = {B: _prompts(B, llm.engine.vocab_size, 200 + B) for B in (1, 3, 8)}
        fp32 = {B: llm.generate(p, _params()) for B, p in prompts.items()}
        llm.shutdown()
        llm = _llm(tiny_dir, "1")
        separate = {B: llm.generate(p, _params()) for B, p in prompts.items()}
        llm.shutdown()
        FU.ATTENTION_ROPE = True
        DA.paged_decode_attention = counted
        llm = _llm(tiny_dir, "1")
        runner = llm.engine.runner
        for B, p in prompts.items():
            one = llm.generate(p, _params())
            _compare(separate[B], one, f"attention_rope_vs_separate_b{B}", max_diff=None)
            err_sep, err_one = _error_vs(fp32[B], separate[B]), _error_vs(fp32[B], one)
            _report(test=f"attention_rope_accuracy_b{B}", err_separate_vs_fp32=err_sep, err_one_launch_vs_fp32=err_one)
            assert err_one <= 1.5 * err_sep + BF16_LOGIT_ULP, \
                f"b{B}: one-launch logprobs are {err_one:.4f} from float32's, the separate launches' {err_sep:.4f}"
            graphs, runner.graphs = runner.graphs, None
            try:
                eager = llm.generate(p, _params())
            finally:
                runner.graphs = graphs
            res = _compare(eager, one, f"attention_rope_graph_vs_eager_b{B}")
            assert res["diverged"] == 0, res
        llm.shutdown()
        _report(test="attention_rope_calls", **calls)
        assert calls["rope"] > 0, calls
    finally:
        FU.MODE, FU.ATTENTION_ROPE = saved
        DA.paged_decode_attention = orig
