"""AFMoE (specs/afmoe.yaml) and the attention output gate (`attention.out_gate`): `o_proj(attn * act(gate(x)))`.
Arms on the tiny checkpoint (conformance builds it with the gate, a NoPE global layer, a dense first layer and the
sigmoid-routed experts): the gate's weights negated (a different gate) and muP's embedding scale each change
transformers' tokens, and the engine must agree; the op against its formula, per element and per head."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

ARCH = "AfmoeForCausalLM"


def test_gate_output_per_element_and_per_head():
    from xllm_gen.runtime.layers.attention import gate_output

    g = torch.Generator().manual_seed(0)
    out = torch.randn(5, 3 * 4, generator=g)
    per_el = torch.randn(5, 12, generator=g)
    torch.testing.assert_close(gate_output(out, per_el, "sigmoid", 4), out * torch.sigmoid(per_el))
    per_head = torch.randn(5, 3, generator=g)
    want = (out.view(5, 3, 4) * torch.nn.functional.softplus(per_head)[..., None]).view(5, 12)
    torch.testing.assert_close(gate_output(out, per_head, "softplus", 4), want)
    with pytest.raises(ValueError, match="activation"):
        gate_output(out, per_el, "tanh", 4)


def _negated_gate(src, dst):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    hit = [k for k in tensors if k.endswith("self_attn.gate_proj.weight")]
    assert hit, "the tiny AFMoE checkpoint has no attention gate"
    for k in hit:
        tensors[k] = -tensors[k]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.engine
def test_output_gate_matters(tiny_checkpoint, tmp_path):
    from test_scalings import _agree, _engine, _hf

    ckpt = tiny_checkpoint(ARCH)
    prompt = np.random.default_rng(3).integers(0, 400, 12).tolist()
    base = _hf(ckpt, prompt)
    arm = _negated_gate(ckpt, tmp_path / "gate")
    want = _hf(arm, prompt)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), "the gate changes nothing"
    _agree(_engine(arm, prompt), want, "negated attention gate")


@pytest.mark.slow
@pytest.mark.engine
def test_mup_embedding_scale(tiny_checkpoint, tmp_path):
    from fixtures.tiny_hf import edit_config
    from test_scalings import _agree, _engine, _hf

    ckpt = tiny_checkpoint(ARCH)
    prompt = np.random.default_rng(4).integers(0, 400, 12).tolist()
    base = _hf(ckpt, prompt)
    arm = edit_config(ckpt, tmp_path / "mup", lambda c: c.__setitem__("mup_enabled", True))
    assert json.loads((arm / "config.json").read_text())["mup_enabled"] is True
    want = _hf(arm, prompt)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), "mup_enabled changes nothing"
    _agree(_engine(arm, prompt), want, "mup_enabled")
