"""Decode CUDA graphs on the GPU (marker `gpu`; skipped without CUDA).

- graph vs eager greedy tokens at batch sizes 1, 2, 3, 5, 7, 8, 13, 16, 31, 47, 100 and the largest bucket
  (tiny bf16 Qwen3 with head_dim 128, so FlashInfer builds the kernels the benchmark uses);
- padding rows of a bucket leave every KV slot but the real rows' new ones untouched;
- bf16 parity with Hugging Face transformers: max logits error of a prefill, logprob error of the graph
  decode (teacher-forced), and the first divergent step of greedy decoding;
- Qwen3-VL (when generated/qwen3_vl exists): image and video requests identical under graph and eager, and
  the four deepstack arms {eager, graph} x {normal, zeroed deepstack}, also after text-only warm-up requests.

Graph and eager runs share one engine (the graphs are switched off for eager: `runner.graphs = None` and
`runner.prefill_graphs = None`; the VL arms thus compare decode + piecewise prefill graphs with deepstack
against a fully eager engine). In
bf16 a padded batch may run other GEMM / split-KV kernels than the unpadded eager batch, so a token may flip
where the top two logprobs tie to bf16 rounding: a divergence passes only at such a near tie (gap < NEAR_TIE),
and the chosen tokens' logprobs must agree to MAX_LOGPROB_DIFF while the tokens agree; a real fault (wrong
positions, corrupted KV, stale inputs) moves logprobs by far more and diverges away from ties.
Numbers are printed (pytest -s) and appended as JSON lines to $XLLM_TEST_REPORT when set.
"""
from __future__ import annotations

import contextlib
import importlib.util
import random

import pytest
import torch
from fixtures.graph_compare import _compare, _eager
from fixtures.report import report as _report

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BATCH_SIZES = [1, 2, 3, 5, 7, 8, 13, 16, 31, 47, 100]
MAX_NUM_SEQS = 256
NEW_TOKENS = 24




@contextlib.contextmanager
def _fast(llm):
    """ModelRunner.run calling DecodeGraphs.run(seqs) directly (the proposed runner patch), when the runner
    does not do so yet."""
    runner = llm.engine.runner
    orig = runner.run

    def run(seqs, is_prefill, all_rows=False):
        g = runner.graphs
        if not is_prefill and not all_rows and g is not None and g.fits(len(seqs)):
            with torch.inference_mode():
                return runner.model.compute_logits(g.run(seqs)).float()
        return orig(seqs, is_prefill, all_rows)
    runner.run = run
    try:
        yield
    finally:
        del runner.run


def _params(n=NEW_TOKENS, logprobs=2):
    from xllm_gen import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


# ------------------------------------------------------------------------------------------------ Qwen3
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from fixtures.tiny_hf import make_tiny_qwen3
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_gpu"), hidden_size=256, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=512,
                           max_position_embeddings=2048, seed=0)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    from xllm_gen import LLM
    # prefix caching off: graph and eager runs of the same prompts must compute the same things (a cached
    # prefix changes the prefill split, hence bf16 rounding, and flips near-ties)
    llm = LLM(str(tiny_dir), dtype="bfloat16", max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=4096, max_model_len=512,
              enable_prefix_caching=False)
    assert llm.engine.runner.graphs is not None, "graphs were not captured"
    yield llm
    llm.shutdown()


def _prompts(n: int, vocab: int, seed: int, lo=3, hi=70):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]} for _ in range(n)]


def test_buckets(llm):
    from xllm_gen.runtime.executor.cuda_graph import graph_buckets
    g = llm.engine.runner.graphs
    assert g.buckets == graph_buckets(llm.engine.runner.graph_buckets, MAX_NUM_SEQS)
    assert list(g.buckets[:4]) == [1, 2, 4, 8] and all(b % 16 == 0 for b in g.buckets[4:])
    assert g.fits(g.buckets[-1]) and not g.fits(g.buckets[-1] + 1)
    assert [g.bucket_for(b) for b in (1, 3, 5, 9, 100)] == [1, 4, 8, 16, 112]
    assert graph_buckets((1, 2, 4, 8, 16, 32), 20) == (1, 2, 4, 8, 16, 20)
    assert graph_buckets((1, 2, 4, 8), 100) == (1, 2, 4, 8)
    _report(test="buckets", buckets=list(g.buckets), capture_seconds=g.capture_seconds)


@pytest.mark.parametrize("batch", BATCH_SIZES + ["largest"])
def test_graph_equals_eager(llm, batch):
    runner = llm.engine.runner
    if batch == "largest":
        batch = runner.graphs.buckets[-1]
    prompts = _prompts(batch, llm.engine.vocab_size, seed=batch)
    graph_outs = llm.generate(prompts, _params())               # ModelRunner.run -> DecodeGraphs.replay
    with _fast(llm):
        fast_outs = llm.generate(prompts, _params())            # DecodeGraphs.run(seqs)
    with _eager(llm):
        eager_outs = llm.generate(prompts, _params())
    _compare(eager_outs, graph_outs, f"graph_vs_eager_b{batch}")
    _compare(eager_outs, fast_outs, f"graph_fast_vs_eager_b{batch}")
    assert [o.outputs[0].token_ids for o in graph_outs] == [o.outputs[0].token_ids for o in fast_outs]


