"""Beam (specs/beam.yaml) and its primitives: depth-scaled residual adds (a step's `residual_scale` on the stream,
`x = residual_scale * x + scale * h`), the NoPE layers' position-power query scale (`query_scale: {form: power}`), the
output gate's per-head logit bias (`out_gate.head_bias`). Each against transformers' own function; a sensitivity arm
on the tiny checkpoint (conformance builds it with a NoPE full layer between sliding ones, a dense first layer and 8
experts in 4 groups): the gate biases moved change transformers' tokens and the engine agrees; the guard refuses a
layer kind the spec does not model, by name."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

ARCH = "BeamForCausalLM"


def test_power_query_scale_equals_transformers():
    from transformers.models.beam.modeling_beam import compute_attention_scaling

    from xllm_gen.runtime.layers import QueryScale

    pos = torch.tensor([0, 1, 7, 2047, 100_000, 1_000_000])
    want = compute_attention_scaling(pos[None]).reshape(-1)
    qs = QueryScale(0.1, 2048, 1, form="power")
    torch.testing.assert_close(qs.scale(pos), want)
    assert want[-1] > 1.4                       # it matters at long positions (1 at the first)
    q = torch.randn(6, 2, 4)
    torch.testing.assert_close(qs(pos, q), q * want.view(-1, 1, 1))
    with pytest.raises(ValueError, match="form"):
        QueryScale(0.1, 2048, 1, form="exp")


def test_gate_head_bias_equals_transformers():
    from xllm_gen.runtime.layers import gate_output

    g = torch.Generator().manual_seed(0)
    n, heads, d = 5, 3, 4
    out, gate, bias = (torch.randn(n, heads * d, generator=g), torch.randn(n, heads * d, generator=g),
                       torch.randn(heads, generator=g))
    want = (out.view(n, heads, d) * torch.sigmoid(gate.view(n, heads, d) + bias[None, :, None])).view(n, -1)
    torch.testing.assert_close(gate_output(out, gate, "sigmoid", d, head_bias=bias), want)


def _config(tiny_checkpoint, edit=None):
    from xllm_gen.generated.beam.model import BeamConfig

    hf = json.loads((tiny_checkpoint(ARCH) / "config.json").read_text())
    if edit:
        edit(hf)
    return BeamConfig.from_hf(hf)


def test_depth_scaled_adds_equal_transformers(tiny_checkpoint):
    """Each layer's two adds scale as transformers' depth_scaled_residual_add with i = 2 (layer + 1) and i + 1."""
    from xllm_gen.generated.beam.model import BeamDecoderLayer

    cfg = _config(tiny_checkpoint)
    for layer in range(cfg.num_hidden_layers):
        with torch.device("meta"):
            m = BeamDecoderLayer(cfg, layer)
        for i, (s, r) in ((2 * (layer + 1), (m.self_attn_scale, m.self_attn_residual_scale)),
                          (2 * (layer + 1) + 1, (m.mlp_scale, m.mlp_residual_scale))):
            assert s == pytest.approx(1 / i ** 0.5) and r == pytest.approx(((i - 1) / i) ** 0.5)


@pytest.mark.parametrize("field, value", [("mlp_layer_types", ["dense", "moe", "sparse"]),
                                          ("layer_types", ["sliding_attention", "chunked_attention", "full_attention"])])
def test_guard_refuses_unknown_layer_kinds(tiny_checkpoint, field, value):
    with pytest.raises(ValueError, match="layer_kinds_known"):
        _config(tiny_checkpoint, lambda c: c.__setitem__(field, value))


@pytest.mark.engine
def test_gate_bias_matters(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file
    from test_scalings import _agree, _engine, _hf

    ckpt = tiny_checkpoint(ARCH)
    prompt = np.random.default_rng(6).integers(0, 400, 12).tolist()
    base = _hf(ckpt, prompt)
    arm = tmp_path / "bias"
    shutil.copytree(ckpt, arm)
    tensors = load_file(str(arm / "model.safetensors"))
    hit = [k for k in tensors if k.endswith("self_attn.gate_bias")]
    assert hit, "the tiny Beam checkpoint has no gate_bias"
    for k in hit:
        tensors[k] = torch.linspace(-3.0, 3.0, tensors[k].numel())
    save_file(tensors, str(arm / "model.safetensors"), metadata={"format": "pt"})
    want = _hf(arm, prompt)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), "the gate bias changes nothing"
    _agree(_engine(arm, prompt), want, "gate bias")
