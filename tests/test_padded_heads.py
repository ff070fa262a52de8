"""Attention heads served zero-padded (Attention.pad_head_dim): the CUDA path's FlashInfer kernels exist for head dims
64 / 128 / 256 only, so a model with another one (Phi-2's 80, Phi-3-mini's 96) is served with q, k, v padded by zero
columns to the next of them and the output cut back (runtime/executor/runner_backend.py _pad_head_dims). The
padding must change nothing: checked on the CPU (debug pad_head_dim forces it there) against the plain path in
float32, with chunked prefill, prefix caching and decode over the padded cache; a padding with non-zero columns
(the sensitivity arm) must change the output."""
from __future__ import annotations

import pytest
import torch
from fixtures.tiny_hf import make_tiny_qwen3

from xllm_gen import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 41, 8, 8, 12, 60, 7, 2, 31, 77, 15, 4, 9, 100],
           [5, 17, 99, 3, 250, 41, 8, 8, 12, 60, 7, 2, 31, 77, 15, 4, 9, 100, 33, 21],   # shares a prefix
           [66, 2]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("padded") / "ckpt", head_dim=24, hidden_size=64)


def _run(ckpt, **debug):
    llm = LLM(str(ckpt), dtype="float32", block_size=16, max_num_seqs=4, max_model_len=128, num_kv_blocks=32,
              enable_prefix_caching=True, max_num_batched_tokens=16, _debug=debug)
    try:
        layers = llm.engine.runner.attn_layers
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3))
        logits = llm.prefill_logits(PROMPTS[0])
        return layers, outs, torch.as_tensor(logits).float()
    finally:
        llm.shutdown()


def test_padded_heads_equal_the_plain_heads(ckpt):
    plain_layers, plain, plain_logits = _run(ckpt)
    layers, padded, logits = _run(ckpt, pad_head_dim=64)
    assert all(m.model_head_dim == 24 and m.head_dim == 64 and m.k_cache.shape[-1] == 64 for m in layers)
    assert all(m.model_head_dim is None and m.k_cache.shape[-1] == 24 for m in plain_layers)
    for a, b in zip(plain, padded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert max(abs(la[t].logprob - lb[t].logprob) for t in la) < 1e-5
    assert ((logits - plain_logits).abs().max() / plain_logits.abs().max()).item() < 1e-5


def test_nonzero_padding_would_show(ckpt, monkeypatch):
    """Sensitivity: the padding is exact because q's padding columns are zero (k's then never count, v's are cut
    off). Padding q with ones and k with a copy of its first column adds a key-dependent term to every score, and the
    tokens' log-probabilities must move."""
    import types

    import torch.nn.functional as F

    from xllm_gen.runtime.layers import attention as A
    _, plain, _ = _run(ckpt, pad_head_dim=64)
    calls = {"n": 0}

    def bad_pad(t, pad, *a, **k):        # Attention pads q, k, v in that order
        out = F.pad(t, pad, *a, **k)
        calls["n"] += 1
        out[..., t.shape[-1]:] = 1.0 if calls["n"] % 3 == 1 else t[..., :1] if calls["n"] % 3 == 2 else 0.0
        return out

    monkeypatch.setattr(A, "F", types.SimpleNamespace(pad=bad_pad))      # (the plain attention uses F.pad only)
    _, wrong, _ = _run(ckpt, pad_head_dim=64)
    assert calls["n"] > 0
    moved = max(abs(a.outputs[0].logprobs[0][t].logprob - b.outputs[0].logprobs[0][t].logprob)
                for a, b in zip(plain, wrong) for t in a.outputs[0].logprobs[0] if t in b.outputs[0].logprobs[0])
    assert moved > 1e-3, moved
