"""(hR) Fast tests of the fixes the released-settings trials of tests/test_real_settings_hR.py called for: tiny
checkpoints with the releases' fields, served as transformers; other values refused by name.

- Trinity-Nano-Preview / Trinity-Mini (AfmoeForCausalLM): Arcee's config.json states the router in its training code's
  names (score_func, route_norm, n_group / topk_group, num_expert_groups / num_limited_groups, use_grouped_mm), which
  transformers' AFMoE never reads (its router is always sigmoid, renormalized, ungrouped): refused as unknown before;
  accepted at those values now, refused at others.
- GLM-5 / GLM-5.3 (GlmMoeDsaForCausalLM): `indexer_rope_interleave: true` (what transformers' indexer always builds)
  and GLM's `moe_router_dtype`, refused as unknown before; `indexer_rope_interleave: false` is refused.
- MiMo-V2-Flash (MiMoV2FlashForCausalLM): the release restates in its serving code's names what transformers derives
  itself (hybrid_layer_pattern, moe_layer_freq, swa_* head counts / widths, rope_theta / swa_rope_theta /
  partial_rotary_factor beside rope_parameters, layernorm_epsilon, attention_chunk_size, the sink flags, use_qk_norm,
  mlp_bias, scoring_func / topk_method, hidden_dropout): all refused as unknown before; read (or assumed) now and
  accepted where they state what transformers builds, refused by name where they do not.
"""
from __future__ import annotations

import pytest
from fixtures.tiny_hf import edit_config, tiny_config
from test_released_settings import _served_as_transformers


def _from_hf(cfg: dict):
    from xllm_gen.runtime.loading import registry

    module, _ = registry.resolve(cfg)
    return module.Config.from_hf(cfg)


# --- AFMoE (arcee-ai/Trinity-Nano-Preview, Trinity-Mini)
_TRINITY_ROUTER = {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1,
                   "num_expert_groups": 1, "num_limited_groups": 1, "use_grouped_mm": True}


def test_trinity_router_fields_are_served_as_transformers(tiny_checkpoint, tmp_path):
    ckpt = edit_config(tiny_checkpoint("AfmoeForCausalLM"), tmp_path / "trinity",
                       lambda c: c.update(_TRINITY_ROUTER))
    _served_as_transformers(ckpt, "AFMoE with Trinity's router fields")


@pytest.mark.parametrize("field,value", [("score_func", "softmax"), ("route_norm", False), ("n_group", 4),
                                         ("topk_group", 2), ("num_expert_groups", 4), ("num_limited_groups", 2)])
def test_trinity_other_router_values_are_refused(field, value):
    cfg = tiny_config("AfmoeForCausalLM").to_dict()
    cfg.update(_TRINITY_ROUTER, **{field: value})
    with pytest.raises(ValueError, match=field):
        _from_hf(cfg)


# --- GLM-MoE-DSA (zai-org/GLM-5, GLM-5.3)
_GLM5_FIELDS = {"indexer_rope_interleave": True, "moe_router_dtype": "float32"}


def test_glm5_indexer_rope_and_router_dtype_are_served_as_transformers(tiny_checkpoint, tmp_path):
    ckpt = edit_config(tiny_checkpoint("GlmMoeDsaForCausalLM"), tmp_path / "glm5", lambda c: c.update(_GLM5_FIELDS))
    _served_as_transformers(ckpt, "GLM-MoE-DSA with GLM-5's indexer_rope_interleave / moe_router_dtype")


def test_glm5_unrotated_pairs_indexer_is_refused():
    cfg = tiny_config("GlmMoeDsaForCausalLM").to_dict()
    cfg.update(_GLM5_FIELDS, indexer_rope_interleave=False)
    with pytest.raises(ValueError, match="indexer_rope_interleave"):
        _from_hf(cfg)


# --- MiMo-V2-Flash (XiaomiMiMo/MiMo-V2-Flash)
def _mimo_released(c: dict) -> None:
    """The release's restatements, written from the tiny config's own values (what transformers builds)."""
    rp = c["rope_parameters"]
    c.update(hybrid_layer_pattern=[0 if t == "full_attention" else 1 for t in c["layer_types"]],
             moe_layer_freq=[0 if t == "dense" else 1 for t in c["mlp_layer_types"]],
             swa_num_attention_heads=c["num_attention_heads"], swa_num_key_value_heads=2 * c["num_key_value_heads"],
             swa_head_dim=c["head_dim"], swa_v_head_dim=c["v_head_dim"],
             rope_theta=rp["full_attention"]["rope_theta"], swa_rope_theta=rp["sliding_attention"]["rope_theta"],
             partial_rotary_factor=rp["full_attention"]["partial_rotary_factor"],
             layernorm_epsilon=c["rms_norm_eps"], sliding_window_size=c["sliding_window"] - 1,
             attention_chunk_size=c["sliding_window"] - 1, add_swa_attention_sink_bias=True,
             add_full_attention_sink_bias=False, use_qk_norm=False, mlp_bias=False, scoring_func="sigmoid",
             topk_method="noaux_tc", hidden_dropout=0.0)


