"""Async scheduling (runtime/engine/async_decode.py) on the real engine and a tiny Qwen3 checkpoint: a greedy decode
step is launched before the previous step's tokens are read, its inputs taken from the device. The outputs must
be those of the synchronous engine for every kind of request (greedy, sampled, logprobs, penalties, stop strings
and tokens, EOS, max_tokens), mixed in one batch, with aborts while a step is in flight; no KV block may leak;
and the arms prove the path is live: steps are launched ahead, and feeding them the wrong device tokens changes
the output."""
from __future__ import annotations

import random

import pytest
import torch

from xllm_gen import LLM, SamplingParams

ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_num_seqs=8, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def engines(qwen3_tied):
    sync = LLM(str(qwen3_tied), async_scheduling=False, **ENGINE)
    ahead = LLM(str(qwen3_tied), **ENGINE)
    assert sync.engine._async is None and ahead.engine._async is not None
    yield sync, ahead
    sync.shutdown()
    ahead.shutdown()


def _count_ahead(llm):
    """Counts decode steps launched from the device tokens of the step before (monkeypatched runner)."""
    runner = llm.engine.runner
    counter = {"ahead": 0, "first": 0}
    orig = runner.decode_greedy

    def decode_greedy(seqs, prev_tokens=None, rows=None):
        counter["ahead" if prev_tokens is not None else "first"] += 1
        return orig(seqs, prev_tokens, rows)
    runner.decode_greedy = decode_greedy
    return counter, lambda: setattr(runner, "decode_greedy", orig)


def _mixed_requests(vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(2, 20))]} for _ in range(14)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    params = [
        SamplingParams(max_tokens=rng.randint(1, 24), **greedy) for _ in range(6)
    ] + [
        SamplingParams(temperature=0.0, max_tokens=24),                              # may stop at EOS
        None,                                                                        # a stop token, set below
        SamplingParams(max_tokens=10, logprobs=2, **greedy),
        SamplingParams(max_tokens=10, repetition_penalty=1.3, **greedy),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True),
        SamplingParams(max_tokens=10, min_tokens=6, **greedy),
        SamplingParams(max_tokens=16, stop=["a", "e"], **greedy),
        SamplingParams(max_tokens=30, **greedy),
    ]
    return prompts, params


def _tokens(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def test_mixed_batch_equals_synchronous_engine(engines):
    sync, ahead = engines
    vocab = min(sync.engine.vocab_size, 500)
    counter, restore = _count_ahead(ahead)
    try:
        for seed in range(2):
            prompts, params = _mixed_requests(vocab, seed)
            # a stop token that is surely hit mid-way: the 5th token of the request's greedy continuation
            probe = sync.generate([prompts[7]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
            params[7] = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                       stop_token_ids=[probe[0].outputs[0].token_ids[4]])
            ref = sync.generate(prompts, params)
            assert ref[7].outputs[0].finish_reason == "stop" and ref[12].outputs[0].finish_reason == "stop"
            got = ahead.generate(prompts, params)
            assert _tokens(got) == _tokens(ref), f"seed {seed}: async tokens differ from the synchronous engine"
            for r, g in zip(ref, got):
                assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in r.outputs]
                assert [c.text for c in g.outputs] == [c.text for c in r.outputs]
            assert ahead.engine.block_manager.num_free_blocks == ahead.engine.block_manager.num_blocks
    finally:
        restore()
    assert counter["ahead"] > 3 * counter["first"], counter        # most decode steps were launched ahead


def test_greedy_batch_runs_ahead_and_streams_the_same_deltas(engines):
    sync, ahead = engines
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(200) for _ in range(rng.randint(3, 12))]} for _ in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2, 9, 17, 17)]

    def stream(llm):
        eng = llm.engine
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(i, p, sp)
        seen = {i: [] for i in range(len(prompts))}
        while eng.num_requests():
            for out in eng.step_deltas():
                seen[out.request_id] += list(out.outputs[0].token_ids) if out.outputs else []
        return seen

    counter, restore = _count_ahead(ahead)
    try:
        assert stream(ahead) == stream(sync)
    finally:
        restore()
    assert counter["ahead"] >= 10, counter


def test_abort_while_a_step_is_in_flight(engines):
    sync, ahead = engines
    eng = ahead.engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [{"prompt_token_ids": [11 + i, 12, 13, 14 + i]} for i in range(4)]
    ref = sync.generate(prompts, params)
    for i, p in enumerate(prompts):
        eng.add_request(i, p, params)
    for _ in range(5):                                   # prefill, then decode steps in flight
        eng.step_outputs()
    assert eng._async.inflight is not None, "no decode step in flight to abort under"
    assert eng.abort_request(1) and eng.abort_request(2)
    outs = {}
    while eng.num_requests():
        for o in eng.step_outputs():
            outs[o.request_id] = o
    assert sorted(outs) == [0, 3]
    assert list(outs[0].outputs[0].token_ids) == list(ref[0].outputs[0].token_ids)
    assert list(outs[3].outputs[0].token_ids) == list(ref[3].outputs[0].token_ids)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    eng.abort_all()
    assert eng._async.inflight is None


def test_wrong_device_tokens_change_the_output(engines):
    """Sensitivity: the steps launched ahead really take their inputs from the device tokens of the step
    before. Feeding them a constant instead must change the continuation."""
    sync, ahead = engines
    prompts = [{"prompt_token_ids": [21, 22, 23, 24, 25]}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = _tokens(sync.generate(prompts, params))
    runner = ahead.engine.runner
    orig = runner.decode_greedy

    def stale(seqs, prev_tokens=None, rows=None):
        if prev_tokens is not None:
            prev_tokens = torch.zeros_like(prev_tokens)
        return orig(seqs, prev_tokens, rows)
    runner.decode_greedy = stale
    try:
        got = _tokens(ahead.generate(prompts, params))
    finally:
        runner.decode_greedy = orig
    assert got != ref, "zeroed device inputs did not change the output: the steps did not read them"
    assert _tokens(ahead.generate(prompts, params)) == ref
