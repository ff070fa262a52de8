"""vLLM's request surface: n, penalties, min_p, logit_bias, skip_special_tokens, prompt_logprobs, stop_reason,
LLM(tokenizer=...), checked against transformers' logits processors and generate(); validation at admission
whatever happened to the SamplingParams object; per-step deltas (streaming) equal the final outputs."""
from __future__ import annotations

import math
import random
import shutil

import pytest
import torch
from hf_ref import hf_model, hf_prefill_logits

pytestmark = pytest.mark.engine


def _sp(**kw):
    from xllm_gen import SamplingParams

    base = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    base.update(kw)
    return SamplingParams(**base)


def _seq(history, n_prompt, **kw):
    from xllm_gen.runtime.engine.sequence import Sequence

    s = Sequence(0, history[:n_prompt], _sp(**kw).validated())
    for t in history[n_prompt:]:
        s.append_token(t)
    return s


V = 97


# ------------------------------------------------------------------ logits processors against transformers
@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_hf(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    from xllm_gen.runtime.engine.sampler import process_row

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(V, generator=g) * 3
    hist = torch.randint(0, V, (20,), generator=g).tolist()
    seq = _seq(hist, 12, repetition_penalty=penalty)
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([hist]), logits[None].clone())[0]
    torch.testing.assert_close(process_row(logits, seq), want)


def test_frequency_presence_penalties_match_openai_formula():
    from xllm_gen.runtime.engine.sampler import process_row

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(V, generator=g)
    hist = torch.randint(0, V, (30,), generator=g).tolist()
    seq = _seq(hist, 10, frequency_penalty=0.7, presence_penalty=-0.4)
    want = logits.clone()
    for t in set(hist[10:]):                 # output tokens only (OpenAI / vLLM)
        c = hist[10:].count(t)
        want[t] -= c * 0.7 + (1 if c > 0 else 0) * -0.4
    torch.testing.assert_close(process_row(logits, seq), want)


def test_logit_bias_matches_hf_sequence_bias():
    from transformers import SequenceBiasLogitsProcessor

    from xllm_gen.runtime.engine.sampler import process_row

    logits = torch.randn(V, generator=torch.Generator().manual_seed(3))
    bias = {5: 2.5, 17: -7.0, 96: 0.25}
    seq = _seq([1, 2, 3], 3, logit_bias=bias)
    want = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([[1, 2, 3]]),
                                                                             logits[None].clone())[0]
    torch.testing.assert_close(process_row(logits, seq), want)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_matches_hf(min_p):
    from transformers import MinPLogitsWarper

    from xllm_gen.runtime.engine.sampler import apply_min_p

    logits = torch.randn(V, generator=torch.Generator().manual_seed(4)) * 2
    ours = apply_min_p(logits, min_p)
    ref = MinPLogitsWarper(min_p, min_tokens_to_keep=1)(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0]
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(ours[~torch.isinf(ours)], logits[~torch.isinf(ref)])


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (-1, 0.6), (20, 0.9)])
def test_top_k_top_p_match_hf(top_k, top_p):
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    from xllm_gen.runtime.engine.sampler import _filter_top_k_top_p

    logits = torch.randn(V, generator=torch.Generator().manual_seed(5)) * 2
    ref = logits[None].clone()
    if top_k > 0:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    assert torch.equal(torch.isinf(_filter_top_k_top_p(logits, top_k, top_p)), torch.isinf(ref[0]))


@pytest.mark.parametrize("top_p", [1e-308, 5e-324, 1e-45, 1e-9])
def test_tiny_top_p_keeps_the_top_token(top_p):
    """A valid top_p below float32's range (found by the request fuzzer: 1.1e-308) rounds to 0 in a float32
    comparison; the top token must still be kept, so the request samples it instead of failing on NaN."""
    from xllm_gen.runtime.engine.sampler import _filter_top_k_top_p, sample_row
    from xllm_gen.runtime.engine.sampling_params import SamplingParams
    from xllm_gen.runtime.engine.sequence import Sequence

    logits = torch.randn(V, generator=torch.Generator().manual_seed(7)) * 2
    kept = ~torch.isinf(_filter_top_k_top_p(logits, -1, top_p))
    assert kept.nonzero().flatten().tolist() == [int(logits.argmax())]
    seq = Sequence(0, [1, 2], SamplingParams(temperature=0.7, top_p=top_p, seed=3))
    assert sample_row(logits, seq, torch.Generator().manual_seed(0)) == int(logits.argmax())


