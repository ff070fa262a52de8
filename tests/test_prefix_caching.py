"""Automatic prefix caching: outputs are identical with and without it (shared prefixes, seeded sampling,
chunked prefill, preemption in a small pool, images), cached blocks are really reused (hits, num_cached_tokens),
a different image with the same placeholder tokens never matches, and every block is free at the end."""
from __future__ import annotations

import random

import numpy as np
import pytest

pytestmark = pytest.mark.engine


def _sp(**kw):
    from xllm_gen import SamplingParams

    return SamplingParams(**{"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, **kw})


def _workload(seed: int):
    rng = random.Random(seed)
    shared = [rng.randrange(500) for _ in range(23)]
    prompts, params = [], []
    for i in range(14):
        tail = [rng.randrange(500) for _ in range(rng.randint(0, 9))]
        prompts.append({"prompt_token_ids": (shared[:rng.choice([8, 16, 23])] + tail) or [1]})
        params.append(_sp(max_tokens=rng.randint(4, 24)) if i % 2 else
                      _sp(temperature=1.0, seed=i, top_k=20, max_tokens=rng.randint(4, 24)))
    return prompts, params


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _clean(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.scheduler.has_unfinished()
    assert sorted(bm.free_blocks) == list(range(bm.num_blocks)) and not any(bm.ref_count)


@pytest.mark.parametrize("extra", [dict(), dict(enable_chunked_prefill=True, max_num_batched_tokens=7)],
                         ids=["whole", "chunked"])
def test_outputs_identical_with_and_without_caching_under_preemption(qwen3_tied, make_llm, extra):
    prompts, params = _workload(0)
    off = make_llm(qwen3_tied, enable_prefix_caching=False, num_kv_blocks=40, **extra)
    on = make_llm(qwen3_tied, enable_prefix_caching=True, num_kv_blocks=40, **extra)
    want = off.generate(prompts, params)
    pre = on.engine.scheduler.num_preemptions
    first = on.generate(prompts, params)
    again = on.generate(prompts, params)          # warm cache: most prompts hit
    assert _tokens(first) == _tokens(want) and _tokens(again) == _tokens(want)
    assert on.engine.scheduler.num_preemptions > pre, "the small pool did not preempt"
    assert sum(o.num_cached_tokens for o in again) > 0
    bm = on.engine.block_manager
    assert bm.prefix_hits > 0 and bm.prefix_queries >= bm.prefix_hits
    _clean(on)
    _clean(off)


def test_shared_blocks_are_reference_counted(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied, enable_prefix_caching=True)
    eng = llm.engine
    ids = list(range(100, 130))
    want = llm.generate([{"prompt_token_ids": ids}], _sp())[0].outputs[0].token_ids
    eng.add_request("a", {"prompt_token_ids": ids}, _sp(max_tokens=30))
    eng.add_request("b", {"prompt_token_ids": ids + [7]}, _sp(max_tokens=3))
    eng.step_outputs()                               # both prefilled on cached blocks
    seqs = {rid: s[0] for rid, s in eng._requests.items()}
    shared = set(seqs["a"].block_table) & set(seqs["b"].block_table)
    assert len(shared) >= 6 and all(eng.block_manager.ref_count[b] == 2 for b in shared)
    assert seqs["a"].num_cached_tokens == 28
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step_outputs():
            outs[o.request_id] = o
    assert outs["a"].outputs[0].token_ids[:16] == want
    _clean(llm)


def test_prompt_logprobs_requests_skip_the_cache(qwen3_tied, make_llm):
    llm = make_llm(qwen3_tied, enable_prefix_caching=True)
    ids = {"prompt_token_ids": list(range(200, 221))}
    llm.generate([ids], _sp())
    out = llm.generate([ids], _sp(prompt_logprobs=1))[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == 21
    _clean(llm)


def test_images_hash_by_content(qwen3_vl_tied, make_llm):
    from PIL import Image

    imgs = [Image.fromarray(np.random.default_rng(k).integers(0, 256, (64, 64, 3), dtype=np.uint8)) for k in (0, 1)]
    text = "<|vision_start|><|image_pad|><|vision_end|>Describe this picture in a few words please."
    reqs = [{"prompt": text, "multi_modal_data": {"image": [imgs[k]]}} for k in (0, 0, 1)]
    off = make_llm(qwen3_vl_tied, enable_prefix_caching=False)
    on = make_llm(qwen3_vl_tied, enable_prefix_caching=True)
    want = [off.generate([r], _sp(max_tokens=8))[0] for r in reqs]
    got = [on.generate([r], _sp(max_tokens=8))[0] for r in reqs]
    assert _tokens(got) == _tokens(want)
    assert got[0].num_cached_tokens == 0 and got[1].num_cached_tokens > 0
    assert got[2].num_cached_tokens == 0, "another image with the same placeholder tokens matched the cache"
    _clean(on)
