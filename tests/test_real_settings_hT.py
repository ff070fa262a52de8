"""(hT) Released settings of the newest families: GraniteMoeSWA / GraniteSWA, OlmoHybrid, LFM3, MiniCPM5-MoE, Laguna,
Hy3 / HYV4, dots3-note, Kolibri1 / 1.1, Ergo, Flint, HrmText, CohereCompass, Apertus 1.5, A.X K1 / K2, Gemma 4 unified,
LaraMini, Beam, Cohere2-MoE (North). Each release's config.json (tests/data/real_configs; provenance in its MANIFEST:
found in the stored index, whole or as the field list a vendoring repository pins, or - where no release was found -
the transformers 5.25 config class's documented defaults at its documented release size), every non-size field as
there, only the sizes shrunk: each integer field that transformers' tiny fixture shrinks takes the tiny value, the
layer count is cut to the first `layers` of the release's per-layer lists (so the tiny model keeps the release's
pattern), per-layer head counts map onto the tiny head counts. `verify` must find the same greedy tokens and
per-layer states as transformers.
"""
from __future__ import annotations

import functools

import pytest
from test_real_settings import ROOT, _build, _real

# integers that are no size (kept as released even where the tiny fixture sets them)
_KEEP = {"max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "original_max_position_embeddings", "n_group", "topk_group"}


@functools.cache
def _sizes(arch: str) -> tuple[dict, dict]:
    from fixtures.tiny_hf import model_class, tiny_config

    return model_class(arch).config_class().to_dict(), tiny_config(arch, None).to_dict()


def _shrunk(arch: str, stem: str, layers: int, heads_map: dict | None = None, **extra) -> dict:
    c = _real(stem)
    default, tiny = _sizes(arch)
    n = c.get("num_hidden_layers", default.get("num_hidden_layers"))
    for k, v in list(c.items()):
        t = tiny.get(k)
        if (k not in _KEEP and isinstance(v, int) and not isinstance(v, bool) and isinstance(t, int)
                and not isinstance(t, bool) and t != default.get(k)):
            c[k] = t
        elif isinstance(v, list) and len(v) == n and n != layers:
            c[k] = v[:layers]
    c["num_hidden_layers"] = layers
    if heads_map:
        for k in ("num_attention_heads_per_layer",):
            if k in c:
                c[k] = [heads_map[h] for h in c[k]]
    c.update(extra)
    return c


def _dots3() -> dict:
    # the release's partial rotary 0.25 of head_dim (the sliding layers' q/k width) is qk_rope_head_dim: tiny head_dim
    # 32 = nope 24 + rope 8 on the sliding layers (its per-layer overrides, zero-padded keys as released), nope 16 on
    # the indexed ones
    c = _shrunk("Dots3NoteForCausalLM", "dots3_note__documented-defaults", 4, head_dim=32, qk_rope_head_dim=8,
                qk_nope_head_dim=16, v_head_dim=12, kv_lora_rank=16, q_lora_rank=24)
    c["per_layer_config"] = {k: {"num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 32,
                                 "qk_nope_head_dim": 24} for k in c["per_layer_config"] if int(k) < 4}
    return c


def _compass() -> dict:
    c = _shrunk("CohereCompassForCausalLM", "cohere_compass__North-Micro-Vision-Instruct-text", 4)
    c["rope_parameters"] = {**c["rope_parameters"],
                            "sliding_attention": {**c["rope_parameters"]["sliding_attention"], "mrope_section": [4, 2, 2]}}
    return c


def _kolibri1_1() -> dict:
    # 10 layers: the release's first indexed layer (4) and the layer reading its K/V (9, kv_source_layers)
    c = _shrunk("Kolibri1_1ForCausalLM", "kolibri1_1__documented-defaults", 10)
    c["index_layers"] = [i for i in c["index_layers"] if i < 10]
    return c


_D = "__documented-defaults"
CASES = {
    "granite-swa-3b-a600m": ("GraniteMoeSWAForCausalLM", "granitemoe_swa",
                             lambda: _shrunk("GraniteMoeSWAForCausalLM", "granitemoe_swa__granite-swa-3b-a600m", 4,
                                             num_experts_per_tok=2)),
    "granite-swa-defaults": ("GraniteSWAForCausalLM", "granite_swa",
                             lambda: _shrunk("GraniteSWAForCausalLM", "granite_swa" + _D, 4)),
    "olmo-hybrid-defaults": ("OlmoHybridForCausalLM", "olmo_hybrid",
                             lambda: _shrunk("OlmoHybridForCausalLM", "olmo_hybrid" + _D, 4)),
    "lfm3-defaults": ("Lfm3ForCausalLM", "lfm3", lambda: _shrunk("Lfm3ForCausalLM", "lfm3" + _D, 5)),
    "minicpm5-moe": ("MiniCPM5MoeForCausalLM", "minicpm5_moe",
                     lambda: _shrunk("MiniCPM5MoeForCausalLM", "minicpm5_moe__MiniCPM5-MoE", 3)),
    # 5 layers (full, 3 sliding, full); per-layer heads 48 / 64 -> 6 / 8 (kv 2)
    "laguna-xs.2.1": ("LagunaForCausalLM", "laguna",
                      lambda: _shrunk("LagunaForCausalLM", "laguna__Laguna-XS.2.1", 5, {48: 6, 64: 8},
                                      num_attention_heads=6)),
    "hy3": ("HYV3ForCausalLM", "hy_v3", lambda: _shrunk("HYV3ForCausalLM", "hy_v3__Hy3", 3)),
    "hy-v4-defaults": ("HYV4ForCausalLM", "hy_v4", lambda: _shrunk("HYV4ForCausalLM", "hy_v4" + _D, 4)),
    "dots3-note-defaults": ("Dots3NoteForCausalLM", "dots3_note", _dots3),
    "kolibri1-defaults": ("Kolibri1ForCausalLM", "kolibri1",
                          lambda: _shrunk("Kolibri1ForCausalLM", "kolibri1" + _D, 5)),
    "kolibri1.1-defaults": ("Kolibri1_1ForCausalLM", "kolibri1_1", _kolibri1_1),
    "ergo-defaults": ("ErgoForCausalLM", "ergo", lambda: _shrunk("ErgoForCausalLM", "ergo" + _D, 4)),
    "flint-defaults": ("FlintForCausalLM", "flint", lambda: _shrunk("FlintForCausalLM", "flint" + _D, 4)),
    "hrm-text-defaults": ("HrmTextForCausalLM", "hrm_text",
                          lambda: _shrunk("HrmTextForCausalLM", "hrm_text" + _D, 24)),
    # the sliding layers' interleaved mRoPE section [24, 20, 20] of head_dim 128 -> [4, 2, 2] of 16
    "north-micro-vision-instruct-text": ("CohereCompassForCausalLM", "cohere_compass", _compass),
    "apertus-v1.5-8b": ("Apertus1p5TextForCausalLM", "apertus1p5",
                        lambda: _shrunk("Apertus1p5TextForCausalLM", "apertus1p5__Apertus-v1.5-8B-text", 3,
                                        output_vocab_size=384)),   # 131072 of 266752: logits over a prefix
    # 8 groups of 2 experts (256 in 8 groups of 32 as released), the best 4 groups kept
    "axk1-defaults": ("AXK1ForCausalLM", "axk1",
                      lambda: _shrunk("AXK1ForCausalLM", "axk1" + _D, 4, n_routed_experts=16)),
    "axk2-defaults": ("AXK2ForCausalLM", "axk2", lambda: _shrunk("AXK2ForCausalLM", "axk2" + _D, 4)),
    "gemma-4-12b-unified": ("Gemma4UnifiedForCausalLM", "gemma4",
                            lambda: _shrunk("Gemma4UnifiedForCausalLM", "gemma4__gemma-4-12B-unified-text", 6,
                                            global_head_dim=32, num_global_key_value_heads=1)),
    "lara-mini-defaults": ("LaraMiniForCausalLM", "lara_mini",
                           lambda: _shrunk("LaraMiniForCausalLM", "lara_mini" + _D, 4)),
    # 6 layers (the first full layer is 5; 3 dense layers), 8 groups of 2 experts
    "beam-defaults": ("BeamForCausalLM", "beam",
                      lambda: _shrunk("BeamForCausalLM", "beam" + _D, 6, num_experts=16)),
}

# the release's RMSNorm form (`rms_norm_eps` set: a layernorm without centering, hR's `center` flag), and the same
# release without rms_norm_eps (the LayerNorm form); 5 layers (full, 3 sliding, full); top-8 of 16 experts
_NORTH = dict(num_experts=16, prefix_dense_intermediate_size=96)
CASES["north-mini-code-1.0"] = (
    "Cohere2MoeForCausalLM", "cohere2_moe",
    lambda: _shrunk("Cohere2MoeForCausalLM", "cohere2_moe__North-Mini-Code-1.0", 5, **_NORTH))
CASES["north-mini-code-1.0-layernorm"] = (
    "Cohere2MoeForCausalLM", "cohere2_moe",
    lambda: {k: v for k, v in _shrunk("Cohere2MoeForCausalLM", "cohere2_moe__North-Mini-Code-1.0", 5,
                                      **_NORTH).items() if k != "rms_norm_eps"})
REFUSED: dict = {}      # (case -> (architecture, spec, config factory, the field the refusal names))


def _build_only(arch: str, cfg: dict) -> dict | None:
    """What the build alone needs: per-layer-type rope mappings as released (_build's flat rope_parameters would
    replace them); the per-layer overrides the config class derives from the release's legacy fields (Gemma 4
    unified's global_head_dim), in place of the tiny fixture's own."""
    from fixtures.tiny_hf import ARCH_DEFAULTS, DROP, model_class

    out = {}
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        out["rope_parameters"] = rp
    stale = set(ARCH_DEFAULTS.get(arch, {}).get("per_layer_config") or {}) | set(
        model_class(arch).config_class().to_dict().get("per_layer_config") or {})
    if stale:
        kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
        derived = model_class(arch).config_class(**kw).to_dict().get("per_layer_config") or {}
        out["per_layer_config"] = {**{k: DROP for k in stale}, **{str(k): dict(v) for k, v in derived.items()}}
    return out or None


@pytest.mark.slow      # ~10 s each: a transformers model and an engine per checkpoint
@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_real_settings_ht_verify(case, tmp_path):
    from xllm_gen.codegen.verify import verify

    arch, spec, make = CASES[case]
    cfg = make()
    ckpt = _build(tmp_path / case, arch, cfg, _build_only(arch, cfg))
    report = verify(ROOT / "specs" / f"{spec}.yaml", ckpt, prompt_lens=(3, 9, 17, 30))
    assert report.ok, report.text()


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("case", list(REFUSED))
def test_real_settings_ht_refused(case, tmp_path):
    from xllm_gen.codegen.verify import verify

    arch, spec, make, field = REFUSED[case]
    cfg = make()
    ckpt = _build(tmp_path / case, arch, cfg, _build_only(arch, cfg))
    report = verify(ROOT / "specs" / f"{spec}.yaml", ckpt, prompt_lens=(3, 9))
    assert not report.ok and "REFUSED" in report.text() and field in report.text(), report.text()