@pytest.mark.parametrize("params", [dict(temperature=1e308), dict(repetition_penalty=5e-324),
                                    dict(temperature=1e308, repetition_penalty=5e-324, top_p=5e-324, min_p=5e-324),
                                    dict(temperature=1e-5, repetition_penalty=100.0, presence_penalty=-2.0)])
def test_extreme_valid_params_sample_a_token(params):
    """Valid parameters at the edges of float32 (a temperature above its max, a repetition penalty below its
    range) on logits with -inf entries and a seen token: a token is drawn among the finite ones, no NaN."""
    from xllm_gen.runtime.engine.sampler import process_row, sample_row
    from xllm_gen.runtime.engine.sampling_params import SamplingParams
    from xllm_gen.runtime.engine.sequence import Sequence

    logits = torch.randn(V, generator=torch.Generator().manual_seed(8))
    logits[1:4] = float("-inf")
    seq = Sequence(0, [1, 2, 3, 9], SamplingParams(seed=5, **params).validated())
    for trial in range(5):
        tok = sample_row(process_row(logits, seq), seq, torch.Generator().manual_seed(trial))
        assert 0 <= tok < V and tok not in (1, 2, 3), tok


def test_sampled_distribution_follows_processed_probs():
    """Many seeded draws from one row follow softmax(processed / T) (chi-square-ish bound)."""
    from xllm_gen.runtime.engine.sampler import sample_row

    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    seq = _seq([0], 1, temperature=0.7, min_p=0.1, seed=3)
    probs = torch.softmax(logits / 0.7, -1)
    probs = torch.where(probs < 0.1 * probs.max(), 0.0, probs)
    probs /= probs.sum()
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sample_row(logits, seq, torch.Generator())] += 1
    assert counts[4] == 0 and counts[3] == 0          # below min_p: never drawn
    assert torch.allclose(counts / 4000, probs, atol=0.03)


# ------------------------------------------------------------------ end to end on the tiny checkpoint
def test_repetition_penalty_greedy_matches_hf_generate(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied)
    ids = [5, 17, 99, 3, 42, 42, 7]
    ours = llm.generate([{"prompt_token_ids": ids}], _sp(repetition_penalty=1.8, max_tokens=10))[0].outputs[0]
    model = hf_model(qwen3_tied)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=10, do_sample=False, repetition_penalty=1.8, eos_token_id=None,
                             pad_token_id=0)
    assert ours.token_ids == out[0, len(ids):].tolist()


def test_n_completions_and_seeds(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied)
    p = "Once upon a time"
    outs = llm.generate([p], _sp(n=3, temperature=1.0, seed=11))[0].outputs
    assert [c.index for c in outs] == [0, 1, 2]
    for i, c in enumerate(outs):      # completion i is the request with seed + i
        alone = llm.generate([p], _sp(temperature=1.0, seed=11 + i))[0].outputs[0]
        assert c.token_ids == alone.token_ids and c.text == alone.text
    assert len({tuple(c.token_ids) for c in outs}) > 1
    greedy = llm.generate([p], _sp(n=2))[0].outputs
    assert greedy[0].token_ids == greedy[1].token_ids
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_logit_bias_forces_token(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied)
    out = llm.generate(["Hello"], _sp(logit_bias={123: 100.0}, max_tokens=5))[0].outputs[0]
    assert out.token_ids == [123] * 5


