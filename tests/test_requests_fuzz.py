"""Property test over request fields (hypothesis): a batch of random requests, some with junk in any prompt or
SamplingParams field (set after construction, so only admission can catch it). Each request gets exactly what
it gets alone: the same tokens when it is served, the same error (naming its field) when it is not; a bad
request never fails another; the engine is clean (no request queued, every block free) after each batch."""
from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.engine

FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "max_tokens", "ignore_eos", "stop_token_ids", "stop",
          "include_stop_str_in_output", "min_tokens", "seed", "logprobs", "prompt_logprobs", "skip_special_tokens"]

junk = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 2), st.text(max_size=4),
    st.lists(st.integers(-5, 10 ** 6), max_size=3), st.lists(st.text(max_size=3), max_size=2),
    st.dictionaries(st.integers(-3, 10 ** 6), st.floats(allow_nan=True), max_size=2),
    st.just("\ud800"), st.just(object()),
)

good_prompt = st.one_of(
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=12),
    st.builds(lambda ids: {"prompt_token_ids": ids}, st.lists(st.integers(0, 500), min_size=1, max_size=12)),
)
bad_prompt = st.one_of(
    st.just(""), st.just({"prompt_token_ids": []}), st.just("a\udc80b"), st.just({"prompt": "\ud83d"}),
    st.builds(lambda ids: {"prompt_token_ids": ids}, st.lists(st.integers(-10 ** 20, 10 ** 20), min_size=1, max_size=3)),
    st.just({"prompt_token_ids": [1, "2"]}), st.just({"prompt": 3}), st.just(None), st.just([1, 2]),
    st.just({"prompt": "x", "prompt_token_ids": [1]}), st.just({"prompt_token_ids": list(range(5000))}),
)


@st.composite
def request(draw):
    from xllm_gen import SamplingParams

    sampled = draw(st.booleans())
    params = SamplingParams(
        temperature=draw(st.sampled_from([0.7, 1.0, 1.3])) if sampled else 0.0,
        top_p=draw(st.sampled_from([1.0, 0.9])), top_k=draw(st.sampled_from([-1, 5])),
        min_p=draw(st.sampled_from([0.0, 0.05])), repetition_penalty=draw(st.sampled_from([1.0, 1.2])),
        presence_penalty=draw(st.sampled_from([0.0, 0.5])), max_tokens=draw(st.integers(1, 8)),
        ignore_eos=True, seed=draw(st.integers(0, 2 ** 66)), logprobs=draw(st.sampled_from([None, 0, 2])),
        n=draw(st.sampled_from([1, 1, 2])), stop=draw(st.sampled_from([[], ["e"]])))
    mutated = None
    if draw(st.integers(0, 2)) == 0:                         # junk in one field, set after construction
        mutated = draw(st.sampled_from(FIELDS))
        value = draw(junk)
        if mutated == "seed" and value is None:
            value = 5                                         # unseeded sampling is not reproducible alone
        setattr(params, mutated, value)
    prompt = draw(bad_prompt if draw(st.integers(0, 4)) == 0 else good_prompt)
    return prompt, params, mutated


def _tokens(out):
    return [c.token_ids for c in out.outputs]


# derandomized: CI runs the same examples every time (a random draw found the sub-float32 top_p once; the
# edge values it exposed are pinned in tests/test_sampling_surface.py)
@settings(max_examples=30, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(request(), min_size=2, max_size=5))
def test_bad_requests_fail_alone_good_ones_give_solo_tokens(batch, fuzz_llm):
    llm = fuzz_llm
    eng = llm.engine
    prompts = [p for p, _, _ in batch]
    params = [sp for _, sp, _ in batch]
    solo = [llm.generate([p], [sp], on_error="return")[0] for p, sp in zip(prompts, params)]
    outs = llm.generate(prompts, params, on_error="return")
    for i, (out, alone, (_, _, mutated)) in enumerate(zip(outs, solo, batch)):
        assert out.request_id == i
        if alone.error:
            assert out.error and re.search(rf"request {i}\b", out.error), out.error
            assert out.error.split(":", 1)[1] == alone.error.split(":", 1)[1]
            if mutated and "prompt" not in alone.error and "vocab" not in alone.error:
                assert mutated in out.error, (mutated, out.error)
        else:
            assert out.error is None, out.error
            assert _tokens(out) == _tokens(alone)
            assert [c.text for c in out.outputs] == [c.text for c in alone.outputs]
    assert not eng.scheduler.has_unfinished() and not eng._requests
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.fixture(scope="module")
def fuzz_llm(qwen3_tied, make_llm):
    return make_llm(qwen3_tied, num_kv_blocks=40, max_model_len=200)
