"""Non-finite logits (a model fault: overflowing weights or activations) fail the request they belong to, with an
error that says so, on every path that turns logits into a token: the synchronous sampler (greedy and sampled
rows), async greedy decode (tokens read back from the device) and speculative decoding's verification. The other
requests of the batch are served unchanged. Before, greedy decoding returned the argmax of a NaN row (token 0 for
an all-NaN row) as if it were an answer.

The fault is injected into a tiny untied Qwen3 checkpoint's engine by setting one token's embedding row to NaN: a prompt
holding that token has NaN logits from its first token on; a token the model generates later makes the decode step
after it NaN (the async path's case)."""
from __future__ import annotations

import pytest
import torch

from xllm_gen import LLM, SamplingParams

ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_num_seqs=8, enable_prefix_caching=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CLEAN = [11, 12, 13, 14, 15]
OTHER = [31, 32, 33]


def _embedding(llm) -> torch.Tensor:
    return next(m for m in llm.engine.runner.model.modules() if isinstance(m, torch.nn.Embedding)
                or type(m).__name__.endswith("Embedding")).weight


def _poisoned(llm, token: int):
    """A context that sets `token`'s embedding row to NaN, and restores it."""
    class Poison:
        def __enter__(self):
            self.w = _embedding(llm)
            self.row = self.w.data[token].clone()
            self.w.data[token] = float("nan")

        def __exit__(self, *exc):
            self.w.data[token] = self.row
    return Poison()


@pytest.fixture(scope="module", params=["sync", "async"])
def llm(request, qwen3_untied):
    engine = LLM(str(qwen3_untied), async_scheduling=request.param == "async", **ENGINE)
    assert (engine.engine._async is not None) == (request.param == "async")
    yield engine
    engine.shutdown()


def _toks(out):
    return list(out.outputs[0].token_ids) if out.outputs else []


def test_nan_prompt_fails_alone(llm):
    ref = [_toks(o) for o in llm.generate([{"prompt_token_ids": CLEAN}, {"prompt_token_ids": OTHER}], GREEDY)]
    bad = [21, 22, 99, 23]
    with _poisoned(llm, 99):
        outs = llm.generate([{"prompt_token_ids": CLEAN}, {"prompt_token_ids": bad}, {"prompt_token_ids": OTHER}],
                            [GREEDY, GREEDY, SamplingParams(temperature=0.7, seed=3, max_tokens=8)],
                            on_error="return")
        sampled_bad = llm.generate([{"prompt_token_ids": bad}], SamplingParams(temperature=0.7, seed=3, max_tokens=4),
                                   on_error="return")[0]
    assert outs[1].error and "not finite" in outs[1].error, outs[1].error
    assert _toks(outs[1]) == [], "a token chosen from NaN logits was returned"
    assert sampled_bad.error and ("not finite" in sampled_bad.error), sampled_bad.error
    assert _toks(outs[0]) == ref[0], "a clean request of the same batch changed"
    assert outs[0].error is None and outs[2].error is None


def test_nan_at_decode_fails_alone(llm):
    """The fault appears at a decode step (async: read back as -1 from the device): the request keeps the tokens it
    had and fails with the error; the other request is unchanged."""
    ref = [_toks(o) for o in llm.generate([{"prompt_token_ids": CLEAN}, {"prompt_token_ids": OTHER}], GREEDY)]
    k = next(i for i, t in enumerate(ref[0]) if i >= 2 and t not in CLEAN + ref[0][:i] + OTHER + ref[1])
    with _poisoned(llm, ref[0][k]):
        outs = llm.generate([{"prompt_token_ids": CLEAN}, {"prompt_token_ids": OTHER}], GREEDY, on_error="return")
    assert outs[0].error and "not finite" in outs[0].error, outs[0].error
    assert _toks(outs[0]) == ref[0][:k + 1], "the tokens before the fault were lost, or a NaN-chosen one was added"
    assert _toks(outs[1]) == ref[1] and outs[1].error is None
    # the engine serves on: the same request after the fault is restored gives the clean tokens
    assert _toks(llm.generate([{"prompt_token_ids": CLEAN}], GREEDY)[0]) == ref[0]


def test_greedy_argmax_flags_rows():
    from xllm_gen.runtime.engine.sampler import greedy_argmax
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, 3.0, 2.0], [1.0, nan, 3.0], [-inf, -inf, -inf], [1.0, inf, 2.0], [-inf, 0.5, -inf]])
    feed, report = greedy_argmax(x)
    assert report.tolist() == [1, -1, -1, -1, 1]
    assert all(0 <= t < 3 for t in feed.tolist()), "the next step's inputs must stay valid ids"


def test_spec_decode_nan_fails_alone(qwen3_untied):
    llm = LLM(str(qwen3_untied), speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **ENGINE)
    try:
        ref = _toks(llm.generate([{"prompt_token_ids": OTHER}], GREEDY)[0])
        with _poisoned(llm, 99):
            outs = llm.generate([{"prompt_token_ids": [21, 99, 22]}, {"prompt_token_ids": OTHER}], GREEDY,
                                on_error="return")
        assert outs[0].error and "not finite" in outs[0].error, outs[0].error
        assert _toks(outs[1]) == ref
    finally:
        llm.shutdown()
