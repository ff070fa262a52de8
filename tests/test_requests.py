"""Request validation and sampling, through the public API on the tiny Qwen3 checkpoint.

Bad requests (contract of LLM.generate): each bad request is rejected alone, the others are served.
- on_error="return": the bad request's RequestOutput has `.error` (a message naming "request {i}" and the
  problem), `finished=True` and no tokens;
- default (on_error="raise"): after serving the valid requests, a ValueError naming every bad request is
  raised; its `.outputs` holds all outputs in prompt order.
Invalid SamplingParams values raise ValueError at construction.

Sampling: seeded sampling is reproducible and independent of the batch around the request; temperature > 0
differs from greedy; top_k=1 is greedy; logprobs match HF's log-softmax and include the chosen token.
"""
from __future__ import annotations

import random
import re

import pytest
import torch
from hf_ref import hf_greedy, hf_greedy_logprobs

pytestmark = pytest.mark.engine


def _sp(**kw):
    from xllm_gen import SamplingParams

    base = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    base.update(kw)
    return SamplingParams(**base)


def _ids(seed: int, n: int, n_tok: int = 400) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, n_tok) for _ in range(n)]


def _names_request(msg: str, i: int) -> bool:
    return re.search(rf"request\W*(index\W*)?{i}\b", msg, re.IGNORECASE) is not None


GOOD = ["Hello, world!", {"prompt_token_ids": _ids(1, 7)}, "The capital of France is"]


def _bad_requests(max_pos: int) -> list[tuple[object, str]]:
    """(prompt, regex the error must match besides the request index)."""
    return [
        ("", r"empty"),
        ({"prompt_token_ids": []}, r"empty"),
        ({"prompt_token_ids": [5, 999999, 7]}, r"999999.*vocab|vocab.*999999"),
        ({"prompt_token_ids": [5, -1, 7]}, r"-1.*vocab|vocab.*-1"),
        ({"prompt_token_ids": _ids(2, max_pos + 50)}, r"context|max_model_len|max_position|too long|exceeds"),
        ({"prompt_token_ids": [1, 2], "prompt": "both"}, r"prompt"),
        (12345, r"prompt|str|dict"),
    ]


# ------------------------------------------------------------------------------------------- bad requests
def _mixed(max_pos: int):
    """Good and bad requests interleaved: (prompts, {index: regex} of the bad ones, good indices)."""
    bad = _bad_requests(max_pos)
    prompts, expect_bad, good_idx = [], {}, []
    gi = iter(GOOD)
    for k in range(len(bad)):
        if k < len(GOOD):
            good_idx.append(len(prompts))
            prompts.append(next(gi))
        expect_bad[len(prompts)] = bad[k][1]
        prompts.append(bad[k][0])
    return prompts, expect_bad, good_idx


def _max_pos(ckpt) -> int:
    import json

    return json.loads((ckpt / "config.json").read_text())["max_position_embeddings"]


def test_bad_requests_return_errors_and_others_are_served(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied)
    prompts, expect_bad, good_idx = _mixed(_max_pos(qwen3_tied))
    outs = llm.generate(prompts, _sp(), on_error="return")
    assert len(outs) == len(prompts)
    alone = llm.generate(GOOD, _sp())
    for k, i in enumerate(good_idx):
        assert outs[i].error is None
        assert list(outs[i].outputs[0].token_ids) == list(alone[k].outputs[0].token_ids)
        assert len(outs[i].outputs[0].token_ids) == 16
    for i, pattern in expect_bad.items():
        err = outs[i].error
        assert isinstance(err, str) and err, f"request {i} ({prompts[i]!r:.60}) was not rejected"
        assert _names_request(err, i), f"error does not name request {i}: {err!r}"
        assert re.search(pattern, err, re.IGNORECASE), f"request {i}: error {err!r} does not match {pattern!r}"
        assert outs[i].finished
        assert all(len(c.token_ids) == 0 for c in outs[i].outputs)


