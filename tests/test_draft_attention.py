"""`xllm-gen draft` of an ordinary attention layer's features (codegen/draft_attention.py), read from the attention class's
source and the config class, never from a family's name; then `xllm-gen verify` of the drafts.

  - q/k norms: per head (Qwen3), over the whole projection (OLMoE), `(1 + w)` (Gemma 3), behind a flag
    (GLM-4-MoE's `use_qk_norm`: `enabled`), their eps the config field the call passes;
  - the rotary: interleaved pairs from the `rotate_half` the rotary function calls (Helium), a partial rotary factor the
    modeling code reads (StableLM, GLM-4-MoE: `fraction`, with the at-least-one-pair guard);
  - windows: the attention's `self.sliding_window = ...` translated, `layer_types` with the default the config class
    computes (Qwen3's use_sliding_window / max_window_layers, Gemma 3's `sliding_window_pattern` keyword);
  - the softmax scale (Gemma 3's query_pre_attn_scalar, Granite's attention_multiplier), soft-capping (Gemma 2), clipped
    q/k/v (OLMoE's clip_qkv);
  - the layer's pre- / post-norms from its forward (codegen/draft_layer.py): OLMo 2's post-norms, Gemma 2 / 3's
    sandwich of (1 + w) norms, Cohere's / Phi's parallel layer, the lm_head's soft-cap; Gemma 3's rope parameters
    per layer type;
  - StableLM's per-head q/k LayerNorm lists (`q_layernorm.norms.{h}`): `weights: per_head` with `weights` entries
    stacking the heads' tensors, behind `qk_layernorm`;
  - the drafts of tiny GLM-4-MoE (at the tiny builder's defaults), ERNIE 4.5 MoE, Dots1, OLMoE, Helium, StableLM (qk_layernorm),
    OLMo 2, Gemma 2, Gemma 3, Cohere and Phi verify OK (slow); with the interleaved layout, the partial rotary or the q/k norms'
    (1 + w) dropped, or the window on the wrong layers, verify fails (slow).
Default arms draft by class name only (~2.5 s after the first draft of the session); the verify arms are slow.
"""
from __future__ import annotations

import pytest
from draft_util import checklist as _checklist
from draft_util import draft_by_name, drafts_of_checkpoints


def _draft(target: str) -> tuple[str, dict, dict]:
    """(text, doc, the attention block) of the draft of `target` (a class name: drafted once per session)."""
    text, doc = draft_by_name(target)
    return text, doc, doc["decoder"]["layers"]["blocks"]["self_attn"]


def test_per_head_qk_norm_and_a_window_by_layer_type():
    text, doc, attn = _draft("Qwen3ForCausalLM")
    assert attn["qk_norm"] == {"kind": "rmsnorm", "eps": "rms_norm_eps", "q": "q_norm", "k": "k_norm"}
    assert attn["sliding_window"] == "sliding_window if layer_types[layer] == 'sliding_attention' else None"
    cfg = doc["config"]
    assert cfg["layer_types"]["default_expr"] == (
        "['sliding_attention' if use_sliding_window and sliding_window is not None and i >= max_window_layers "
        "else 'full_attention' for i in range(num_hidden_layers)]")
    # the class nulls the window unless use_sliding_window: absent means 4096 only then
    assert cfg["sliding_window"]["default_expr"] == "4096 if use_sliding_window else None"
    assert {"use_sliding_window", "max_window_layers"} <= set(cfg)
    checklist = _checklist(text)
    assert "sliding window" not in checklist and "q/k norms" not in checklist and "layer_types" not in checklist


def test_qk_norm_behind_a_flag_and_partial_rotary():
    text, doc, attn = _draft("Glm4MoeForCausalLM")
    assert attn["qk_norm"]["enabled"] == "use_qk_norm"
    assert doc["config"]["use_qk_norm"]["default"] is False     # Glm4MoeConfig's own default
    assert attn["rotary"]["fraction"] == "partial_rotary_factor"
    prf = doc["config"]["partial_rotary_factor"]
    assert prf["from"] == ["rope_parameters.partial_rotary_factor", "partial_rotary_factor"] and prf["default"] == 0.5
    assert doc["config"]["rotary_dims"]["guard"] is True
    assert "partial_rotary_factor" not in _checklist(text)


