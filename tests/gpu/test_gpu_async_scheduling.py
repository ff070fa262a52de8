"""Async scheduling with CUDA-graph decode on the GPU (marker `gpu`; skipped without CUDA).

Two engines over the same tiny bf16 Qwen3 checkpoint, identical but for async scheduling. The same greedy
requests go to both: batches of 1, 3, 17 and 40 sequences (several decode-graph buckets, one above the largest
graph: eager decode). With equal lengths and no stops both engines run the same batches, and the tokens must be
identical. With different lengths and stop tokens the batches differ (async leaves out sequences certain to
end, computes a dropped row for one that stopped), and a request may differ only from a near tie on. Steps are
launched ahead (counted), and a sensitivity arm feeds them stale device tokens.
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


def _run_counted(llm, prompts, params):
    runner = llm.engine.runner
    counter = {"ahead": 0}
    orig = runner.decode_greedy

    def counted(seqs, prev_tokens=None, rows=None):
        counter["ahead"] += prev_tokens is not None
        return orig(seqs, prev_tokens, rows)
    runner.decode_greedy = counted
    try:
        return llm.generate(prompts, params), counter["ahead"]
    finally:
        runner.decode_greedy = orig


def _prompts(rng, batch):
    return [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(5, 300))]} for _ in range(batch)]


@pytest.mark.parametrize("batch", [1, 3, 17, 40])
def test_same_batches_give_identical_tokens(engines, batch):
    """Every request the same length, no stops: both engines run the same batch at every step (the same graph
    bucket; 40 is above the largest graph, eager decode), so the tokens must be identical, bit for bit."""
    from xllm_gen import SamplingParams
    ahead, sync = engines
    prompts = _prompts(random.Random(batch), batch)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=40)
    got, steps_ahead = _run_counted(ahead, prompts, params)
    ref = sync.generate(prompts, params)
    bad = [i for i, (a, b) in enumerate(zip(_tokens(got), _tokens(ref))) if a != b]
    _report(test=f"async_vs_sync_same_batches_b{batch}", requests=batch, diverged=len(bad), steps_ahead=steps_ahead)
    assert not bad, f"requests {bad} differ between async and synchronous scheduling"
    assert steps_ahead >= 30


@pytest.mark.parametrize("batch", [3, 17, 40])
def test_shrinking_batches_with_stops(engines, batch):
    """Different lengths and stop tokens: the async engine leaves out sequences certain to end and computes a
    dropped row for one that stopped, so its batches (and graph buckets, hence bf16 rounding) differ from the
    synchronous engine's. A request may then differ only from a near tie on: at the first differing token the
    synchronous engine's top two logprobs are closer than twice the bf16 noise of a batch change, measured here:
    the synchronous engine itself, running each request alone (another graph bucket, other kernels), moves the
    logprob of the tokens it agrees on by at most `noise` (in this tiny random model: one or two bf16 ulps of
    the logits, 1/16 to 1/8)."""
    from xllm_gen import SamplingParams
    ahead, sync = engines
    rng = random.Random(100 + batch)
    prompts = _prompts(rng, batch)
    lens = [rng.randint(1, 48) for _ in range(batch)]
    probe = _tokens(sync.generate(prompts, [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
                                            for n in lens]))
    stops = [[probe[i][len(probe[i]) // 2]] if i % 2 == 0 and len(probe[i]) > 3 else [] for i in range(batch)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, stop_token_ids=st)
              for n, st in zip(lens, stops)]
    got, steps_ahead = _run_counted(ahead, prompts, params)
    with_lp = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, stop_token_ids=st, logprobs=2)
               for n, st in zip(lens, stops)]
    ref = sync.generate(prompts, with_lp)
    ref2 = [sync.generate([p], [sp])[0] for p, sp in zip(prompts, with_lp)]         # each alone: graph bucket 1
    noise, self_diverged = 1e-3, 0
    for r, r2 in zip(ref, ref2):
        a, b = r.outputs[0], r2.outputs[0]
        self_diverged += list(a.token_ids) != list(b.token_ids)
        for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                break
            noise = max(noise, abs(a.logprobs[k][x].logprob - b.logprobs[k][y].logprob))
    assert noise < 0.5, f"bf16 noise of a batch change {noise} is not small: the comparison is meaningless"
    diverged, not_tie = [], []
    for i, (g, r) in enumerate(zip(got, ref)):
        a, b = list(g.outputs[0].token_ids), list(r.outputs[0].token_ids)
        if a == b:
            continue
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        diverged.append(i)
        if j < len(b):
            top = sorted((lp.logprob for lp in r.outputs[0].logprobs[j].values()), reverse=True)
            if len(top) < 2 or top[0] - top[1] > 2 * noise:
                not_tie.append((i, j, top[:2]))
        else:
            not_tie.append((i, j, "length"))
    _report(test=f"async_vs_sync_shrinking_b{batch}", requests=batch, diverged=len(diverged), not_near_tie=not_tie,
            batch_change_noise=noise, sync_self_diverged=self_diverged, steps_ahead=steps_ahead)
    assert not not_tie, f"async differs from sync away from a near tie: {not_tie}"
    assert steps_ahead > 0
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