def test_bad_requests_raise_after_serving_the_others(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied)
    prompts, expect_bad, good_idx = _mixed(_max_pos(qwen3_tied))
    with pytest.raises(ValueError) as ei:
        llm.generate(prompts, _sp())
    msg = str(ei.value)
    for i in expect_bad:
        assert _names_request(msg, i), f"the error does not name request {i}: {msg!r}"
    for i in good_idx:
        assert not _names_request(msg, i), f"good request {i} named in the error: {msg!r}"
    outs = getattr(ei.value, "outputs", None)
    assert outs is not None and len(outs) == len(prompts), "the error must carry every request's output"
    alone = llm.generate(GOOD, _sp())
    for k, i in enumerate(good_idx):
        assert list(outs[i].outputs[0].token_ids) == list(alone[k].outputs[0].token_ids)
    # The engine is clean afterwards.
    again = llm.generate(GOOD, _sp())
    assert [list(o.outputs[0].token_ids) for o in again] == [list(o.outputs[0].token_ids) for o in alone]


def test_only_bad_requests(qwen3_tied, make_llm):
    outs = make_llm(qwen3_tied).generate(["", {"prompt_token_ids": [999999]}], _sp(), on_error="return")
    assert [bool(o.error) for o in outs] == [True, True]


def test_per_request_bad_sampling_params_rejected_alone(qwen3_tied, make_llm):
    """A SamplingParams made valid and then mutated to a bad value is rejected for that request only."""
    llm = make_llm(qwen3_tied)
    bad = _sp()
    bad.top_p = 2.0
    outs = llm.generate(GOOD[:2], [_sp(), bad], on_error="return")
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 16
    assert outs[1].error and _names_request(outs[1].error, 1) and "top_p" in outs[1].error


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_p=2.0), dict(top_p=0.0), dict(top_p=-0.5), dict(temperature=-0.1), dict(max_tokens=0),
        dict(max_tokens=-3), dict(top_k=-2), dict(logprobs=-1),
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_sampling_params_reject_bad_values(kwargs):
    from xllm_gen import SamplingParams

    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(temperature=0.0), dict(top_p=1.0), dict(top_p=0.01), dict(top_k=-1), dict(top_k=1),
     dict(max_tokens=1), dict(seed=0), dict(logprobs=0), dict(stop_token_ids=[1, 2])],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "defaults",
)
def test_sampling_params_accept_good_values(kwargs):
    from xllm_gen import SamplingParams

    SamplingParams(**kwargs)


def test_best_of_says_what_to_do_instead():
    """vLLM's best_of (more samples than returned, ranked) is not supported: a ValueError saying what to do, not
    Python's bare TypeError for an unknown argument; best_of == n (nothing to rank) passes."""
    from xllm_gen import SamplingParams

    with pytest.raises(ValueError, match=r"best_of=4 is not supported .*n=k with logprobs=0 .*cumulative_logprob"):
        SamplingParams(n=2, best_of=4)
    assert SamplingParams(n=2, best_of=2).n == 2


# ----------------------------------------------------------------------------------------------- sampling
def test_seeded_sampling_reproducible_and_batch_independent(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied)
    target = {"prompt_token_ids": _ids(5, 9)}
    sp = _sp(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=24)
    alone = llm.generate([target], sp)[0].outputs[0].token_ids
    again = llm.generate([target], sp)[0].outputs[0].token_ids
    assert list(alone) == list(again)
    batch = llm.generate(
        ["Hello, world!", target, {"prompt_token_ids": _ids(6, 30)}, target],
        [_sp(temperature=1.0, seed=7, max_tokens=30), sp, _sp(max_tokens=5), _sp(temperature=0.8, max_tokens=20)],
    )
    assert list(batch[1].outputs[0].token_ids) == list(alone)
    other_seed = llm.generate([target], _sp(temperature=1.0, top_p=0.95, top_k=50, seed=99, max_tokens=24))
    assert list(other_seed[0].outputs[0].token_ids) != list(alone)


def test_seeded_sampling_survives_preemption(qwen3_tied, make_llm):
    prompts = [{"prompt_token_ids": _ids(20 + k, 5 + 3 * k)} for k in range(5)]
    sps = [_sp(temperature=1.0, seed=100 + k, max_tokens=24) for k in range(5)]
    ref = make_llm(qwen3_tied).generate(prompts, sps)
    small = make_llm(qwen3_tied, num_kv_blocks=14)
    before = small.engine.scheduler.num_preemptions
    outs = small.generate(prompts, sps)
    assert small.engine.scheduler.num_preemptions > before, "no preemption happened"
    assert [list(o.outputs[0].token_ids) for o in outs] == [list(o.outputs[0].token_ids) for o in ref]


