"""xLSTM: the `mlstm` block kind (runtime/layers/recurrent/mlstm.py L.MLSTM) and specs/xlstm.yaml on the tiny checkpoint
(tests/fixtures/tiny_hf.py: 3 blocks, hidden 128, 4 heads of q / k 16 and v 32, an MLP of 192, gate and logit
soft-caps on):

- greedy parity with transformers float32 with chunked prefill (a 70-token prompt, which transformers runs in its
  chunkwise form over 64 tokens and steps the rest, in chunks of 9 beside shorter ones): a prompt's later chunks
  continue its C / n / m states from its slot;
- the recurrence is transformers' step (prompt and decode form) bit for bit, and its state carries;
- sensitivity: zeroing the mLSTM state before every decode step changes the tokens, and so does dropping the gates'
  soft cap (the engine without it equals transformers without it);
- the guard refuses by name (the fused weight mode, float16 states, an odd qk width) and TP refuses a head count it
  cannot split, naming the field; TP 2 with chunked prefill (slow).
"""
from __future__ import annotations

import json

import pytest
import torch

ARCH = "xLSTMForCausalLM"
PROMPTS = [[5, 17, 99, 3, 250, 8, 77, 41, 9, 300, 12], [7, 8, 9], list(range(20, 90, 3))]
MAX_TOKENS = 10


def _hf(ckpt, prompts=PROMPTS):
    import transformers
    model = transformers.xLSTMForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


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
    prompts = PROMPTS[:2] + [[(7 + 37 * i) % 500 for i in range(70)]]
    assert _engine(ckpt, prompts, enable_chunked_prefill=True, max_num_batched_tokens=9, max_num_seqs=2) == \
        _hf(ckpt, prompts)


def test_recurrence_is_the_reference_step():
    from transformers.models.xlstm.modeling_xlstm import mlstm_recurrent_sequence_native, mlstm_recurrent_step_native

    from xllm_gen.runtime.layers.recurrent import mlstm_scan, mlstm_step
    g = torch.Generator().manual_seed(0)
    T, H, dk, dv = 9, 2, 4, 6
    q, k = torch.randn(1, H, T, dk, generator=g), torch.randn(1, H, T, dk, generator=g)
    v = torch.randn(1, H, T, dv, generator=g)
    i, f = torch.randn(1, H, T, generator=g) * 3, torch.randn(1, H, T, generator=g) * 3
    zeros = (torch.zeros(1, H, dk, dv), torch.zeros(1, H, dk), torch.zeros(1, H, 1))
    want, want_state = mlstm_recurrent_sequence_native(q, k, v, i, f, *zeros, return_last_states=True)

    def tok(x):                             # [1, H, T, ...] -> [T, H, ...]
        return x[0].transpose(0, 1)
    got1, st = mlstm_scan(tok(q)[:4], tok(k)[:4], tok(v)[:4], tok(i)[:4], tok(f)[:4], [z[0] for z in zeros], 1e-6)
    got2, st = mlstm_scan(tok(q)[4:], tok(k)[4:], tok(v)[4:], tok(i)[4:], tok(f)[4:], st, 1e-6)
    assert torch.equal(torch.cat([got1, got2]), tok(want))
    for a, b in zip(st, want_state):
        assert torch.equal(a, b[0])
    # a decode step continues it as transformers' step kernel does
    q1, k1, v1 = torch.randn(1, H, dk, generator=g), torch.randn(1, H, dk, generator=g), torch.randn(1, H, dv, generator=g)
    i1, f1 = torch.randn(1, H, 1, generator=g), torch.randn(1, H, 1, generator=g)
    want1, _ = mlstm_recurrent_step_native(q1, k1, v1, i1, f1, *want_state)
    assert torch.equal(mlstm_step(q1, k1, v1, i1, f1, *want_state, 1e-6)[0], want1)
    # sensitivity: the state carries
    fresh = [z[0] for z in zeros]
    assert not torch.allclose(mlstm_scan(tok(q)[4:], tok(k)[4:], tok(v)[4:], tok(i)[4:], tok(f)[4:], fresh, 1e-6)[0],
                              got2)


def test_state_carries(tiny_checkpoint):
    ckpt = tiny_checkpoint(ARCH)
    zeroed = _engine(ckpt, _debug={"zero_state_at_decode": ("C", "n", "m")})
    assert zeroed != _hf(ckpt), "zeroing the mLSTM state between decode steps did not change the tokens"


def test_gate_soft_cap_matters(tiny_checkpoint, monkeypatch):
    # a cap of 1 (a strong one) on the gate pre-activations: the engine without it differs from transformers with it,
    # and equals transformers without it (its soft_cap also caps the logits: a monotone map, greedy tokens keep)
    from xllm_gen.runtime import layers as L
    ckpt = tiny_checkpoint(ARCH, overrides={"gate_soft_cap": 1.0})
    want = _hf(ckpt)

    def off(model):
        mixers = [m for m in model.modules() if isinstance(m, L.MLSTM)]
        assert len(mixers) == 3 and all(m.gate_soft_cap == 1.0 for m in mixers)
        for m in mixers:
            m.gate_soft_cap = None
    got = _engine(ckpt, edit=off)
    assert got != want, "dropping the gates' soft cap did not change the tokens"
    from transformers.models.xlstm import modeling_xlstm as hf_xl
    monkeypatch.setattr(hf_xl, "soft_cap", lambda values, cap_value=None: values)
    assert _hf(ckpt) == got


@pytest.mark.parametrize("field, value, match", [
    ("weight_mode", "fused", "weight_mode"),
    ("inference_state_dtype", "bfloat16", "inference_state_dtype"),
    ("norm_reduction_force_float32", False, "norm_reduction_force_float32"),
    ("qk_dim_factor", 0.45, r"qk_dim 57 \(config.json qk_dim = int\(hidden_size \* qk_dim_factor\)\) must be a "
                            r"multiple of heads 4"),
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
    hf.update(num_heads=1)
    model_module, _ = registry.resolve(hf)
    with pytest.raises(ValueError, match=r"1 heads \(config.json num_heads\)"):
        check_tensor_parallel(model_module, hf, 2)


@pytest.mark.slow
def test_tp2_chunked_prefill(tiny_checkpoint):
    ckpt = tiny_checkpoint(ARCH)
    assert _engine(ckpt, tensor_parallel_size=2, enable_chunked_prefill=True, max_num_batched_tokens=4) == _hf(ckpt)
