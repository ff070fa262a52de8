"""Primitives the dense families written from the docs needed (Persimmon, StableLM 2 12B, EXAONE 4, Cohere 2,
Ministral, VaultGemma):

- a row layout on a fused tensor stored under the parameter's own name (Persimmon's `query_key_value`) is applied
  (it was silently dropped: the weights loaded blocked and the model was wrong);
- `{h}` in a `weights` source stacks one tensor per row (head) into the parameter's first dim (StableLM's per-head
  q/k LayerNorms `norms.{h}.weight`), with located errors where it does not fit;
- an `optional` symbol with a `default` reads an absent field as the default and an explicit null as None (what
  transformers does: a null in config.json overrides the class default), e.g. EXAONE 4's `sliding_window`.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from xllm_gen.codegen import cli
from xllm_gen.runtime.executor.sharding import WeightLoadError
from xllm_gen.runtime.loading.layout import RowLayout
from xllm_gen.runtime.loading.plan import plan_from_parameters
from xllm_gen.runtime.loading.weights import StackedRows

ROOT = Path(__file__).resolve().parents[1]


def test_layout_of_a_tensor_under_its_own_name_is_applied():
    m = nn.Module()
    m.attn = nn.Linear(4, 12)
    plan = {r.param: r for r in plan_from_parameters(m, {}, {"attn.weight": RowLayout("head", ("q", "k", "v"))})}
    assert plan["attn.weight"].layout == RowLayout("head", ("q", "k", "v"))
    assert plan["attn.weight"].sources == ("attn.weight",)
    assert plan["attn.bias"].layout is None


def test_stacked_rows_reads_only_the_rows_asked_for():
    parts = [torch.full((3,), float(h)) for h in range(4)]
    st = StackedRows(parts)
    assert st.get_shape() == [4, 3] and st.get_dtype() == torch.float32
    assert torch.equal(st[1:3], torch.stack(parts[1:3]))
    assert torch.equal(st[:, 0:2], torch.stack(parts)[:, 0:2])
    with pytest.raises(WeightLoadError, match="row 2 has shape"):
        StackedRows([torch.zeros(3), torch.zeros(3), torch.zeros(4)])


STACKED_SPEC = """
extends: {base}
name: stacked_llama
class_prefix: StackedLlama
architectures: [StackedLlamaForCausalLM]
decoder:
  layers:
    blocks:
      self_attn:
        qk_norm: {{kind: layernorm, eps: rms_norm_eps, q: q_norm, k: k_norm, weights: per_head}}
weights:
  {param}:
    from: {source}
