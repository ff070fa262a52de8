"""Sensitivity arms of families served by YAML alone (specs/cwm.yaml, specs/hyperclovax.yaml): switching a
feature off changes transformers' output, and the engine serves the switched checkpoint alike (or refuses it
by name where the spec builds the feature in)."""
from __future__ import annotations

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


def test_hyperclovax_without_post_norm_is_refused_by_name(tiny_checkpoint):
    """use_post_norm false (Granite's layer) changes transformers' output; the spec builds the post norms in,
    so such a checkpoint is refused naming the field, never served wrong."""
    base = tiny_checkpoint("HyperCLOVAXForCausalLM")
    off = tiny_checkpoint("HyperCLOVAXForCausalLM", overrides={"use_post_norm": False})
    assert _hf(off) != _hf(base)
    with pytest.raises(Exception, match="use_post_norm"):
        _engine(off)


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
