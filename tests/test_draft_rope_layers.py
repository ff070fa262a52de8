"""`xllm-gen draft` of per-layer rotary on / off (codegen/draft_rope_layers.py) and of the per-layer lists a config class
computes when config.json lacks them (codegen/draft_config_lists.py), read from the source, never from a family's name:

  - the rotary call under an `if` in the attention's forward: its condition translated into `rotary.enabled`
    (SmolLM3's `self.use_rope = config.no_rope_layers[layer_idx]` -> `"bool(no_rope_layers[layer])"`; Cohere 2's
    `self.sliding_window is not None`; EXAONE 4's `__init__` local `layer_type` substituted);
  - the list the config class computes: SmolLM3's `no_rope_layers` from `no_rope_layer_interval`, its `layer_types`
    (a `for` loop of appends: sliding where `use_sliding_window` and the layer has no rope), Llama 4's comprehension over
    another list field; each checked against the class built at several values;
  - verify (slow): tiny SmolLM3 (a NoPE middle layer; and with its sliding window on) and Cohere 2 (a full layer without
    rotary) verify OK as drafted; with `enabled` dropped verify fails at the NoPE layer, with the no_rope_layers default
    inverted its defaults check fails.
"""
from __future__ import annotations

import pytest
from draft_util import checklist as _checklist
from draft_util import draft_by_name, drafts_of_checkpoints


def _draft(target: str) -> tuple[str, dict, dict]:
    """(text, doc, the attention block) of the draft of `target` (a class name: drafted once per session)."""
    text, doc = draft_by_name(target)
    return text, doc, doc["decoder"]["layers"]["blocks"]["self_attn"]


def test_no_rope_layers_drafted_with_the_class_default():
    text, doc, attn = _draft("SmolLM3ForCausalLM")
    assert attn["rotary"]["enabled"] == "bool(no_rope_layers[layer])"
    cfg = doc["config"]
    assert cfg["no_rope_layers"] == {"type": "int_tuple", "from": "no_rope_layers", "default_expr":
                                     "[int((i + 1) % no_rope_layer_interval != 0) for i in range(num_hidden_layers)]"}
    assert cfg["no_rope_layer_interval"]["default"] == 4
    # layer_types: the class's loop of appends (sliding on the NoPE layers where use_sliding_window), not a guess
    assert cfg["layer_types"]["default_expr"] == (
        "['sliding_attention' if use_sliding_window and sliding_window is not None and (not no_rope_layers[i]) "
        "else 'full_attention' for i in range(num_hidden_layers)]")
    assert "no_rope" not in _checklist(text) and "no_rope" not in str(doc.get("config_assume"))


def test_list_defaults_from_the_config_source():
    """No model built: the config classes' own computations, translated and checked against the classes."""
    import transformers

    from xllm_gen.codegen.draft_config_lists import computed_default

    def default(cls_name, f):
        c = getattr(transformers, cls_name)
        d = c().to_dict()
        return computed_default(c, f, d, set(d))
    expr, used, _ = default("Llama4TextConfig", "layer_types")      # a comprehension over another list field
    assert expr == ("['chunked_attention' if no_rope_layers[i] and attention_chunk_size is not None else "
                    "'full_attention' for i in range(len(no_rope_layers))]")
    assert used == {"no_rope_layers", "attention_chunk_size"}
    # `self.f = self.f if self.f else <local>`
    assert default("Llama4TextConfig", "no_rope_layers")[0] == (
        "[int((i + 1) % no_rope_layer_interval != 0) for i in range(num_hidden_layers)]")
    # `bool(...)` in the condition dropped (Gemma 2)
    assert default("Gemma2Config", "layer_types")[0] == (
        "['sliding_attention' if (i + 1) % 2 else 'full_attention' for i in range(num_hidden_layers)]")
    # Qwen3 nulls the window unless use_sliding_window before computing layer_types: the plain translation disagrees
    # with the class when config.json sets a window without the flag, so it is not used
    assert default("Qwen3Config", "layer_types") is None


def test_rope_only_on_sliding_layers_from_a_window_condition():
    _, _, attn = _draft("Cohere2ForCausalLM")
    assert attn["rotary"]["enabled"] == (
        "(sliding_window if layer_types[layer] == 'sliding_attention' else None) is not None")


@pytest.mark.slow       # draft-only; EXAONE 4's __init__ local `layer_type` substituted into `self.is_sliding`
def test_init_locals_substituted():
    text, _, attn = _draft("Exaone4ForCausalLM")
    assert attn["rotary"]["enabled"] == "sliding_window is None or layer_types[layer] == 'sliding_attention'"
    assert "rotary only where" not in _checklist(text)


# ---- verify (slow: a tiny checkpoint and two model runs each) -------------------------------------------------

CASES = {
    "smollm3": ("SmolLM3ForCausalLM", {}),          # the tiny builder's no_rope_layers [1, 0, 1]
    "smollm3-window": ("SmolLM3ForCausalLM", {"no_rope_layers": [1, 0, 1], "use_sliding_window": True,
                                              "sliding_window": 4}),      # layer 1 NoPE and sliding
    "cohere2": ("Cohere2ForCausalLM", {"sliding_window_pattern": 2}),     # layer 1 full, without rotary
}


@pytest.fixture(scope="module")
def drafted(tiny_checkpoint, tmp_path_factory):
    return drafts_of_checkpoints(tiny_checkpoint, tmp_path_factory.mktemp("draft_rope_layers"), CASES.__getitem__)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_verify_accepts_the_drafted_rope_layers(drafted, case):
    from xllm_gen.codegen.verify import verify
    ckpt, spec = drafted(case)
    assert 'enabled: "' in spec.read_text()
    r = verify(spec, ckpt, max_tokens=4, prompt_lens=[3, 9])
    assert r.ok, r.text()


@pytest.mark.slow
@pytest.mark.parametrize("case, old, new, layer", [
    pytest.param("smollm3", 'enabled: "bool(no_rope_layers[layer])", ', "", 1, id="nope-layer-given-rope"),
    pytest.param("cohere2", "enabled: \"(sliding_window if layer_types[layer] == 'sliding_attention' else None) is not "
                            "None\", ", "", 1, id="full-layer-given-rope"),
])
def test_verify_fails_a_draft_with_rope_on_a_nope_layer(drafted, case, old, new, layer):
    from xllm_gen.codegen.verify import verify
    ckpt, spec = drafted(case)
    text = spec.read_text()
    assert old in text
    bad = spec.parent / f"bad_{case}.yaml"
    bad.write_text(text.replace(old, new, 1))
    r = verify(bad, ckpt, max_tokens=4, prompt_lens=[9])
    assert not r.ok
    assert r.first_divergence()[2].layer == layer, r.text()


@pytest.mark.slow
def test_verify_fails_a_wrong_no_rope_default(drafted):
    """Every token agrees on a checkpoint that writes no_rope_layers; the defaults check finds the wrong default."""
    from xllm_gen.codegen.verify import verify
    ckpt, spec = drafted("smollm3")
    text = spec.read_text()
    bad = spec.parent / "bad_default.yaml"
    bad.write_text(text.replace("% no_rope_layer_interval != 0", "% no_rope_layer_interval == 0", 1))
    r = verify(bad, ckpt, max_tokens=2, prompt_lens=[3])
    assert not r.ok
    assert "default DIFFERS: no_rope_layers" in r.text(), r.text()
