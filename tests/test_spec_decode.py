"""Speculative decoding (runtime/engine/spec_decode.py) on the real engine and tiny Qwen3 checkpoints.

- greedy: token for token the output of non-speculative decoding, for n-gram drafts (a repetitive prompt whose
  drafts are often right, random prompts whose drafts are often wrong) and draft models, in batches that mix
  speculated rows with rows that are not (sampled, structured outputs, no match), with logprobs, penalties,
  min_tokens, stop strings and max_tokens cut inside an accepted run, and a KV cache small enough to preempt;
- a draft model identical to the target is always accepted (rate 1.0, fewer steps); one with shuffled
  vocabulary rows almost never (rate ~0), and the output is the same;
- sampled: the empirical distribution of a 3-token continuation (many samples) passes a chi-square test
  against the exact distribution computed with transformers, for a draft model whose q differs from p and for
  n-gram drafts (q one-hot); the same test FAILS with a biased acceptance rule (always accept; for the draft model
  also accept with p(d)), so it can tell; a seeded request with n-gram drafts gets the tokens of the engine without
  speculation, under a tight KV cache and token budget too;
- KV rollback: blocks registered in the prefix cache after speculative steps hold the committed tokens' KV (a
  prompt reusing them decodes as without the cache); no block leaks;
- configuration errors name the key; the server's stats line shows the acceptance rate."""
from __future__ import annotations

import collections
import random
import shutil
from pathlib import Path

import pytest
import torch

