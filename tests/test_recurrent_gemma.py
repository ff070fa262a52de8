"""RecurrentGemma (Griffin): the `rg_lru` block kind (runtime/layers/recurrent/rg_lru.py L.RGLRU) and specs/recurrent_gemma.yaml
on the tiny checkpoint (tests/fixtures/tiny_hf.py: 4 layers of the repeated pattern recurrent, recurrent, attention,
recurrent; an RG-LRU of 96 channels in 4 head blocks, wider than the residual; transformers' log-decay init; a local
attention window of 6 that the prompts cross):

- greedy parity with transformers float32 with chunked prefill (a 100-token prompt in chunks of at most 70 tokens,
  beside shorter ones; TP 2 (slow): chunks of 4): a prompt's later chunks continue its conv and LRU states from its
  slot, the reset at position 0 happens once, and a chunk's recurrence crosses the scan's 64-token blocks;
- the LRU state carries (slow): zeroing only the `lru` state (not the conv state) before every decode step changes
  the tokens;
- the sqrt(1 - a^2) input normalisation matters (slow): switched off in the engine it changes the tokens, and equals
  transformers with its normalisation switched off the same way;
- a prompt's chunked recurrence (log-space decays in chunks of 64) equals the step-by-step one;
- the embedding scale is transformers' bfloat16 `normalizer` (sqrt(48) -> 6.9375), not sqrt(hidden_size) in float32;
- the guard refuses by name what the spec does not model (a block type, an activation, a rope type, an unscaled
  embedding, an LRU width that the heads do not divide), and TP refuses a head count it cannot split, naming the field;
- TP 2 with chunked prefill (slow; the spec battery's TP 2 arm is slow too).
The plain parity arms and the features-ON config (attention biases, an untied head, one KV head, a small soft-cap)
are the spec / conformance batteries'; the decode-graph path (no host sync, uncaptured parity) is
tests/test_recurrent_graphs.py's, which finds this model from the generated sources.
"""
from __future__ import annotations

import json

import pytest
import torch

ARCH = "RecurrentGemmaForCausalLM"
PROMPTS = [[5, 17, 99, 3, 250, 8, 77, 41, 9, 300, 12], [7, 8, 9], list(range(20, 90, 3))]
MAX_TOKENS = 10


def _hf(ckpt, prompts=PROMPTS):
    import transformers
    model = transformers.RecurrentGemmaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
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
    # a 100-token prompt in chunks of at most 70 tokens: each chunk continues the slot's states, and its recurrence
    # crosses the 64-token blocks of the chunked scan
    ckpt = tiny_checkpoint(ARCH)
    prompts = PROMPTS[:2] + [[(7 + 37 * i) % 500 for i in range(100)]]
    assert _engine(ckpt, prompts, enable_chunked_prefill=True, max_num_batched_tokens=70, max_num_seqs=2) == \
        _hf(ckpt, prompts)


@pytest.mark.slow
def test_lru_state_carries(tiny_checkpoint):
    ckpt = tiny_checkpoint(ARCH)
    zeroed = _engine(ckpt, _debug={"zero_state_at_decode": ("lru",)})
    assert zeroed != _hf(ckpt), "zeroing the LRU state between decode steps did not change the tokens"


@pytest.mark.slow
def test_input_normalisation_matters(tiny_checkpoint, monkeypatch):
    from xllm_gen.runtime import layers as L
    ckpt = tiny_checkpoint(ARCH)
    want = _hf(ckpt)

    def off(model):
        mixers = [m for m in model.modules() if isinstance(m, L.RGLRU)]
        assert len(mixers) == 3                             # layers 0, 1, 3
        for m in mixers:
            m.normalize_input = False
    got = _engine(ckpt, edit=off)
    assert got != want, "dropping the sqrt(1 - a^2) input normalisation did not change the tokens"
    # transformers without it (its multiplier 1 everywhere) agrees with the engine without it
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma as hf_rg
    monkeypatch.setattr(hf_rg.SqrtBoundDerivative, "apply", staticmethod(lambda x: torch.ones_like(x)))
    assert _hf(ckpt) == got


def test_chunked_scan_equals_the_step_by_step_recurrence():
    # prompts run the recurrence in chunks (log-space decays within a chunk); the reference steps token by token
    from xllm_gen.runtime.layers.recurrent import rg_lru_scan, rg_lru_scan_chunked
    g = torch.Generator().manual_seed(0)
    for T, chunk in ((1, 4), (7, 4), (64, 64), (150, 16)):
        x, state = torch.randn(T, 32, generator=g), torch.randn(32, generator=g)
        log_a = -torch.rand(T, 32, generator=g) * torch.tensor([0.01, 1.0, 20.0, 80.0]).repeat(8)   # a ~ 1 .. 1e-35
        want, want_h = rg_lru_scan(x, log_a.exp(), state)
        got, got_h = rg_lru_scan_chunked(x, log_a, state, chunk=chunk)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-5)
    # sensitivity: the state carries into the scan
    assert not torch.allclose(rg_lru_scan_chunked(x, log_a, state)[0], rg_lru_scan_chunked(x, log_a, 0 * state)[0])


def test_embedding_scale_is_the_bfloat16_normalizer():
    import transformers

    from xllm_gen.generated.recurrent_gemma import model as M
    hf = transformers.RecurrentGemmaConfig(hidden_size=48, num_attention_heads=4, num_hidden_layers=3,
                                           vocab_size=100, intermediate_size=96)
    normalizer = float(transformers.RecurrentGemmaModel(hf).normalizer)
    with torch.device("meta"):
        model = M.Model(M.Config.from_hf(hf.to_dict()))
    assert model.model.embed_scale == normalizer == 6.9375 != 48 ** 0.5


@pytest.mark.parametrize("field, value, match", [
    ("block_types", ["recurrent", "mlp"], r"layer 1: block_types\[layer % len\(block_types\)\] is 'mlp'"),
    ("hidden_activation", "relu", "hidden_activation"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, "linear"),
    ("embeddings_scale_by_sqrt_dim", False, "embeddings_scale_by_sqrt_dim"),
    ("lru_width", 90, r"width 90 \(config.json lru_width\) must be a multiple of heads 4"),
])
def test_guard_refuses_by_name(tiny_checkpoint, field, value, match):
    from xllm_gen.runtime.loading import registry
    hf = json.loads((tiny_checkpoint(ARCH) / "config.json").read_text())
    hf[field] = value
    model_module, _ = registry.resolve(hf)
    with pytest.raises(ValueError, match=match), torch.device("meta"):
        model_module.Model(model_module.Config.from_hf(hf))


def test_tp_refuses_indivisible_heads(tiny_checkpoint):
    from xllm_gen.runtime.executor.tp_check import check_tensor_parallel
    from xllm_gen.runtime.loading import registry
    hf = json.loads((tiny_checkpoint(ARCH) / "config.json").read_text())
    hf.update(num_attention_heads=3, lru_width=96, head_dim=16)   # 3 blocks of 32 channels over 2 ranks
    model_module, _ = registry.resolve(hf)
    with pytest.raises(ValueError, match=r"3 heads \(config.json num_attention_heads\)"):
        check_tensor_parallel(model_module, hf, 2)


@pytest.mark.slow
def test_tp2_chunked_prefill(tiny_checkpoint):
    ckpt = tiny_checkpoint(ARCH)
    assert _engine(ckpt, tensor_parallel_size=2, enable_chunked_prefill=True, max_num_batched_tokens=4) == _hf(ckpt)
