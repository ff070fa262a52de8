"""Chunked prefill: long prompts split into chunks of max_num_batched_tokens tokens give the same greedy
tokens as Hugging Face. For Qwen3-VL the chunk boundaries fall inside images and videos, so visual rows
and deepstack rows must be aligned with each chunk (a lesson from other engines)."""
from __future__ import annotations

import pytest
from hf_ref import hf_greedy
from test_parity_qwen3 import MAX_TOKENS, _assert_same_tokens, prompts_for
from test_parity_qwen3 import _sp as text_sp
from test_parity_qwen3_vl import REQUESTS, _check
from test_parity_qwen3_vl import _sp as vl_sp


@pytest.mark.engine
def test_qwen3_chunked_prefill_matches_hf(qwen3_tied, make_llm):
    _, ids = prompts_for(qwen3_tied)
    llm = make_llm(qwen3_tied, enable_chunked_prefill=True, max_num_batched_tokens=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], text_sp())
    assert max(len(p) for p in ids) > 5, "prompts must be longer than one chunk"
    _assert_same_tokens([o.outputs[0].token_ids for o in outs], hf_greedy(qwen3_tied, ids, MAX_TOKENS),
                        "chunked: ")


@pytest.mark.engine
@pytest.mark.vl
@pytest.mark.parametrize("chunk", [3, 7])
def test_qwen3_vl_chunked_prefill_matches_hf(chunk, qwen3_vl_tied, make_llm):
    names = ["image", "three_images", "video", "image_video", "text"]
    llm = make_llm(qwen3_vl_tied, enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    _check(qwen3_vl_tied, names, llm.generate([REQUESTS[n] for n in names], vl_sp()), f"chunk {chunk}: ")


@pytest.mark.engine
@pytest.mark.parametrize("blocks", [22, 28])
def test_chunked_prefill_with_preemption_matches_hf(blocks, qwen3_tied, make_llm):
    """A small KV pool with chunked prefill: preempted requests queue behind a half-prefilled one, and
    every request still completes with HF's tokens."""
    _, ids = prompts_for(qwen3_tied)
    llm = make_llm(qwen3_tied, enable_chunked_prefill=True, max_num_batched_tokens=5, num_kv_blocks=blocks)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], text_sp())
    _assert_same_tokens([o.outputs[0].token_ids for o in outs], hf_greedy(qwen3_tied, ids, MAX_TOKENS),
                        f"chunked, {blocks} blocks: ")


@pytest.mark.engine
def test_request_longer_than_the_kv_cache_ends_with_length(qwen3_tied, make_llm):
    """A request that outgrows the whole KV cache ends with finish_reason 'length' (its tokens so far equal
    HF's); the others are served in full."""
    llm = make_llm(qwen3_tied, num_kv_blocks=6)           # 24 token slots
    prompts = [{"prompt_token_ids": list(range(3, 13))}, {"prompt_token_ids": [7, 8, 9]}]
    outs = llm.generate(prompts, text_sp(max_tokens=20))
    long, short = outs[0].outputs[0], outs[1].outputs[0]
    assert long.finish_reason == "length" and 0 < len(long.token_ids) < 20
    assert short.finish_reason == "length" and len(short.token_ids) == 20
    want = hf_greedy(qwen3_tied, [p["prompt_token_ids"] for p in prompts], 20)
    assert long.token_ids == want[0][:len(long.token_ids)] and short.token_ids == want[1]


def test_step_capacity_without_chunking_covers_a_whole_prompt(qwen3_tied, make_llm):
    """Without chunked prefill a prompt longer than max_num_batched_tokens is prefilled whole, alone: the runner (its
    buffers, the attention workspace on CUDA) is sized for max_model_len tokens a step; with chunking, for the budget."""
    whole = make_llm(qwen3_tied, max_num_batched_tokens=8, max_model_len=64)
    assert whole.engine.scheduler.max_num_batched_tokens == 8 and whole.engine.runner.max_num_batched_tokens == 64
    chunked = make_llm(qwen3_tied, enable_chunked_prefill=True, max_num_batched_tokens=8, max_model_len=64)
    assert chunked.engine.runner.max_num_batched_tokens == 8
