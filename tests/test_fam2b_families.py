"""Sensitivity arms of families served by YAML alone (specs/cwm.yaml, specs/hyperclovax.yaml): switching a
feature off changes transformers' output, and the engine serves the switched checkpoint alike (or refuses it
by name where the spec builds the feature in)."""
from __future__ import annotations

import copy

import pytest
import torch
from test_norm_dataflow import _arm, _edit_tensors, _engine, _hf


def test_cwm_layer_types_matter(tiny_checkpoint):
    """CWM's sliding layers (layer_types) against all-full layers: two outputs, each transformers'."""
    base = tiny_checkpoint("CwmForCausalLM")
    full = tiny_checkpoint("CwmForCausalLM", overrides={"layer_types": ["full_attention"] * 3})
    want = _hf(full)
    assert want != _hf(base), "fixture: the tiny sliding window does not change transformers' output"
    assert _engine(full) == want
    assert _engine(base) == _hf(base)


def test_hyperclovax_without_post_norm_is_served(tiny_checkpoint):
    """use_post_norm false (Granite's layer: transformers builds post_norm1 / post_norm2 as nn.Identity, no
    parameters) changes transformers' output; the spec's post norms are `enabled: use_post_norm`, served alike."""
    base = tiny_checkpoint("HyperCLOVAXForCausalLM")
    off = tiny_checkpoint("HyperCLOVAXForCausalLM", overrides={"use_post_norm": False})
    want = _hf(off)
    assert want != _hf(base)
    assert _engine(off) == want


def test_flex_olmo_top_k_matters(tiny_checkpoint):
    """FlexOlmo's top-k routing: one expert per token instead of the default changes transformers' output,
    served alike. (norm_topk_prob cannot be told apart here: the post-feedforward RMSNorm divides away a
    per-token scale of the mixture's output.)"""
    from fixtures.tiny_hf import tiny_config
    k = tiny_config("FlexOlmoForCausalLM").num_experts_per_tok
    assert k > 1
    base = tiny_checkpoint("FlexOlmoForCausalLM")
    one = tiny_checkpoint("FlexOlmoForCausalLM", overrides={"num_experts_per_tok": 1})
    want = _hf(one)
    assert want != _hf(base)
    assert _engine(one) == want


def test_granite_swa_sinks_matter(tiny_checkpoint, tmp_path):
    """Granite SWA's learned sink logit per head (zeros in the tiny checkpoint): other values change the tokens."""
    base = tiny_checkpoint("GraniteSWAForCausalLM")
    g = torch.Generator().manual_seed(7)

    def edit(name, t):
        return 3.0 * torch.randn(t.shape, generator=g) if name.endswith("self_attn.sinks") else None
    _arm(base, _edit_tensors(base, tmp_path / "granite_swa_sinks", edit), "perturbing the attention sinks")


def test_granite_swa_layer_rope_theta_matters(tiny_checkpoint):
    """Granite SWA's per-layer rope theta (the tiny [10000, 0 (no rope), 500]) against one theta everywhere."""
    base = tiny_checkpoint("GraniteSWAForCausalLM")
    same = tiny_checkpoint("GraniteSWAForCausalLM", overrides={"layer_rope_theta": [10000.0] * 3})
    _arm(base, same, "one rope theta on every layer")


def test_granitemoe_swa_shared_expert_and_sinks_matter(tiny_checkpoint, tmp_path):
    """Granite MoE SWA: the shared expert (tiny 48, off at 0) and the attention sinks each move the tokens."""
    base = tiny_checkpoint("GraniteMoeSWAForCausalLM")
    _arm(base, tiny_checkpoint("GraniteMoeSWAForCausalLM", overrides={"shared_intermediate_size": 0}),
         "no shared expert")
    g = torch.Generator().manual_seed(8)

    def edit(name, t):
        return 3.0 * torch.randn(t.shape, generator=g) if name.endswith("self_attn.sinks") else None
    _arm(base, _edit_tensors(base, tmp_path / "granitemoe_swa_sinks", edit), "perturbing the attention sinks")


@pytest.mark.slow      # a sensitivity arm (~10 s); the family's parity is the conformance battery's
def test_mellum_mlp_layer_types_and_local_rope_matter(tiny_checkpoint):
    """Mellum: the dense first layer (mlp_layer_types) against all-sparse, and the sliding layers' own rope theta
    against the full layers', each move transformers' tokens and are served alike."""
    base = tiny_checkpoint("MellumForCausalLM")
    _arm(base, tiny_checkpoint("MellumForCausalLM", overrides={"mlp_layer_types": ["sparse"] * 3}),
         "all-sparse mlp_layer_types")
    _arm(base, tiny_checkpoint("MellumForCausalLM",
                               overrides={"rope_parameters.sliding_attention": {"rope_theta": 500000.0}}),
         "the full layers' rope theta on the sliding layers")


