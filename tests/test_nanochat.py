"""NanoChatForCausalLM (specs/nanochat.yaml): parameter-free RMSNorms (`rmsnorm weight: false`, also as the per-head
q/k norm after rotary and as decoder.embed_norm), a rotary turning backward (`rotary.direction: backward`:
transformers' NanoChat rotate_half is [x2, -x1]), relu2 MLP, final logit soft-capping.

- the primitives against transformers' own modules: the backward Rotary gives NanoChat's rotated q / k (in the pair
  order it keeps them: the same values, permuted alike for q and k), the forward one does not (its sensitivity);
  the weightless RMSNorm equals NanoChatRMSNorm;
- greedy parity on a tiny checkpoint with its features on (attention biases, one KV head).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

ARCH = "NanoChatForCausalLM"


def test_backward_rotary_is_nanochat_rope():
    from transformers.models.nanochat.modeling_nanochat import apply_rotary_pos_emb

    from xllm_gen.runtime import layers as L

    g = torch.Generator().manual_seed(0)
    n, d = 7, 16
    q, k = torch.randn(n, 4, d, generator=g), torch.randn(n, 2, d, generator=g)
    pos = torch.arange(3, 3 + n)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = pos[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), emb.cos(), emb.sin(), unsqueeze_dim=0)
    hq, hk = hq.transpose(0, 1), hk.transpose(0, 1)
    back = L.Rotary(d, 10000.0, 64, direction="backward")
    bq, bk = back(pos, q.clone(), k.clone())
    order = back.gather                    # our dim j holds transformers' dim order[j]
    assert torch.allclose(bq, hq[..., order], atol=1e-6) and torch.allclose(bk, hk[..., order], atol=1e-6)
    scores = torch.einsum("qhd,khd->hqk", bq[:, :2], bk)
    assert torch.allclose(scores, torch.einsum("qhd,khd->hqk", hq[:, :2], hk), atol=1e-5)
    fq, fk = L.Rotary(d, 10000.0, 64)(pos, q.clone(), k.clone())
    assert not torch.allclose(torch.einsum("qhd,khd->hqk", fq[:, :2], fk), scores, atol=1e-3)


def test_weightless_rmsnorm_is_nanochat_norm():
    from transformers.models.nanochat.modeling_nanochat import NanoChatRMSNorm

    from xllm_gen.runtime import layers as L

    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)) * 3
    norm = L.RMSNorm(32, 1e-6, weight=False)
    assert not list(norm.parameters())
    assert torch.equal(norm(x), NanoChatRMSNorm(eps=1e-6)(x))
    y, r = norm(x, x)
    assert torch.equal(r, x + x) and torch.equal(y, NanoChatRMSNorm(eps=1e-6)(x + x))


@pytest.mark.engine
@pytest.mark.slow      # the default run serves NanoChat through the spec and conformance batteries
def test_features_on_match_hf(tiny_checkpoint):
    from hf_ref import hf_greedy

    from xllm_gen import LLM, SamplingParams

    prompts = [np.random.default_rng(0).integers(0, 200, n).tolist() for n in (3, 9, 17, 30)]
    ckpt = tiny_checkpoint(ARCH, overrides={"attention_bias": True, "num_key_value_heads": 1})
    want = hf_greedy(ckpt, prompts, 16)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want
