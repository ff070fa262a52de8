"""Piecewise prefill CUDA graphs on the GPU (marker `gpu`; skipped without CUDA).

Two engines over the same tiny bf16 Qwen3 checkpoint (head_dim 128), identical but for prefill graphs: one
with buckets 16, 64, 256, 1024 and one with prefill_graph_sizes=[] (eager prefill); both decode in graphs.
The same requests, in the same order, go to both (so their prefix caches hold the same blocks):

- single prompts of 1 ... 1500 tokens (below, at and above a bucket; 1500 is above the largest bucket and
  prefills eagerly) and a batch of 24 prompts prefilled together: every prompt token's logprob
  (prompt_logprobs) and the greedy continuation agree (bf16: a token may flip only at a near tie);
- chunked prefill with prefix caching (max_num_batched_tokens 256, prompts sharing a 300-token prefix): the
  paged prefill path inside the pieces;
- the graphs were used (replays counted), and a sensitivity arm: replaying the pieces without the eager
  attention between them must change the output.
"""
from __future__ import annotations

import random

import pytest
import torch
from fixtures.report import report as _report

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BUCKETS = [16, 64, 256, 1024]
NEAR_TIE = 0.05
VOCAB = 500              # token ids below the tiny tokenizer size (507)
MAX_LOGPROB_DIFF = 0.1


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from fixtures.tiny_hf import make_tiny_qwen3
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_prefill"), hidden_size=256, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=512,
                           max_position_embeddings=2048, seed=0)


def _engine(tiny_dir, sizes, **kw):
    from xllm_gen import LLM
    return LLM(str(tiny_dir), dtype="bfloat16", max_num_seqs=64, num_kv_blocks=2048, max_model_len=2048,
               prefill_graph_sizes=sizes, **kw)


@pytest.fixture(scope="module")
def engines(tiny_dir):
    graph, eager = _engine(tiny_dir, BUCKETS), _engine(tiny_dir, [])
    assert graph.engine.runner.prefill_graphs is not None and graph.engine.runner.prefill_graphs.sizes == tuple(BUCKETS)
    assert eager.engine.runner.prefill_graphs is None
    yield graph, eager
    graph.shutdown()
    eager.shutdown()


def _params(n=16):
    from xllm_gen import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2, prompt_logprobs=0)


def _count_replays(llm):
    pg = llm.engine.runner.prefill_graphs
    counter = {"n": 0}
    orig = pg.run

    def run(*args, **kwargs):
        counter["n"] += 1
        return orig(*args, **kwargs)
    pg.run = run
    return counter


def _compare(ref, got, what):
    worst_prompt, worst_lp, diverged, bad = 0.0, 0.0, 0, []
    for i, (r, g) in enumerate(zip(ref, got)):
        for a, b in zip(r.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            (tok, la), = [(t, lp.logprob) for t, lp in a.items() if t in b][:1] or [(None, None)]
            if tok is not None:
                worst_prompt = max(worst_prompt, abs(la - b[tok].logprob))
        a, b = r.outputs[0], g.outputs[0]
        n = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        for j in range(len(a.token_ids) if n is None else n):
            worst_lp = max(worst_lp, abs(a.logprobs[j][a.token_ids[j]].logprob - b.logprobs[j][a.token_ids[j]].logprob))
        if n is not None:
            diverged += 1
            vals = sorted((lp.logprob for lp in a.logprobs[n].values()), reverse=True)
            if len(vals) < 2 or vals[0] - vals[1] >= NEAR_TIE:
                bad.append((i, n))
    res = dict(test=what, requests=len(ref), max_prompt_logprob_diff=worst_prompt, max_logprob_diff=worst_lp,
               diverged=diverged, bad=bad)
    print(f"\n[{what}]", res)
    _report(**res)
    assert not bad, f"{what}: diverged away from a near tie: {bad}"
    assert worst_prompt < MAX_LOGPROB_DIFF and worst_lp < MAX_LOGPROB_DIFF, res
    return res


def test_prefill_graphs_equal_eager_prefill(engines):
    graph, eager = engines
    counter = _count_replays(graph)
    rng = random.Random(0)
    lens = [1, 5, 16, 17, 63, 100, 255, 700, 1023, 1024, 1500]
    singles = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(n)]} for n in lens]
    ref, got = [], []
    for p in singles:                                   # one prefill step each
        ref += eager.generate([p], _params())
        got += graph.generate([p], _params())
    assert counter["n"] == sum(1 for n in lens if n <= BUCKETS[-1]), counter   # 1500 prefills eagerly
    _compare(ref, got, "prefill_graphs_single")
    batch = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(3, 40))]} for _ in range(24)]
    _compare(eager.generate(batch, _params()), graph.generate(batch, _params()), "prefill_graphs_batch")


def test_prefill_graphs_chunked_with_prefix_cache(tiny_dir):
    graph = _engine(tiny_dir, BUCKETS, enable_chunked_prefill=True, max_num_batched_tokens=256)
    eager = _engine(tiny_dir, [], enable_chunked_prefill=True, max_num_batched_tokens=256)
    try:
        counter = _count_replays(graph)
        rng = random.Random(1)
        prefix = [rng.randrange(VOCAB) for _ in range(300)]
        prompts = [{"prompt_token_ids": prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 200))]}
                   for _ in range(6)]
        ref, got = [], []
        for chunk in (prompts[:2], prompts[2:]):        # the second call hits the cached prefix
            ref += eager.generate(chunk, _params())
            got += graph.generate(chunk, _params())
        assert counter["n"] > 0
        _compare(ref, got, "prefill_graphs_chunked_prefix_cache")
    finally:
        graph.shutdown()
        eager.shutdown()


def test_sensitivity_pieces_without_attention_differ(engines):
    graph, eager = engines
    pg = graph.engine.runner.prefill_graphs
    rng = random.Random(2)
    p = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(200)]}]
    ref = eager.generate(p, _params(8))

    def broken_run(ids, pos, ctx, embeds=None):         # the pieces alone: attention outputs stay stale zeros
        N = ids.shape[0]
        pieces = pg.pieces[pg.bucket_for(N)]
        pg._ids[:N].copy_(ids)
        pg._pos[..., :N].copy_(pos)
        for _, _, _, ob in pg._buffers.values():
            ob.zero_()
        for g in pieces.graphs:
            g.replay()
        return pieces.output[:N]
    orig, pg.run = pg.run, broken_run
    try:
        got = graph.generate(p, _params(8))
    finally:
        pg.run = orig
    a = [next(iter(d.values())).logprob for d in ref[0].prompt_logprobs[1:]]
    b = [next(iter(d.values())).logprob for d in got[0].prompt_logprobs[1:]]
    diff = max(abs(x - y) for x, y in zip(a, b))
    _report(test="prefill_graphs_sensitivity", prompt_logprob_diff=diff)
    assert diff > 0.5, f"skipping attention changed prompt logprobs by only {diff}"