@pytest.mark.slow      # a sensitivity arm (~10 s); the family's parity is the conformance battery's
def test_flint_sinks_and_layer_types_matter(tiny_checkpoint, tmp_path):
    """Flint: the sink logits (softmax_offset in the checkpoint) and the rope-less full layers (all-sliding
    layer_types put rope on every layer) each move transformers' tokens and are served alike."""
    base = tiny_checkpoint("FlintForCausalLM")
    g = torch.Generator().manual_seed(9)

    def edit(name, t):
        return 3.0 * torch.randn(t.shape, generator=g) if name.endswith("self_attn.softmax_offset") else None
    _arm(base, _edit_tensors(base, tmp_path / "flint_sinks", edit), "perturbing the attention sinks")
    _arm(base, tiny_checkpoint("FlintForCausalLM", overrides={"layer_types": ["sliding_attention"] * 3}),
         "rope (and the window) on every layer")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["FlexOlmoForCausalLM", "SolarOpenForCausalLM"])
def test_moe_experts_follow_hidden_act(tiny_checkpoint, arch):
    """FlexOlmo's and Solar Open's experts (and Solar Open's shared experts) run ACT2FN[hidden_act]: a relu checkpoint
    (no fused gated kernel: the torch grouped experts) changes transformers' output and is served alike."""
    _arm(tiny_checkpoint(arch), tiny_checkpoint(arch, overrides={"hidden_act": "relu"}), f"{arch} hidden_act relu")


@pytest.mark.slow
def test_olmo_hybrid_nope_is_served(tiny_checkpoint):
    """OLMo Hybrid with a null rope theta (the released checkpoints' NoPE: transformers builds no rotary) changes
    transformers' output against the default theta, and the spec serves it (rotary `enabled: rope_theta is not None`)."""
    _arm(tiny_checkpoint("OlmoHybridForCausalLM"),
         tiny_checkpoint("OlmoHybridForCausalLM", overrides={"rope_parameters": {"rope_theta": None}}), "NoPE")


@pytest.mark.slow
def test_exaone4_layer_types_derived_from_the_pattern(tiny_checkpoint, tmp_path):
    """EXAONE 4 without layer_types in config.json: transformers derives them from sliding_window_pattern (full where
    (i + 1) % pattern == 0; a pattern of 1 is every layer full, NoPE with the window set); the spec derives alike, and
    reads the pattern only there (a string pattern beside layer_types, as released, is not read)."""
    import json
    import shutil

    def edited(src, name, drop=("layer_types",), **fields):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        cfg = json.loads((dst / "config.json").read_text())
        for k in drop:
            cfg.pop(k)
        cfg.update(fields)
        (dst / "config.json").write_text(json.dumps(cfg))
        return dst

    base = tiny_checkpoint("Exaone4ForCausalLM")          # sliding_window_pattern 2: sliding, full, sliding
    want = _hf(base)
    assert _engine(edited(base, "p2")) == want
    _arm(base, edited(tiny_checkpoint("Exaone4ForCausalLM", overrides={"sliding_window_pattern": 1}), "p1"),
         "pattern 1 (every layer full)")
    assert _engine(edited(base, "released", drop=(), sliding_window_pattern="LLLG")) == want


def test_olmo_hybrid_and_exaone4_config_readings():
    """Config readings alone (no model): OLMo Hybrid's rope theta, null (NoPE) wherever transformers' class holds None
    and its value elsewhere; EXAONE 4's layer_types derived from sliding_window_pattern only where they are absent,
    and the checkpoints transformers fails on refused by name."""
    from transformers import Exaone4Config, OlmoHybridConfig

    from xllm_gen.generated.exaone4.model import Exaone4Config as ExSpec
    from xllm_gen.generated.olmo_hybrid.model import OlmoHybridConfig as OhSpec

    base = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
            "num_hidden_layers": 4, "vocab_size": 100}
    for rope in ({"rope_parameters": {"rope_type": "default", "rope_theta": None}}, {"rope_theta": None}, {},
                 {"rope_parameters": None}, {"rope_parameters": {"rope_type": "default"}, "rope_theta": None},
                 {"rope_parameters": {"rope_type": "default", "rope_theta": None}, "rope_theta": 5000.0},
                 {"rope_parameters": {"rope_type": "default", "rope_theta": 7000.0}, "rope_theta": None},
                 {"rope_theta": 3000.0}):
        hf = OlmoHybridConfig.from_dict(copy.deepcopy({**base, **rope})).rope_parameters.get("rope_theta")
        assert OhSpec.from_hf(copy.deepcopy({**base, **rope})).rope_theta == hf, rope

    ex = {**base, "architectures": ["Exaone4ForCausalLM"]}
    for fields in ({"sliding_window_pattern": 2}, {"sliding_window_pattern": 1}, {"sliding_window_pattern": 5},
                   {"sliding_window_pattern": -3}, {}):
        want = Exaone4Config.from_dict(copy.deepcopy({**ex, **fields})).layer_types
        assert list(ExSpec.from_hf(copy.deepcopy({**ex, **fields})).layer_types) == want, fields
    given = ["sliding_attention", "full_attention"] * 2
    assert list(ExSpec.from_hf({**ex, "layer_types": given, "sliding_window_pattern": "LLLG"}).layer_types) == given
    with pytest.raises(ValueError, match="sliding_window_pattern"):        # transformers: int % str
        ExSpec.from_hf({**ex, "sliding_window_pattern": "LLLG"})
    with pytest.raises(ValueError, match="layer_types_derivable"):         # transformers: modulo by zero
        ExSpec.from_hf({**ex, "sliding_window": None})
