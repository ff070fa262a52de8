"""RWKV-4: the `wkv` and `channel_mix` block kinds (runtime/layers/recurrent/wkv.py L.WKV, L.TokenShiftMLP),
`layers.stream_scale` and specs/rwkv.yaml on the tiny checkpoint (tests/fixtures/tiny_hf.py: 4 layers, transformers'
inference rescale every 2 layers, token-shift mixes U(0, 1), log-decays over transformers' range):

- greedy parity with transformers float32 with chunked prefill (a 40-token prompt in chunks of 7 beside shorter
  ones): a prompt's later chunks continue its shift and WKV states from its slot;
- the WKV scan is transformers' CPU recurrence bit for bit (prompt and decode form), and its state carries;
- sensitivity: zeroing the WKV state, or only the token-shift states, before every decode step changes the tokens;
  dropping the stream halving (keeping the projections' rescale) changes them; the rescale is modelled exactly
  (transformers' log-probabilities move with rescale_every by more than the engine's distance to them);
- the guard / TP refuse by name (a WKV width the TP size does not divide);
- TP 2 with chunked prefill (slow; the spec battery's and the conformance battery's TP 2 arms are slow too).
The plain parity arms and the features-ON config (an untied / tied head) are the spec / conformance batteries'.
"""
from __future__ import annotations

import json

import pytest
import torch

ARCH = "RwkvForCausalLM"
PROMPTS = [[5, 17, 99, 3, 250, 8, 77, 41, 9, 300, 12], [7, 8, 9], list(range(20, 90, 3))]
MAX_TOKENS = 10


def _hf(ckpt, prompts=PROMPTS):
    import transformers
    model = transformers.RwkvForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def _engine(ckpt, prompts=PROMPTS, edit=None, **kw):
    from xllm_gen import LLM, SamplingParams
    with LLM(str(ckpt), device="cpu", dtype="float32", **kw) as llm:
        if edit is not None:
            edit(llm.engine.runner.model)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_chunked_prefill(tiny_checkpoint):
    ckpt = tiny_checkpoint(ARCH)
    prompts = PROMPTS[:2] + [[(7 + 37 * i) % 500 for i in range(40)]]
    assert _engine(ckpt, prompts, enable_chunked_prefill=True, max_num_batched_tokens=7, max_num_seqs=2) == \
        _hf(ckpt, prompts)


def test_wkv_scan_is_the_reference_recurrence():
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    from xllm_gen.runtime.layers.recurrent import fresh_wkv_state, wkv_scan, wkv_step
    g = torch.Generator().manual_seed(0)
    C, T = 24, 13
    decay, first = torch.rand(C, generator=g) * 5 - 3, torch.rand(C, generator=g) * 2 - 1
    k, v = torch.randn(1, T, C, generator=g) * 3, torch.randn(1, T, C, generator=g)
    init = [torch.zeros(1, C), torch.zeros(1, C), torch.full((1, C), -1e30)]    # transformers' generation state
    want, want_state = rwkv_linear_attention_cpu(decay, first, k, v, state=[s.clone() for s in init],
                                                 return_state=True)
    w = -torch.exp(decay)
    # a prompt in two chunks, the second continuing the first's state
    out1, st = wkv_scan(w, first, k[0, :5], v[0, :5], fresh_wkv_state(torch.zeros(C)))
    out2, st = wkv_scan(w, first, k[0, 5:], v[0, 5:], st)
    assert torch.equal(torch.cat([out1, out2]), want[0])
    for got, ref in zip(st, want_state):
        assert torch.equal(got, ref[0])
    # a decode step (batched form) continues it as transformers' one-token call does
    k1, v1 = torch.randn(1, 1, C, generator=g), torch.randn(1, 1, C, generator=g)
    want1, _ = rwkv_linear_attention_cpu(decay, first, k1, v1, state=[s.clone() for s in want_state],
                                         return_state=True)
    got1, *_ = wkv_step(w, first, k1[:, 0], v1[:, 0], *(s.clone() for s in want_state))
    assert torch.equal(got1, want1[:, 0])
    # sensitivity: the state carries (a fresh state instead of the first chunk's gives another output)
    assert not torch.allclose(wkv_scan(w, first, k[0, 5:], v[0, 5:], fresh_wkv_state(torch.zeros(C)))[0], out2)


@pytest.mark.parametrize("names", [("num", "den", "max"), ("shift",)], ids=["wkv", "shift"])
def test_state_carries(tiny_checkpoint, names):
    ckpt = tiny_checkpoint(ARCH)
    zeroed = _engine(ckpt, _debug={"zero_state_at_decode": names})
    assert zeroed != _hf(ckpt), f"zeroing the {names} states between decode steps did not change the tokens"


def test_stream_halving_matters(tiny_checkpoint):
    # the rescale is two halves: the projections into the stream divided by 2 ** (layer // 2), and the stream halved
    # after layers 1 and 3; without the second the layers' outputs are out of scale with the stream
    ckpt = tiny_checkpoint(ARCH)

    def off(model):
        scales = [layer.stream_scale for layer in model.model.layers]
        assert scales == [1.0, 0.5, 1.0, 0.5]
        for layer in model.model.layers:
            layer.stream_scale = 1.0
    assert _engine(ckpt, edit=off) != _hf(ckpt), "dropping the stream halving did not change the tokens"


def test_rescale_is_exact(tiny_checkpoint):
    # the rescale only moves the LayerNorms' eps relative to the stream: tokens cannot show it; transformers'
    # prompt log-probabilities do move with rescale_every (1 vs off), and the engine's follow them much closer
    import numpy as np
    from hf_ref import hf_prefill_logits

    from xllm_gen import LLM, SamplingParams
    ids = np.random.default_rng(0).integers(0, 400, 30).tolist()
    on, off = tiny_checkpoint(ARCH, overrides={"rescale_every": 1}), tiny_checkpoint(ARCH, overrides={"rescale_every": 0})
    ref = {c: torch.log_softmax(hf_prefill_logits(c, ids), -1) for c in (on, off)}
    want = [float(ref[on][j - 1, ids[j]]) for j in range(1, len(ids))]
    moved = max(abs(a - float(ref[off][j - 1, ids[j]])) for j, a in zip(range(1, len(ids)), want))
    with LLM(model=str(on), device="cpu", dtype="float32") as llm:
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=1,
                                                                       prompt_logprobs=0))[0]
    got = [out.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))]
    err = max(abs(g - w) for g, w in zip(got, want))
    assert moved > 1e-4 and err < moved / 20, (moved, err)


def test_tp_refuses_an_indivisible_width(tiny_checkpoint):
    from xllm_gen.runtime.executor.tp_check import check_tensor_parallel
    from xllm_gen.runtime.loading import registry
    hf = json.loads((tiny_checkpoint(ARCH) / "config.json").read_text())
    hf.update(attention_hidden_size=63)
    model_module, _ = registry.resolve(hf)
    with pytest.raises(ValueError, match=r"63 channels \(config.json attention_hidden_size\)"):
        check_tensor_parallel(model_module, hf, 2)


@pytest.mark.slow
def test_tp2_chunked_prefill(tiny_checkpoint):
    ckpt = tiny_checkpoint(ARCH)
    assert _engine(ckpt, tensor_parallel_size=2, enable_chunked_prefill=True, max_num_batched_tokens=4) == _hf(ckpt)
