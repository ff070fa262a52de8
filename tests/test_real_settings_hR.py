"""(hR) Released settings of linear-attention / sparse-attention / MoE families: MiniMax-Text-01, Kimi-Linear,
FlexOlmo, DeepSeek-V3.2-Exp, GLM-5 (GlmMoeDsa), MiMo-V2-Flash, AFMoE (Trinity), Aria's text decoder, Cohere 2 MoE
(North-Mini-Code-1.0) and the Bailing linear releases (Ring-*-linear-2.0). Each release's config.json (tests/data/real_configs, provenance in MANIFEST.md), every non-size
field as published, the sizes shrunk; the weights from transformers' own class. `verify` must find the same greedy
tokens and per-layer states as transformers. Releases transformers cannot build (remote-code-only classes) must be
refused at load, naming what is not served.
"""
from __future__ import annotations

import pytest
from test_real_settings import ROOT, _build, _real


def _minimax_text01_hf() -> dict:
    c = _real("minimax__MiniMax-Text-01-hf")      # alpha 3.557 on every residual, 7 lightning layers then 1 full
    c.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
             num_hidden_layers=8, layer_types=c["layer_types"][:8], num_local_experts=8, vocab_size=512)
    return c


def _kimi_linear_48b() -> dict:
    c = _real("kimi_linear__Kimi-Linear-48B-A3B-Instruct")   # NoPE MLA every 4th layer (1-based lists), KDA between,
    c.update(hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=4,   # one dense layer, sigmoid
             kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,   # router with bias,
             intermediate_size=128, moe_intermediate_size=32, num_experts=16, num_experts_per_token=4,  # scale 2.446
             num_hidden_layers=5, vocab_size=512)
    c["linear_attn_config"] = dict(c["linear_attn_config"], full_attn_layers=[4, 5], kda_layers=[1, 2, 3],
                                   head_dim=8, num_heads=4)
    return c


def _flex_olmo_7x7b() -> dict:
    c = _real("flex_olmo__FlexOlmo-7x7B-1T")       # 7 experts top-5 unnormalized, q/k norms over the projections
    c.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3, intermediate_size=64,
             vocab_size=512)
    return c


_MLA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, intermediate_size=128, moe_intermediate_size=32,
            vocab_size=512, index_head_dim=16, index_topk=6)


def _deepseek_v32_exp() -> dict:
    c = _real("deepseek_v32__DeepSeek-V3.2-Exp")   # yarn 40 (mscale 1 / 1), 3 dense layers, 8 groups best 4, sparse top
    c.pop("quantization_config")                  # (FP8 blocks; the tiny weights are float32)
    c.update(_MLA, v_head_dim=16, num_hidden_layers=5, n_routed_experts=16, num_experts_per_tok=4, index_n_heads=8)
    return c


def _glm5() -> dict:
    c = _real("glm_moe_dsa__GLM-5")                # interleaved rope (rope_interleave, indexer_rope_interleave)
    c.update(_MLA, v_head_dim=16, qk_head_dim=24, num_hidden_layers=5, n_routed_experts=16, num_experts_per_tok=4,
             index_n_heads=4)
    return c


def _glm53() -> dict:
    c = _real("glm_moe_dsa__GLM-5.3")              # indexer shared by 3 of 4 layers (index_topk_freq 4, offset 3)
    c.update(_MLA, v_head_dim=16, qk_head_dim=24, num_hidden_layers=6, n_routed_experts=16, num_experts_per_tok=4,
             index_n_heads=4, indexer_types=c["indexer_types"][:6], mlp_layer_types=c["mlp_layer_types"][:6])
    return c


def _mimo_v2_flash() -> dict:
    c = _real("mimo_v2_flash__MiMo-V2-Flash")      # sinks on the sliding layers, value scale 0.707, partial rotary
    c.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=24, v_head_dim=16,   # 0.334
             swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=24, swa_v_head_dim=16,
             num_hidden_layers=6, hybrid_layer_pattern=c["hybrid_layer_pattern"][:6],
             moe_layer_freq=c["moe_layer_freq"][:6], intermediate_size=128, moe_intermediate_size=32,
             n_routed_experts=16, num_experts_per_tok=4, sliding_window=6, sliding_window_size=6,
             attention_chunk_size=6, vocab_size=512)
    # the release's `rope_scaling: null` makes transformers 5's MiMoV2FlashConfig drop its per-layer-type rope (its
    # rope_parameters end up None and the model cannot be built): left out, as transformers can only load it so
    c.pop("rope_scaling")
    return c


def _trinity(stem: str) -> dict:
    c = _real(stem)                                # muP embedding scale, 2 dense layers, every 4th layer global NoPE
    c.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
             moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4, num_hidden_layers=6,
             sliding_window=6, vocab_size=512)
    return c


def _aria_text() -> dict:
    c = _real("aria_text__Aria")   # 64 experts top-6 + 2 shared, theta 5e6
    c.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32, num_hidden_layers=3,
             moe_num_experts=16, vocab_size=512)
    return c


