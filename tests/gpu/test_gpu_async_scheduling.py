"""Async scheduling with CUDA-graph decode on the GPU (marker `gpu`; skipped without CUDA).

Two engines over the same tiny bf16 Qwen3 checkpoint, identical but for async scheduling. The same greedy
requests go to both: batches of 1, 3, 17 and 40 sequences (several decode-graph buckets, one above the largest
graph: eager decode), with different output lengths (the batch shrinks while steps are in flight), stop tokens
and aborts. Tokens must be identical: the two engines run the same kernels on the same inputs, only the host's
order of work differs. Steps are launched ahead (counted), and a sensitivity arm feeds them stale device tokens.
"""
from __future__ import annotations

import random

import pytest
import torch
from fixtures.report import report as _report

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 500


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from fixtures.tiny_hf import make_tiny_qwen3

    from xllm_gen import LLM
    d = make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_async"), hidden_size=256, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=512,
                        max_position_embeddings=2048, seed=0)
    kw = dict(dtype="bfloat16", max_num_seqs=64, num_kv_blocks=2048, max_model_len=1024,
              cuda_graph_sizes=[1, 2, 4, 8, 16, 32])
    ahead, sync = LLM(str(d), **kw), LLM(str(d), async_scheduling=False, **kw)
    assert ahead.engine._async is not None and sync.engine._async is None
    yield ahead, sync
    ahead.shutdown()
    sync.shutdown()


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("batch", [1, 3, 17, 40])
def test_async_equals_sync(engines, batch):
    from xllm_gen import SamplingParams
    ahead, sync = engines
    rng = random.Random(batch)
    prompts = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(5, 300))]} for _ in range(batch)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(1, 48)) for _ in range(batch)]
    probe = _tokens(sync.generate(prompts, params))
    for i in range(0, batch, 2):                       # every other request stops at a token of its own output
        if len(probe[i]) > 3:
            params[i] = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=params[i].max_tokens,
                                       stop_token_ids=[probe[i][len(probe[i]) // 2]])
    runner = ahead.engine.runner
    counter = {"ahead": 0}
    orig = runner.decode_greedy

    def counted(seqs, prev_tokens=None, rows=None):
        counter["ahead"] += prev_tokens is not None
        return orig(seqs, prev_tokens, rows)
    runner.decode_greedy = counted
    try:
        got = _tokens(ahead.generate(prompts, params))
    finally:
        runner.decode_greedy = orig
    ref = _tokens(sync.generate(prompts, params))
    bad = [i for i, (a, b) in enumerate(zip(got, ref)) if a != b]
    _report(test=f"async_vs_sync_b{batch}", requests=batch, diverged=len(bad), steps_ahead=counter["ahead"])
    assert not bad, f"requests {bad} differ between async and synchronous scheduling"
    assert counter["ahead"] > 0
    e = ahead.engine
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def test_stale_device_tokens_change_the_output(engines):
    from xllm_gen import SamplingParams
    ahead, sync = engines
    prompts = [{"prompt_token_ids": [7, 8, 9, 10, 11, 12]}] * 2
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16)
    ref = _tokens(sync.generate(prompts, params))
    runner = ahead.engine.runner
    orig = runner.decode_greedy

    def stale(seqs, prev_tokens=None, rows=None):
        return orig(seqs, None if prev_tokens is None else torch.zeros_like(prev_tokens), rows)
    runner.decode_greedy = stale
    try:
        got = _tokens(ahead.generate(prompts, params))
    finally:
        runner.decode_greedy = orig
    _report(test="async_stale_tokens", changed=got != ref)
    assert got != ref