def test_stop_reason(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied)
    ids = {"prompt_token_ids": [5, 17, 99, 3]}
    full = llm.generate([ids], _sp(max_tokens=8))[0].outputs[0]
    assert full.stop_reason is None and full.finish_reason == "length"
    t = full.token_ids[2]
    by_tok = llm.generate([ids], _sp(max_tokens=8, stop_token_ids=[t]))[0].outputs[0]
    assert by_tok.stop_reason == t and by_tok.finish_reason == "stop"
    text_out = llm.generate(["The quick brown fox"], _sp(max_tokens=24))[0].outputs[0]
    stop = text_out.text[5:8]
    by_str = llm.generate(["The quick brown fox"], _sp(max_tokens=24, stop=[stop, "\x00never"]))[0].outputs[0]
    assert by_str.stop_reason == stop and by_str.finish_reason == "stop"
    eos = next(iter(llm.engine.eos_token_ids))
    by_eos = llm.generate([ids], _sp(max_tokens=8, ignore_eos=False, logit_bias={eos: 100.0}))[0].outputs[0]
    assert by_eos.finish_reason == "stop" and by_eos.stop_reason is None and by_eos.token_ids == [eos]


def test_skip_special_tokens(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied)
    tok = llm.get_tokenizer()
    special = tok.convert_tokens_to_ids(tok.all_special_tokens[0])
    kw = dict(max_tokens=2, logit_bias={special: 100.0})
    skipped = llm.generate(["Hi"], _sp(**kw))[0].outputs[0]
    kept = llm.generate(["Hi"], _sp(skip_special_tokens=False, **kw))[0].outputs[0]
    assert skipped.text == "" and kept.text == tok.all_special_tokens[0] * 2


def _stream(eng, prompts, params) -> dict:
    """Each request's streamed deltas (step_deltas) joined: request index -> (text, token ids, finish_reason)."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"s{i}", p, sp)
    acc: dict = {}
    while eng.has_unfinished_requests():
        for out in eng.step_deltas():
            for c in out.outputs:
                text, ids, _ = acc.get(int(out.request_id[1:]), ("", [], None))
                acc[int(out.request_id[1:])] = (text + c.text, ids + list(c.token_ids), c.finish_reason)
    return acc


def test_the_stop_token_is_not_in_the_text(qwen3_tied, make_llm):
    """vLLM's rule: the token that ends a completion (EOS, a stop_token_ids id) stays in token_ids but its text is
    left out, special or not (skip_special_tokens false); include_stop_str_in_output puts it in. Streamed deltas
    and the serving API side's detokenization (the engine core sends token ids) agree."""
    from xllm_gen.runtime.serving.core_client import _RequestDetok

    llm = make_llm(qwen3_tied)
    eng, tok = llm.engine, llm.get_tokenizer()
    ids = {"prompt_token_ids": [5, 17, 99, 3]}
    full = llm.generate([ids], _sp(max_tokens=12))[0].outputs[0].token_ids
    k = next(i for i, t in enumerate(full) if i >= 2 and t not in full[:i] and tok.decode([t]).strip().isalnum())
    stop_tok, eos = full[k], min(eng.eos_token_ids)
    eos_text = tok.decode([eos])
    cases = [  # (params, the text wanted)
        (_sp(stop_token_ids=[stop_tok]), tok.decode(full[:k])),
        (_sp(stop_token_ids=[stop_tok], include_stop_str_in_output=True), tok.decode(full[:k + 1])),
        (_sp(stop_token_ids=[stop_tok], skip_special_tokens=False), tok.decode(full[:k])),
        (_sp(ignore_eos=False, skip_special_tokens=False, logit_bias={eos: 100.0}, min_tokens=2, max_tokens=4),
         None),
        (_sp(ignore_eos=False, skip_special_tokens=False, logit_bias={eos: 100.0}, include_stop_str_in_output=True),
         eos_text),
    ]
    outs = [o.outputs[0] for o in llm.generate([ids] * len(cases), [c[0] for c in cases])]
    head = outs[3].token_ids[:2]
    assert outs[3].token_ids == head + [eos] and eos not in head
    wants = [w if w is not None else tok.decode(head, skip_special_tokens=False) for _, w in cases]
    assert [(o.text, o.finish_reason) for o in outs] == [(w, "stop") for w in wants]
    assert outs[0].token_ids == full[:k + 1] and outs[0].stop_reason == stop_tok
    streamed = _stream(eng, [ids] * len(cases), [c[0] for c in cases])
    assert [streamed[i] for i in range(len(cases))] == [(o.text, o.token_ids, "stop") for o in outs]
    eng.detokenize = False            # as in the engine core: the API side detokenizes the token ids
    try:
        for i, (sp, _) in enumerate(cases):
            det, text = _RequestDetok(tok, sp, eng.eos_token_ids), ""
            eng.add_request("c", ids, sp)
            while eng.has_unfinished_requests():
                for out in eng.step_deltas():
                    det(out)
                    text += "".join(c.text for c in out.outputs)
            assert text == outs[i].text, i
    finally:
        eng.detokenize = True


