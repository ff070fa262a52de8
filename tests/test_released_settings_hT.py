"""(hT) Fast checks of the fixes the released-settings trials (tests/test_real_settings_hT.py) found:

- tencent/Hy3's config.json (num_nextn_predict_layers, qk_norm, first_k_dense_replace, expert_hidden_dim: fields
  transformers' HYV3Config never reads) was refused as unknown fields; accepted now, qk_norm assumed true (refused by
  name otherwise), and the MTP layer's tensors (model.layers.80.*) skipped at load as transformers skips them.
- Laguna XS.2's `gating: "per-head"` (transformers reads it as `true`: one gate per head) was refused ("assumes
  gating=True"): `config_assume` takes `{any_of: [...]}` now (values transformers treats alike), laguna.yaml assumes
  `{any_of: [true, per-head]}`; "per-element" (not modeled) stays refused by name. Its `mlp_only_layers` /
  `norm_topk_prob` (Qwen3-MoE leftovers LagunaConfig deletes; transformers never reads them) were refused as unknown:
  ignored now.
- dots3.note: a sliding layer's per_layer_config entry without a shape key (transformers 5's serialized form omits
  what equals the top level) was read as transformers' fixed sliding defaults (64 heads, ranks 1024, 256 / 192 / 128)
  instead of the top level's: refused at load with a weight-shape error; now per_layer_config's presence decides
  (`present: true`): given, an omitted key is the top level's; absent, the swa_* aliases or the class defaults.
- Gemma 4 (and unified): transformers 5.25 saves per_layer_config as the full layers' difference from the top level
  (`{}` where they equal it); the spec read a missing per-layer head_dim as 512 (the legacy global_head_dim default).
  A config symbol may now tell a field's presence (`present: true`); gemma4.yaml reads the legacy global_head_dim /
  num_global_key_value_heads only where per_layer_config is absent, as transformers does.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from test_real_settings import _real


def _read(cfg: dict):
    from xllm_gen.runtime.loading import registry
    module, _ = registry.resolve(cfg)
    return module.Config.from_hf(cfg)


def test_hy3_release_fields_are_accepted():
    c = _read(_real("hy_v3__Hy3"))
    assert c.num_hidden_layers == 80


def test_hy3_without_qk_norm_is_refused_by_name():
    cfg = _real("hy_v3__Hy3")
    cfg["qk_norm"] = False
    with pytest.raises(Exception, match="qk_norm"):
        _read(cfg)


def test_hy3_mtp_layer_tensors_are_skipped_like_transformers():
    import re

    from transformers import HYV3ForCausalLM

    from xllm_gen.generated.hy_v3 import model
    pats = [p for p in vars(model).values() if isinstance(p, (list, tuple)) and any(
        isinstance(x, str) and "inv_freq" in x for x in p)][0]
    for name in ("model.layers.80.eh_proj.weight", "model.layers.80.self_attn.q_proj.weight"):
        assert any(re.fullmatch(p, name) for p in pats)
        assert any(re.search(p, name) for p in HYV3ForCausalLM._keys_to_ignore_on_load_unexpected)
    assert not any(re.fullmatch(p, "model.layers.8.self_attn.q_proj.weight") for p in pats)


@pytest.mark.parametrize("gating", [True, "per-head"])
def test_laguna_per_head_gating_spellings_are_served(gating):
    cfg = _real("laguna__Laguna-XS.2.1")
    cfg["gating"] = gating
    _read(cfg)


@pytest.mark.parametrize("gating", ["per-element", False])
def test_laguna_other_gating_is_refused_by_name(gating):
    cfg = _real("laguna__Laguna-XS.2.1")
    cfg["gating"] = gating
    with pytest.raises(Exception, match="gating"):
        _read(cfg)


def test_transformers_reads_laguna_gating_spellings_alike():
    from transformers import LagunaConfig
    from transformers.models.laguna.modeling_laguna import LagunaAttention

    def per_head(g):
        c = LagunaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_hidden_layers=1, gating=g)
        return LagunaAttention(c, 0, 4).gate_per_head

    assert per_head(True) and per_head("per-head") and not per_head("per-element")


def test_config_assume_any_of_in_the_language(tmp_path):
    from pydantic import TypeAdapter

    from xllm_gen.codegen.schema import AssumeAnyOf, Spec
    from xllm_gen.runtime.loading.hf_config import ConfigError, ConfigReader

    field = Spec.model_fields["config_assume"]
    parsed = TypeAdapter(field.annotation).validate_python({"gating": {"any_of": [True, "per-head"]}, "x": 1})
    assert isinstance(parsed["gating"], AssumeAnyOf) and parsed["x"] == 1
    r = ConfigReader({"gating": "per-head"}, "x.yaml", assume={"gating": {"any_of": [True, "per-head"]}})
    r.finish()
    r = ConfigReader({"gating": "per-element"}, "x.yaml", assume={"gating": {"any_of": [True, "per-head"]}})
    with pytest.raises(ConfigError, match="gating"):
        r.finish()
    # one value is a value (found by a blind exercise: refused with a pydantic union message); none is a located
    # error, not the internal error it was
    assert isinstance(TypeAdapter(field.annotation).validate_python({"g": {"any_of": [1]}})["g"], AssumeAnyOf)
    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.errors import SpecError
    spec = tmp_path / "s.yaml"
    spec.write_text(f"extends: {Path(__file__).resolve().parents[1] / 'specs' / 'llama.yaml'}\nname: s\n"
                    "class_prefix: S\narchitectures: [SForCausalLM]\nconfig_assume:\n  pretraining_tp: {any_of: []}\n")
    with pytest.raises(SpecError, match=r"s\.yaml:6:.*config_assume\.pretraining_tp\.any_of: list the values"):
        compile_spec(spec)


_SWA = {"swa_heads": "num_attention_heads", "swa_kv_heads": "num_key_value_heads", "swa_q_lora_rank": "q_lora_rank",
        "swa_kv_lora_rank": "kv_lora_rank", "swa_head_dim": "head_dim", "swa_qk_nope_head_dim": "qk_nope_head_dim",
        "swa_v_head_dim": "v_head_dim", "swa_qk_rope_head_dim": "qk_rope_head_dim"}
_DOTS3_TOP = {"architectures": ["Dots3NoteForCausalLM"], "model_type": "dots3_note", "hidden_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24,
              "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "head_dim": 32,
              "layer_types": ["indexed_attention", "indexed_attention", "sliding_attention", "sliding_attention"]}


@pytest.mark.parametrize("extra", [
    # transformers 5's serialized form: only what differs from the top level
    {"per_layer_config": {"02": {"num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 32,
                                 "qk_nope_head_dim": 24}, "03": {"num_attention_heads": 2, "num_key_value_heads": 2,
                                                                 "kv_lora_rank": 32, "qk_nope_head_dim": 24}}},
    {"per_layer_config": {"02": {"kv_lora_rank": 32, "qk_nope_head_dim": 24},
                          "03": {"kv_lora_rank": 32, "qk_nope_head_dim": 24}}},
    # the released form: swa_* aliases, no per_layer_config (the class derives the entries)
    {"swa_num_attention_heads": 2, "swa_num_key_value_heads": 2, "swa_q_lora_rank": 16, "swa_kv_lora_rank": 32,
     "swa_head_dim": 32, "swa_qk_nope_head_dim": 24, "swa_v_head_dim": 12},
], ids=["per-layer-diff", "per-layer-one-key", "swa-aliases"])
def test_dots3_sliding_shapes_read_as_transformers(extra):
    """A sliding layer's per_layer_config entry omitting a shape has the top level's (transformers 5 saves only the
    difference): the spec read transformers' fixed sliding defaults (64 heads, ranks 1024, 256 / 192 / 128) there
    before - refused at load with a weight-shape error; now per_layer_config's presence decides, as in transformers."""
    from transformers.models.dots3_note.configuration_dots3_note import Dots3NoteTextConfig

    cfg = {**_DOTS3_TOP, **extra}
    hf = Dots3NoteTextConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    layer = hf.per_layer_config[2]
    c = _read(cfg)
    assert {k: getattr(c, k) for k in _SWA} == {k: getattr(layer, v) for k, v in _SWA.items()}


