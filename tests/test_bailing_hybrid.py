"""Bailing hybrid (specs/bailing_hybrid.yaml, BailingHybridForCausalLM): KDA (`gated_delta_net`, `decay: channel`) with
the bounded decay (`bounded_decay: kda_safe_gate`: g = kda_lower_bound * sigmoid(exp(A_log) (f + dt_bias))) around
multi-head latent attention with rotary and a sigmoid output gate per head (`mla_attention.out_gate`). On the tiny
checkpoint (tests/fixtures/tiny_hf.py ARCH_DEFAULTS: KDA on layers 0, 2, MLA on 1, 3, a dense first layer, grouped
experts):

- greedy parity with transformers float32 with chunked prefill (chunks of 5 tokens) over concurrent sequences;
- the state carries: zeroing the recurrent state before every decode step changes the tokens;
- the bounded decay and its bound are load-bearing: kda_safe_gate false (the softplus decay) and another
  kda_lower_bound each change transformers' tokens and the engine follows (slow);
- the MLA output gate is load-bearing: g_proj of the MLA layers scaled changes the tokens, both sides agree (slow);
- the guard: fewer KV heads than heads is refused by name;
- transformers >= 5.25's per-layer SwiGLU limits (`glu_clamped`, routed and shared experts by their own lists): each
  list moves transformers' tokens and the engine follows; bad lists are refused by name; the form's module and
  its compile errors.
The plain parity arms (TP 1, TP 2) and the features-ON config are the spec / conformance batteries'.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

ARCH = "BailingHybridForCausalLM"
PROMPTS = [[5, 17, 99, 3, 250, 8, 77, 41, 9, 300, 12], [7, 8, 9], list(range(20, 90, 3))]
MAX_TOKENS = 10


def _hf(ckpt, prompts=PROMPTS):
    import transformers
    model = transformers.BailingHybridForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
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


def test_guard_refuses_fewer_kv_heads():
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.generated.bailing_hybrid.model import Config
    base = tiny_config(ARCH).to_dict()
    Config.from_hf(base)
    with pytest.raises(Exception, match="num_key_value_heads"):
        Config.from_hf({**base, "num_key_value_heads": 1})


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{"kda_safe_gate": False}, {"kda_lower_bound": -1.0}])
def test_bounded_decay_is_load_bearing(tiny_checkpoint, overrides):
    base = _hf(tiny_checkpoint(ARCH))
    ckpt = tiny_checkpoint(ARCH, overrides=overrides)
    want = _hf(ckpt)
    assert want != base, f"{overrides} did not change transformers' tokens"
    assert _engine(ckpt) == want


@pytest.mark.slow
def test_mla_output_gate_is_load_bearing(tiny_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    src = tiny_checkpoint(ARCH)
    base = _hf(src)
    ckpt = tmp_path / "gate"
    shutil.copytree(src, ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    gates = [k for k in tensors if k.endswith("attention.g_proj.weight") and tensors[k].shape[0] == 4]
    assert len(gates) == 2                         # the MLA layers' per-head gates (KDA's g_proj is [64, 64])
    for k in gates:
        tensors[k] = tensors[k] * -4.0
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    want = _hf(ckpt)
    assert want != base, "scaling the MLA output gate did not change transformers' tokens"
    assert _engine(ckpt) == want


# transformers >= 5.25: per-layer SwiGLU limits (0: none), routed and shared experts apart, clamped after the activation
LIMITS = {"expert_swiglu_limit_list": [0, 0.02, 0, 0.02], "share_expert_swiglu_limit_list": [0, 0, 0.02, 0.02]}


@pytest.mark.parametrize("overrides", [
    LIMITS,
    pytest.param({"expert_swiglu_limit_list": LIMITS["expert_swiglu_limit_list"]}, marks=pytest.mark.slow),
    pytest.param({"share_expert_swiglu_limit_list": LIMITS["share_expert_swiglu_limit_list"]}, marks=pytest.mark.slow)],
    ids=["both", "routed", "shared"])
def test_swiglu_limits_per_layer(tiny_checkpoint, overrides):
    """glu_clamped (min(act(gate), limit) * clamp(up, +-limit)) per layer, routed and shared experts each by their own
    list: transformers' tokens move with each list (sensitivity) and the engine follows."""
    pytest.importorskip("transformers.models.bailing_hybrid.configuration_bailing_hybrid")
    import transformers
    if not hasattr(transformers.BailingHybridConfig(), "swiglu_limits"):
        pytest.skip("this transformers has no per-layer SwiGLU limits (< 5.25)")
    ckpt = tiny_checkpoint(ARCH, overrides=overrides)
    want = _hf(ckpt)
    assert want != _hf(tiny_checkpoint(ARCH)), f"{overrides} did not change transformers' tokens"
    assert _engine(ckpt) == want


def test_guard_refuses_bad_limit_lists():
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.generated.bailing_hybrid.model import Config
    base = tiny_config(ARCH).to_dict()
    for bad in ({"expert_swiglu_limit_list": [0.5]}, {"share_expert_swiglu_limit_list": [0, -1.0, 0, 0]}):
        with pytest.raises(Exception, match=next(iter(bad))):
            Config.from_hf({**base, **bad})


def test_glu_clamped_module():
    """glu_clamped = min(act(gate), limit) * clamp(up, -limit, limit) (the clamp after the activation); limit None is the
    plain gated activation; a non-positive limit is refused."""
    from xllm_gen.runtime.layers.activation import gated_act
    x = torch.randn(5, 8) * 3
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate).clamp(max=0.4) * up.clamp(-0.4, 0.4)
    assert torch.equal(gated_act("glu_clamped", act="silu", limit=0.4)(x), want)
    assert torch.allclose(gated_act("glu_clamped", act="silu", limit=None)(x), torch.nn.functional.silu(gate) * up)
    with pytest.raises(ValueError, match="limit"):
        gated_act("glu_clamped", act="silu", limit=0.0)


@pytest.mark.parametrize("form, match", [
    ("{kind: glu_clamped, act: ~, limit: 1.0}", r"glu_clamped needs `act`"),
    ("{kind: glu_clamped, act: silu, alpha: 1.0}", r"alpha: not a parameter of glu_clamped"),
    ("{kind: glu_clamped, act: nope}", r"act: 'nope' is neither"),
    ("{kind: swiglu_clamped, act: silu, alpha: 1.0}", r"act: not a parameter of swiglu_clamped"),
])
def test_glu_clamped_spec_errors_are_located(tmp_path, form, match):
    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.errors import SpecError
    spec = Path(__file__).resolve().parents[1] / "specs" / "bailing_hybrid.yaml"
    p = tmp_path / "child.yaml"
    p.write_text(f"spec_version: 2\nextends: {spec}\nname: bailing_child\narchitectures: [BailingChild]\n"
                 f"decoder:\n  layers:\n    blocks:\n      moe: {{activation: {form}}}\n")
    with pytest.raises(SpecError, match=match) as e:
        compile_spec(p)
    assert "child.yaml:" in str(e.value)
