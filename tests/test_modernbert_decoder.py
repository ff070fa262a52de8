"""ModernBERT decoder (specs/modernbert_decoder.yaml) and the two primitives it brought into the language: a norm
absent on some layers (`enabled` per layer on a layer's norm: the identity, no parameters, where it is false) and the
LM head's input transform (`decoder.head_transform`: norm(act(dense(x))), BERT's prediction head).

Parity with transformers with every feature on is the conformance battery's (tests/conformance, features ON: biases
on the norms, attention, MLP and prediction head, an untied head, linear rope scaling). Here: the config guard refuses
by name what the spec does not model, the compiler refuses a misplaced `enabled` / a head transform of the wrong
width, and (slow) sensitivity arms: perturbing the prediction head moves transformers' tokens with the engine
following; a spec that puts the attention norm on layer 0 too is refused at load (the parameter has no tensor), and
one that normalizes layer 0 with a unit LayerNorm instead of the identity diverges from transformers at layer 0."""
from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from fixtures.tiny_hf import tiny_config

ARCH = "ModernBertDecoderForCausalLM"
SPEC = Path(__file__).resolve().parent.parent / "specs" / "modernbert_decoder.yaml"


def _hf(overrides: dict | None = None) -> dict:
    return copy.deepcopy(tiny_config(ARCH, overrides).to_dict())


def _config(hf: dict):
    import importlib
    return importlib.import_module("xllm_gen.generated.modernbert_decoder.model").Config.from_hf(hf)


def _refusal(hf: dict) -> str:
    from xllm_gen.runtime.loading.hf_config import ConfigError
    with pytest.raises(ConfigError) as e:
        _config(hf)
    return str(e.value)


def test_guard_reads_the_window_and_refuses_what_it_does_not_model():
    """The window: config.json's sliding_window where present (transformers sets the saved field over its derived
    one), else local_attention // 2, an explicit null (which transformers cannot run) refused; a head_dim other than hidden / heads (transformers'
    attention ignores it, its rotary reads it), an unknown layer type and an unmodeled rope type are refused by
    name; older Hub configs' global / local rope thetas and the layer period are read."""
    hf = _hf()
    assert _config(hf).sliding_window == 6
    hf["sliding_window"] = 9
    assert _config(hf).sliding_window == 9
    del hf["sliding_window"]
    hf["local_attention"] = 40
    assert _config(hf).sliding_window == 20
    hf["sliding_window"] = None                 # transformers' cache cannot run a null window
    assert "sliding_window" in _refusal(hf)
    hf = _hf()
    hf["head_dim"] = 32
    assert "head_dim" in _refusal(hf)
    hf["head_dim"] = 16                       # hidden 64 / 4 heads: accepted
    assert _config(hf).head_dim == 16
    hf = _hf()
    hf["layer_types"] = ["full_attention", "chunked_attention", "sliding_attention"]
    assert "layer_types" in _refusal(hf)
    hf = _hf()
    hf["rope_parameters"]["full_attention"] = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 160000.0}
    assert "yarn" in _refusal(hf)
    hub = _hf()
    for k in ("rope_parameters", "layer_types", "sliding_window"):
        del hub[k]
    hub.update(global_rope_theta=80000.0, local_rope_theta=5000.0, global_attn_every_n_layers=2)
    cfg = _config(hub)
    assert (cfg.rope_theta, cfg.rope_local_theta) == (80000.0, 5000.0)
    assert cfg.layer_types == ("full_attention", "sliding_attention", "full_attention")
    assert cfg.sliding_window == 6


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


def test_compiler_refuses_misplaced_norm_flags_and_head_widths(tmp_path):
    """`enabled` belongs to a layer's norm (the final norm has decoder.norm_enabled); a literal false is a deleted
    norm; a per-layer value must be a bool on every layer; the head transform reads the residual width and feeds the
    LM head's."""
    final = "  norm: {kind: layernorm, dim: hidden_size, eps: norm_eps, bias: norm_bias}\n"
    msg = _compile_error(tmp_path, final, final.replace("bias: norm_bias}", "bias: norm_bias, enabled: \"layer != 0\"}"))
    assert "decoder.norm.enabled" in msg and "norm_enabled" in msg, msg
    msg = _compile_error(tmp_path, 'enabled: "layer != 0"', "enabled: false")
    assert "attn_norm.enabled: false" in msg, msg
    msg = _compile_error(tmp_path, 'enabled: "layer != 0"', 'enabled: "layer + 0"')
    assert "attn_norm.enabled of layer 0 is 0; expected a bool" in msg, msg
    msg = _compile_error(tmp_path, "    in: hidden_size\n    out: hidden_size\n", "    in: intermediate_size\n    out: hidden_size\n")
    assert "decoder.head_transform.in" in msg, msg
    msg = _compile_error(tmp_path, "    activation: classifier_activation\n", "    activation: prelu\n")
    assert "decoder.head_transform.activation" in msg, msg