@pytest.mark.parametrize("arch,cls", [("Gemma4UnifiedForCausalLM", "Gemma4UnifiedTextConfig"),
                                      ("Gemma4ForCausalLM", "Gemma4TextConfig")])
def test_gemma4_per_layer_config_given_omits_what_equals_the_top_level(arch, cls):
    """transformers 5 writes per_layer_config as each full layer's difference from the top level: a checkpoint whose
    full layers have the sliding layers' head_dim saves `per_layer_config: {}`. The spec read the full layers' head_dim
    as 512 (the legacy global_head_dim's default) there: now per_layer_config's presence decides (`present: true`),
    as in transformers; without it the legacy global_head_dim is read."""
    import transformers

    conf = getattr(transformers, cls)
    kw = dict(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, intermediate_size=128)
    for extra in (dict(head_dim=32, global_head_dim=32), dict(head_dim=32, global_head_dim=64)):
        hf = conf(**kw, **extra)
        d = {**hf.to_dict(), "architectures": [arch]}
        full = hf.per_layer_config[hf.layer_types.index("full_attention")]
        assert _read(d).global_head_dim == full.head_dim
        legacy = {k: v for k, v in d.items() if k != "per_layer_config"} | extra
        assert _read(legacy).global_head_dim == full.head_dim


def test_present_symbols_read_no_content():
    """`present: true` tells a field's presence only: the keys under it are still the guard's."""
    from xllm_gen.runtime.loading.hf_config import ConfigReader

    for hf, want in (({"per_layer_config": {}}, True), ({"per_layer_config": None}, True), ({}, False)):
        r = ConfigReader(hf, "x.yaml")
        assert r.present("given", "per_layer_config") is want
        r.finish()
    r = ConfigReader({"per_layer_config": {"5": {"sliding_window": 3}}}, "x.yaml")
    r.present("given", "per_layer_config")
    with pytest.raises(Exception, match="sliding_window"):
        r.finish()