from xllm_gen import LLM, SamplingParams
from xllm_gen.runtime.engine import spec_decode
from xllm_gen.runtime.engine.spec_decode import SpeculativeConfig

ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_num_seqs=16)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` whose tensors `edit(name, tensor)` may replace."""
    from safetensors.torch import load_file, save_file
    if not dst.exists():
        shutil.copytree(src, dst)
        for f in dst.glob("*.safetensors"):
            w = load_file(f)
            save_file({k: edit(k, v).contiguous() for k, v in w.items()}, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def ckpts(qwen3_tied, tmp_path_factory):
    base = tmp_path_factory.mktemp("spec")
    perm = torch.randperm(10**6, generator=torch.Generator().manual_seed(0))

    def shuffle(name, t):                      # vocabulary rows permuted: the draft's argmax is another token
        if "embed_tokens" in name or "lm_head" in name:
            return t[perm[perm < t.shape[0]]]
        return t

    def sharpen(name, t):                      # logits x 2: the draft's q is p at temperature 1/2
        return t * 2.0 if name.endswith("model.norm.weight") else t
    return {"target": qwen3_tied, "shuffled": _edited_copy(qwen3_tied, base / "shuffled", shuffle),
            "sharp": _edited_copy(qwen3_tied, base / "sharp", sharpen)}


@pytest.fixture(scope="module")
def plain(ckpts):
    llm = LLM(str(ckpts["target"]), **ENGINE)
    yield llm
    llm.shutdown()


def _spec(ckpts, cfg, **kw):
    return LLM(str(ckpts["target"]), speculative_config=cfg, **{**ENGINE, **kw})


def _prompts(seed: int, n: int = 6):
    rng = random.Random(seed)
    out = [{"prompt_token_ids": [rng.randrange(500) for _ in range(rng.randint(3, 24))]} for _ in range(n)]
    out.append({"prompt_token_ids": [5, 6, 7, 8] * 6})                  # repetitive: n-gram drafts often right
    return out


def _mixed_params():
    return [SamplingParams(max_tokens=40, **GREEDY)] * 4 + [
        SamplingParams(max_tokens=30, logprobs=2, **GREEDY),
        SamplingParams(max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.2, **GREEDY),
        SamplingParams(max_tokens=7, min_tokens=5, **GREEDY),              # max_tokens cut inside a run
        SamplingParams(max_tokens=40, stop=["e", "a"], **GREEDY),         # stop strings inside a run
        SamplingParams(temperature=0.0, max_tokens=40),                   # may stop at EOS
        SamplingParams(max_tokens=40, stop_token_ids=[70, 397], **GREEDY),
    ]


def _same_greedy(a, b):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].text == y.outputs[0].text
        assert x.outputs[0].finish_reason == y.outputs[0].finish_reason
        assert x.outputs[0].stop_reason == y.outputs[0].stop_reason
        if x.outputs[0].logprobs is not None:
            for ex, ey in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
                assert ex.keys() == ey.keys()
                for t in ex:
                    assert ex[t].logprob == pytest.approx(ey[t].logprob, abs=1e-4) and ex[t].rank == ey[t].rank


def _no_leak(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_count)


def _batch(seed):
    return _prompts(seed, 9), _mixed_params()


@pytest.mark.parametrize("k", [1, 3])
def test_ngram_greedy_identical(ckpts, plain, k):
    prompts, params = _batch(k)
    ref = plain.generate(prompts, params)
    llm = _spec(ckpts, {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3})
    out = llm.generate(prompts, params)
    _same_greedy(ref, out)
    st = llm.engine.stats
    assert st["spec_steps"] > 0 and 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"]
    assert st["steps"] < plain.engine.stats["steps"] or k == 1
    _no_leak(llm)
    llm.shutdown()


def test_ngram_repetitive_prompt_accepts_most(ckpts, plain):
    prompt = [{"prompt_token_ids": [5, 6, 7, 8] * 6}]
    p = SamplingParams(max_tokens=40, **GREEDY)
    llm = _spec(ckpts, {"method": "ngram", "num_speculative_tokens": 4})
    _same_greedy(plain.generate(prompt, p), llm.generate(prompt, p))
    assert llm.engine.spec_acceptance_rate > 0.5
    llm.shutdown()


def test_ngram_proposer_lookup():
    prop = spec_decode.NgramProposer(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                                              "prompt_lookup_min": 2, "prompt_lookup_max": 3}))
    assert prop.propose_one([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]   # latest match of the suffix
    assert prop.propose_one([1, 2, 9, 8, 7, 2], 3) == []                          # 1-token matches are below min
    assert prop.propose_one([4, 4, 4], 5) == [4]                                  # what follows, up to the end


def test_draft_model_identical_accepts_all(ckpts, plain):
    prompts, params = _batch(5)
    ref = plain.generate(prompts, params)
    llm = _spec(ckpts, {"method": "draft_model", "model": str(ckpts["target"]), "num_speculative_tokens": 4})
    out = llm.generate(prompts, params)
    _same_greedy(ref, out)
    st = llm.engine.stats
    assert st["spec_draft_tokens"] > 50 and llm.engine.spec_acceptance_rate == 1.0
    assert st["spec_steps"] * 3 < st["decode_tokens"]               # several tokens per step
    _no_leak(llm)
    llm.shutdown()


def test_shuffled_draft_rejects_and_output_identical(ckpts, plain):
    prompts, params = _batch(6)
    ref = plain.generate(prompts, params)
    llm = _spec(ckpts, {"method": "draft_model", "model": str(ckpts["shuffled"]), "num_speculative_tokens": 3})
    out = llm.generate(prompts, params)
    _same_greedy(ref, out)
    assert llm.engine.stats["spec_draft_tokens"] > 50 and llm.engine.spec_acceptance_rate < 0.05
    _no_leak(llm)
    llm.shutdown()


def test_small_kv_cache_preempts_identical(ckpts):
    prompts, params = _batch(7)
    kw = dict(num_kv_blocks=40, enable_prefix_caching=False)
    ref_llm = LLM(str(ckpts["target"]), **{**ENGINE, **kw})
    ref = ref_llm.generate(prompts, params)
    llm = _spec(ckpts, {"method": "draft_model", "model": str(ckpts["target"]), "num_speculative_tokens": 4}, **kw)
    out = llm.generate(prompts, params)
    _same_greedy(ref, out)
    assert llm.engine.scheduler.num_preemptions > 0
    _no_leak(llm)
    ref_llm.shutdown()
    llm.shutdown()


def test_ngram_seeded_sampling_is_reproducible_whatever_the_batch(ckpts, plain):
    """n-gram drafts are one-hot (q = the draft), so a sampled row can draw its token exactly as non-speculative
    sampling does (one draw from p on the request's own generator) and keep the draft iff that token is it: the
    same acceptance probability p(d) as rejection sampling, and a seeded request's tokens no longer depend on how
    many drafts it got (which follows the free KV blocks, the token budget, the other requests). Before, the
    accept test drew a uniform and a rejection a residual sample, so a seeded request changed with a tighter KV
    cache or token budget and never matched the engine without speculation."""
    rng = random.Random(5)
    prompts = []
    for _ in range(6):
        base = [rng.randrange(500) for _ in range(rng.randint(2, 4))]
        prompts.append({"prompt_token_ids": (base * 6)[:rng.randint(6, 16)]})   # repeats: n-gram drafts
    params = [SamplingParams(temperature=0.8, seed=10 + i, max_tokens=16, ignore_eos=True, n=1 + i % 2)
              for i in range(6)]
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, params)]
    cfg = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    for kw in (dict(), dict(num_kv_blocks=14, enable_chunked_prefill=True, max_num_batched_tokens=3)):
        llm = _spec(ckpts, cfg, **kw)
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        solo = [[c.token_ids for c in llm.generate(q, p)[0].outputs] for q, p in zip(prompts, params)]
        assert llm.engine.stats["spec_accepted_tokens"] > 0
        assert got == want and solo == want, kw
        _no_leak(llm)
        llm.shutdown()


def test_prefix_cache_holds_committed_kv_only(ckpts, plain):
    """Blocks registered after speculative steps (many rejected drafts) are reused by a longer prompt: its
    output must equal decoding it without the cache (a block holding a rejected draft's KV would change it)."""
    llm = _spec(ckpts, {"method": "draft_model", "model": str(ckpts["shuffled"]), "num_speculative_tokens": 3})
    prompts = _prompts(8, 4)
    p = SamplingParams(max_tokens=30, **GREEDY)
    first = llm.generate(prompts, p)
    longer = [{"prompt_token_ids": q["prompt_token_ids"] + o.outputs[0].token_ids[:25]} for q, o in zip(prompts, first)]
    out = llm.generate(longer, p)
    assert all(o.num_cached_tokens >= 16 for o in out)
    nocache = LLM(str(ckpts["target"]), enable_prefix_caching=False, **ENGINE)
    _same_greedy(nocache.generate(longer, p), out)
    nocache.shutdown()
    llm.shutdown()


def test_structured_and_sampled_rows_mix(ckpts, plain):
    """Greedy rows with a grammar are speculated (the grammar advanced per accepted token), sampled rows with
    a grammar decode one token per step; both keep their outputs valid, greedy ones identical."""
    pytest.importorskip("xgrammar")
    from xllm_gen.runtime.engine.structured_outputs import StructuredOutputsParams
    prompts = _prompts(9, 3)
    choice = StructuredOutputsParams(choice=["alpha beta gamma", "delta"])
    params = [SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=choice),
              SamplingParams(max_tokens=20, temperature=0.9, seed=3, structured_outputs=choice),
              SamplingParams(max_tokens=25, **GREEDY),
              SamplingParams(max_tokens=25, temperature=1.0, seed=1, ignore_eos=True)]
    ref = plain.generate(prompts, params)
    llm = _spec(ckpts, {"method": "draft_model", "model": str(ckpts["target"]), "num_speculative_tokens": 3})
    out = llm.generate(prompts, params)
    for i in (0, 2):
        assert out[i].outputs[0].token_ids == ref[i].outputs[0].token_ids
    assert out[1].outputs[0].text in ("alpha beta gamma", "delta")
    assert len(out[3].outputs[0].token_ids) == 25
    _no_leak(llm)
    llm.shutdown()


# ---- the output distribution of sampled rows ----------------------------------------------------------------
N_SAMPLES, TOP_K, LENGTH = 3000, 3, 3


def _exact_distribution(ckpt: Path, prompt: list[int]) -> dict:
    """P(first LENGTH tokens) of sampling with temperature 1 and top-k TOP_K, from transformers' logits."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    exact = {}

    def walk(prefix, pr):
        if len(prefix) == len(prompt) + LENGTH:
            exact[tuple(prefix[len(prompt):])] = pr
            return
        with torch.no_grad():
            logits = hf(torch.tensor([prefix])).logits[0, -1]
        vals, ids = torch.topk(logits, TOP_K)
        for t, p in zip(ids.tolist(), torch.softmax(vals, -1).tolist()):
            walk(prefix + [t], pr * p)
    walk(list(prompt), 1.0)
    return exact


def _chi_square(exact: dict, counts: collections.Counter) -> tuple[float, float]:
    """(statistic, critical value at p = 0.001); cells expected below 5 pooled, with every outcome outside
    the exact support."""
    from scipy.stats import chi2
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for cell, p in exact.items():
        if p * N_SAMPLES >= 5:
            obs.append(counts.get(cell, 0))
            exp.append(p * N_SAMPLES)
        else:
            rest_o, rest_e = rest_o + counts.get(cell, 0), rest_e + p * N_SAMPLES
    rest_o += sum(v for c, v in counts.items() if c not in exact)
    obs.append(rest_o)
    exp.append(max(rest_e, 1e-3))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return stat, float(chi2.ppf(0.999, len(obs) - 1))


# the exactness of rejection sampling is the same code for both drafts: the default run keeps the n-gram arm
@pytest.mark.parametrize("method", [pytest.param("draft_model", marks=pytest.mark.slow), "ngram"])
def test_sampled_distribution_matches_and_biased_rule_fails(ckpts, plain, monkeypatch, method):
    prompt = [11, 22, 33, 44, 55]
    if method == "ngram":     # the model's own greedy loop: its likely next tokens occurred before (drafts)
        prompt += plain.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=30, **GREEDY))[0] \
            .outputs[0].token_ids
    cfg = ({"method": "draft_model", "model": str(ckpts["sharp"]), "num_speculative_tokens": 2}
           if method == "draft_model" else {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    exact = _exact_distribution(ckpts["target"], prompt)
    p = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=LENGTH, ignore_eos=True)
    llm = _spec(ckpts, cfg, max_num_seqs=256, seed=1)

    def sample():
        outs = llm.generate([{"prompt_token_ids": prompt}] * N_SAMPLES, p)
        return _chi_square(exact, collections.Counter(tuple(o.outputs[0].token_ids) for o in outs))
    stat, crit = sample()
    assert stat < crit, f"speculative sampling differs from the target's distribution: chi2 {stat:.1f} >= {crit:.1f}"
    st = llm.engine.stats
    assert st["spec_draft_tokens"] >= N_SAMPLES // 2 and 0.05 < llm.engine.spec_acceptance_rate < 1.0
    if method == "ngram":     # q is one-hot: the sampler's token, the draft kept iff equal; biased: always keep it
        token = spec_decode.SpecDecoder._token

        def always_accept(self, logits, argmax, seq, draft, q):
            tok = token(self, logits, argmax, seq, draft, q)
            return draft if draft is not None and tok is not None else tok
        monkeypatch.setattr(spec_decode.SpecDecoder, "_token", always_accept)
        stat, crit = sample()
        assert stat > crit, f"a biased acceptance rule passed the distribution test (chi2 {stat:.1f} < {crit:.1f})"
    for biased in ((lambda pd, qd: 1.0, lambda pd, qd: pd) if method == "draft_model" else ()):   # always; ignore q
        monkeypatch.setattr(spec_decode, "acceptance_probability", biased)
        stat, crit = sample()
        assert stat > crit, f"a biased acceptance rule passed the distribution test (chi2 {stat:.1f} < {crit:.1f})"
    llm.shutdown()


# ---- configuration and reporting -------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, msg", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "'method' must be one of"),
    ({"method": "ngram"}, "'num_speculative_tokens' is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "'num_speculative_tokens' must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min 4 exceeds prompt_lookup_max 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup": 2}, "unknown key(s) ['prompt_lookup']"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ("{not json", "not valid JSON"),
])
def test_config_errors_name_the_key(cfg, msg):
    with pytest.raises(ValueError, match="speculative_config") as e:
        SpeculativeConfig.parse(cfg)
    assert msg in str(e.value)


def test_draft_model_of_another_vocabulary_is_refused(ckpts, qwen3_variant, tmp_path):
    other = tmp_path / "other"
    from fixtures.tiny_hf import make_tiny_qwen3
    make_tiny_qwen3(other, vocab_size=640)
    with pytest.raises(ValueError, match="vocab_size 640 .* differs from the target's"):
        _spec(ckpts, {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        _spec(ckpts, {"method": "draft_model", "model": str(tmp_path / "missing"), "num_speculative_tokens": 2})


def test_stats_line_shows_acceptance(ckpts):
    pytest.importorskip("prometheus_client")
    from xllm_gen.runtime.serving.metrics import ServerMetrics
    llm = _spec(ckpts, {"method": "ngram", "num_speculative_tokens": 3})
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8] * 6}], SamplingParams(max_tokens=20, **GREEDY))
    m = ServerMetrics("tiny")
    m.on_step(llm.engine, 0)
    rate = llm.engine.spec_acceptance_rate
    assert f"draft acceptance rate {100 * rate:.1f}%" in m.stats_line() and rate > 0
    assert b"xllm:spec_decode_num_accepted_tokens" in m.render()
    llm.shutdown()


@pytest.mark.slow
def test_ngram_tensor_parallel_identical(ckpts, plain):
    """At TP 2 the ranks mirror rank 0's tokens: after a verification they drop the rejected drafts
    (TensorParallelRunner.rollback_tokens), or the next step would feed a rank a rejected draft."""
    prompts, params = _batch(10)
    ref = plain.generate(prompts, params)
    llm = _spec(ckpts, {"method": "ngram", "num_speculative_tokens": 3}, tensor_parallel_size=2)
    try:
        _same_greedy(ref, llm.generate(prompts, params))
        assert 0 < llm.engine.stats["spec_accepted_tokens"] < llm.engine.stats["spec_draft_tokens"]
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="a draft model runs at tensor_parallel_size 1 only"):
        _spec(ckpts, {"method": "draft_model", "model": str(ckpts["target"]), "num_speculative_tokens": 2},
              tensor_parallel_size=2)


def test_server_flag(ckpts):
    """`--speculative-config JSON` reaches the engine; a malformed one is refused naming the key."""
    from xllm_gen.runtime.serving.server import _parser, make_engine
    args = _parser().parse_args([str(ckpts["target"]), "--device", "cpu", "--dtype", "float32",
                                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    engine = make_engine(args)
    try:
        assert engine.spec is not None and engine.spec.cfg.num_speculative_tokens == 2
    finally:
        engine.shutdown()
    bad = _parser().parse_args([str(ckpts["target"]), "--speculative-config", '{"method": "ngram"}'])
    with pytest.raises(ValueError, match="speculative_config: 'num_speculative_tokens' is required"):
        make_engine(bad)


def test_multimodal_target_is_refused(qwen3_vl_tied):
    with pytest.raises(ValueError, match="speculative decoding is not supported for multimodal models"):
        LLM(str(qwen3_vl_tied), speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **ENGINE)


def test_streamed_deltas_and_seeded_reproducibility(ckpts):
    """Several tokens per step arrive as one delta each step; the deltas add up to the final output. A seeded
    sampled request gives the same tokens on every run (its own generator draws the drafts and the checks)."""
    llm = _spec(ckpts, {"method": "draft_model", "model": str(ckpts["target"]), "num_speculative_tokens": 4})
    eng = llm.engine
    eng.add_request("a", {"prompt_token_ids": [5, 6, 7, 8] * 3}, SamplingParams(max_tokens=30, **GREEDY))
    ids, sizes, final = [], [], None
    while eng.has_unfinished_requests():
        for out in eng.step_deltas():
            ids += out.outputs[0].token_ids
            sizes.append(len(out.outputs[0].token_ids))
            final = out if out.finished else final
    assert len(ids) == 30 and max(sizes) > 1 and final is not None
    ref = llm.generate([{"prompt_token_ids": [5, 6, 7, 8] * 3}], SamplingParams(max_tokens=30, **GREEDY))
    assert ids == ref[0].outputs[0].token_ids
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True, logprobs=1)
    runs = [llm.generate([{"prompt_token_ids": [3, 1, 4, 1, 5]}], seeded)[0].outputs[0] for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].logprobs) == 20
    llm.shutdown()


@pytest.mark.parametrize("arch", ["Gemma3ForCausalLM", "MixtralForCausalLM", "GPTNeoXForCausalLM"])
def test_other_families_greedy_identical(tiny_checkpoint, arch):
    """The verification is a prefill chunk of the family's own generated runner: sliding windows (Gemma 3's
    per-layer pattern, crossed by the drafts), MoE routing, parallel residual blocks decode as without drafts."""
    ckpt = tiny_checkpoint(arch)
    prompts = _prompts(11, 3)
    p = SamplingParams(max_tokens=24, **GREEDY)
    kw = dict(ENGINE, enable_prefix_caching=False)
    ref = LLM(str(ckpt), **kw)
    want = ref.generate(prompts, p)
    ref.shutdown()
    llm = LLM(str(ckpt), speculative_config={"method": "draft_model", "model": str(ckpt), "num_speculative_tokens": 3},
              **kw)
    _same_greedy(want, llm.generate(prompts, p))
    assert llm.engine.spec_acceptance_rate == 1.0 and llm.engine.stats["spec_steps"] * 2 < llm.engine.stats["decode_tokens"]
    llm.shutdown()
