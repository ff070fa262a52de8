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