def _north_mini_code() -> dict:
    c = _real("cohere2_moe__North-Mini-Code-1.0")  # a dense first layer, sigmoid top-8 unnormalized, every 4th full
    c.update(hidden_size=64, head_dim=16, num_attention_heads=8, num_key_value_heads=1, num_hidden_layers=5,
             layer_types=c["layer_types"][:5], intermediate_size=32, prefix_dense_intermediate_size=128,
             num_experts=16, sliding_window=6, vocab_size=512)
    return c


CASES = {
    "minimax-text-01-hf": ("MiniMaxForCausalLM", "minimax", _minimax_text01_hf, (3, 9, 17, 30)),
    "kimi-linear-48b-a3b": ("KimiLinearForCausalLM", "kimi_linear", _kimi_linear_48b, (3, 9, 17, 30)),
    "flexolmo-7x7b-1t": ("FlexOlmoForCausalLM", "flex_olmo", _flex_olmo_7x7b, (3, 9, 17, 30)),
    "deepseek-v3.2-exp": ("DeepseekV32ForCausalLM", "deepseek_v32", _deepseek_v32_exp, (3, 9, 17, 30)),
    "glm-5": ("GlmMoeDsaForCausalLM", "glm_moe_dsa", _glm5, (3, 9, 17, 30)),
    "glm-5.3": ("GlmMoeDsaForCausalLM", "glm_moe_dsa", _glm53, (3, 9, 17, 30)),
    "mimo-v2-flash": ("MiMoV2FlashForCausalLM", "mimo_v2_flash", _mimo_v2_flash, (3, 9, 17, 30)),
    "trinity-nano-preview": ("AfmoeForCausalLM", "afmoe", lambda: _trinity("afmoe__Trinity-Nano-Preview"),
                             (3, 9, 17, 30)),
    "trinity-mini": ("AfmoeForCausalLM", "afmoe", lambda: _trinity("afmoe__Trinity-Mini"), (3, 9, 17, 30)),
    "aria-text": ("AriaTextForCausalLM", "aria_text", _aria_text, (3, 9, 17, 30)),
    "north-mini-code-1.0": ("Cohere2MoeForCausalLM", "cohere2_moe", _north_mini_code, (3, 9, 17, 30)),
}
# sizes the tiny weights need that the real config.json leaves to the config class
# (the fixture's 3-layer lists replaced by what the release's fields give transformers)
BUILD_ONLY: dict[str, dict] = {
    "deepseek-v3.2-exp": {"mlp_layer_types": None}, "glm-5": {"mlp_layer_types": None, "indexer_types": None},
    "mimo-v2-flash": {"layer_types": None, "mlp_layer_types": None},
    "trinity-nano-preview": {"layer_types": None}, "trinity-mini": {"layer_types": None},
    "north-mini-code-1.0": {"mlp_layer_types": None}}


@pytest.mark.slow      # ~10 s each: a transformers model and an engine per checkpoint
@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_real_settings_hr_verify(case, tmp_path):
    from xllm_gen.codegen.verify import verify

    arch, spec, make, prompt_lens = CASES[case]
    ckpt = _build(tmp_path / case, arch, make(), BUILD_ONLY.get(case))
    report = verify(ROOT / "specs" / f"{spec}.yaml", ckpt, prompt_lens=prompt_lens)
    assert report.ok, report.text()


# releases of remote-code-only classes transformers cannot build: refused at load, naming the class
REFUSED = {
    "minimax-text-01": ("minimax__MiniMax-Text-01", "MiniMaxText01ForCausalLM"),
    # the Ring linear 2.0 releases (lightning-style linear attention in groups, bailing_moe_linear): not the
    # KDA + MLA model transformers' bailing_hybrid builds (specs/bailing_hybrid.yaml)
    "ring-mini-linear-2.0": ("bailing_hybrid__Ring-mini-linear-2.0", "BailingMoeLinearV2ForCausalLM"),
    "ring-flash-linear-2.0": ("bailing_hybrid__Ring-flash-linear-2.0", "BailingMoeLinearV2ForCausalLM"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_real_settings_hr_refused(case):
    from xllm_gen.runtime.loading import registry

    stem, named = REFUSED[case]
    with pytest.raises(ValueError, match=named):
        registry.resolve(_real(stem))


def test_minimax_text01_hf_with_rotary_dim_is_refused():
    """The remote release rotates rotary_dim 64 of head_dim 128; transformers' MiniMax rotates the whole head and
    never reads rotary_dim. Whether the -hf file carries it is not known here: if it does, the engine cannot serve
    both readings, and refuses it by name (not modelled) rather than pick one."""
    from xllm_gen.runtime.loading import registry

    cfg = _minimax_text01_hf()
    cfg["rotary_dim"] = cfg["head_dim"] // 2
    module, _ = registry.resolve(cfg)
    with pytest.raises(ValueError, match="rotary_dim"):
        module.Config.from_hf(cfg)
