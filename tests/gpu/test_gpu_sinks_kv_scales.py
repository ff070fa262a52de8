"""Attention sinks and per-KV-head fp8 KV-cache scales on the GPU (marker `gpu`; skipped without CUDA / FlashInfer;
issues 20, 21). What runs: runtime/attention/flashinfer_run.py around FlashInfer's wrappers (return_lse + the
epilogue kernel for sinks; q folded per KV head, output times v_scale for per-head scales) and the Triton decode /
store kernels' own sinks and per-head scale pointers. The math and wiring are checked on the CPU
(tests/test_attention_epilogue.py); here the kernels themselves:

- FlashInferBackend with sinks (full and sliding-window variants) for ragged prefill, paged (chunked) prefill and
  decode on FlashInfer's and the Triton kernel, against the torch attention (TorchPagedBackend, float32 math) on the
  same cache: bf16 rounding only (relative error < 2e-2); without sink mass (logits -30) far off (sensitivity); and
  FlashInfer's LSE base is checked: read as natural (ln 2 -> 1), FlashInfer's runs are off by more than 5e-2;
- per-KV-head fp8 scales: the Triton store kernel writes the torch store's float8 bytes bit for bit; the backend on
  that cache equals the torch attention (< 2e-2 within each KV head's query group; with sinks too); the heads' scales
  swapped are far off;
- GPT-OSS (specs/gpt_oss.yaml, tiny, bf16, decode CUDA graphs on FlashInfer's and on the Triton decode kernel,
  piecewise prefill graphs) against transformers, with test_gpu_specs.py's battery and bounds, on the tiny checkpoint
  with strong sinks (1 .. 5; the tiny init's ~0.1 barely matter); sensitivity: those sinks move transformers' logits
  5x more than the engine differs from transformers;
- a tiny Llama rescaled per KV head (tests/test_kv_head_scales.py: head 0's K x 300, head 1's / 300, V likewise;
  no one scale fits both heads) served with kv_cache_dtype="fp8" and its calibrated per-head scales (graphs, chunked
  prefill). Against the torch attention on the same fp8 cache (the CPU semantics, run on the GPU eagerly): logprobs
  within 0.1 and prefill logits within 5e-2 relative (the per-tensor test's bounds, test_gpu_quant.py: bf16
  rounding of two attention implementations; the q folding adds one bf16 rounding of q * k_scale, 2^-9 relative).
  Against the bf16 model (a bf16 cache): prefill logits within 0.2 relative, the per-tensor test's bound (e4m3 keeps
  3 mantissa bits, up to 2^-4 relative per element; that test's Qwen3 measured 0.08 on the CPU) and at least 3x
  closer than the same checkpoint with one scale per tensor (on the CPU in float32: 2.6e-2 vs 3.0e-1, 11x). The
  heads' scales swapped are beyond 0.3 (CPU: 7.7e-1).
Figures go to $XLLM_TEST_REPORT.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from fixtures.report import report as _report

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer")]


def _rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _group_err(a, b, groups: int):
    """The worst _rel_err over the query-head groups of the KV heads (a, b [N, H, D]): heads whose outputs differ in
    size by orders of magnitude (per-head V scales) are each held to their own size."""
    return max(_rel_err(x, y) for x, y in zip(a.chunk(groups, 1), b.chunk(groups, 1)))


def _backend(H, Hk, D, page, pool, kv_dtype, decode_kernel, variants):
    from xllm_gen.runtime.attention.flashinfer_backend import FlashInferBackend
    return FlashInferBackend(num_heads=H, num_kv_heads=Hk, head_dim=D, dtype=torch.bfloat16, device="cuda",
                             block_size=page, max_batch=8, max_model_len=512, max_num_blocks=pool, kv_dtype=kv_dtype,
                             sm_scale=D ** -0.5, decode_kernel=decode_kernel, variants=variants)


STEPS = {"ragged_prefill": None, "paged_prefill": [1, 9, 40, 64, 7], "decode": [1, 1, 1, 1, 1]}


@pytest.mark.parametrize("decode_kernel", ["flashinfer", "triton"])
def test_sinks_kernels_vs_torch(decode_kernel, monkeypatch):
    from test_gpu_quant import _paged_ctx

    from xllm_gen.runtime import ops
    from xllm_gen.runtime.attention.base import make_variant
    from xllm_gen.runtime.attention.torch_ref import TorchPagedBackend
    from xllm_gen.runtime.ops import reference as R
    torch.manual_seed(0)
    dev = torch.device("cuda")
    H, Hk, D, page, pool = 8, 2, 128, 16, 96
    lens = [1, 17, 130, 64, 300]
    perm = torch.randperm(pool).tolist()
    variants = (make_variant(sinks=True), make_variant(sliding_window=32, sinks=True))
    # sink logits of the rows' log-sum-exps' size (scores of std ~3 below): each takes a real share of the mass
    sinks = (torch.randn(H, device=dev) * 2 + 4).to(torch.bfloat16)
    results, off, misread = {}, {}, {}
    for step, qlens in STEPS.items():
        qlens = qlens or lens                                  # ragged: every token of every sequence is new
        ctx = _paged_ctx(lens, qlens, page, perm, dev)
        kc = torch.zeros(pool, page, Hk, D, dtype=torch.bfloat16, device=dev)
        vc = torch.zeros_like(kc)
        full = _paged_ctx(lens, lens, page, perm, dev)
        k_all = torch.randn(sum(lens), Hk, D, device=dev).to(torch.bfloat16)
        v_all = torch.randn(sum(lens), Hk, D, device=dev).to(torch.bfloat16)
        ops.store_kvcache(k_all, v_all, kc, vc, full.slot_mapping)
        # this step's k / v: each sequence's last qlens tokens (what a ragged prefill reads instead of the cache)
        starts = [sum(lens[:i]) for i in range(len(lens))]
        rows = torch.tensor([s + L - q + j for s, L, q in zip(starts, lens, qlens) for j in range(q)], device=dev)
        k, v = k_all[rows], v_all[rows]
        q = (torch.randn(sum(qlens), H, D, device=dev) * 3).to(torch.bfloat16)      # scores of std ~3: peaky rows
        be = _backend(H, Hk, D, page, pool, torch.bfloat16, decode_kernel, variants)
        be.plan(ctx)
        assert be._mode == {"ragged_prefill": "ragged", "paged_prefill": "paged_prefill", "decode": "decode"}[step]
        ref = TorchPagedBackend()
        ref.plan(ctx)
        for var in variants:
            name = f"{step}_window{var.sliding_window}"
            got = be.forward(q, k, v, kc, vc, ctx, D ** -0.5, variant=var, sinks=sinks)
            want = ref.forward(q, k, v, kc, vc, ctx, D ** -0.5, variant=var, sinks=sinks)
            # sensitivity: no sink mass (logits -30), and (FlashInfer's runs) the base-2 LSE read as natural
            none = be.forward(q, k, v, kc, vc, ctx, D ** -0.5, variant=var, sinks=torch.full_like(sinks, -30.0))
            results[name], off[name] = _rel_err(got, want), _rel_err(none, want)
            if step != "decode" or decode_kernel == "flashinfer":
                with monkeypatch.context() as m:
                    m.setattr(R, "LN2", 1.0)
                    misread[name] = _rel_err(be.forward(q, k, v, kc, vc, ctx, D ** -0.5, variant=var, sinks=sinks),
                                             want)
    _report(test=f"sinks_kernels_{decode_kernel}", rel_err=results, no_sinks_rel_err=off, lse_as_natural=misread)
    print(f"\n[sinks, {decode_kernel}] relative error vs torch {results}; without sinks {off}; the LSE read as "
          f"natural {misread}")
    assert all(e < 2e-2 for e in results.values()), results
    assert all(e > 0.1 for e in off.values()), off
    assert all(e > 5e-2 for e in misread.values()), misread


@pytest.mark.parametrize("decode_kernel", ["flashinfer", "triton"])
def test_per_head_kv_scales_kernels_vs_torch(decode_kernel):
    from test_gpu_quant import _paged_ctx

    from xllm_gen.runtime import ops
    from xllm_gen.runtime.attention.base import FULL, make_variant
    from xllm_gen.runtime.attention.torch_ref import TorchPagedBackend
    from xllm_gen.runtime.ops import reference as R
    torch.manual_seed(0)
    dev, f8 = torch.device("cuda"), torch.float8_e4m3fn
    H, Hk, D, page, pool = 8, 2, 128, 16, 96
    lens = [1, 17, 130, 64, 300]
    perm = torch.randperm(pool).tolist()
    # head 0's K past fp8's range and head 1's far below it (no one scale fits both), V likewise the other way
    kf, vf = torch.tensor([300.0, 1 / 300.0], device=dev), torch.tensor([1e-3, 30.0], device=dev)
    ks = (1.25 * kf * 4 / 448).reshape(Hk, 1).contiguous()
    vs = (1.25 * vf * 4 / 448).reshape(Hk, 1).contiguous()
    kc = torch.zeros(pool, page, Hk, D, dtype=f8, device=dev)
    vc = torch.zeros_like(kc)
    full = _paged_ctx(lens, lens, page, perm, dev)
    N = sum(lens)
    k = (torch.randn(N, Hk, D, device=dev) * kf.view(1, Hk, 1)).to(torch.bfloat16)
    v = (torch.randn(N, Hk, D, device=dev) * vf.view(1, Hk, 1)).to(torch.bfloat16)
    ops.store_kvcache(k, v, kc, vc, full.slot_mapping, ks, vs)
    kr, vr = torch.zeros(pool, page, Hk, D, dtype=f8), torch.zeros(pool, page, Hk, D, dtype=f8)
    R.store_kvcache(k.cpu(), v.cpu(), kr, vr, full.slot_mapping.cpu(), ks.cpu(), vs.cpu())
    assert torch.equal(kc.cpu().view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(vc.cpu().view(torch.uint8), vr.view(torch.uint8))
    sinks = (torch.randn(H, device=dev) * 2).to(torch.bfloat16)
    worst, swapped = {}, {}
    for step in ("paged_prefill", "decode"):
        ctx = _paged_ctx(lens, STEPS[step], page, perm, dev)
        n = sum(STEPS[step])
        # scores of std ~1: q divided per group by its KV head's factor (as the rescaled checkpoint's q_proj)
        q = (torch.randn(n, H, D, device=dev) / kf.repeat_interleave(H // Hk).view(1, H, 1)).to(torch.bfloat16)
        step_kv = torch.zeros(n, Hk, D, device=dev, dtype=torch.bfloat16)
        for var, extra in ((FULL, {}), (make_variant(sinks=True), {"sinks": sinks})):
            be = _backend(H, Hk, D, page, pool, f8, decode_kernel, (var,))
            be.plan(ctx)
            ref = TorchPagedBackend()
            ref.plan(ctx)
            name = f"{step}{'_sinks' if extra else ''}"
            kw = dict(variant=var, **extra)
            got = be.forward(q, step_kv, step_kv, kc, vc, ctx, D ** -0.5, k_scale=ks, v_scale=vs, **kw)
            want = ref.forward(q, step_kv, step_kv, kc, vc, ctx, D ** -0.5, k_scale=ks, v_scale=vs, **kw)
            flip = be.forward(q, step_kv, step_kv, kc, vc, ctx, D ** -0.5, k_scale=ks.flip(0).contiguous(),
                              v_scale=vs.flip(0).contiguous(), **kw)
            worst[name], swapped[name] = _group_err(got, want, Hk), _group_err(flip, want, Hk)
    _report(test=f"per_head_kv_scales_kernels_{decode_kernel}", rel_err=worst, swapped_rel_err=swapped)
    print(f"\n[fp8 KV per-head scales, {decode_kernel}] relative error vs torch {worst}; heads swapped {swapped}")
    assert all(e < 2e-2 for e in worst.values()), worst
    assert all(e > 0.5 for e in swapped.values()), swapped


# ---------------------------------------------------------------------------------------------- GPT-OSS end to end
def _strong_sinks(ckpt: Path) -> Path:
    """In place: every layer's sinks set to per-head logits spread over 1 .. 5 (the tiny checkpoint's are ~0.1, which
    take under 1% of a row's mass: ignoring them would pass a parity test). Returns ckpt."""
    from safetensors.torch import load_file, save_file
    files = sorted(ckpt.glob("*.safetensors"))
    assert len(files) == 1, files
    sd = load_file(str(files[0]))
    names = sorted(n for n in sd if n.endswith(".sinks"))
    assert names, "the tiny GPT-OSS has no sinks tensors"
    for i, n in enumerate(names):
        sd[n] = (torch.linspace(1.0, 5.0, sd[n].numel()).roll(i) + 0.1 * i).to(sd[n].dtype)
    save_file(sd, str(files[0]), metadata={"format": "pt"})
    return ckpt