def test_temperature_differs_from_greedy(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied)
    p = {"prompt_token_ids": _ids(8, 6)}
    greedy = llm.generate([p], _sp(max_tokens=32))[0].outputs[0].token_ids
    hot = llm.generate([p], _sp(temperature=1.5, seed=0, max_tokens=32))[0].outputs[0].token_ids
    assert list(hot) != list(greedy)


def test_top_k_1_and_tiny_top_p_are_greedy(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied)
    p = {"prompt_token_ids": _ids(9, 10)}
    greedy = list(llm.generate([p], _sp(max_tokens=24))[0].outputs[0].token_ids)
    assert greedy == hf_greedy(qwen3_tied, [p["prompt_token_ids"]], 24)[0]
    k1 = llm.generate([p], _sp(temperature=1.3, top_k=1, seed=3, max_tokens=24))[0].outputs[0].token_ids
    p0 = llm.generate([p], _sp(temperature=1.3, top_p=1e-6, seed=3, max_tokens=24))[0].outputs[0].token_ids
    assert list(k1) == greedy
    assert list(p0) == greedy


def _lp(v) -> float:
    return float(v.logprob if hasattr(v, "logprob") else v)


def test_logprobs_match_hf_and_include_chosen(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied)
    ids = _ids(10, 11)
    n_new, top_n = 8, 2
    tokens, hf_lp = hf_greedy_logprobs(qwen3_tied, ids, n_new)
    out = llm.generate([{"prompt_token_ids": ids}], _sp(max_tokens=n_new, logprobs=top_n))[0].outputs[0]
    assert list(out.token_ids) == tokens
    assert out.logprobs is not None and len(out.logprobs) == n_new
    worst = 0.0
    for step, (entry, tok, ref) in enumerate(zip(out.logprobs, tokens, hf_lp)):
        assert tok in entry, f"step {step}: chosen token {tok} missing from logprobs {entry}"
        assert top_n <= len(entry) <= top_n + 1
        want_top = torch.topk(ref, top_n).indices.tolist()
        assert set(want_top) <= set(entry), f"step {step}: top-{top_n} {want_top} vs {sorted(entry)}"
        for t, v in entry.items():
            worst = max(worst, abs(_lp(v) - float(ref[t])))
        assert _lp(entry[tok]) == max(_lp(v) for v in entry.values())  # greedy: the chosen is the best
    print(f"\n[parity] logprobs max abs error vs HF = {worst:.3e}")
    assert worst < 1e-4


def test_sampled_logprobs_include_chosen_token(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied)
    out = llm.generate([{"prompt_token_ids": _ids(11, 4)}], _sp(temperature=2.0, seed=5, max_tokens=16,
                                                                   logprobs=1))[0].outputs[0]
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and 1 <= len(entry) <= 2
        assert all(_lp(v) <= 0.0 for v in entry.values())


def test_outputs_in_prompt_order_with_mixed_lengths(qwen3_tied, make_llm):
    prompts = [{"prompt_token_ids": _ids(30 + k, n)} for k, n in enumerate((40, 1, 17, 3))]
    sps = [_sp(max_tokens=m) for m in (3, 20, 1, 9)]
    outs = make_llm(qwen3_tied).generate(prompts, sps)
    for o, p, m in zip(outs, prompts, (3, 20, 1, 9)):
        assert list(o.prompt_token_ids) == p["prompt_token_ids"]
        assert len(o.outputs[0].token_ids) == m


# ------------------------------------------------------------------ stop strings and min_tokens
@pytest.mark.engine
def test_stop_strings_cut_text_and_finish(qwen3_tied, make_llm):
    from xllm_gen import SamplingParams

    llm = make_llm(qwen3_tied)
    prompt = "The quick brown fox"
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    text = full.text
    assert len(text) > 12, text
    stop = text[6:9]
    at = text.find(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop"
    assert c.text == text[:at]
    assert c.token_ids == full.token_ids[:len(c.token_ids)] and len(c.token_ids) < len(full.token_ids)
    kept = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=stop,
                                                 include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[:at + len(stop)]


@pytest.mark.engine
def test_min_tokens_holds_back_stop_tokens(qwen3_tied, make_llm):
    from xllm_gen import SamplingParams

    llm = make_llm(qwen3_tied)
    ids = {"prompt_token_ids": [5, 17, 99, 3]}
    first = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    t0 = first.token_ids[0]
    stopped = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                 stop_token_ids=[t0]))[0].outputs[0]
    assert stopped.token_ids == [t0] and stopped.finish_reason == "stop"
    held = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[t0],
                                              min_tokens=3))[0].outputs[0]
    assert len(held.token_ids) >= 3 and t0 not in held.token_ids[:3]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