def test_padding_rows_leave_kv_untouched(llm):
    """3 sequences run in bucket 4: only the 3 new tokens' KV slots change, in every layer."""
    engine, runner = llm.engine, llm.engine.runner
    assert runner.graphs.bucket_for(3) == 4
    seqs = [engine.make_sequence(i, p, _params(4, None)) for i, p in enumerate(_prompts(3, engine.vocab_size, 7))]
    bm, bs = engine.block_manager, runner.block_size
    try:
        for s in seqs:
            bm.allocate(s, s.num_tokens)
            s.chunk_len = s.num_tokens
        logits = runner.run(seqs, True)
        for s, t in zip(seqs, logits.argmax(-1).tolist()):
            s.num_computed_tokens = s.num_tokens
            s.append_token(int(t))
            bm.allocate(s, s.num_tokens)
            s.chunk_len = 1
        expected = sorted(s.block_table[(s.num_tokens - 1) // bs] * bs + (s.num_tokens - 1) % bs for s in seqs)
        for path in ("hook", "fast"):
            for a in runner.attn_layers:                            # clear the slots this step writes
                for c in (a.k_cache, a.v_cache):
                    c.view(-1, *c.shape[2:])[expected] = 0
            before = [(a.k_cache.clone(), a.v_cache.clone()) for a in runner.attn_layers]
            with torch.inference_mode():
                if path == "hook":                                  # prepare()'s inputs -> DecodeGraphs.replay
                    ids, pos, ctx, _ = runner.prepare(seqs, False)
                    runner.graphs.replay(ids, pos, ctx)
                else:
                    runner.graphs.run(seqs)
            torch.cuda.synchronize()
            for (k0, v0), a in zip(before, runner.attn_layers):
                for old, new in ((k0, a.k_cache), (v0, a.v_cache)):
                    changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
                    assert changed == expected, f"{path}: KV slots changed {changed}, expected only {expected}"
    finally:
        for s in seqs:
            bm.free(s)
    _report(test="padding_kv", written_slots=expected)


def test_fast_replan_matches_wrapper_plan(llm):
    """The decode graphs' re-plan of a bucket gives FlashInfer's own plan() result, for random lengths (the buckets
    on FlashInfer's decode; the small ones run the Triton kernel, which has no plan to re-run)."""
    g = llm.engine.runner.graphs
    rng = random.Random(5)
    checked = 0
    fi_buckets = [b for b in g.buckets if g._attn[b]._replan is not None]
    if not fi_buckets:
        pytest.skip("the fast re-plan is not used with this FlashInfer configuration")
    for Bk in sorted({fi_buckets[0], fi_buckets[len(fi_buckets) // 2], fi_buckets[-1]}):
        attn = g._attn[Bk]
        B = max(1, Bk - rng.randrange(min(Bk, 3)))
        lens = [rng.randint(1, 400) for _ in range(B)]
        tables = [[rng.randrange(g.max_pages // 4) for _ in range((n + 15) // 16)] for n in lens]
        slots = [t[(n - 1) // 16] * 16 + (n - 1) % 16 for t, n in zip(tables, lens)]
        total = g._write_step(B, Bk, [0] * B, [n - 1 for n in lens], slots, lens, tables)
        g._upload(Bk, total)
        attn._replan(g._indptr_h[Bk], g._last_h[Bk])
        fast = list(attn.wrapper._plan_info)
        be = attn.backend
        attn.wrapper.plan(g._indptr_h[Bk], g.page_indices[:total], g._last_h[Bk], be.num_heads, be.num_kv_heads,
                          be.head_dim, be.block_size, q_data_type=be.dtype, kv_data_type=be.kv_dtype,
                          sm_scale=be.sm_scale)
        torch.cuda.synchronize()
        assert list(attn.wrapper._plan_info) == fast, f"bucket {Bk}: re-plan differs from plan()"
        checked += 1
    _report(test="fast_replan", buckets_checked=checked)


def test_bf16_parity_with_hf(tiny_dir, llm):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.bfloat16).cuda().eval()
    rng = random.Random(11)
    prompt = [rng.randrange(llm.engine.vocab_size) for _ in range(48)]
    n_new = 64
    with torch.inference_mode():
        ours = llm.prefill_logits(prompt)
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0].float()
        prefill_err = (ours - ref).abs().max().item()
        prefill_rel = prefill_err / ref.abs().max().item()
        out = llm.generate([{"prompt_token_ids": prompt}], _params(n_new, 0))[0].outputs[0]
        toks = list(out.token_ids)
        # teacher-forced HF logprobs of our graph-decoded tokens
        full = torch.tensor([prompt + toks], device="cuda")
        hf_lp = torch.log_softmax(hf(full).logits[0].float(), -1)
        hf_tok_lp = [hf_lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(toks)]
        ours_lp = [out.logprobs[j][t].logprob for j, t in enumerate(toks)]
        decode_lp_err = max(abs(a - b) for a, b in zip(hf_tok_lp, ours_lp))
        hf_greedy = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=n_new, min_new_tokens=n_new,
                                do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    first_div = next((j for j, (a, b) in enumerate(zip(toks, hf_greedy)) if a != b), None)
    hf_argmax_agree = sum(int(hf_lp[len(prompt) - 1 + j].argmax().item() == t) for j, t in enumerate(toks))
    _report(test="bf16_parity_hf", prefill_max_abs_logit_err=prefill_err, prefill_rel_err=prefill_rel,
            decode_max_logprob_err=decode_lp_err, first_divergent_step=first_div, steps=n_new,
            hf_teacher_forced_argmax_agree=hf_argmax_agree)
    assert prefill_rel < 0.05, f"prefill logits differ from HF by {prefill_err} (rel {prefill_rel})"
    assert decode_lp_err < 0.25, f"decode logprobs differ from HF by {decode_lp_err}"
    assert first_div is None or first_div >= 1, "the first greedy token differs from HF"
    assert hf_argmax_agree >= n_new - 3


# --------------------------------------------------------------------------------------------- Qwen3-VL
def _vl_available() -> bool:
    return importlib.util.find_spec("xllm_gen.generated.qwen3_vl.model") is not None


@pytest.fixture(scope="module")
def vl_llm(tmp_path_factory):
    if not _vl_available():
        pytest.skip("generated/qwen3_vl is not generated yet (xllm-gen specs/qwen3_vl.yaml)")
    from fixtures.tiny_hf import make_tiny_qwen3_vl

    from xllm_gen import LLM
    d = make_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny_qwen3_vl_gpu"), hidden_size=256, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=128, intermediate_size=512, mrope_section=(24, 20, 20),
                           max_position_embeddings=4096, rope_theta=10000.0, seed=0)
    llm = LLM(str(d), dtype="bfloat16", max_num_seqs=16, num_kv_blocks=1024, max_model_len=2048,
              enable_prefix_caching=False)
    assert llm.engine.runner.graphs is not None
    pg = llm.engine.runner.prefill_graphs          # image / video prefills replay pieces over inputs_embeds
    assert pg is not None and pg.embeds_input
    yield llm
    llm.shutdown()


def _vl_requests():
    import numpy as np
    from PIL import Image
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8))
    vid = np.random.default_rng(1).integers(0, 256, (8, 48, 64, 3), dtype=np.uint8)
    return {
        "image": {"prompt": "Describe <|vision_start|><|image_pad|><|vision_end|> the image.",
                  "multi_modal_data": {"image": [img]}},
        "video": {"prompt": "Describe the video. <|vision_start|><|video_pad|><|vision_end|>",
                  "multi_modal_data": {"video": [vid]}},
    }


def _vl_run(llm, reqs, *, eager: bool, zero_deepstack: bool):
    runner = llm.engine.runner
    old = runner.debug.get("zero_deepstack")
    runner.debug["zero_deepstack"] = zero_deepstack
    try:
        with (_eager(llm) if eager else contextlib.nullcontext()):
            return llm.generate(list(reqs.values()), _params(16))
    finally:
        runner.debug["zero_deepstack"] = old


@pytest.mark.parametrize("warm_text_first", [False, True])
def test_vl_graph_equals_eager_and_deepstack_arms(vl_llm, warm_text_first):
    reqs = _vl_requests()
    if warm_text_first:
        vl_llm.generate(["The capital of France is", "Hello, world!"], _params(8, None))
    arms = {(e, z): _vl_run(vl_llm, reqs, eager=e, zero_deepstack=z) for e in (True, False) for z in (False, True)}
    for z in (False, True):
        _compare(arms[(True, z)], arms[(False, z)], f"vl_graph_vs_eager_zero{int(z)}_warm{int(warm_text_first)}")
    # zeroed deepstack must change the output of each visual request (tokens or logprobs)
    for (name, _), a, b in zip(reqs.items(), arms[(False, False)], arms[(False, True)]):
        ta, tb = a.outputs[0], b.outputs[0]
        differs = ta.token_ids != tb.token_ids or any(
            abs(x[t].logprob - y[t].logprob) > 1e-3 for x, y, t in zip(ta.logprobs, tb.logprobs, ta.token_ids))
        assert differs, f"{name}: zeroing deepstack changed nothing (features ignored?)"
    _report(test="vl_deepstack_arms", warm_text_first=warm_text_first, ok=True)