@pytest.mark.parametrize("decode_kernel", ["flashinfer", "triton"])
def test_gpt_oss_bf16_graphs_vs_hf(tmp_path, monkeypatch, decode_kernel):
    """test_gpu_specs.py's battery (bf16, decode graphs, prefill and decode logprobs against transformers float32,
    bounds from transformers' own bf16 noise) for GPT-OSS, no longer refused, on its tiny checkpoint with strong sinks,
    the decode kernel forced; and both graph kinds captured (a failed prefill capture falls back to eager prefill
    silently)."""
    import test_gpu_specs as S

    from xllm_gen import LLM
    captured = []
    real_init, real_ckpt = LLM.__init__, S._checkpoint

    def init(self, *a, **kw):
        kw["_debug"] = {**(kw.get("_debug") or {}), "decode_attention": decode_kernel}
        real_init(self, *a, **kw)
        runner = self.engine.runner
        captured.append((runner.graphs is not None, runner.prefill_graphs is not None))
    monkeypatch.setattr(LLM, "__init__", init)
    monkeypatch.setattr(S, "_checkpoint", lambda arch, out: _strong_sinks(real_ckpt(arch, out)))
    assert S._cuda_refusal("GptOssForCausalLM") is None
    S.test_spec_bf16_graphs_vs_hf("GptOssForCausalLM", tmp_path)
    # the first engine is the bf16 one under test (a MoE spec's battery then builds a float32 eager engine for its
    # exact routing, which captures no graphs)
    assert captured and captured[0] == (True, True), f"decode / prefill graphs captured: {captured}"