@pytest.mark.engine
def test_min_tokens_holds_back_stop_strings(qwen3_tied, make_llm):
    """As vLLM's: a stop string ends no completion before min_tokens tokens (it did after the first token)."""
    from xllm_gen import SamplingParams

    llm = make_llm(qwen3_tied)
    ids = {"prompt_token_ids": [5, 17, 99, 3]}
    full = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    stop = llm.get_tokenizer().decode(full.token_ids[:1])
    assert stop, full.token_ids
    early = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                               stop=[stop]))[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) == 1
    held = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop],
                                              min_tokens=4))[0].outputs[0]
    assert len(held.token_ids) >= 4 and held.token_ids[:4] == full.token_ids[:4], (held, full)
    # stop_token_ids over the whole vocabulary leave min_tokens nothing to sample: refused at admission, alone (a
    # sampled request failed on torch's "probability tensor contains inf", a greedy one emitted banned token 0)
    every = list(range(llm.engine.vocab_size))
    outs = llm.generate([ids, ids], [SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=every),
                                     SamplingParams(max_tokens=2)], on_error="return")
    assert outs[0].error.startswith("request 0: min_tokens: no token can be sampled") and not outs[1].error


# ------------------------------------------------------------------ the request-level engine API
@pytest.mark.engine
def test_engine_add_step_abort(qwen3_tied, make_llm):
    """add_request / step_outputs / abort_request, as a server drives the engine: an aborted request frees
    its blocks, and the others end with the tokens they get alone."""
    from xllm_gen import SamplingParams

    llm = make_llm(qwen3_tied)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = {rid: llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids
             for rid, p in (("a", [3, 4, 5]), ("c", [9, 8, 7, 6]))}
    free = eng.block_manager.num_free_blocks
    eng.add_request("a", {"prompt_token_ids": [3, 4, 5]}, params)
    eng.add_request("b", {"prompt_token_ids": [11, 12]}, params)
    with pytest.raises(ValueError, match="request b: .*already queued"):
        eng.add_request("b", {"prompt_token_ids": [1]}, params)
    with pytest.raises(ValueError, match="request z: empty prompt"):
        eng.add_request("z", {"prompt_token_ids": []}, params)
    done = {}
    for o in eng.step_outputs():
        done[o.request_id] = o
    assert eng.abort_request("b") and not eng.abort_request("b")
    eng.add_request("c", {"prompt_token_ids": [9, 8, 7, 6]}, params)
    while eng.has_unfinished_requests():
        for o in eng.step_outputs():
            done[o.request_id] = o
    assert set(done) == {"a", "c"}
    assert done["a"].outputs[0].token_ids == alone["a"] and done["c"].outputs[0].token_ids == alone["c"]
    assert eng.block_manager.num_free_blocks == free
    # any hashable id is a request's, None and 0 included (None's output was never reported and it stayed queued)
    for rid in (None, 0):
        eng.add_request(rid, {"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0.0, max_tokens=2))
    got = [o.request_id for _ in range(8) if eng.has_unfinished_requests() for o in eng.step_outputs()]
    assert sorted(got, key=str) == [0, None] and eng.num_requests() == 0
    assert eng.block_manager.num_free_blocks == free


@pytest.mark.engine
def test_interrupted_generate_leaves_a_usable_engine(qwen3_tied, make_llm, monkeypatch):
    """Ctrl-C (or a failing step) in the middle of generate() frees every request's blocks; the next call
    serves normally."""
    from xllm_gen import SamplingParams

    llm = make_llm(qwen3_tied)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [6, 7]}]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    free = eng.block_manager.num_free_blocks
    real_run, calls = eng.runner.run, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_run(*a, **k)

    monkeypatch.setattr(eng.runner, "run", flaky)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    assert eng.block_manager.num_free_blocks == free and not eng.scheduler.has_unfinished()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want


def test_unknown_llm_arguments_are_errors(qwen3_tied):
    from xllm_gen import LLM
    with pytest.raises(TypeError, match="tensor_parallel"):
        LLM(model=str(qwen3_tied), device="cpu", tensor_parallel=2)
