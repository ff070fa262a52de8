"""Ergo (specs/ergo.yaml) and its primitives: the `residual_gate` block kind (a learned per-channel gate on a step's
residual add, `x = residual(w) * x + branch(w) * h`, formulas over `w`: codegen/gate_expr.py), the MoE's
`expert_out_norm` (an RMSNorm of each routed expert's output with that expert's own weight) and
`shared_expert.out_norm`. Each against transformers' own module; sensitivity arms on the tiny checkpoint (conformance
builds it with a NoPE full layer scaled by global_attention_scale, a dense first layer and 8 experts): the gates zeroed
and the expert norms set to ones each change transformers' tokens, and the engine agrees; refusals located."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from xllm_gen.codegen import cli, gate_expr

ROOT = Path(__file__).resolve().parents[1]
ARCH = "ErgoForCausalLM"
BRANCH, RESIDUAL = "sigmoid(w)", "sqrt(1 + sigmoid(w)) * exp(-softplus(w) / 2)"


def _formula(src):
    tree = gate_expr.parse(src)
    return eval(f"lambda w: {gate_expr.render(tree)}", {"torch": torch})   # noqa: S307 - the rendered test formula


def test_residual_gate_equals_transformers():
    from transformers.models.ergo.configuration_ergo import ErgoConfig
    from transformers.models.ergo.modeling_ergo import ErgoResidualGate

    from xllm_gen.runtime.layers import ResidualGate

    ref = ErgoResidualGate(ErgoConfig(hidden_size=16))
    ours = ResidualGate(16, branch=_formula(BRANCH), residual=_formula(RESIDUAL))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, generator=g) * 2
    ref.weight.data.copy_(w)
    ours.weight.data.copy_(w)
    h, x = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    gh, gx = ours(h, x)
    torch.testing.assert_close(gh + gx, ref(h, x), rtol=1e-6, atol=1e-6)
    # Doge's learned residual gain, x = w * x + h: the branch left at 1
    gain = ResidualGate(16, residual=_formula("w"))
    gain.weight.data.copy_(w)
    gh, gx = gain(h, x)
    torch.testing.assert_close(gh + gx, w * x + h)


@pytest.mark.parametrize("src, msg", [("softpus(w)", "only the calls"), ("x * w", "unknown name 'x'"),
                                      ("log(-1 - w * w)", "not a finite number"), ("w if w else 1", "IfExp"),
                                      (True, "not True")])
def test_gate_formula_refusals(src, msg):
    with pytest.raises(gate_expr.GateExprError, match=msg):
        gate_expr.check_finite(gate_expr.parse(src))


def test_expert_norm_equals_transformers():
    from transformers.models.ergo.configuration_ergo import ErgoConfig
    from transformers.models.ergo.modeling_ergo import ErgoExpertNorm

    from xllm_gen.runtime.layers.expert_norm import ExpertNorm

    ref = ErgoExpertNorm(ErgoConfig(hidden_size=8, num_experts=4, rms_norm_eps=1e-6))
    ours = ExpertNorm(4, 8, 1e-6)
    g = torch.Generator().manual_seed(1)
    w = torch.rand(4, 8, generator=g) + 0.5
    ref.weight.data.copy_(w)
    ours.weight.data.copy_(w)
    y, ids = torch.randn(6, 8, generator=g), torch.tensor([0, 3, 1, 1, 2, 0])
    torch.testing.assert_close(ours(y, ids), ref(y, ids))


def _spec_variant(tmp_path, capsys, old, new):
    text = (ROOT / "specs" / "ergo.yaml").read_text()
    assert old in text, old
    spec = tmp_path / "ergo_v.yaml"
    spec.write_text(text.replace("extends: llama.yaml", f"extends: {ROOT / 'specs' / 'llama.yaml'}")
                    .replace(old, new))
    code = cli.main(["--dry-run", str(spec)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("old, new, msg", [
    ("parallel: expert", "parallel: tensor", "expert_out_norm: each expert's output is normalized whole"),
    ('branch: "sigmoid(w)"', 'branch: "sigmoid(v)"', "attention_residual_gate.branch: unknown name 'v'"),
    ('branch: "sigmoid(w)",\n         residual: "sqrt(1 + sigmoid(w)) * exp(-softplus(w) / 2)"',
     "branch: 1, residual: 1.0", "both formulas are 1"),
    ("gate: attention_residual_gate}", "gate: post_attention_layernorm}", "expected residual_gate"),
])
def test_spec_refusals_are_located(tmp_path, capsys, old, new, msg):
    code, err = _spec_variant(tmp_path, capsys, old, new)
    assert code == 2 and "ergo_v.yaml:" in err and msg in err, err


def test_cuda_refuses_the_full_layers_own_scale(tiny_checkpoint):
    """global_attention_scale gives the full layers their own softmax scale: one FlashInfer plan per step cannot run
    it, so the CUDA path refuses at load (decided on the CPU, before any kernel)."""
    import json
    import types

    from xllm_gen.generated.ergo.model import ErgoConfig, ErgoForCausalLM
    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.executor.model_runner import ModelRunner

    cfg = ErgoConfig.from_hf(json.loads((tiny_checkpoint(ARCH) / "config.json").read_text()))
    with torch.device("meta"):
        model = ErgoForCausalLM(cfg)
    attn = [m for m in model.modules() if isinstance(m, L.Attention)]
    assert len({a.scale for a in attn}) == 2
    runner = types.SimpleNamespace(device=torch.device("cuda"), debug={}, attn_layers=attn)
    with pytest.raises(NotImplementedError, match="attention scale differs between layers"):
        ModelRunner._make_backend(runner)


def _edited(src, dst, suffix, fn):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    hit = [k for k in tensors if k.endswith(suffix)]
    assert hit, f"the tiny Ergo checkpoint has no {suffix}"
    for k in hit:
        tensors[k] = fn(tensors[k])
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _arm(tiny_checkpoint, tmp_path, name, suffixes, fn, seed):
    from test_scalings import _agree, _engine, _hf

    ckpt = tiny_checkpoint(ARCH)
    prompt = np.random.default_rng(seed).integers(0, 400, 12).tolist()
    base = _hf(ckpt, prompt)
    arm = ckpt
    for i, suffix in enumerate(suffixes):
        arm = _edited(arm, tmp_path / f"{name}{i}", suffix, fn)
    want = _hf(arm, prompt)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), f"{name} changes nothing"
    _agree(_engine(arm, prompt), want, name)


@pytest.mark.engine
def test_residual_gates_matter(tiny_checkpoint, tmp_path):
    """The gates zeroed (transformers' init: branch 1/2, residual sqrt(3/4)) instead of U(0.5, 1.5)."""
    _arm(tiny_checkpoint, tmp_path, "gates zeroed", ["post_attention_residual.scale", "post_ffn_residual.scale"],
         torch.zeros_like, 3)


@pytest.mark.engine
def test_expert_output_norms_matter(tiny_checkpoint, tmp_path):
    """Every expert's (and the shared expert's) output norm weight set to ones: the per-expert weights matter."""
    _arm(tiny_checkpoint, tmp_path, "expert norms ones", ["expert_output_norm.scale",
                                                          "shared_expert_output_norm.scale"], torch.ones_like, 4)