@pytest.mark.slow      # draft-only, but beyond the default arms' time budget (~0.7 s with Phi and Granite below)
def test_partial_rotary_of_a_dense_family_and_a_multiplier_scale():
    _, _, granite = _draft("GraniteForCausalLM")
    assert granite["scale"] == "attention_multiplier"
    _, doc, _ = _draft("PhiForCausalLM")     # its final norm loads from model.final_layernorm, its lm_head a bias
    assert doc["weights"]["model.norm.weight"] == {"from": "model.final_layernorm.weight"}
    assert doc["lm_head"]["bias"] is True
    _, doc, attn = _draft("StableLmForCausalLM")
    assert attn["rotary"]["fraction"] == "partial_rotary_factor" and doc["config"]["partial_rotary_factor"]["default"] == 0.25
    assert "layout" not in attn["rotary"]
    # qk_layernorm: a LayerNorm module per head (`norms.{h}`), stacked into the per-head weight
    assert attn["qk_norm"] == {"kind": "layernorm", "eps": "layer_norm_eps", "q": "q_layernorm", "k": "k_layernorm",
                               "weights": "per_head", "enabled": "qk_layernorm"}
    assert doc["weights"]["model.layers.{i}.self_attn.k_layernorm.weight"] == {
        "from": "model.layers.{i}.self_attn.k_layernorm.norms.{h}.weight"}


def test_interleaved_rotary_from_rotate_half():
    text, _, attn = _draft("HeliumForCausalLM")
    assert attn["rotary"]["layout"] == "interleaved"
    assert "rotate_half is interleaved" not in _checklist(text)
    _, _, qwen = _draft("Qwen3ForCausalLM")
    assert "layout" not in qwen["rotary"] and "fraction" not in qwen["rotary"]


def test_projection_wide_qk_norm_and_clipping():
    text, doc, attn = _draft("OlmoeForCausalLM")
    assert attn["qk_norm"]["over"] == "projection"
    assert attn["clip_qkv"] == "clip_qkv" and doc["config"]["clip_qkv"]["optional"] is True
    assert "clipped" not in _checklist(text)


def test_offset_qk_norm_scale_and_a_keyword_window_pattern():
    _, doc, attn = _draft("Gemma3ForCausalLM")
    assert attn["qk_norm"]["weight_offset"] == 1
    assert attn["scale"] == "query_pre_attn_scalar ** (-0.5)"
    cfg = doc["config"]
    assert cfg["layer_types"]["default_expr"] == ("['sliding_attention' if (i + 1) % sliding_window_pattern else "
                                                  "'full_attention' for i in range(num_hidden_layers)]")
    assert cfg["sliding_window_pattern"] == {"type": "int", "from": "sliding_window_pattern", "default": 6, "min": 1}
    assert "_sliding_window_pattern" in doc["config_ignore"]


def test_post_norms_and_sandwich_norms_from_the_layer_forward():
    """The decoder layer's forward says which norm runs before and which after each block (codegen/draft_layer.py):
    OLMo 2's post-norms only, Gemma 2's sandwich of (1 + w) norms; its final soft-cap on the lm_head."""
    text, doc, attn = _draft("Olmo2ForCausalLM")
    steps = doc["decoder"]["layers"]["dataflow"]
    assert steps == [{"block": "self_attn", "post_norm": "post_attention_layernorm"},
                     {"block": "mlp", "post_norm": "post_feedforward_layernorm"}]
    assert attn["qk_norm"]["over"] == "projection"
    text, doc, attn = _draft("Gemma2ForCausalLM")
    steps = doc["decoder"]["layers"]["dataflow"]
    assert steps == [{"norm": "input_layernorm", "block": "self_attn", "post_norm": "post_attention_layernorm"},
                     {"norm": "pre_feedforward_layernorm", "block": "mlp", "post_norm": "post_feedforward_layernorm"}]
    blocks = doc["decoder"]["layers"]["blocks"]
    assert all(blocks[n]["weight_offset"] == 1 for n in ("input_layernorm", "post_feedforward_layernorm"))
    assert attn["softcap"] == "attn_logit_softcapping" and doc["lm_head"]["softcap"] == "final_logit_softcapping"
    assert doc["config"]["layer_types"]["default_expr"].startswith("['sliding_attention' if (i + 1) % 2 else")
    checklist = _checklist(text)
    assert "extra per-layer norms" not in checklist and "soft-caps" not in checklist and "(1 + weight)" not in checklist


