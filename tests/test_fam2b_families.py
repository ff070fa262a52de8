"""Sensitivity arms of families served by YAML alone (specs/cwm.yaml, specs/hyperclovax.yaml): switching a
feature off changes transformers' output, and the engine serves the switched checkpoint alike (or refuses it
by name where the spec builds the feature in)."""
from __future__ import annotations

import pytest
from test_norm_dataflow import _engine, _hf


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