variants: {{Llama-3.2-1B: ~, Llama-3.1-8B: ~}}
"""


def _compile(tmp_path, capsys, param, source):
    spec = tmp_path / "stacked.yaml"
    spec.write_text(STACKED_SPEC.format(base=str(ROOT / "specs" / "llama.yaml"), param=param, source=source))
    code = cli.main(["--dry-run", str(spec)])
    return code, capsys.readouterr().err


def test_h_placeholder_compiles_for_a_per_head_parameter(tmp_path, capsys):
    code, err = _compile(tmp_path, capsys, "model.layers.{i}.self_attn.q_norm.weight",
                         "model.layers.{i}.self_attn.q_norm.norms.{h}.weight")
    assert code == 0, err


def test_h_placeholder_on_a_vector_is_a_located_error(tmp_path, capsys):
    code, err = _compile(tmp_path, capsys, "model.layers.{i}.input_layernorm.weight",
                         "model.layers.{i}.input_layernorm.norms.{h}.weight")
    assert code == 2 and "stacked.yaml:" in err and "{h}" in err, err


def test_stacked_checkpoint_without_row_0_is_refused_by_name(tmp_path):
    from safetensors.torch import save_file

    from xllm_gen.runtime.loading.loader import CheckpointError, load_weights
    from xllm_gen.runtime.loading.weights import WeightRule
    m = nn.Module()
    m.norm = nn.Module()
    m.norm.weight = nn.Parameter(torch.zeros(2, 3))
    save_file({"n.norms.1.weight": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'n.norms.0.weight'"):
        load_weights(m, [WeightRule("norm.weight", ("n.norms.{h}.weight",))], tmp_path)
    save_file({f"n.norms.{h}.weight": torch.full((3,), float(h)) for h in range(2)},
              str(tmp_path / "model.safetensors"))
    load_weights(m, [WeightRule("norm.weight", ("n.norms.{h}.weight",))], tmp_path)
    assert torch.equal(m.norm.weight.data, torch.tensor([[0.0] * 3, [1.0] * 3]))


def test_optional_symbol_with_default_reads_null_as_none():
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.generated.exaone4.model import Config
    cfg = json.loads(tiny_config("Exaone4ForCausalLM").to_json_string(use_diff=True))
    assert Config.from_hf(cfg).sliding_window == cfg["sliding_window"]
    absent = {k: v for k, v in cfg.items() if k != "sliding_window"}
    assert Config.from_hf(absent).sliding_window == 4096          # transformers' Exaone4Config default
    assert Config.from_hf({**cfg, "sliding_window": None}).sliding_window is None


def test_xielu_equals_transformers_with_learned_parameters():
    from transformers.activations import ACT2CLS

    from xllm_gen.runtime.layers.activation import act
    ref = ACT2CLS["xielu"](dtype=torch.float32)
    mine = act("xielu")
    with torch.no_grad():
        for name, value in (("alpha_p", [0.3]), ("alpha_n", [-0.7])):
            getattr(ref, name).copy_(torch.tensor(value))
        mine.load_state_dict({"alpha_p": ref.alpha_p.detach(), "alpha_n": ref.alpha_n.detach(), "beta": ref.beta,
                              "eps": ref.eps})
    x = torch.linspace(-6, 6, 101)
    torch.testing.assert_close(mine(x), ref(x), rtol=0, atol=0)
    assert {n for n, _ in mine.named_parameters()} == {"alpha_p", "alpha_n", "beta", "eps"}


def test_learned_activation_must_be_admitted_alone(tmp_path, capsys):
    spec = tmp_path / "two_acts.yaml"
    spec.write_text((ROOT / "specs" / "apertus.yaml").read_text().replace(
        "extends: llama.yaml", f"extends: {ROOT / 'specs' / 'llama.yaml'}").replace(
        "values: [xielu]", "values: [xielu, relu2]"))
    assert cli.main(["--dry-run", str(spec)]) == 2
    assert "has learned parameters" in capsys.readouterr().err


def test_ntk_alpha_rope_served_where_the_spec_reads_alpha(tmp_path):
    """Hunyuan's released rope (`dynamic` with an `alpha` key: theta * alpha ** (d / (d - 2)), static) through a
    rope-mapping key that a symbol of the spec reads and a theta expression with a division exponent; transformers'
    tokens depend on alpha, and the engine agrees. A spec that does not read the key still refuses it by name."""
    from fixtures.tiny_hf import make_tiny_checkpoint

    from xllm_gen.codegen.verify import verify
    from xllm_gen.generated.llama.model import Config as LlamaConfig
    from xllm_gen.runtime.loading.hf_config import ConfigError
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0}
    ckpt = make_tiny_checkpoint("HunYuanDenseV1ForCausalLM", tmp_path / "hy", overrides={"rope_parameters": rope})
    report = verify(ROOT / "specs" / "hunyuan_v1_dense.yaml", ckpt, max_tokens=8, prompt_lens=(9, 30))
    assert report.ok, report.text()
    llama = json.loads(json.dumps({"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
                                   "num_hidden_layers": 1, "num_attention_heads": 4, "rope_parameters": rope}))
    with pytest.raises(ConfigError, match=r"rope_parameters.alpha=1000.0"):
        LlamaConfig.from_hf(llama)