def test_a_parallel_layer_with_per_head_qk_norms():
    """Cohere: one bias-free LayerNorm feeding both blocks (one residual add), per-head q/k LayerNorms behind
    use_qk_norm, interleaved rotary."""
    _, doc, attn = _draft("CohereForCausalLM")
    assert doc["decoder"]["layers"]["dataflow"] == [{"parallel": [{"norm": "input_layernorm", "block": "self_attn"},
                                                                  {"norm": "input_layernorm", "block": "mlp"}]}]
    assert doc["decoder"]["layers"]["blocks"]["input_layernorm"]["bias"] is False
    assert attn["qk_norm"] == {"kind": "layernorm", "eps": "layer_norm_eps", "q": "q_norm", "k": "k_norm",
                               "weights": "per_head", "enabled": "use_qk_norm"}
    assert attn["rotary"]["layout"] == "interleaved"


def test_rope_parameters_per_layer_type():
    _, doc, attn = _draft("Gemma3ForCausalLM")
    assert attn["rotary"]["theta"] == "rope_theta if layer_types[layer] == 'full_attention' else rope_theta_sliding"
    assert attn["rotary"]["scaling"] == "rope_full if layer_types[layer] == 'full_attention' else rope_sliding"
    assert doc["config"]["rope_sliding"]["from"] == "rope_parameters.sliding_attention"


# ---- verify (slow: a tiny checkpoint and two model runs each) -------------------------------------------------

FAMILIES = {
    "Glm4MoeForCausalLM": {},           # the tiny builder's defaults: q/k norms on, partial rotary 0.5
    "Ernie4_5_MoeForCausalLM": {},      # interleaved rotary
    "Dots1ForCausalLM": {},             # q/k norms, a window of 6 on layer 2 (max_window_layers 2)
    "OlmoeForCausalLM": {},             # projection-wide q/k norms, clip_qkv
    "HeliumForCausalLM": {},            # interleaved rotary
    "StableLmForCausalLM": {"qk_layernorm": True},      # partial rotary 0.25, a LayerNorm per head on q and k
    "Olmo2ForCausalLM": {},             # post-norms only, projection-wide q/k norms
    "Gemma2ForCausalLM": {},            # sandwich (1 + w) norms, soft-caps, a window every other layer
    "Gemma3ForCausalLM": {},            # + (1 + w) q/k norms, rope parameters per layer type
    "CohereForCausalLM": {"use_qk_norm": True},     # parallel layer, per-head q/k LayerNorms, interleaved rotary
    "PhiForCausalLM": {"qk_layernorm": True},       # parallel layer, partial rotary, q/k LayerNorms with bias
}


@pytest.fixture(scope="module")
def drafted(tiny_checkpoint, tmp_path_factory):
    return drafts_of_checkpoints(tiny_checkpoint, tmp_path_factory.mktemp("draft_attention"),
                                 lambda arch: (arch, FAMILIES[arch]))


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_verify_accepts_the_drafted_attention(drafted, arch):
    from xllm_gen.codegen.verify import verify
    ckpt, spec = drafted(arch)
    r = verify(spec, ckpt, max_tokens=4, prompt_lens=[3, 9])
    assert r.ok, r.text()


@pytest.mark.slow
@pytest.mark.parametrize("arch, old, new, layer", [
    pytest.param("Ernie4_5_MoeForCausalLM", "layout: interleaved, ", "", 0, id="interleaved-made-neox"),
    pytest.param("Glm4MoeForCausalLM", "fraction: partial_rotary_factor, ", "", 0, id="partial-rotary-dropped"),
    # the window (6) is on layer 2 only (layer_types [full, full, sliding]): moved to layers 0 and 1 instead
    pytest.param("Dots1ForCausalLM", "layer_types[layer] == 'sliding_attention'",
                 "layer_types[layer] != 'sliding_attention'", 0, id="window-on-the-wrong-layers"),
    pytest.param("Gemma3ForCausalLM", "q: q_norm, k: k_norm, weight_offset: 1}", "q: q_norm, k: k_norm}", 0,
                 id="qk-norm-offset-dropped"),
    # StableLM's per-head LayerNorms read as RMSNorms (position 0 attends to itself only: position 1 differs)
    pytest.param("StableLmForCausalLM", "qk_norm: {kind: layernorm,", "qk_norm: {kind: rmsnorm,", 0,
                 id="per-head-qk-norm-kind"),
])
def test_verify_fails_a_draft_with_an_attention_fact_wrong(drafted, arch, old, new, layer):
    from xllm_gen.codegen.verify import verify
    ckpt, spec = drafted(arch)
    text = spec.read_text()
    assert old in text
    bad = spec.parent / f"bad_{arch}.yaml"
    bad.write_text(text.replace(old, new, 1))
    r = verify(bad, ckpt, max_tokens=4, prompt_lens=[9])
    assert not r.ok
    assert r.first_divergence()[2].layer == layer, r.text()