def test_stop_strings_need_a_tokenizer(qwen3_tied, make_llm, monkeypatch):
    """Without a tokenizer no stop string can match: a request with `stop` is refused naming the field (it ran to
    max_tokens, the stop silently ignored), alone; token ids with stop_token_ids are served."""
    llm = make_llm(qwen3_tied)
    monkeypatch.setattr(llm.engine, "tokenizer", None)
    ids = {"prompt_token_ids": [5, 17, 99, 3]}
    outs = llm.generate([ids, ids], [_sp(max_tokens=4, stop=["a"]), _sp(max_tokens=4, stop_token_ids=[7])],
                        on_error="return")
    assert outs[0].error and outs[0].error.startswith("request 0: stop: ") and "tokenizer" in outs[0].error
    assert outs[1].error is None and outs[1].outputs[0].token_ids


def test_vllm_none_values(qwen3_tied, make_llm):
    """vLLM's SamplingParams take None for stop and stop_token_ids (none) and for max_tokens (up to the context's
    end); scripts that pass them through were refused."""
    from xllm_gen import SamplingParams

    llm = make_llm(qwen3_tied, max_model_len=24)
    sp = SamplingParams(temperature=0.0, ignore_eos=True, stop=None, stop_token_ids=None, max_tokens=None)
    assert (sp.stop, sp.stop_token_ids, sp.max_tokens) == ([], [], None)
    out = llm.generate([{"prompt_token_ids": [5, 17, 99, 3]}], sp)[0].outputs[0]
    assert len(out.token_ids) == 24 - 4 and out.finish_reason == "length"
    assert sp.max_tokens is None                             # the caller's object is not changed
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=None, min_tokens=-1)


def test_prompt_logprobs_match_hf(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied, enable_chunked_prefill=True, max_num_batched_tokens=5)
    ids = [random.Random(0).randrange(400) for _ in range(13)]
    out = llm.generate([{"prompt_token_ids": ids}, "another request"], _sp(prompt_logprobs=2, max_tokens=3))[0]
    ref = torch.log_softmax(hf_prefill_logits(qwen3_tied, ids), -1)
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):
        entry = plp[j]
        assert ids[j] in entry and len(entry) in (2, 3)
        assert math.isclose(entry[ids[j]].logprob, float(ref[j - 1, ids[j]]), abs_tol=1e-4)
        top = torch.topk(ref[j - 1], 2).indices.tolist()
        assert [t for t, lp in entry.items() if lp.rank <= 2] == top or set(top) <= set(entry)


def test_tokenizer_argument(qwen3_tied, tmp_path):
    from xllm_gen import LLM

    tdir = tmp_path / "tok"
    tdir.mkdir()
    for f in qwen3_tied.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            shutil.copy(f, tdir / f.name)
    llm = LLM(model=str(qwen3_tied), tokenizer=str(tdir), device="cpu", dtype="float32", block_size=4)
    assert llm.generate(["Hello"], _sp(max_tokens=3))[0].outputs[0].text is not None
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(model=str(qwen3_tied), tokenizer=str(tmp_path / "missing"), device="cpu", dtype="float32")


