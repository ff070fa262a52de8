"""dots.3 Note (specs/dots3_note.yaml) and the primitives it added to `mla_attention`: `rope_key_norm` (an RMSNorm
of the shared rope key), `sliding_window`, and `q_scale` on the normalized query latent (which the indexer reads
too); its two layer types have MLA shapes of their own (a per-layer block choice). The spec battery and the
conformance battery check greedy parity at TP 1 and 2 on the tiny checkpoint (indexed layers 0-1, sliding layers 2-3
with other heads, ranks and head dims); here each feature gets an arm that changes transformers' output, and the
guard refuses what the spec does not model, by name."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_scalings import _agree, _engine, _hf

ARCH = "Dots3NoteForCausalLM"
PROMPT = np.random.default_rng(7).integers(0, 400, 13).tolist()


def _changed(want, base) -> bool:
    return want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3)


def _attns(model):
    return [layer.self_attn for layer in model.model.layers]


@pytest.mark.engine
@pytest.mark.parametrize("arm", ["q_lora_scale", "kv_lora_scale", "k_rope_only_layernorm"])
def test_dots3_attention_features_matter(arm, tiny_checkpoint):
    """transformers without the feature (scale 1, no rope-key norm) decodes otherwise: what the
    engine's parity with the unpatched model (the batteries) rests on."""
    import torch
    from hf_ref import hf_model

    ckpt = Path(tiny_checkpoint(ARCH))
    base = _hf(ckpt, PROMPT)
    model = hf_model(ckpt)
    # set and restored by hand, not with monkeypatch: pytest 9.2's undo deletes an attribute that was not in the
    # instance's __dict__ (a submodule lives in _modules), which broke the cached model for the later tests
    saved = [(a, getattr(a, arm)) for a in _attns(model)]
    for a, _ in saved:
        setattr(a, arm, 1.0 if arm.endswith("scale") else torch.nn.Identity())
    try:
        want = _hf(ckpt, PROMPT)
    finally:
        for a, old in saved:
            setattr(a, arm, old)
    assert _changed(want, base), f"{arm} off changes nothing in transformers' output: no arm"


@pytest.mark.engine
def test_dots3_sliding_window_arm(tiny_checkpoint, tmp_path):
    """A window longer than the sequences: transformers' output changes and the engine follows."""
    from fixtures.tiny_hf import edit_config

    ckpt = Path(tiny_checkpoint(ARCH))
    base = _hf(ckpt, PROMPT)
    _agree(_engine(ckpt, PROMPT), base, "as built")
    arm = edit_config(ckpt, tmp_path / "window", lambda cfg: cfg.__setitem__("sliding_window", 64))
    want = _hf(arm, PROMPT)
    assert _changed(want, base), "a longer window changes nothing: no arm"
    _agree(_engine(arm, PROMPT), want, "sliding_window = 64")


def _set(path: str, value):
    def edit(cfg):
        *head, last = path.split(".")
        d = cfg
        for k in head:
            d = d[k]
        d[last] = value
    return edit


def _per_layer(key, value, layer="3"):
    def edit(cfg):
        cfg["per_layer_config"][layer][key] = value
    return edit


@pytest.mark.parametrize("what,edit,named", [
    ("a sliding head_dim that is not nope + rope", _per_layer("head_dim", 24, "2"), "per_layer_config"),
    ("sliding layers of two shapes", _per_layer("num_attention_heads", 4), "per_layer_config"),
    ("K/V heads != heads", _set("num_key_value_heads", 2), "kv_heads_equal_heads"),
    ("a full (non-indexed) attention layer",
     _set("layer_types", ["indexed_attention", "full_attention", "sliding_attention", "sliding_attention"]),
     "full_attention_layers"),
    ("YaRN on the sliding layers", _set("rope_parameters.sliding_attention.rope_type", "yarn"), "rope_type"),
    ("MLP biases", _set("mlp_bias", True), "mlp_bias"),
])
def test_dots3_guard_refuses_by_name(what, edit, named, tiny_checkpoint):
    from xllm_gen.generated.dots3_note.model import Dots3NoteConfig

    cfg = json.loads((Path(tiny_checkpoint(ARCH)) / "config.json").read_text())
    Dots3NoteConfig.from_hf(cfg)                        # as built: accepted
    edit(cfg)
    with pytest.raises(ValueError, match=named):
        Dots3NoteConfig.from_hf(cfg)
