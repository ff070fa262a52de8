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