# ------------------------------------------------------------------ admission validation
def _clean(llm):
    eng = llm.engine
    assert not eng.scheduler.has_unfinished() and not eng._requests
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("field,value", [
    ("temperature", float("nan")), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -5), ("max_tokens", 0),
    ("max_tokens", 2.5), ("n", 0), ("min_p", 1.5), ("presence_penalty", 3.0), ("frequency_penalty", float("inf")),
    ("repetition_penalty", 0.0), ("logit_bias", {"a": 1}), ("logit_bias", {1: float("nan")}), ("logprobs", 10 ** 6),
    ("prompt_logprobs", -1), ("seed", 1.5), ("stop_token_ids", [None]), ("stop", [""]), ("stop", 5),
    ("stop", ["\ud800"]), ("skip_special_tokens", "yes"), ("min_tokens", 99), ("ignore_eos", None),
])
def test_fields_changed_after_construction_are_revalidated(qwen3_tied, make_llm, field, value):
    from xllm_gen.runtime.engine.llm import InvalidRequestError

    llm = make_llm(qwen3_tied)
    bad = _sp()
    setattr(bad, field, value)
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request("x", "Hello", bad)
    with pytest.raises(InvalidRequestError, match=field) as e:
        llm.generate(["Hello", "World"], [_sp(), bad])
    assert e.value.outputs[0].error is None and len(e.value.outputs[0].outputs[0].token_ids) == 12
    _clean(llm)


def test_numpy_numbers_are_numbers(qwen3_tied, make_llm):
    """numpy scalars (np.int64 from len() of an array, np.float32 from a sweep) and token ids are served as the
    Python numbers they hold (they were refused as "max_tokens must be an integer >= 1, got np.int64(12)"),
    also when set after construction; a float is still no integer."""
    np = pytest.importorskip("numpy")
    from xllm_gen import SamplingParams

    llm = make_llm(qwen3_tied)
    want = llm.generate([{"prompt_token_ids": [5, 17, 99]}], _sp(max_tokens=4, stop_token_ids=[7],
                                                                  logit_bias={3: 1.5}))[0]
    sp = SamplingParams(temperature=np.float32(0.0), max_tokens=np.int64(4), ignore_eos=True, seed=np.uint64(3),
                        stop_token_ids=[np.int32(7)], logit_bias={np.int64(3): np.float64(1.5)}, n=np.int8(1))
    assert type(sp.max_tokens) is int and type(sp.temperature) is float
    late = _sp(max_tokens=2)
    late.top_k = np.int64(5)
    got = llm.generate([{"prompt_token_ids": list(np.array([5, 17, 99]))}, "Hello"], [sp, late])
    assert got[0].outputs[0].token_ids == want.outputs[0].token_ids and got[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="max_tokens must be an integer"):
        SamplingParams(max_tokens=np.float64(5.0))
    _clean(llm)


def test_tiny_temperature_and_huge_seed(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied)
    greedy = llm.generate(["Hello"], _sp())[0].outputs[0].token_ids
    assert llm.generate(["Hello"], _sp(temperature=1e-38, seed=1))[0].outputs[0].token_ids == greedy
    sp = _sp()
    sp.temperature = 5e-324                       # set after construction: same result
    assert llm.generate(["Hello"], sp)[0].outputs[0].token_ids == greedy
    big = llm.generate(["Hello"], _sp(temperature=1.0, seed=2 ** 70))[0].outputs[0].token_ids
    same = llm.generate(["Hello"], _sp(temperature=1.0, seed=2 ** 70 % 2 ** 64))[0].outputs[0].token_ids
    assert big == same
    assert llm.generate(["Hello"], _sp(temperature=1.0, seed=-(2 ** 90)))[0].outputs[0].token_ids
    _clean(llm)


