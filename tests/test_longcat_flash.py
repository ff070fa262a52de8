"""LongCat-Flash (specs/longcat_flash.yaml) and the primitives it added: a moe's `identity_experts`, the
`mla_attention` block's `q_scale` / `latent_scale`, a step's `join` of a branch value, and a norm shared by a branch
op and a step. The spec battery and the conformance battery check greedy parity at TP 1 and 2 on the tiny
checkpoint; here each feature gets an arm that changes transformers' output (so the parity can fail), the engine
following it where the arm is a checkpoint, and the guard's refusals by name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_scalings import _agree, _engine, _hf

from xllm_gen.codegen import cli

ARCH = "LongcatFlashForCausalLM"
ROOT = Path(__file__).resolve().parents[1]
PROMPT = np.random.default_rng(5).integers(0, 400, 11).tolist()


def _edit_tensors(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` at `dst` whose tensors are `edit(name, tensor)` (None: unchanged)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for name, t in list(tensors.items()):
        new = edit(name, t.clone())
        if new is not None:
            tensors[name] = new.contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _bias_arm(bonus_identity: float, zero_experts: bool = False):
    """The selection bias pushes the identity experts in (+) or out (-); `zero_experts` zeroes the routed experts'
    down projections (with the identity experts out, the shortcut MoE's output is zero)."""
    def edit(name, t):
        if name.endswith("router.e_score_correction_bias"):
            t[-2:] = bonus_identity          # the tiny checkpoint's 2 identity experts are the last choices
            return t
        if zero_experts and ".mlp.experts." in name and name.endswith("down_proj.weight"):
            return t.zero_()
        return None
    return edit


@pytest.mark.engine
@pytest.mark.parametrize("arm,edit", [("identity experts chosen", _bias_arm(5.0)),
                                      ("identity experts excluded", _bias_arm(-5.0)),
                                      ("shortcut MoE off", _bias_arm(-5.0, zero_experts=True))])
def test_longcat_routing_arms(arm, edit, tiny_checkpoint, tmp_path):
    ckpt = Path(tiny_checkpoint(ARCH))
    assert json.loads((ckpt / "config.json").read_text())["zero_expert_num"] == 2
    base = _hf(ckpt, PROMPT)
    _agree(_engine(ckpt, PROMPT), base, "as built")
    changed = _edit_tensors(ckpt, tmp_path / "arm", edit)
    want = _hf(changed, PROMPT)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), \
        f"{arm}: changes nothing in transformers' output on the tiny checkpoint: no arm"
    _agree(_engine(changed, PROMPT), want, arm)


@pytest.mark.engine
@pytest.mark.parametrize("attr", ["mla_scale_q_lora", "mla_scale_kv_lora"])
def test_longcat_latent_scales_matter(attr, tiny_checkpoint, monkeypatch):
    """transformers with the scale set to 1 decodes otherwise: the engine's q_scale / latent_scale are what makes it
    agree (its parity with the unpatched model is the battery's)."""
    from hf_ref import hf_model

    ckpt = Path(tiny_checkpoint(ARCH))
    base = _hf(ckpt, PROMPT)
    model = hf_model(ckpt)
    attns = [a for layer in model.model.layers for a in layer.self_attn]
    for a in attns:
        assert getattr(a, attr) != 1.0
        monkeypatch.setattr(a, attr, 1.0)
    try:
        want = _hf(ckpt, PROMPT)
    finally:
        monkeypatch.undo()
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), f"{attr} = 1 changes nothing"


def _config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


@pytest.mark.parametrize("field,value,named", [
    ("head_dim", 16, "rotary_dims_match"),             # transformers' rotary would turn head_dim dims
    ("qk_head_dim", 32, "query_dims_match"),
    ("num_key_value_heads", 2, "kv_heads_equal_heads"),
    ("zero_expert_type", "zero", "zero_expert_type"),
    ("router_bias", True, "router_bias"),
    ("zero_expert_num", 0, "zero_expert_num"),          # transformers: no identity experts, not modelled
    ("zero_expert_num", None, "zero_expert_num"),
])
def test_longcat_guard_refuses_by_name(field, value, named, tiny_checkpoint):
    from xllm_gen.generated.longcat_flash.model import LongcatFlashConfig

    cfg = _config(Path(tiny_checkpoint(ARCH)))
    LongcatFlashConfig.from_hf(cfg)                     # as built: accepted
    cfg[field] = value
    with pytest.raises(ValueError, match=named):
        LongcatFlashConfig.from_hf(cfg)


JOIN_SPEC = """\
extends: {base}
name: join_llama
class_prefix: JoinLlama
architectures: [JoinLlamaForCausalLM]
decoder:
  layers:
    blocks:
      side: {{kind: mlp, hidden: hidden_size, intermediate: intermediate_size, activation: hidden_act,
             up: {{name: up_proj}}, down: {{name: down_proj}}}}
    dataflow:
{dataflow}
variants: {{Llama-3.2-1B: ~, Llama-3.1-8B: ~}}
"""
SIDE = "[{norm: post_attention_layernorm, block: side}]"


def _compile(tmp_path, capsys, dataflow):
    spec = tmp_path / "join.yaml"
    spec.write_text(JOIN_SPEC.format(base=str(ROOT / "specs" / "llama.yaml"), dataflow=dataflow))
    code = cli.main(["--dry-run", str(spec)])
    return code, capsys.readouterr().err


def test_join_with_a_norm_shared_by_a_branch_compiles(tmp_path, capsys):
    code, err = _compile(tmp_path, capsys, f"""\
      - {{norm: input_layernorm, block: self_attn}}
      - branch: {{name: side_out, input: [residual], steps: {SIDE}}}
      - {{norm: post_attention_layernorm, block: mlp, join: side_out}}""")
    assert code == 0, err


@pytest.mark.parametrize("dataflow,message", [
    (f"""\
      - {{norm: input_layernorm, block: self_attn, join: nowhere}}
      - branch: {{name: side_out, input: [residual], steps: {SIDE}}}
      - {{norm: post_attention_layernorm, block: mlp}}""", "no branch value 'nowhere'"),
    (f"""\
      - {{norm: input_layernorm, block: self_attn}}
      - branch: {{name: side_out, input: [residual], steps: {SIDE}}}
      - {{norm: input_layernorm, block: mlp, join: side_out}}""", "block 'input_layernorm' is already used"),
    (f"""\
      - {{norm: input_layernorm, block: self_attn}}
      - branch: {{name: side_out, input: [residual], steps: {SIDE}}}
      - branch: {{name: again, input: [residual], steps: [{{norm: post_attention_layernorm, block: mlp}}]}}""",
     "block 'post_attention_layernorm' is already used"),
])
def test_join_errors_are_located(dataflow, message, tmp_path, capsys):
    code, err = _compile(tmp_path, capsys, dataflow)
    assert code == 2 and "join.yaml:" in err and message in err, err