def test_mimo_v2_flash_released_restatements_are_served_as_transformers(tiny_checkpoint, tmp_path):
    ckpt = edit_config(tiny_checkpoint("MiMoV2FlashForCausalLM"), tmp_path / "mimo", _mimo_released)
    _served_as_transformers(ckpt, "MiMo-V2-Flash with the release's restated fields")


def _flip_first(key):
    return lambda c: [1 - c[key][0]] + c[key][1:]


@pytest.mark.parametrize("field,value", [
    ("hybrid_layer_pattern", _flip_first("hybrid_layer_pattern")),
    ("moe_layer_freq", _flip_first("moe_layer_freq")),
    ("swa_num_attention_heads", lambda c: 2 * c["num_attention_heads"]),
    ("swa_num_key_value_heads", lambda c: c["num_key_value_heads"]),
    ("swa_head_dim", lambda c: 2 * c["head_dim"]),
    ("swa_v_head_dim", lambda c: 2 * c["v_head_dim"]),
    ("rope_theta", lambda c: 1000000.0),
    ("swa_rope_theta", lambda c: 500000.0),
    ("partial_rotary_factor", lambda c: 0.5),
    ("layernorm_epsilon", lambda c: 1e-6),
    ("attention_chunk_size", lambda c: 4096),
    ("add_full_attention_sink_bias", lambda c: True),
    ("add_swa_attention_sink_bias", lambda c: False),
    ("use_qk_norm", lambda c: True),
])
def test_mimo_v2_flash_restatements_that_differ_are_refused(field, value):
    cfg = tiny_config("MiMoV2FlashForCausalLM").to_dict()
    _mimo_released(cfg)
    _from_hf(dict(cfg))                               # the release form itself is accepted
    cfg[field] = value(cfg)
    with pytest.raises(ValueError, match=field):
        _from_hf(cfg)


# --- Cohere 2 MoE (CohereLabs/North-Mini-Code-1.0)
def test_cohere2_moe_rmsnorm_form_is_served_as_transformers(tiny_checkpoint, tmp_path):
    """North-Mini-Code-1.0 sets `rms_norm_eps` (1e-6, beside layer_norm_eps 1e-5): transformers' Cohere 2 MoE then
    builds RMSNorms for every layer norm and the final norm (same weights). Refused before (the LayerNorm form only);
    served now (the norms' `center` flag)."""
    ckpt = edit_config(tiny_checkpoint("Cohere2MoeForCausalLM"), tmp_path / "north",
                       lambda c: c.update(rms_norm_eps=1e-6, layer_norm_eps=1e-5))
    _served_as_transformers(ckpt, "Cohere 2 MoE, RMSNorm form")


def test_layernorm_without_centering_is_rmsnorm_math():
    import torch

    from xllm_gen.runtime.layers.norm import LayerNorm, RMSNorm

    torch.manual_seed(0)
    x, r = torch.randn(3, 16) * 3 + 1, torch.randn(3, 16)
    ln, rms = LayerNorm(16, 1e-6, bias=False, center=False), RMSNorm(16, 1e-6)
    with torch.no_grad():
        ln.weight.copy_(torch.randn(16))
        rms.weight.copy_(ln.weight)
    assert torch.allclose(ln(x), rms(x), atol=1e-6)
    (y1, s1), (y2, s2) = ln(x, r), rms(x, r)
    assert torch.allclose(y1, y2, atol=1e-6) and torch.equal(s1, s2)
    centered = LayerNorm(16, 1e-6, bias=False)
    with torch.no_grad():
        centered.weight.copy_(ln.weight)
    assert not torch.allclose(centered(x), ln(x), atol=1e-3)      # (the mean is not zero: the forms differ)


@pytest.mark.parametrize("center,extra,message", [
    ("false", "", "center: false: write `kind: rmsnorm`"),
    ("layernorm_form", ", weight: false", "the RMSNorm form needs a plain weight"),
    ("layernorm_form", ", weight_offset: 1", "the RMSNorm form needs a plain weight"),
])
def test_layernorm_center_misuse_is_a_located_error(tmp_path, center, extra, message):
    from pathlib import Path

    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.errors import SpecError, SpecErrors

    text = (Path(__file__).resolve().parents[1] / "specs" / "cohere2_moe.yaml").read_text()
    old = "input_layernorm: {kind: layernorm, dim: hidden_size, eps: norm_eps, bias: false, center: layernorm_form}"
    assert old in text
    path = tmp_path / "mutant.yaml"
    path.write_text(text.replace(old, "input_layernorm: {kind: layernorm, dim: hidden_size, eps: norm_eps, "
                                      f"bias: false, center: {center}{extra}}}"))
    # (extends: resolved beside the original)
    path.write_text(path.read_text().replace("extends: cohere2.yaml",
                                             f"extends: {Path(__file__).resolve().parents[1] / 'specs' / 'cohere2.yaml'}"))
    with pytest.raises((SpecError, SpecErrors)) as info:
        compile_spec(path)
    assert message in str(info.value)