def test_gpt_oss_sinks_matter(tmp_path):
    """Sensitivity of the battery above: the strong sinks move transformers' prefill logits far more than the engine
    (bf16, graphs) differs from transformers on either checkpoint, so a CUDA path that dropped the sinks (or misread
    FlashInfer's log-sum-exp) would fail it; and the engine's error stays within 3x transformers' own bf16 error."""
    import json
    import shutil

    import test_gpu_specs as S

    from xllm_gen import LLM
    plain = S._checkpoint("GptOssForCausalLM", tmp_path / "plain")
    strong = _strong_sinks(Path(shutil.copytree(plain, tmp_path / "strong")))
    vocab = json.loads((plain / "config.json").read_text()).get("vocab_size", 1000)
    prompt = [(7 * j + 3) % (min(vocab, 900) - 10) + 5 for j in range(100)]      # crosses the window of 32
    logits = {}
    for name, path in (("plain", plain), ("strong", strong)):
        llm = LLM(str(path), dtype="bfloat16", max_num_seqs=4, num_kv_blocks=256, max_model_len=512)
        try:
            assert llm.engine.runner.prefill_graphs is not None
            logits[name] = torch.as_tensor(llm.prefill_logits(prompt)).float().cpu()
        finally:
            llm.shutdown()
        with torch.inference_mode():
            for dt, key in ((torch.float32, "hf_"), (torch.bfloat16, "hf16_")):
                hf = S._hf(path, dt)
                logits[key + name] = hf(torch.tensor([prompt], device="cuda")).logits[0].float().cpu()
                del hf
    moved = _rel_err(logits["hf_strong"], logits["hf_plain"])
    err = {n: _rel_err(logits[n][:, : logits["hf_" + n].shape[1]], logits["hf_" + n]) for n in ("plain", "strong")}
    # bf16 noise is measured, not guessed (as test_gpu_specs.py's battery): transformers itself in bf16
    noise = {n: _rel_err(logits["hf16_" + n], logits["hf_" + n]) for n in ("plain", "strong")}
    _report(test="gpt_oss_sinks_matter", hf_moved=moved, engine_err=err, hf16_err=noise)
    print(f"\n[GPT-OSS sinks] transformers moved by {moved:.3f} with strong sinks; engine vs transformers {err}; "
          f"transformers bf16 vs float32 {noise}")
    assert moved > 5 * max(err.values()), (moved, err)
    assert all(err[n] <= max(3 * noise[n], 0.02) for n in err), (err, noise)


