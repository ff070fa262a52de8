"""attention.key_bias (runtime L.ValueKeyBias): a learned per-key score bias from the values with a top-`keep` of keys
per query (Doge's dynamic mask attention, specs/doge.yaml).

- the kept keys equal transformers' DogeAttention.prepare_dynamic_mask, ties included (the first layer's repeated
  tokens give equal biases; transformers breaks them by torch.topk over its row);
- the torch backend adds the bias to the scaled scores of each KV head's query heads, -inf hiding the key;
- sensitivity arms (slow): with the bias zeroed, or the top-k off, the engine's tokens on the features-ON tiny Doge
  checkpoint leave transformers' (which the conformance battery shows the engine meets).
"""
from __future__ import annotations

import pytest
import torch

from xllm_gen.runtime.attention.torch_ref import attend
from xllm_gen.runtime.layers.key_bias import ValueKeyBias


def _hf_kept(dt: torch.Tensor, keep: int, window=None) -> torch.Tensor:
    """transformers' kept keys [Hk, Q, L] of a one-pass prefill (dt [Hk, L], float32)."""
    from transformers.models.doge.modeling_doge import DogeAttention
    Hk, L = dt.shape
    qpos = torch.arange(L)[:, None]
    kpos = torch.arange(L)[None, :]
    visible = kpos <= qpos
    if window is not None:
        visible &= kpos > qpos - window
    low = torch.finfo(torch.float32).min
    mask = torch.where(visible, 0.0, low)[None, None]                  # [1, 1, Q, L] additive
    hidden = torch.zeros(1, L, 8)
    out = DogeAttention.prepare_dynamic_mask(None, hidden, dt[None], keep_window_size=keep, attention_mask=mask)
    return (out[0] != low)                                             # [Hk, Q, L]


def _ours_kept(dt: torch.Tensor, keep: int, window=None) -> torch.Tensor:
    Hk, L = dt.shape
    m = ValueKeyBias(Hk, keep=keep, sliding_window=window)
    rows = m._top_keep(dt[None].expand(L, -1, -1), L, L, torch.float32)     # [Q, Hk, L]
    qpos = torch.arange(L)[:, None]
    kpos = torch.arange(L)[None, :]
    visible = kpos <= qpos
    if window is not None:
        visible &= kpos > qpos - window
    return (torch.isfinite(rows) & visible[:, None, :]).permute(1, 0, 2)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("window", [None, 9])
def test_top_keep_matches_transformers(ties, window):
    g = torch.Generator().manual_seed(3)
    dt = torch.rand(2, 23, generator=g) + 0.5
    if ties:     # repeated tokens at the first layer: equal biases
        dt[:, 4:12] = dt[:, 3:4]
        dt[:, 15:] = dt[:, 2:3]
    for keep in (1, 4, 7, 22, 40):
        torch.testing.assert_close(_ours_kept(dt, keep, window).int(), _hf_kept(dt, keep, window).int())


def test_backend_adds_the_bias_per_kv_head():
    g = torch.Generator().manual_seed(0)
    Q, H, Hk, D = 5, 4, 2, 8
    q, k, v = torch.randn(Q, H, D, generator=g), torch.randn(Q, Hk, D, generator=g), torch.randn(Q, Hk, D, generator=g)
    bias = torch.randn(Q, Hk, Q, generator=g)
    got = attend(q, k, v, 0.3, 0, key_bias=bias)
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, 1)) * 0.3 + bias.repeat_interleave(2, 1).transpose(0, 1)
    s = s.masked_fill(torch.ones(Q, Q, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", s.softmax(-1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # -inf hides a key as a key mask does
    hide = torch.zeros(Q, Hk, Q)
    hide[:, :, 1] = float("-inf")
    mask = torch.ones(Q, Q, dtype=torch.bool)
    mask[:, 1] = False
    mask[0, 1] = True    # (query 0 sees key 0 only anyway)
    torch.testing.assert_close(attend(q, k, v, 0.3, 0, key_bias=hide)[1:], attend(q, k, v, 0.3, 0, key_mask=mask)[1:])


def test_refusals():
    with pytest.raises(ValueError, match="keep"):
        ValueKeyBias(2, keep=0)
    with pytest.raises(ValueError, match="kv_heads"):
        ValueKeyBias(0)


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("arm", ["bias_zeroed", "top_k_off"])
def test_doge_key_bias_sensitivity(arm, tiny_checkpoint, monkeypatch):
    from conformance import families as F
    plan = next(p for p in F.served_plans() if p.family.architecture == "DogeForCausalLM")
    ckpt = tiny_checkpoint("DogeForCausalLM", overrides=plan.overrides)
    from test_spec_battery import BLOCK_SIZE, MAX_TOKENS, Tokens, _requests
    want = Tokens().hf(ckpt)
    forward = ValueKeyBias.forward
    if arm == "bias_zeroed":
        monkeypatch.setattr(ValueKeyBias, "forward", lambda self, *a: torch.zeros_like(forward(self, *a)))
    else:
        def no_top_k(self, *a):
            self.keep = None
            return forward(self, *a)
        monkeypatch.setattr(ValueKeyBias, "forward", no_top_k)
    from xllm_gen import LLM, SamplingParams
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=BLOCK_SIZE) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(
            _requests(ckpt), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    assert got != want, f"{arm}: the engine's tokens do not depend on the key bias"
