"""Blocks several layers reuse (`layers.shared`), side branches (`branch`, `add`), per-use LoRA adapters (`lora`) and
per-layer checkpoint names (`{<expression>}` in `weights`), as Zamba2 (specs/zamba2.yaml) uses them.

The tiny checkpoint (tests/fixtures/tiny_hf.py ARCH_DEFAULTS): six layers, hybrid layers 1, 3, 4 taking turns at two
shared blocks (num_mem_blocks 2: blocks 0, 1, 0), q/k/v and gate/up adapters of rank 8 per use, tied embeddings (so
transformers ties the shared blocks: their tensors are stored once, under layers 1 and 3).

- the engine's modules: one block per turn (layer 4's shared parameters ARE layer 1's objects), adapters per layer,
  a KV cache per hybrid layer (three attention layers, each its own cache) and a state per layer (six Mamba-2 mixers);
- greedy parity with transformers on the tied checkpoint (sharing exercised; the conformance battery's features-ON
  checkpoint is untied: every hybrid layer its own block), rotary on;
- the guard: use_long_context, unknown layer types, rope types, adapters with fewer KV heads are refused by name;
- sensitivity (slow): zeroing one use's q adapter changes transformers' tokens and the engine follows; a spec that
  gives layer 4 the wrong turn's block loads and differs from transformers (the turn expression is load-bearing).
Greedy parity at TP 2 is the spec battery's slow arm; the features-ON (untied) parity is the conformance battery's.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "specs" / "zamba2.yaml"
ARCH = "Zamba2ForCausalLM"
PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [7, 300, 12, 64, 9, 123, 77, 2, 31, 400, 18, 55, 6]]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint(ARCH, overrides={"use_mem_rope": True})


def _engine_tokens(path, n: int = 8) -> list[list[int]]:
    from xllm_gen import LLM, SamplingParams
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in out]


def _hf_tokens(path, n: int = 8) -> list[list[int]]:
    from hf_ref import hf_greedy
    return hf_greedy(path, PROMPTS, n)


def test_shared_blocks_caches_and_adapters(ckpt):
    from xllm_gen import LLM
    from xllm_gen.runtime import layers as L
    with LLM(str(ckpt), device="cpu", dtype="float32") as llm:
        runner = llm.engine.runner
        layers = runner.model.model.layers
        hybrid = [1, 3, 4]
        assert [i for i, layer in enumerate(layers) if layer.shared_attn is not None] == hybrid
        # layer 4 (third use, turn 0) holds layer 1's block; layer 3 (turn 1) its own
        for name in ("shared_norm", "shared_ff_norm"):
            assert getattr(layers[4], name).weight is getattr(layers[1], name).weight
            assert getattr(layers[3], name).weight is not getattr(layers[1], name).weight
        a1, a3, a4 = (layers[i].shared_attn for i in hybrid)
        assert a4.qkv_proj.weight is a1.qkv_proj.weight and a4.o_proj.weight is a1.o_proj.weight
        assert a3.qkv_proj.weight is not a1.qkv_proj.weight
        assert layers[4].shared_mlp.gate_up_proj.weight is layers[1].shared_mlp.gate_up_proj.weight
        # adapters per use, never shared
        assert a4.adapters["q"].down.weight is not a1.adapters["q"].down.weight
        assert layers[4].shared_mlp.adapter.up.weight is not layers[1].shared_mlp.adapter.up.weight
        assert not torch.equal(a4.adapters["q"].up.weight, a1.adapters["q"].up.weight)
        # a KV cache per use of a shared attention, a state per Mamba-2 mixer
        assert runner.attn_layers == [a1.attn, a3.attn, a4.attn]
        assert len({id(a.k_cache) for a in runner.attn_layers}) == 3
        assert runner.state_layers == [layer.mamba for layer in layers]
        assert all(isinstance(layer.mamba, L.RecurrentMixer) for layer in layers)
        # the plan loads a shared parameter once, under the layer that holds it
        names = {n for n, _ in runner.model.named_parameters()}
        assert "model.layers.1.shared_attn.qkv_proj.weight" in names
        assert "model.layers.4.shared_attn.qkv_proj.weight" not in names
        assert "model.layers.4.shared_attn.adapters.q.down.weight" in names


@pytest.mark.engine
def test_tied_checkpoint_matches_transformers(ckpt):
    """The shared blocks tied as transformers ties them (tie_word_embeddings): greedy tokens agree in float32."""
    assert _engine_tokens(ckpt) == _hf_tokens(ckpt)


@pytest.mark.parametrize("edit, field", [
    ({"use_long_context": True}, "use_long_context"),
    ({"layers_block_type": ["linear_attention", "hybrid", "attention", "hybrid", "hybrid", "linear_attention"]},
     "layer_types"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope_type"),
])
def test_guard_refuses_by_name(ckpt, edit, field):
    from generated.zamba2 import model as M
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    cfg.update(edit)
    with pytest.raises(Exception, match=field):
        M.Config.from_hf(cfg)


def test_mamba_only_layers_keep_their_names(ckpt):
    """The `{<expression>}` weight names: a hybrid layer's Mamba tensors sit under `mamba_decoder.`, the others not;
    the adapters of layer 4 (third use, turn 0) are entry 2 of layer 1's adapter lists."""
    from generated.zamba2 import model as M
    cfg = M.Config.from_hf(json.loads((Path(ckpt) / "config.json").read_text()))
    assert cfg.shared_block_layer == (0, 1, 2, 3, 1, 5) and cfg.hybrid_use[4] == 2
    with torch.device("meta"):
        model = M.Model(cfg)
    rules = {r.param: r.sources for r in M.weight_plan(model)}
    assert rules["model.layers.0.mamba.in_proj.weight"] == ("model.layers.0.mamba.in_proj.weight",)
    assert rules["model.layers.3.mamba.in_proj.weight"] == ("model.layers.3.mamba_decoder.mamba.in_proj.weight",)
    assert rules["model.layers.4.shared_attn.adapters.q.up.weight"] == (
        "model.layers.1.shared_transformer.self_attn.linear_q_adapter_list.2.1.weight",)


@pytest.mark.slow
@pytest.mark.engine
def test_zeroed_adapter_changes_tokens(ckpt, tmp_path):
    """Zeroing the third use's q adapter (layer 4) changes transformers' tokens; the engine follows."""
    from safetensors.torch import load_file, save_file
    out = tmp_path / "zeroed"
    shutil.copytree(ckpt, out)
    tensors = load_file(str(out / "model.safetensors"))
    name = "model.layers.1.shared_transformer.self_attn.linear_q_adapter_list.2.1.weight"
    tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    want = _hf_tokens(out)
    assert want != _hf_tokens(ckpt)
    assert _engine_tokens(out) == want


@pytest.mark.slow
def test_wrong_turn_differs(ckpt, tmp_path):
    """A spec that gives layer 4 block 1 (layer 3's) instead of block 0 loads, and verify finds it differs."""
    from codegen.verify import verify
    text = SPEC.read_text()
    old = 'shared_attn: "shared_block_layer[layer]"'
    assert old in text
    path = tmp_path / "zamba2_mutant.yaml"
    path.write_text(text.replace(old, 'shared_attn: "min(hybrid_use[layer], 1) if layer_types[layer] == \'hybrid\' '
                                      'else layer"'))
    shutil.copy(ROOT / "specs" / "spec.schema.json", tmp_path / "spec.schema.json")
    report = verify(path, ckpt, max_tokens=4, prompt_lens=(9,))
    assert not report.ok and not report.refused, report.text()
