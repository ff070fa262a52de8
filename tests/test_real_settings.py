"""Tiny checkpoints at the real settings of released checkpoints: the config.json of tests/data/real_configs (or, for
a release without a file there, its fields as published), every non-size field as released (rope scaling mappings
with their factor lists, windows, soft-caps, partial rotary, biases, tie, norm flags), only the sizes shrunk; the
weights from transformers' own class (tests/fixtures/tiny_hf.py), config.json replaced by the shrunken real file.
`xllm-gen verify` must find the same greedy tokens and per-layer states as transformers.

Where a real list is per rotating frequency (longrope's short / long factors), it is subsampled to the tiny head.
The long-context regimes shrink the original context too (8, ratio 32 as Phi-3.5-mini's 4096 -> 131072), so the
prompts (9..30 tokens) exceed it from their prefill on.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

REAL = Path(__file__).parent / "data" / "real_configs"
ROOT = Path(__file__).resolve().parents[1]
_META = ("architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "bos_token_id",
         "eos_token_id", "pad_token_id", "model_type", "_attn_implementation")


def _real(stem: str) -> dict:
    return json.loads((REAL / f"{stem}.json").read_text())


def _shrink_factors(cfg: dict, n: int) -> dict:
    rs = dict(cfg["rope_scaling"])
    for key in ("short_factor", "long_factor"):
        rs[key] = [rs[key][i] for i in np.linspace(0, len(rs[key]) - 1, n).round().astype(int)]
    return {**cfg, "rope_scaling": rs}


def _phi35(rope_type: str, long: bool) -> dict:
    c = _real("phi3__Phi-3.5-mini-instruct")
    c.update(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
             intermediate_size=256, vocab_size=512)
    c = _shrink_factors(c, 16)                     # head_dim 32: 16 rotating frequencies
    c["rope_scaling"]["type"] = rope_type
    if long:
        c.update(original_max_position_embeddings=8, max_position_embeddings=256)
    return c


def _gemma2_27b() -> dict:
    c = _real("gemma2__gemma-2-27b")               # query_pre_attn_scalar = hidden / heads (144), not head_dim (128)
    c.update(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
             num_hidden_layers=4, intermediate_size=192, vocab_size=512, sliding_window=6, sliding_window_size=6)
    return c


# stabilityai/stablelm-2-12b (its config.json as published): GQA 32 / 8, per-head q/k LayerNorms, parallel residual
_STABLELM_2_12B = {
    "architectures": ["StableLmForCausalLM"], "bos_token_id": 100257, "eos_token_id": 100257, "hidden_act": "silu",
    "hidden_dropout": 0.0, "attention_dropout": 0.0, "hidden_size": 160, "initializer_range": 0.01,
    "intermediate_size": 320, "layer_norm_eps": 1e-05, "max_position_embeddings": 4096, "model_type": "stablelm",
    "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 1, "partial_rotary_factor": 0.25,
    "qk_layernorm": True, "rope_scaling": None, "rope_theta": 10000, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_parallel_residual": True, "use_qkv_bias": False,
    "vocab_size": 512}


def _mistral_nemo() -> dict:
    c = _real("mistral__Mistral-7B-v0.3")          # Mistral-Nemo: head_dim 128 beside hidden 5120 / 32 heads (160)
    c.update(hidden_size=160, num_attention_heads=4, num_key_value_heads=1, head_dim=32, num_hidden_layers=3,
             intermediate_size=256, vocab_size=512, max_position_embeddings=1024000, rope_theta=1000000.0,
             sliding_window=None)
    return c


_MLA = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=512)


def _deepseek_v2_lite() -> dict:
    c = _real("deepseek_v2__DeepSeek-V2-Lite")     # yarn factor 40 with mscale = mscale_all_dim 0.707; greedy top-6
    c.update(_MLA, moe_intermediate_size=32, n_routed_experts=8, q_lora_rank=None, aux_loss_alpha=0.001, seq_aux=True,
             attention_dropout=0.0, tie_word_embeddings=False)   # the Hub file's fields the mlc-llm preset leaves out
    return c


def _deepseek_v2() -> dict:
    c = _deepseek_v2_lite()                        # DeepSeek-V2 (236B): low-rank q, 160 experts in 8 groups, best 3
    c.update(q_lora_rank=48, n_routed_experts=16, n_group=8, topk_group=3, topk_method="group_limited_greedy",
             routed_scaling_factor=16.0, aux_loss_alpha=0.003)
    return c


def _deepseek_v3() -> dict:
    c = _real("deepseek_v3__DeepSeek-V3")          # the FP8 quantization_config dropped (the tiny weights are float32)
    c.pop("quantization_config")
    c.update(_MLA, moe_intermediate_size=32, q_lora_rank=48, n_routed_experts=16, first_k_dense_replace=1)
    return c


def _mixtral() -> dict:
    c = _real("mixtral__Mixtral-8x7B-v0.1")
    c.update(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
             vocab_size=512)
    return c


def _exaone4_32b() -> dict:
    c = _real("exaone4__EXAONE-4.0-32B")           # LLLG layer_types, llama3 rope; rotary on the sliding layers only
    c.update(hidden_size=64, head_dim=16, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, sliding_window=6, layer_types=c["layer_types"][:4])
    return c


# openbmb/MiniCPM3-4B's config.json (as published), sizes shrunk: its 16 longrope factors (short = long) subsampled to
# the 4 rotating frequencies of qk_rope_head_dim 8; v_head_dim left implicit (hidden / heads) as there
_MINICPM3_FACTORS = [1.0591234137867171, 3.1174739066063757, 16.43262007003069, 28.717843855233994]


def _minicpm3_4b() -> dict:
    return {"architectures": ["MiniCPM3ForCausalLM"], "bos_token_id": 1, "eos_token_id": [2, 73440],
            "hidden_act": "silu", "initializer_range": 0.1, "hidden_size": 64, "num_hidden_layers": 3,
            "intermediate_size": 160, "max_position_embeddings": 32768, "num_attention_heads": 4,
            "num_key_value_heads": 4, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "q_lora_rank": 48,
            "kv_lora_rank": 32, "rms_norm_eps": 1e-05,
            "rope_scaling": {"type": "longrope", "long_factor": _MINICPM3_FACTORS, "short_factor": _MINICPM3_FACTORS,
                             "original_max_position_embeddings": 32768},
            "vocab_size": 512, "scale_emb": 12, "dim_model_base": 256, "scale_depth": 1.4, "use_cache": True,
            "torch_dtype": "bfloat16"}


_ATT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)


def _gpt_oss(stem: str) -> dict:
    c = _real(stem)                                # yarn factor 32 with truncate false, sinks, sliding 128 -> 6
    c.pop("quantization_config")                   # (MXFP4: tests/test_mxfp4.py; the tiny weights are float32)
    c.update(_ATT, num_hidden_layers=4, layer_types=c["layer_types"][:4], intermediate_size=64, num_local_experts=8,
             sliding_window=6)
    return c


def _dbrx_instruct() -> dict:
    c = _real("dbrx__dbrx-instruct")               # clip_qkv 8, 16 experts top-4 (here 8, and ffn = d_model: square)
    c.update(d_model=64, n_heads=4, n_layers=3, vocab_size=512,
             # transformers 5 reads the rope base from rope_parameters only (the release's attn_config.rope_theta,
             # which the spec reads, is lost there): the same base, written as it reads it
             rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    c["attn_config"] = {**c["attn_config"], "kv_n_heads": 2}
    c["ffn_config"] = {**c["ffn_config"], "ffn_hidden_size": 64, "moe_num_experts": 8}
    return c


def _jetmoe_8b() -> dict:
    c = _real("jetmoe__jetmoe-8b")
    c.update(hidden_size=64, num_key_value_heads=2, kv_channels=16, num_hidden_layers=3, intermediate_size=64,
             num_local_experts=4, vocab_size=512)
    return c


def _dots1_inst(n_group) -> dict:
    c = _real("dots1__dots.llm1.inst")             # 128 experts top-6 (here 8), 2 shared, 1 dense layer, theta 1e7
    c.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3, intermediate_size=128,
             moe_intermediate_size=32, n_routed_experts=8, vocab_size=512, n_group=n_group, topk_group=n_group)
    return c


def _llama4(stem: str) -> dict:
    c = _real(stem)                                # chunked attention 8192 -> 8, NoPE layers, temperature tuning
    c.update(_ATT, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=4, num_local_experts=4,
             attention_chunk_size=8)
    if "moe_layers" in c:
        c["moe_layers"] = [i for i in c["moe_layers"] if i < 4]
    if "no_rope_layers" in c:
        c["no_rope_layers"] = c["no_rope_layers"][:4]
    if "floor_scale" in c:                         # 8192 -> 8: the NoPE layers' query scale moves within 30 tokens
        c["floor_scale"] = 8
    if c.get("attn_temperature_tuning") == 4:      # (transformers 5 wants the bool; the int: tests/test_released_settings)
        c["attn_temperature_tuning"] = True
    return c


def _apertus_8b() -> dict:
    c = _real("apertus__Apertus-8B-Instruct-2509")   # xIELU, q/k norms, llama3 rope; qk_norm / post_norm leftovers
    c.update(_ATT, intermediate_size=128, num_hidden_layers=3)
    return c


def _afm_45b() -> dict:
    c = _real("arcee__AFM-4.5B")                   # relu2 MLP, yarn factor 20 over 4096 (with `type` beside rope_type)
    c.update(hidden_size=80, num_attention_heads=5, num_key_value_heads=1, head_dim=16, intermediate_size=192,
             num_hidden_layers=3, vocab_size=512)
    return c


# sizes the tiny weights need that the real config.json leaves to the config class (not written to config.json)
_BUILD_ONLY = {"minicpm3-4b": {"v_head_dim": 16}, "llama4-maverick": {"no_rope_layers": None}}


CASES = {
    # the first Phi-3-mini-128k / Phi-3-medium-128k releases name longrope `su` (refused before)
    "phi3-128k-su-short": ("Phi3ForCausalLM", "phi3", lambda: _phi35("su", False), (3, 9, 17, 30)),
    "phi3.5-mini-long": ("Phi3ForCausalLM", "phi3", lambda: _phi35("longrope", True), (9, 17, 30)),
    "gemma2-27b": ("Gemma2ForCausalLM", "gemma2", _gemma2_27b, (3, 9, 17, 30)),
    "stablelm-2-12b": ("StableLmForCausalLM", "stablelm", lambda: dict(_STABLELM_2_12B), (3, 9, 17, 30)),
    "mistral-nemo": ("MistralForCausalLM", "mistral", _mistral_nemo, (3, 9, 17, 30)),
    "deepseek-v2-lite": ("DeepseekV2ForCausalLM", "deepseek_v2", _deepseek_v2_lite, (3, 9, 17, 30)),
    "deepseek-v2": ("DeepseekV2ForCausalLM", "deepseek_v2", _deepseek_v2, (3, 9, 17, 30)),
    "deepseek-v3": ("DeepseekV3ForCausalLM", "deepseek_v3", _deepseek_v3, (3, 9, 17, 30)),
    "mixtral-8x7b": ("MixtralForCausalLM", "mixtral", _mixtral, (3, 9, 17, 30)),
    "exaone-4.0-32b": ("Exaone4ForCausalLM", "exaone4", _exaone4_32b, (3, 9, 17, 30)),
    "minicpm3-4b": ("MiniCPM3ForCausalLM", "minicpm3", _minicpm3_4b, (3, 9, 17, 30)),
    "gpt-oss-20b": ("GptOssForCausalLM", "gpt_oss", lambda: _gpt_oss("gpt_oss__gpt-oss-20b"), (3, 9, 17, 30)),
    "gpt-oss-120b": ("GptOssForCausalLM", "gpt_oss", lambda: _gpt_oss("gpt_oss__gpt-oss-120b"), (3, 9, 17, 30)),
    "dbrx-instruct": ("DbrxForCausalLM", "dbrx", _dbrx_instruct, (3, 9, 17, 30)),
    "jetmoe-8b": ("JetMoeForCausalLM", "jetmoe", _jetmoe_8b, (3, 9, 17, 30)),
    # n_group / topk_group null in the release: no group limit, one group (transformers 5 cannot run null)
    "dots.llm1.inst": ("Dots1ForCausalLM", "dots1", lambda: _dots1_inst(1), (3, 9, 17, 30)),
    "llama4-scout": ("Llama4ForCausalLM", "llama4", lambda: _llama4("llama4__Llama-4-Scout-17B-16E"), (3, 9, 17, 30)),
    "llama4-maverick": ("Llama4ForCausalLM", "llama4", lambda: _llama4("llama4__Llama-4-Maverick-17B-128E"),
                        (3, 9, 17, 30)),
    "apertus-8b": ("ApertusForCausalLM", "apertus", _apertus_8b, (3, 9, 17, 30)),
    "afm-4.5b": ("ArceeForCausalLM", "arcee", _afm_45b, (3, 9, 17, 30)),
}


def _build(tmp: Path, arch: str, real: dict, build_only: dict | None = None) -> Path:
    from fixtures.tiny_hf import make_tiny_checkpoint

    ov = {k: v for k, v in real.items() if k not in _META}
    rs = ov.pop("rope_scaling", None)
    rp = {"rope_type": "default", "rope_theta": ov.get("rope_theta", 10000.0)}
    if isinstance(rs, dict):         # Phi-3's older names (su, its yarn) read as longrope
        kind = rs.get("rope_type", rs.get("type"))
        kind = "longrope" if kind == "su" or arch.startswith("Phi3") else kind
        rp = {**{k: v for k, v in rs.items() if k not in ("type", "rope_type")}, "rope_type": kind,
              "rope_theta": rp["rope_theta"]}
    if "partial_rotary_factor" in ov:
        rp["partial_rotary_factor"] = ov["partial_rotary_factor"]
    ov["rope_parameters"] = rp
    if "qk_rope_head_dim" not in ov and "num_attention_heads" in ov:   # (MLA: from qk_rope_head_dim; DBRX, JetMoE)
        ov.setdefault("head_dim", ov["hidden_size"] // ov["num_attention_heads"])   # transformers' value where absent
    make_tiny_checkpoint(arch, tmp, overrides={**ov, **(build_only or {})})
    built = json.loads((tmp / "config.json").read_text())
    cfg = {**real, "architectures": [arch], "torch_dtype": "float32"}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg.pop(k, None)
        if k in built:
            cfg[k] = built[k]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    return tmp


@pytest.mark.slow      # ~10 s each: a transformers model and an engine per checkpoint
@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_real_settings_verify(case, tmp_path):
    from xllm_gen.codegen.verify import verify

    arch, spec, make, prompt_lens = CASES[case]
    ckpt = _build(tmp_path / case, arch, make(), _BUILD_ONLY.get(case))
    report = verify(ROOT / "specs" / f"{spec}.yaml", ckpt, prompt_lens=prompt_lens)
    assert report.ok, report.text()
