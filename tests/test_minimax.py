"""MiniMax-Text-01 / M1 (specs/minimax.yaml, MiniMaxForCausalLM): lightning attention (the `lightning_attention`
recurrent mixer, runtime/layers/lightning.py: a fixed decay per head and layer, S <- exp(-slope) S + k^T v, a norm over
all heads, a sigmoid output gate) beside softmax attention, the residual taken after each norm and weighted per layer
type (`residual: normed`, `residual_scale`, `scale`), Mixtral's MoE. On the tiny checkpoint (tests/fixtures/tiny_hf.py
ARCH_DEFAULTS: lightning layers 1 and 3, blocks of 8 tokens the prompts cross, alpha / beta factors away from 1):

- greedy parity with transformers float32 with chunked prefill (chunks of 5 tokens) over concurrent sequences;
- the state carries: zeroing the recurrent state before every decode step changes the tokens;
- a wrong decay (the spec's layer count in the decay formula off) diverges from transformers (slow, verify);
- the residual factors are load-bearing: another mlp_alpha_factor changes transformers' tokens and the engine
  follows (slow);
- the guard: an unknown layer type, a rope type the spec does not model are refused by name; TP refuses a head count
  it cannot split.
The plain parity arms (TP 1, TP 2) and the features-ON config are the spec / conformance batteries'.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ARCH = "MiniMaxForCausalLM"
PROMPTS = [[5, 17, 99, 3, 250, 8, 77, 41, 9, 300, 12], [7, 8, 9], list(range(20, 90, 3))]
MAX_TOKENS = 10


def _hf(ckpt, prompts=PROMPTS):
    import transformers
    model = transformers.MiniMaxForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None          # as the engine's ignore_eos
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def _engine(ckpt, prompts=PROMPTS, **kw):
    from xllm_gen import LLM, SamplingParams
    with LLM(str(ckpt), device="cpu", dtype="float32", **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_chunked_prefill_and_state(tiny_checkpoint):
    ckpt = tiny_checkpoint(ARCH)
    want = _hf(ckpt)
    assert _engine(ckpt, enable_chunked_prefill=True, max_num_batched_tokens=5, max_num_seqs=2) == want
    zeroed = _engine(ckpt, _debug={"zero_state_at_decode": True})
    assert zeroed != want, "zeroing the recurrent state between decode steps did not change the tokens"


def test_guard_refuses_by_name():
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.generated.minimax.model import Config
    base = tiny_config(ARCH).to_dict()
    Config.from_hf(base)
    with pytest.raises(Exception, match="layer_types"):
        Config.from_hf({**base, "layer_types": ["full_attention", "moe", "full_attention", "linear_attention"]})
    with pytest.raises(Exception, match="rope"):
        Config.from_hf({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}})


def test_lightning_heads_split_over_tp_refused():
    from xllm_gen.runtime.executor import distributed
    from xllm_gen.runtime.layers.lightning import LightningAttention
    orig = distributed.get_tp_size
    import xllm_gen.runtime.layers.lightning as lt
    lt.get_tp_size = lambda: 3
    try:
        with pytest.raises(Exception, match="num_attention_heads"):
            LightningAttention(4, 16, 0, 4, 8, 1e-6, fields={"heads": "num_attention_heads"})
    finally:
        lt.get_tp_size = orig


@pytest.mark.slow
def test_wrong_decay_diverges(tiny_checkpoint, tmp_path):
    from xllm_gen.codegen.verify import verify
    ckpt = tiny_checkpoint(ARCH)
    text = (ROOT / "specs" / "minimax.yaml").read_text()
    assert text.count("        layers: num_hidden_layers\n") == 1
    spec = tmp_path / "minimax.yaml"
    spec.write_text(text.replace("        layers: num_hidden_layers\n", "        layers: \"num_hidden_layers + 2\"\n"))
    shutil.copy(ROOT / "specs" / "spec.schema.json", tmp_path / "spec.schema.json")
    assert verify(ROOT / "specs" / "minimax.yaml", ckpt, max_tokens=8).ok
    assert not verify(spec, ckpt, max_tokens=8).ok


@pytest.mark.slow
def test_residual_factors_are_load_bearing(tiny_checkpoint):
    base = _hf(tiny_checkpoint(ARCH))
    ckpt = tiny_checkpoint(ARCH, overrides={"mlp_alpha_factor": 1.6, "linear_attn_alpha_factor": 0.5})
    want = _hf(ckpt)
    assert want != base
    assert _engine(ckpt) == want