def test_generated_layer_builds_the_identity_where_the_norm_is_off():
    """Layer 0 has no attention norm (no parameters, the identity with the residual protocol); the others have a
    LayerNorm; the head transform is dense -> act -> norm."""
    import importlib

    from xllm_gen.runtime import layers as L
    mod = importlib.import_module("xllm_gen.generated.modernbert_decoder.model")
    cfg = _config(_hf({"norm_bias": True}))
    layer0, layer1 = mod.ModernBertDecoderDecoderLayer(cfg, 0), mod.ModernBertDecoderDecoderLayer(cfg, 1)
    assert isinstance(layer0.attn_norm, L.IdentityNorm) and not list(layer0.attn_norm.parameters())
    assert isinstance(layer1.attn_norm, L.LayerNorm) and layer1.attn_norm.bias is not None
    x, r = torch.randn(3, 64), torch.randn(3, 64)
    h, res = layer0.attn_norm(x, r)
    assert torch.equal(h, x + r) and torch.equal(res, x + r)
    h, res = layer0.attn_norm(x, None)
    assert h is x and res is x
    model = mod.ModernBertDecoderModel(cfg)
    assert isinstance(model.head_transform, L.HeadTransform) and model.head_transform.norm.bias is not None


@pytest.mark.slow
def test_prediction_head_matters(tiny_checkpoint, tmp_path):
    """Perturbing the prediction head's dense and norm weights moves transformers' tokens; the engine follows."""
    from test_norm_dataflow import _arm, _edit_tensors
    base = tiny_checkpoint(ARCH)
    g = torch.Generator().manual_seed(7)

    def edit(name, t):
        if re.fullmatch(r"lm_head\.(dense|norm)\.weight", name):
            return t * (0.2 + 2.0 * torch.rand(t.shape, generator=g))
        return None
    _arm(base, _edit_tensors(base, tmp_path / "head", edit), "perturbing the prediction head (lm_head.dense / norm)")


@pytest.mark.slow
def test_first_layer_norm_is_absent(tiny_checkpoint, tmp_path):
    """The per-layer `enabled` decides where the norm exists: a spec with the attention norm on every layer is refused
    at load (layer 0's parameter has no tensor); given a unit LayerNorm tensor for layer 0, that spec diverges from
    transformers at layer 0 (a LayerNorm is not the identity), while the shipped spec agrees on the same checkpoint."""
    from safetensors.torch import load_file, save_file

    from xllm_gen.codegen.verify import verify
    base = tiny_checkpoint(ARCH)
    everywhere = tmp_path / "everywhere.yaml"
    everywhere.write_text(SPEC.read_text().replace(', enabled: "layer != 0"}', "}", 1))
    r = verify(everywhere, base, max_tokens=2, prompt_lens=[5])
    assert r.refused and "model.layers.0.attn_norm" in r.refused, r.refused
    unit = tmp_path / "unit_ln"
    unit.mkdir()
    for f in base.iterdir():
        if f.suffix == ".safetensors":
            t = load_file(str(f))
            t["model.layers.0.attn_norm.weight"] = torch.ones(64)
            save_file(t, str(unit / f.name), metadata={"format": "pt"})
        elif f.is_file():
            (unit / f.name).write_bytes(f.read_bytes())
    r = verify(everywhere, unit, max_tokens=4, prompt_lens=[5, 9])
    assert not r.refused and not r.ok, "a unit LayerNorm on layer 0 matches transformers' identity: the arm tests nothing"
    r = verify(SPEC, base, max_tokens=4, prompt_lens=[5, 9])
    assert r.ok, r