def test_lone_surrogate_fails_alone(qwen3_tied, make_llm):
    from xllm_gen.runtime.engine.llm import InvalidRequestError

    llm = make_llm(qwen3_tied)
    want = llm.generate(["Hello"], _sp())[0].outputs[0].token_ids
    for bad in ("ab\ud800cd", {"prompt": "\udfff"}):
        with pytest.raises(InvalidRequestError, match=r"request 1: .*(surrogate|Unicode)") as e:
            llm.generate(["Hello", bad], _sp())
        assert e.value.outputs[0].outputs[0].token_ids == want
        _clean(llm)
    assert llm.generate(["Hello"], _sp())[0].outputs[0].token_ids == want


@pytest.mark.parametrize("rid,prompt,params,field", [
    ([1], "hi", None, "request_id"),
    ("a", "hi", None, "SamplingParams"),
    ("a", "hi", "temperature=0", "SamplingParams"),
    ("a", {"prompt": ["x"]}, _sp, "prompt"),
    ("a", {"prompt_token_ids": "abc"}, _sp, "prompt_token_ids"),
    ("a", {"prompt_token_ids": [1, None]}, _sp, "prompt_token_ids"),
    ("a", {"prompt_token_ids": [1, 2 ** 80]}, _sp, "vocab"),
    ("a", {"prompt_token_ids": [1], 5: 3}, _sp, "prompt key"),
    ("a", {"prompt_token_ids": [1], "mm_processor_kwargs": 3}, _sp, "mm_processor_kwargs"),
    ("a", b"bytes", _sp, "prompt"),
    ("a", None, _sp, "prompt"),
])
def test_add_request_raises_value_error_naming_field(qwen3_tied, make_llm, rid, prompt, params, field):
    llm = make_llm(qwen3_tied)
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request(rid, prompt, params() if callable(params) else params)
    _clean(llm)


def test_logit_bias_and_stop_ids_out_of_vocab(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.engine.add_request("a", "hi", _sp(logit_bias={10 ** 9: 1.0}))
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.engine.add_request("a", "hi", _sp(stop_token_ids=[10 ** 9]))
    _clean(llm)


def test_failure_after_admission_fails_alone(qwen3_tied, make_llm, monkeypatch):
    """A request whose sampling raises (here: an injected fault) ends with .error and its blocks freed; the
    others give their solo tokens."""
    from xllm_gen.runtime.engine import sampler as sampler_mod
    from xllm_gen.runtime.engine.llm import InvalidRequestError

    llm = make_llm(qwen3_tied)
    prompts = ["Hello", "World wide", "Third"]
    solo = [llm.generate([p], _sp(temperature=0.9, seed=i))[0].outputs[0].token_ids for i, p in enumerate(prompts)]
    real = sampler_mod.sample_row

    def faulty(logits, seq, gen):
        if seq.params.seed == 1 and seq.num_completion_tokens == 4:
            raise RuntimeError("injected")
        return real(logits, seq, gen)

    monkeypatch.setattr(sampler_mod, "sample_row", faulty)
    with pytest.raises(InvalidRequestError, match="request 1: .*injected") as e:
        llm.generate(prompts, [_sp(temperature=0.9, seed=i) for i in range(3)])
    outs = e.value.outputs
    assert outs[0].outputs[0].token_ids == solo[0] and outs[2].outputs[0].token_ids == solo[2]
    assert outs[1].error and outs[1].outputs[0].token_ids == solo[1][:4]
    _clean(llm)


# ------------------------------------------------------------------ incremental outputs
def test_incremental_detokenizer_multibyte(qwen3_tied):
    from transformers import AutoTokenizer

    from xllm_gen.runtime.engine.engine import IncrementalDetokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3_tied))
    text = "héllo 世界 🎉🎉 ok ∑ ünïcödé 日本語"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    deltas = [d.step(ids[:k]) for k in range(1, len(ids) + 1)] + [d.flush(ids)]
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == d.text == tok.decode(ids)