# ---------------------------------------------------------------------------------------------- per-head fp8 end to end
def _llama(tmp_path: Path) -> Path:
    from fixtures.tiny_hf import make_tiny_checkpoint
    return make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "base", seed=0,
                                overrides=dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=128, num_hidden_layers=2))


@pytest.mark.parametrize("decode_kernel", ["flashinfer", "triton"])
def test_per_head_kv_scales_checkpoint_cuda(tmp_path, decode_kernel):
    import test_kv_head_scales as K
    from hf_ref import hf_model

    from xllm_gen import LLM, SamplingParams
    ref = K._scaled_per_head(_llama(tmp_path), tmp_path / "ref")
    vocab = 500              # token ids below the tiny tokenizer's 507
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % vocab + 5 for j in range(n)]} for i, n in enumerate((5, 40, 130))]
    amax: dict = {}
    with torch.no_grad():
        K._with_fp8_kv(ref, lambda: hf_model(ref)(input_ids=torch.tensor([sum((p["prompt_token_ids"] for p in prompts),
                                                                              [])])), record=amax)
    scales = {i: (1.25 * 1.4143 * k / 448, 1.25 * v / 448) for i, (k, v) in amax.items()}
    ckpt = K._write_scales(ref, tmp_path / "ckpt", scales)
    swapped = K._write_scales(ref, tmp_path / "swapped", {i: (k.flip(0), v.flip(0)) for i, (k, v) in scales.items()})
    tensor = K._write_scales(ref, tmp_path / "tensor", {i: (k.max().reshape(1), v.max().reshape(1))
                                                         for i, (k, v) in scales.items()}, shape=(1,))
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    kw = dict(dtype="bfloat16", max_num_seqs=4, max_model_len=512, num_kv_blocks=128, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    seqs: list = []

    def run(path, check_graphs=False, **extra):
        llm = LLM(str(path), **{**kw, **extra})
        try:
            if check_graphs:
                attn = next(m for m in llm.engine.runner.model.modules() if hasattr(m, "k_scale")
                            and getattr(m, "k_cache", torch.empty(0)).numel())
                assert isinstance(attn.k_scale, torch.Tensor) and attn.k_scale.is_cuda
                assert attn.k_cache.dtype == torch.float8_e4m3fn and llm.engine.runner.graphs is not None
            out = llm.generate(prompts, sp)
            if not seqs:
                seqs.extend(p["prompt_token_ids"] + list(o.outputs[0].token_ids) for p, o in zip(prompts, out))
            return out, [torch.as_tensor(llm.prefill_logits(x)).float().cpu() for x in seqs]
        finally:
            llm.shutdown()

    def lp_diff(a_out, b_out, steps=8):
        worst = 0.0
        for a, b in zip(a_out, b_out):
            x, y = a.outputs[0], b.outputs[0]
            for j, (t, u) in enumerate(zip(x.token_ids[:steps], y.token_ids[:steps])):
                if t != u:
                    break
                worst = max(worst, abs(x.logprobs[j][t].logprob - y.logprobs[j][t].logprob))
        return worst

    def rel(a, b):
        return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))

    want, want_l = run(ckpt, kv_cache_dtype="fp8", enforce_eager=True, _debug={"torch_attention": True})
    got, got_l = run(ckpt, check_graphs=True, kv_cache_dtype="fp8", _debug={"decode_attention": decode_kernel})
    _, bf16_l = run(ref)
    _, swapped_l = run(swapped, kv_cache_dtype="fp8", _debug={"decode_attention": decode_kernel})
    _, tensor_l = run(tensor, kv_cache_dtype="fp8", _debug={"decode_attention": decode_kernel})
    same, same_l, far = lp_diff(got, want), rel(got_l, want_l), rel(swapped_l, want_l)
    vs_bf16, tensor_vs_bf16 = rel(got_l, bf16_l), rel(tensor_l, bf16_l)
    _report(test=f"per_head_kv_scales_{decode_kernel}", logprob_vs_torch=same, prefill_rel_vs_torch=same_l,
            prefill_rel_vs_bf16=vs_bf16, one_scale_per_tensor_vs_bf16=tensor_vs_bf16, swapped_rel=far)
    print(f"\n[fp8 KV per-head checkpoint, {decode_kernel}] vs torch attention on the same cache: logprobs {same:.4f}, "
          f"prefill {same_l:.2e}; vs a bf16 cache {vs_bf16:.2e} (one scale per tensor: {tensor_vs_bf16:.2e}); heads' "
          f"scales swapped {far:.2e}")
    assert same < 0.1 and same_l < 0.05 and far > 0.3, (same, same_l, far)
    assert vs_bf16 < 0.2 and tensor_vs_bf16 > 3 * vs_bf16, (vs_bf16, tensor_vs_bf16)
