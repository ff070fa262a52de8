"""JetMoE (specs/jetmoe.yaml) and the primitives it brought into the language: the routed linear (`y[t, s] =
W[e(t, s)] x[t]`, runtime `L.RoutedLinear`) as an attention's q and output projections (`attention.experts`, a mixture
of attention heads) and a MoE's `output_bias`.

Greedy parity with transformers (features ON: multi-query attention experts, an untied head, linear rope; TP 2 with
--runslow) is the conformance battery's and the spec battery's. Here: the routed linear against a per-slot loop, the
compiler's refusals, the guard, and (slow) sensitivity arms: the attention router, the attention experts' output
bias and the MoE's output bias each move transformers' tokens, and the engine follows."""
from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from fixtures.tiny_hf import tiny_config

ARCH = "JetMoeForCausalLM"
SPEC = Path(__file__).resolve().parent.parent / "specs" / "jetmoe.yaml"


def test_routed_linear_is_the_per_slot_expert_matrix():
    """Column form: y[t, s] = W[e(t, s)] x[t]; row form: sum_s w[t, s] * W[e(t, s)] x[t, s] + bias (two slots may
    choose one expert: their contributions add)."""
    from xllm_gen.runtime import layers as L
    g = torch.Generator().manual_seed(0)
    E, T, S, D, O = 4, 5, 2, 8, 6
    col = L.RoutedLinear(E, D, O, "column")
    row = L.RoutedLinear(E, O, D, "row", bias=True)
    with torch.no_grad():
        for p in (col.weight, row.weight, row.bias):
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(T, D, generator=g)
    logits = torch.randn(T, E, generator=g)
    w, ids = L.topk_softmax(logits, S, torch.float32)
    assert torch.allclose(w.sum(-1), torch.ones(T)) and torch.equal(ids, logits.topk(S, dim=-1).indices)
    y = col(x, ids)
    want = torch.stack([torch.stack([col.weight[ids[t, s]] @ x[t] for s in range(S)]) for t in range(T)])
    assert torch.allclose(y, want, atol=1e-5)
    ids_dup = ids.clone()
    ids_dup[0, 1] = ids_dup[0, 0]
    z = row(y, ids_dup, w)
    want = torch.stack([sum(w[t, s] * (row.weight[ids_dup[t, s]] @ y[t, s]) for s in range(S)) + row.bias
                        for t in range(T)])
    assert torch.allclose(z, want, atol=1e-4)
    with pytest.raises(ValueError, match="routing weights"):
        row(y, ids)


def _compile_error(tmp_path, old: str, new: str) -> str:
    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.errors import SpecError, SpecErrors
    text = SPEC.read_text()
    assert old in text, old
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises((SpecError, SpecErrors)) as e:
        compile_spec(bad)
    return str(e.value)


def test_compiler_refuses_what_a_mixture_of_attention_heads_cannot_take(tmp_path):
    """q comes from the routed projection (the fused one is [k, v]); heads = top_k * kv_heads; the attention
    features it does not model are compile errors naming them."""
    msg = _compile_error(tmp_path, "qkv: {name: kv_proj, segments: [k, v]}", "qkv: {name: kv_proj, segments: [q, k, v]}")
    assert "qkv.segments" in msg and "[k, v]" in msg, msg
    msg = _compile_error(tmp_path, 'heads: "num_key_value_heads * num_experts_per_tok"', "heads: num_key_value_heads")
    assert "experts.top_k * kv_heads" in msg, msg
    msg = _compile_error(tmp_path, "        qkv: {name: kv_proj, segments: [k, v]}\n",
                         "        qkv: {name: kv_proj, segments: [k, v]}\n        sinks: true\n")
    assert "self_attention.sinks: not supported with `experts`" in msg, msg


def test_guard():
    """head_dim (transformers' attribute for kv_channels) wins over kv_channels as in transformers; an unmodeled rope
    type is refused by name."""
    import importlib

    from xllm_gen.runtime.loading.hf_config import ConfigError
    Config = importlib.import_module("xllm_gen.generated.jetmoe.model").Config
    hf = copy.deepcopy(tiny_config(ARCH).to_dict())
    assert Config.from_hf(hf).head_dim == 16
    hf["head_dim"] = 32
    assert Config.from_hf(hf).head_dim == 32
    hf = copy.deepcopy(tiny_config(ARCH).to_dict())
    hf["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="yarn"):
        Config.from_hf(hf)


def _perturbed(base, dst, pattern: str, seed: int):
    from test_norm_dataflow import _edit_tensors
    g = torch.Generator().manual_seed(seed)

    def edit(name, t):
        if re.fullmatch(pattern, name):
            return t + t.abs().mean().clamp_min(0.05) * 4.0 * torch.randn(t.shape, generator=g)
        return None
    return _edit_tensors(base, dst, edit)


@pytest.mark.slow
@pytest.mark.parametrize("what, pattern", [
    ("the attention router", r"model\.layers\.\d+\.self_attention\.experts\.router\.layer\.weight"),
    ("the attention experts' output bias", r"model\.layers\.\d+\.self_attention\.experts\.bias"),
    ("the MoE's output bias", r"model\.layers\.\d+\.mlp\.bias"),
])
def test_routing_and_biases_matter(what, pattern, tiny_checkpoint, tmp_path):
    from test_norm_dataflow import _arm
    base = tiny_checkpoint(ARCH)
    _arm(base, _perturbed(base, tmp_path / "arm", pattern, 11), f"perturbing {what}")
