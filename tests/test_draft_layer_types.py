"""`xllm-gen draft` of `layer_types` beyond the recognized patterns (codegen/draft_layer_types.py,
codegen/draft_config_lists.py) and of the window the model's per-type masks apply (codegen/draft_attention.py):

  - the list the config class computes, translated from its source: EXAONE 4's `(i + 1) % sliding_window_pattern != 0`,
    Cohere 2 MoE's dense prefix with its own pattern (a keyword the class pops, `first_k_dense_replace`);
  - where the model builds its masks per layer type (`"sliding_attention": create_sliding_window_causal_mask(...)`), the
    window is `sliding_window` on the layers `layer_types` marks whatever the attention's own (flash) attribute says:
    EXAONE 4 holds the window on every layer, SmolLM3 only under `use_sliding_window`;
  - verify (slow): tiny EXAONE 4 and a SmolLM3 whose config.json marks a sliding layer without `use_sliding_window`
    verify OK as drafted; with the attention attribute's window (every layer / only under the flag) verify fails at
    layer 1, the sliding layer.
"""
from __future__ import annotations

import pytest
from draft_util import draft_by_name, drafts_of_checkpoints

BY_TYPE = "sliding_window if layer_types[layer] == 'sliding_attention' else None"
_draft = draft_by_name


def test_the_window_of_the_per_type_masks():
    _, doc = _draft("SmolLM3ForCausalLM")
    assert doc["decoder"]["layers"]["blocks"]["self_attn"]["sliding_window"] == BY_TYPE


@pytest.mark.slow       # draft-only, two more families (~10 s)
def test_layer_types_translated_from_the_config_source():
    text, doc = _draft("Exaone4ForCausalLM")
    cfg = doc["config"]
    assert cfg["layer_types"]["default_expr"] == (
        "['sliding_attention' if (i + 1) % sliding_window_pattern != 0 and i < num_hidden_layers else 'full_attention' "
        "for i in range(num_hidden_layers)]")
    assert cfg["sliding_window_pattern"]["default"] == 4
    assert doc["decoder"]["layers"]["blocks"]["self_attn"]["sliding_window"] == BY_TYPE
    assert "layer_types" not in "\n".join(line for line in text.splitlines() if line.startswith("# - [ ]"))
    _, doc = _draft("Cohere2MoeForCausalLM")
    assert doc["config"]["layer_types"]["default_expr"] == (
        "['sliding_attention' if (i + 1) % prefix_dense_sliding_window_pattern != 0 else 'full_attention' "
        "for i in range(first_k_dense_replace)] + ['sliding_attention' if (i + 1) % sliding_window_pattern != 0 "
        "else 'full_attention' for i in range(num_hidden_layers - first_k_dense_replace)]")


# ---- verify (slow: a tiny checkpoint and two model runs each) -------------------------------------------------

CASES = {
    "exaone4": ("Exaone4ForCausalLM", {}),      # the tiny builder's pattern 2: layer 1 full (NoPE), window 6
    "smollm3": ("SmolLM3ForCausalLM", {"no_rope_layers": [1, 0, 1], "use_sliding_window": False, "sliding_window": 4,
                                       "layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
}


@pytest.fixture(scope="module")
def drafted(tiny_checkpoint, tmp_path_factory):
    return drafts_of_checkpoints(tiny_checkpoint, tmp_path_factory.mktemp("draft_layer_types"), CASES.__getitem__)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_verify_accepts_the_drafted_layer_types(drafted, case):
    from xllm_gen.codegen.verify import verify
    ckpt, spec = drafted(case)
    assert f'sliding_window: "{BY_TYPE}"' in spec.read_text()
    r = verify(spec, ckpt, max_tokens=4, prompt_lens=[3, 9])
    assert r.ok, r.text()


@pytest.mark.slow
@pytest.mark.parametrize("case, new", [
    pytest.param("exaone4", "sliding_window", id="window-on-every-layer"),
    pytest.param("smollm3", "sliding_window if use_sliding_window and layer_types[layer] == 'sliding_attention' "
                            "else None", id="window-only-under-the-flag"),
])
def test_verify_fails_the_attention_attribute_window(drafted, case, new):
    from xllm_gen.codegen.verify import verify
    ckpt, spec = drafted(case)
    text = spec.read_text()
    bad = spec.parent / f"bad_{case}.yaml"
    bad.write_text(text.replace(f'sliding_window: "{BY_TYPE}"', f'sliding_window: "{new}"', 1))
    r = verify(bad, ckpt, max_tokens=4, prompt_lens=[9])
    assert not r.ok
    assert r.first_divergence()[2].layer == 1, r.text()