def test_step_deltas_concatenate_to_final_outputs(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied, num_kv_blocks=14)          # small pool: preemption while streaming
    eng = llm.engine
    prompts = ["The quick brown fox", "Once upon", {"prompt_token_ids": list(range(40, 70))}, "Hi"]
    params = [_sp(max_tokens=20, logprobs=2), _sp(n=2, temperature=1.0, seed=4, max_tokens=16),
              _sp(max_tokens=25, stop=["e"]), _sp(max_tokens=18, prompt_logprobs=1)]
    final = llm.generate(prompts, params)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    acc: dict = {}
    finished = set()
    plp = {}
    while eng.has_unfinished_requests():
        for out in eng.step_deltas():
            assert out.request_id not in finished
            if out.prompt_logprobs is not None:
                plp[out.request_id] = out.prompt_logprobs
            for c in out.outputs:
                a = acc.setdefault((out.request_id, c.index), {"ids": [], "text": "", "lp": [], "fr": None})
                a["ids"] += c.token_ids
                a["text"] += c.text
                a["lp"] += c.logprobs or []
                a["fr"], a["sr"] = c.finish_reason, c.stop_reason
            if out.finished:
                finished.add(out.request_id)
    assert finished == {f"r{i}" for i in range(4)}
    for i, out in enumerate(final):
        for c in out.outputs:
            a = acc[(f"r{i}", c.index)]
            assert a["ids"] == c.token_ids and a["text"] == c.text
            assert (a["fr"], a["sr"]) == (c.finish_reason, c.stop_reason)
            if params[i].logprobs is not None:
                assert [set(e) for e in a["lp"]] == [set(e) for e in c.logprobs]
                for e, f in zip(a["lp"], c.logprobs):      # a prefix-cache hit may round differently
                    assert all(abs(e[t].logprob - f[t].logprob) < 1e-4 for t in e)
    assert len(plp["r3"]) == len(final[3].prompt_logprobs)
    assert eng.scheduler.num_preemptions > 0
    _clean(llm)


# ------------------------------------------------------------------ special tokens of a text prompt
def test_text_prompts_get_the_tokenizers_bos_chat_prompts_do_not(qwen3_tied, tmp_path):
    """A tokenizer that adds a BOS (Llama, Gemma, Mistral): a text prompt is tokenized with it, as vLLM and
    transformers' tokenizer(text) do (a Gemma model without its <bos> degrades badly); a chat prompt is not (its
    template wrote the special tokens); `add_special_tokens` in a prompt dict chooses."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from xllm_gen import LLM, SamplingParams

    d = tmp_path / "bos"
    shutil.copytree(qwen3_tied, d)
    tj = json.loads((d / "tokenizer.json").read_text())
    bos = next(a for a in tj["added_tokens"] if a["content"] == "<|endoftext|>")
    tj["post_processor"] = {"type": "TemplateProcessing",
                            "single": [{"SpecialToken": {"id": bos["content"], "type_id": 0}},
                                       {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [{"SpecialToken": {"id": bos["content"], "type_id": 0}},
                                     {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {bos["content"]: {"id": bos["content"], "ids": [bos["id"]],
                                                                "tokens": [bos["content"]]}}}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    tok = AutoTokenizer.from_pretrained(str(d))
    text = "The capital of France is"
    assert tok(text)["input_ids"][0] == bos["id"]           # the fixture's tokenizer now adds a BOS
    llm = LLM(str(d), device="cpu", dtype="float32", num_kv_blocks=64)
    try:
        sp = SamplingParams(max_tokens=1, temperature=0.0)
        plain, raw = llm.generate([text, {"prompt": text, "add_special_tokens": False}], sp)
        assert plain.prompt_token_ids == tok(text)["input_ids"]
        assert raw.prompt_token_ids == tok(text, add_special_tokens=False)["input_ids"]
        chat = llm.chat([{"role": "user", "content": text}], sp)[0]
        assert chat.prompt_token_ids == tok(chat.prompt, add_special_tokens=False)["input_ids"]
        bad = llm.generate([{"prompt": text, "add_special_tokens": "yes"}], sp, on_error="return")[0]
        assert "add_special_tokens" in bad.error
    finally:
        llm.shutdown()
