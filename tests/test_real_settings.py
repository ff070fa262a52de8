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


_SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, vocab_size=512)


def _granite(stem: str) -> dict:
    c = _real(stem)                                # Granite 3.x: the four scalings, attention_dropout 0.1 (3.0 / 3.1)
    c.update(_SIZES, intermediate_size=128)
    return c


def _granitemoe(stem: str) -> dict:
    c = _real(stem)                                # 32 / 40 experts top-8 -> 8 top-2
    c.update(_SIZES, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    if "shared_intermediate_size" in c:
        c["shared_intermediate_size"] = 64
    return c


def _granite4(stem: str) -> dict:
    """Granite 4.0: the H releases (position_embedding_type 'nope', layer_types 'mamba' / 'attention', 64-72 experts)
    shrunk to 4 layers with the attention layer second and SSD chunks of 8; the dense release (micro: all attention,
    rope, num_local_experts = num_experts_per_tok = 0) to 3 layers."""
    c = _real(stem)
    c.update(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, vocab_size=512, mamba_n_heads=8,
             mamba_d_head=24, mamba_d_state=16, mamba_chunk_size=8)
    if c["num_local_experts"]:
        c.update(num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"], intermediate_size=32,
                 num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=64)
    else:
        c.update(num_hidden_layers=3, layer_types=["attention"] * 3, intermediate_size=128, shared_intermediate_size=128)
    return c


def _bamba_9b() -> dict:
    c = _real("bamba__Bamba-9B")                   # attn_rotary_emb 64 of head_dim 128 -> 8 of 16; use_mamba_kernels
    c.update(_SIZES, num_hidden_layers=4, attn_layer_indices=[1], attn_rotary_emb=8, intermediate_size=128,
             mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8)
    return c


_GLM_DENSE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=3,
                  intermediate_size=256, vocab_size=512)


def _glm(stem: str, **extra) -> dict:
    c = _real(stem)                                # partial (0.5) interleaved rotary, q/k/v biases, 9B-chat's eps 1.5625e-07
    c.update(_GLM_DENSE, **extra)
    return c


def _glm_z1_yarn() -> dict:
    # GLM-Z1-9B-0414 ships GLM-4-9B-0414's config.json; its model card has long inputs served with YaRN added as
    # rope_scaling {type: yarn, factor: 4, original_max_position_embeddings: 32768}
    return _glm("glm4__GLM-4-9B-0414", rope_scaling={"type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 32768})


_GLM_MOE = dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                moe_intermediate_size=32, n_routed_experts=16, vocab_size=512)


def _glm45() -> dict:
    c = _real("glm4_moe__GLM-4.5")                 # q/k norms, 3 dense layers, routed scale 2.5, top-8 (of 16 here)
    c.update(_GLM_MOE, num_hidden_layers=5)
    return c


def _glm45_air() -> dict:
    c = _real("glm4_moe__GLM-4.5-Air")             # no q/k norms, 1 dense layer, routed scale 1.0
    c.update(_GLM_MOE, num_hidden_layers=3)
    return c


def _ernie45_03b() -> dict:
    c = _real("ernie4_5__ERNIE-4.5-0.3B")          # interleaved rotary, tied head, remote-code architectures name
    c.update(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=3,
             intermediate_size=256, vocab_size=512)
    return c


def _ernie45_21b() -> dict:
    c = _real("ernie4_5_moe__ERNIE-4.5-21B-A3B-PT")    # moe_capacity / moe_gate / moe_use_aux_free / MTP leftovers
    c.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, intermediate_size=128,
             moe_intermediate_size=32, moe_num_experts=16, vocab_size=512)
    return c


def _seed_oss_36b() -> dict:
    c = _real("seed_oss__Seed-OSS-36B-Instruct")   # rope_scaling {rope_type: default}, dropouts 0.1, o_proj unbiased
    c.update(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_hidden_layers=3,
             intermediate_size=256, vocab_size=512)
    return c


# --- hK: Mamba-2 / Falcon-H1 / LFM2 / Jamba / Qwen3-Next releases (sizes shrunk, every other field as published)
def _mamba_codestral() -> dict:
    c = _real("mamba2__Mamba-Codestral-7B-v0.1")   # its leftovers: intermediate_size, norm_before_gate, rms_norm, ...
    c.update(hidden_size=64, num_heads=8, head_dim=16, n_groups=4, state_size=16, num_hidden_layers=3,
             intermediate_size=128, time_step_rank=4, vocab_size=512)
    return c


def _falcon_h1_05b() -> dict:
    c = _real("falcon_h1__Falcon-H1-0.5B")          # muP multipliers, mamba_d_ssm 1.5 x hidden (not expand x hidden)
    c.update(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=256,
             num_hidden_layers=3, mamba_n_heads=6, mamba_d_head=32, mamba_d_ssm=192, mamba_d_state=16,
             vocab_size=512)
    return c


def _lfm2_12b() -> dict:
    c = _real("lfm2__LFM2-1.2B")                    # block_ff_dim (read) beside an adjusted intermediate_size (stale)
    c.update(hidden_size=128, block_dim=128, conv_dim=128, conv_dim_out=128, num_attention_heads=4, num_heads=4,
             num_key_value_heads=2, head_dim=32, block_ff_dim=1152, intermediate_size=768, num_hidden_layers=6,
             full_attn_idxs=[2, 5], vocab_size=512)
    return c


def _jamba_15_mini() -> dict:
    c = _real("jamba__AI21-Jamba-1.5-Mini")         # attention every 8th layer (offset 4), MoE every 2nd (offset 1)
    c.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, intermediate_size=128, num_experts=4,
             num_hidden_layers=8, mamba_d_state=8, mamba_dt_rank=8, vocab_size=512)
    return c


def _qwen3_next_80b() -> dict:
    c = _real("qwen3_next__Qwen3-Next-80B-A3B-Thinking")   # Instruct's config.json has the same fields and values
    c.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
             num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, vocab_size=512)
    return c


# Zyphra/Zamba2-7B's settings under transformers' names (its config.json in the index is in Zyphra's older names,
# which transformers cannot read: tests/data/real_configs/zamba2__Zamba2-7B-zyphra-format.json, refused): two shared
# blocks taking turns, rotary in the shared attention (use_mem_rope), 2 B/C groups, MLP adapters only, the fields
# transformers 4.48's Zamba2Config wrote beside them (derived sizes, hybrid_layer_ids, time_step_limit null), the
# 81-layer pattern's first 12 layers (6 Mamba, hybrid, 4 Mamba, hybrid)
def _zamba2_7b() -> dict:
    layers = ["mamba"] * 6 + ["hybrid"] + ["mamba"] * 4 + ["hybrid"]
    return {"architectures": ["Zamba2ForCausalLM"], "model_type": "zamba2", "add_bias_linear": False,
            "adapter_rank": 8, "attention_dropout": 0.0, "attention_head_dim": 32, "attention_hidden_size": 128,
            "bos_token_id": 1, "chunk_size": 256, "eos_token_id": 2, "hidden_act": "gelu", "hidden_size": 64,
            "hybrid_layer_ids": [6, 11], "initializer_range": 0.02, "intermediate_size": 256, "kv_channels": 16,
            "layers_block_type": layers, "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2,
            "mamba_headdim": 16, "mamba_ngroups": 2, "max_position_embeddings": 4096, "n_mamba_heads": 8,
            "num_attention_heads": 4, "num_hidden_layers": 12, "num_key_value_heads": 4, "num_logits_to_keep": 1,
            "num_mem_blocks": 2, "num_query_groups": 4, "pad_token_id": 0, "rms_norm_eps": 1e-05, "rope_theta": 10000,
            "time_step_floor": 0.0001, "time_step_limit": None, "time_step_max": 0.1, "time_step_min": 0.001,
            "torch_dtype": "bfloat16", "use_cache": True, "use_conv_bias": True, "use_long_context": False,
            "use_mamba_kernels": True, "use_mem_eff_path": False, "use_mem_rope": True,
            "use_shared_attention_adapter": False, "vocab_size": 512}


def _zamba2_12b() -> dict:
    """Zyphra/Zamba2-1.2B's settings (its fields as transformers' Zamba2 documents them; no file in the index): ONE
    shared block, LoRA adapters on its q/k/v too (use_shared_attention_adapter), rotary (use_mem_rope), a hybrid layer
    every 6th; the first 13 layers."""
    c = _zamba2_7b()
    layers = ["mamba"] * 6 + ["hybrid"] + ["mamba"] * 5 + ["hybrid"]
    c.update(layers_block_type=layers, num_hidden_layers=13, hybrid_layer_ids=[6, 12], num_mem_blocks=1,
             mamba_ngroups=1, use_shared_attention_adapter=True)
    return c


# --- hJ: OLMoE, OLMo 2, StarCoder2, Qwen2-MoE, PhiMoE, Phi, Nemotron at their released config.json, sizes shrunk
def _shrunk(stem: str, **sizes) -> dict:
    c = _real(stem)
    c.update(vocab_size=512, **sizes)
    return c


def _olmoe_0125() -> dict:
    return _shrunk("olmoe__OLMoE-1B-7B-0125-Instruct", hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                   num_hidden_layers=3, intermediate_size=32, num_experts=8, num_experts_per_tok=4)


def _olmo2(stem: str, kv: int) -> dict:
    return _shrunk(stem, hidden_size=128, num_attention_heads=8, num_key_value_heads=kv, num_hidden_layers=3,
                   intermediate_size=256)


def _starcoder2(stem: str) -> dict:               # the 4096 window shrunk to 6: the prompts cross it
    return _shrunk(stem, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=3,
                   intermediate_size=192, sliding_window=6)


def _qwen2_moe(stem: str, kv: int) -> dict:        # use_sliding_window false: the (shrunk) window must stay off
    return _shrunk(stem, hidden_size=128, num_attention_heads=8, num_key_value_heads=kv, num_hidden_layers=3,
                   intermediate_size=160, moe_intermediate_size=32, shared_expert_intermediate_size=80,
                   num_experts=8, num_experts_per_tok=4, sliding_window=6)


def _phi(stem: str) -> dict:                       # head_dim 20: phi-2's 0.4 rotates 8 dims of each head
    return _shrunk(stem, hidden_size=80, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
                   intermediate_size=160)


def _nemotron(stem: str, heads: int) -> dict:     # head_dim 16 beside hidden 64: heads x head_dim != hidden (8B)
    return _shrunk(stem, hidden_size=64, num_attention_heads=heads, num_key_value_heads=2, head_dim=16,
                   num_hidden_layers=3, intermediate_size=192)


# microsoft/Phi-3.5-MoE-instruct's config.json (as published; its 64 longrope factors per list subsampled to the 8
# rotating frequencies of head_dim 16, sizes shrunk). transformers' PhiMoE turns at short_factor at every length and
# scales by the regime's mscale; the engine serves the short regime with max_model_len <= the original context
_PHI35_MOE = {
    "architectures": ["PhiMoEForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 32000, "hidden_act": "silu", "hidden_dropout": 0.0, "hidden_size": 64, "initializer_range": 0.02,
    "input_jitter_noise": 0.01, "intermediate_size": 96, "lm_head_bias": True, "max_position_embeddings": 131072,
    "model_type": "phimoe", "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3,
    "num_key_value_heads": 2, "num_local_experts": 8, "original_max_position_embeddings": 4096,
    "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_scaling": {"long_factor": [1.0199999809265137, 1.0299999713897705, 1.0399999618530273, 1.0499999523162842,
                                     1.0499999523162842, 1.0499999523162842, 1.059999942779541, 1.059999942779541],
                     "long_mscale": 1.243163121016122, "original_max_position_embeddings": 4096,
                     "short_factor": [1.0, 1.0399999618530273, 1.0399999618530273, 1.0399999618530273,
                                      1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842],
                     "short_mscale": 1.243163121016122, "type": "longrope"},
    "rope_theta": 10000.0, "router_aux_loss_coef": 0.0, "router_jitter_noise": 0.01, "sliding_window": 131072,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.3", "use_cache": True,
    "vocab_size": 512}


HJ_CASES = {
    "olmoe-1b-7b-0125-instruct": ("OlmoeForCausalLM", "olmoe", _olmoe_0125, (3, 9, 17, 30)),
    "olmo-2-1124-7b": ("Olmo2ForCausalLM", "olmo2", lambda: _olmo2("olmo2__OLMo-2-1124-7B", 8), (3, 9, 17, 30)),
    "olmo-2-0325-32b": ("Olmo2ForCausalLM", "olmo2", lambda: _olmo2("olmo2__OLMo-2-0325-32B", 2), (3, 9, 17, 30)),
    "starcoder2-3b": ("Starcoder2ForCausalLM", "starcoder2", lambda: _starcoder2("starcoder2__starcoder2-3b"),
                      (3, 9, 17, 30)),
    "starcoder2-15b": ("Starcoder2ForCausalLM", "starcoder2", lambda: _starcoder2("starcoder2__starcoder2-15b"),
                       (3, 9, 17, 30)),
    "qwen1.5-moe-a2.7b": ("Qwen2MoeForCausalLM", "qwen2_moe", lambda: _qwen2_moe("qwen2_moe__Qwen1.5-MoE-A2.7B", 8),
                          (3, 9, 17, 30)),
    "qwen2-57b-a14b": ("Qwen2MoeForCausalLM", "qwen2_moe", lambda: _qwen2_moe("qwen2_moe__Qwen2-57B-A14B", 2),
                       (3, 9, 17, 30)),
    "phi-1": ("PhiForCausalLM", "phi", lambda: _phi("phi__phi-1"), (3, 9, 17, 30)),    # rotary_dim 32: a leftover
    "phi-1_5": ("PhiForCausalLM", "phi", lambda: _phi("phi__phi-1_5"), (3, 9, 17, 30)),
    "phi-2": ("PhiForCausalLM", "phi", lambda: _phi("phi__phi-2"), (3, 9, 17, 30)),
    "minitron-8b-base": ("NemotronForCausalLM", "nemotron", lambda: _nemotron("nemotron__Minitron-8B-Base", 6),
                         (3, 9, 17, 30)),
    "nemotron-mini-4b-instruct": ("NemotronForCausalLM", "nemotron",
                                  lambda: _nemotron("nemotron__Nemotron-Mini-4B-Instruct", 4), (3, 9, 17, 30)),
    "phi-3.5-moe-instruct": ("PhimoeForCausalLM", "phimoe", lambda: dict(_PHI35_MOE), (3, 9, 17, 30)),
}


_GEMMA = dict(hidden_size=64, num_hidden_layers=3, intermediate_size=128, vocab_size=512)


def _gemma(stem: str, heads: int, kv: int, head_dim: int) -> dict:
    c = _real(stem)                                # hidden_act gelu (read as the tanh GELU), hidden_activation leftover
    c.update(_GEMMA, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim)
    return c


# Gemma 3 / Command R7B tiny layouts: 7 layers (the full layer 5 of period 6 inside), 5 layers (full layer 3 of 4)
_G3_LAYERS = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
_C2_LAYERS = ["sliding_attention"] * 3 + ["full_attention", "sliding_attention"]
_G3 = dict(hidden_size=64, num_hidden_layers=7, intermediate_size=128, vocab_size=512, sliding_window=6)


def _gemma3(stem: str, **sizes) -> dict:
    c = _real(stem)                                # the 4b / 12b / 27b text_config: linear factor 8 on the full layers
    c.update(_G3, **sizes)
    return c


def _recurrentgemma(stem: str) -> dict:
    c = _real(stem)                                # `_block_types` (transformers 4.40's name), partial rotary 0.5
    c.update(hidden_size=64, lru_width=64, num_hidden_layers=4, intermediate_size=192, vocab_size=512,
             num_attention_heads=4, num_key_value_heads=1, head_dim=16, attention_window_size=6)
    return c


def _vaultgemma_1b() -> dict:
    c = _real("vaultgemma__vaultgemma-1b")         # MHA, head_dim 256 beside hidden 1152 / 4 heads, no soft-caps
    c.update(hidden_size=64, num_hidden_layers=4, intermediate_size=128, vocab_size=512, num_attention_heads=4,
             num_key_value_heads=4, head_dim=32, query_pre_attn_scalar=32, sliding_window=6,
             layer_types=c["layer_types"][:4])
    return c


def _cohere2(stem: str) -> dict:
    c = _real(stem)                                # Cohere's leftovers; the period as sliding_window_pattern 4
    c.update(hidden_size=64, num_hidden_layers=5, intermediate_size=128, vocab_size=512, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=6)
    return c


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


def _qwen35_9b() -> dict:
    c = dict(_real("qwen3_5__Qwen3.5-9B")["text_config"])   # (hO) the text decoder: gated attention, mrope (text:
    c.update(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=4,   # plain rotary),
             intermediate_size=256, vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=4,  # MTP leftovers
             linear_key_head_dim=32, linear_value_head_dim=32, layer_types=c["layer_types"][:4])
    c.pop("eos_token_id")
    return c


def _devstral_small_2() -> dict:
    c = dict(_real("ministral3__Devstral-Small-2-24B-Instruct-2512")["text_config"])   # (hO) yarn 48 + llama 4 beta
    c.update(hidden_size=128, head_dim=32, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=3,
             intermediate_size=256, vocab_size=512, max_position_embeddings=384)
    c["rope_parameters"] = dict(c["rope_parameters"], original_max_position_embeddings=8)
    return c


def _minimax_m25() -> dict:
    c = _real("minimax_m2__MiniMax-M2.5")          # (hO) whole-projection q/k norms, rotary_dim 64 of 128, MTP leftovers
    c.update(hidden_size=64, head_dim=16, rotary_dim=8, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=3, intermediate_size=32, num_local_experts=8, num_experts_per_tok=4, vocab_size=512,
             attn_type_list=[1, 1, 1])
    return c


def _longcat_flash_chat() -> dict:
    c = _real("longcat_flash__LongCat-Flash-Chat")   # (hO) 12 of 512 + 256 identity experts; head_dim (64) left to the
    c.update(vocab_size=512, hidden_size=64, ffn_hidden_size=128, expert_ffn_hidden_size=32, num_layers=2,  # class,
             num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=16,  # so the
             n_routed_experts=16, zero_expert_num=8)                                     # rope dims stay 64
    return c


def _k_exaone() -> dict:
    c = _real("exaone_moe__K-EXAONE-236B-A23B-trtllm-test")   # (hO) is_moe_layer, scoring_func / topk_method leftovers
    c.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
             moe_intermediate_size=32, num_experts=16, vocab_size=512)
    return c


# sizes the tiny weights need that the real config.json leaves to the config class (not written to config.json)
_BUILD_ONLY = {"longcat-flash-chat": {"head_dim": 64, "qk_head_dim": 80},
               "minicpm3-4b": {"v_head_dim": 16}, "llama4-maverick": {"no_rope_layers": None},
               # the fixture's Qwen3-Next layout replaced by the one full_attention_interval 4 gives 4 layers
               "qwen3-next-80b-a3b": {"layer_types": ["linear_attention"] * 3 + ["full_attention"]},
               # Zamba2's head_dim is an alias of attention_head_dim (2 * hidden / heads), not hidden / heads
               "zamba2-7b": {"head_dim": 32}, "zamba2-1.2b": {"head_dim": 32},
               # (the tiny builder's default makes layer 1 dense; the releases have every layer sparse)
               "qwen1.5-moe-a2.7b": {"mlp_only_layers": []}, "qwen2-57b-a14b": {"mlp_only_layers": []},
               **{k: {"layer_types": _G3_LAYERS} for k in ("gemma-3-1b-it", "gemma-3-270m", "gemma-3-4b-it",
                                                           "gemma-3-12b-it", "gemma-3-27b-it")},
               **{k: {"layer_types": _C2_LAYERS} for k in ("command-r7b-12-2024", "command-a-03-2025")}}


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
    "granite-3.0-8b-instruct": ("GraniteForCausalLM", "granite", lambda: _granite("granite__granite-3.0-8b-instruct"),
                                (3, 9, 17, 30)),
    "granite-3.1-2b-instruct": ("GraniteForCausalLM", "granite", lambda: _granite("granite__granite-3.1-2b-instruct"),
                                (3, 9, 17, 30)),
    "granite-3.3-8b-instruct": ("GraniteForCausalLM", "granite", lambda: _granite("granite__granite-3.3-8b-instruct"),
                                (3, 9, 17, 30)),
    "granite-3.0-3b-a800m": ("GraniteMoeForCausalLM", "granitemoe",
                             lambda: _granitemoe("granitemoe__granite-3.0-3b-a800m-instruct"), (3, 9, 17, 30)),
    "granite-3.1-1b-a400m": ("GraniteMoeForCausalLM", "granitemoe",
                             lambda: _granitemoe("granitemoe__granite-3.1-1b-a400m"), (3, 9, 17, 30)),
    "granitemoeshared-3b": ("GraniteMoeSharedForCausalLM", "granitemoeshared",
                            lambda: _granitemoe("granitemoeshared__granite-3.0-3b-a800m-shared"), (3, 9, 17, 30)),
    # refused before (position_embedding_type 'nope', normalization_function; micro: num_experts_per_tok 0)
    "granite-4.0-h-tiny": ("GraniteMoeHybridForCausalLM", "granitemoehybrid",
                           lambda: _granite4("granitemoehybrid__granite-4.0-h-tiny"), (3, 9, 17, 30)),
    "granite-4.0-h-small": ("GraniteMoeHybridForCausalLM", "granitemoehybrid",
                            lambda: _granite4("granitemoehybrid__granite-4.0-h-small"), (3, 9, 17, 30)),
    "granite-4.0-micro": ("GraniteMoeHybridForCausalLM", "granitemoehybrid",
                          lambda: _granite4("granitemoehybrid__granite-4.0-micro"), (3, 9, 17, 30)),
    # refused before (attn_rotary_emb, use_mamba_kernels)
    "bamba-9b": ("BambaForCausalLM", "bamba", _bamba_9b, (3, 9, 17, 30)),
    "glm-4-9b-chat-hf": ("GlmForCausalLM", "glm", lambda: _glm("glm__glm-4-9b-chat-hf"), (3, 9, 17, 30)),
    "glm-4-9b-0414": ("Glm4ForCausalLM", "glm4", lambda: _glm("glm4__GLM-4-9B-0414"), (3, 9, 17, 30)),
    "glm-4-32b-0414": ("Glm4ForCausalLM", "glm4", lambda: _glm("glm4__GLM-4-32B-0414"), (3, 9, 17, 30)),
    "glm-z1-9b-yarn": ("Glm4ForCausalLM", "glm4", _glm_z1_yarn, (3, 9, 17, 30)),
    "glm-4.5": ("Glm4MoeForCausalLM", "glm4_moe", _glm45, (3, 9, 17, 30)),
    "glm-4.5-air": ("Glm4MoeForCausalLM", "glm4_moe", _glm45_air, (3, 9, 17, 30)),
    "ernie-4.5-0.3b": ("Ernie4_5ForCausalLM", "ernie4_5", _ernie45_03b, (3, 9, 17, 30)),
    "ernie-4.5-21b-a3b": ("Ernie4_5_MoeForCausalLM", "ernie4_5_moe", _ernie45_21b, (3, 9, 17, 30)),
    "seed-oss-36b": ("SeedOssForCausalLM", "seed_oss", _seed_oss_36b, (3, 9, 17, 30)),
    "mamba-codestral-7b": ("Mamba2ForCausalLM", "mamba2", _mamba_codestral, (3, 9, 17, 30)),
    "falcon-h1-0.5b": ("FalconH1ForCausalLM", "falcon_h1", _falcon_h1_05b, (3, 9, 17, 30)),
    "lfm2-1.2b": ("Lfm2ForCausalLM", "lfm2", _lfm2_12b, (3, 9, 17, 30)),
    "jamba-1.5-mini": ("JambaForCausalLM", "jamba", _jamba_15_mini, (3, 9, 17, 30)),
    "qwen3-next-80b-a3b": ("Qwen3NextForCausalLM", "qwen3_next", _qwen3_next_80b, (3, 9, 17, 30)),
    "zamba2-7b": ("Zamba2ForCausalLM", "zamba2", _zamba2_7b, (3, 9, 17, 30)),
    "zamba2-1.2b": ("Zamba2ForCausalLM", "zamba2", _zamba2_12b, (3, 9, 17, 30)),
    # (hG) Gemma 1, Gemma 3 text, RecurrentGemma, VaultGemma, Cohere 2 at their released config.json
    "gemma-7b": ("GemmaForCausalLM", "gemma", lambda: _gemma("gemma__gemma-7b", 4, 4, 32), (3, 9, 17, 30)),
    "gemma-2b": ("GemmaForCausalLM", "gemma", lambda: _gemma("gemma__gemma-2b", 4, 1, 16), (3, 9, 17, 30)),
    "gemma-1.1-2b-it": ("GemmaForCausalLM", "gemma", lambda: _gemma("gemma__gemma-1.1-2b-it", 4, 1, 16), (3, 9, 30)),
    "codegemma-7b-it": ("GemmaForCausalLM", "gemma", lambda: _gemma("gemma__codegemma-7b-it", 4, 4, 32), (3, 9, 30)),
    "gemma-3-1b-it": ("Gemma3ForCausalLM", "gemma3",
                      lambda: _gemma3("gemma3__gemma-3-1b-it", num_attention_heads=4, num_key_value_heads=1,
                                      head_dim=32, query_pre_attn_scalar=32), (3, 9, 17, 30)),
    "gemma-3-270m": ("Gemma3ForCausalLM", "gemma3",
                     lambda: _gemma3("gemma3__gemma-3-270m", num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                     query_pre_attn_scalar=32, layer_types=_G3_LAYERS), (3, 9, 17, 30)),
    "gemma-3-4b-it": ("Gemma3ForCausalLM", "gemma3",
                      lambda: _gemma3("gemma3__gemma-3-4b-it-text", num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32), (3, 9, 17, 30)),
    "gemma-3-12b-it": ("Gemma3ForCausalLM", "gemma3",
                       lambda: _gemma3("gemma3__gemma-3-12b-it-text", num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=32), (3, 9, 17, 30)),
    "gemma-3-27b-it": ("Gemma3ForCausalLM", "gemma3",
                       lambda: _gemma3("gemma3__gemma-3-27b-it-text", num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, query_pre_attn_scalar=24), (3, 9, 17, 30)),
    "recurrentgemma-2b": ("RecurrentGemmaForCausalLM", "recurrent_gemma",
                          lambda: _recurrentgemma("recurrent_gemma__recurrentgemma-2b"), (3, 9, 17, 30)),
    "recurrentgemma-9b": ("RecurrentGemmaForCausalLM", "recurrent_gemma",
                          lambda: _recurrentgemma("recurrent_gemma__recurrentgemma-9b"), (3, 9, 17, 30)),
    "vaultgemma-1b": ("VaultGemmaForCausalLM", "vaultgemma", _vaultgemma_1b, (3, 9, 17, 30)),
    "command-r7b-12-2024": ("Cohere2ForCausalLM", "cohere2",
                            lambda: _cohere2("cohere2__c4ai-command-r7b-12-2024"), (3, 9, 17, 30)),
    "command-a-03-2025": ("Cohere2ForCausalLM", "cohere2",
                          lambda: _cohere2("cohere2__c4ai-command-a-03-2025"), (3, 9, 17, 30)),
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
CASES.update(HJ_CASES)
CASES.update({    # (hO) the text decoders of multimodal releases
    "qwen3.5-9b": ("Qwen3_5ForCausalLM", "qwen3_5", _qwen35_9b, (3, 9, 17, 30)),
    "devstral-small-2": ("Ministral3ForCausalLM", "ministral3", _devstral_small_2, (3, 9, 17, 30)),
    "minimax-m2.5": ("MiniMaxM2ForCausalLM", "minimax_m2", _minimax_m25, (3, 9, 17, 30)),
    "longcat-flash-chat": ("LongcatFlashForCausalLM", "longcat_flash", _longcat_flash_chat, (3, 9, 17, 30)),
    "k-exaone-236b-a23b": ("ExaoneMoeForCausalLM", "exaone_moe", _k_exaone, (3, 9, 17, 30)),
})


# (hN) OPT, BLOOM, MPT, XGLM, BioGPT at their released config.json (fields as published, sizes shrunk)
def _sized(stem: str, **sizes) -> dict:
    c = _real(stem)
    c.update(sizes)
    return c


_OPT = dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512)
_BLOOM = dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=512)
_MPT = dict(d_model=64, n_layers=2, n_heads=4, vocab_size=512)
HN_CASES = {
    "opt-125m": ("OPTForCausalLM", "opt", lambda: _sized("opt__opt-125m", **_OPT, word_embed_proj_dim=64),
                 (3, 9, 17, 30)),
    # project_in / project_out (word_embed_proj_dim 512 beside hidden 1024), post-norm (do_layer_norm_before false)
    "opt-350m": ("OPTForCausalLM", "opt", lambda: _sized("opt__opt-350m", **_OPT, word_embed_proj_dim=32),
                 (3, 9, 17, 30)),
    "opt-1.3b": ("OPTForCausalLM", "opt", lambda: _sized("opt__opt-1.3b", **_OPT, word_embed_proj_dim=64),
                 (3, 9, 17, 30)),
    "opt-6.7b": ("OPTForCausalLM", "opt", lambda: _sized("opt__opt-6.7b", **_OPT, word_embed_proj_dim=64),
                 (3, 9, 17, 30)),
    "bloom-560m": ("BloomForCausalLM", "bloom", lambda: _sized("bloom__bloom-560m", **_BLOOM), (3, 9, 17, 30)),
    "bloomz-560m": ("BloomForCausalLM", "bloom", lambda: _sized("bloom__bloomz-560m", **_BLOOM), (3, 9, 17, 30)),
    "mpt-7b": ("MptForCausalLM", "mpt", lambda: _sized("mpt__mpt-7b", **_MPT), (3, 9, 17, 30)),
    "mpt-7b-8k": ("MptForCausalLM", "mpt", lambda: _sized("mpt__mpt-7b-8k", **_MPT), (3, 9, 17, 30)),
    "mpt-7b-storywriter": ("MptForCausalLM", "mpt", lambda: _sized("mpt__mpt-7b-storywriter", **_MPT),
                           (3, 9, 17, 30)),
    "xglm-564m": ("XGLMForCausalLM", "xglm",
                  lambda: _sized("xglm__xglm-564M", d_model=64, attention_heads=4, num_layers=2, ffn_dim=128,
                                 vocab_size=512), (3, 9, 17, 30)),
    "biogpt": ("BioGptForCausalLM", "biogpt",
               lambda: _sized("biogpt__biogpt", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                              intermediate_size=128, vocab_size=512), (3, 9, 17, 30)),
    "biogpt-large": ("BioGptForCausalLM", "biogpt",
                     lambda: _sized("biogpt__BioGPT-Large", hidden_size=64, num_attention_heads=4,
                                    num_hidden_layers=2, intermediate_size=128, vocab_size=512), (3, 9, 17, 30)),
}
CASES.update(HN_CASES)


# (hM) GPT-2 / GPT-Neo / GPT-J / CodeGen / GPTBigCode releases: GPT-2 double-heads and training-fork leftovers
_G2 = dict(n_embd=64, n_head=4, n_layer=2, vocab_size=512)


def _g2(stem: str, **sizes) -> dict:
    c = _real(stem)
    c.update(_G2, **sizes)
    return c


def _neo(stem: str) -> dict:
    c = _real(stem)                                # window 6 (crossed by the prompts), global / local alternating
    c.update(hidden_size=64, num_heads=4, num_layers=4, vocab_size=512, window_size=6,
             attention_layers=["global", "local"] * 2, attention_types=[[["global", "local"], 2]])
    return c


HM_CASES = {
    "distilgpt2": ("GPT2LMHeadModel", "gpt2", lambda: _g2("gpt2__distilgpt2"), (3, 9, 17, 30)),
    "gpt-neo-125m": ("GPTNeoForCausalLM", "gpt_neo", lambda: _neo("gpt_neo__gpt-neo-125m"), (3, 9, 17, 30)),
    "gpt-neo-1.3b": ("GPTNeoForCausalLM", "gpt_neo", lambda: _neo("gpt_neo__gpt-neo-1.3B"), (3, 9, 17, 30)),
    "gpt-neo-2.7b": ("GPTNeoForCausalLM", "gpt_neo", lambda: _neo("gpt_neo__gpt-neo-2.7B"), (3, 9, 17, 30)),
    "gpt-j-6b": ("GPTJForCausalLM", "gptj", lambda: _g2("gptj__gpt-j-6b", rotary_dim=8), (3, 9, 17, 30)),
    "codegen-350m-mono": ("CodeGenForCausalLM", "codegen", lambda: _g2("codegen__codegen-350M-mono", rotary_dim=8),
                          (3, 9, 17, 30)),
    "codegen-2b-mono": ("CodeGenForCausalLM", "codegen", lambda: _g2("codegen__codegen-2B-mono", rotary_dim=8),
                        (3, 9, 17, 30)),
    "starcoderbase": ("GPTBigCodeForCausalLM", "gpt_bigcode", lambda: _g2("gpt_bigcode__starcoderbase", n_inner=256),
                      (3, 9, 17, 30)),
    "santacoder": ("GPTBigCodeForCausalLM", "gpt_bigcode",
                   lambda: _g2("gpt_bigcode__gpt_bigcode-santacoder", n_inner=256), (3, 9, 17, 30)),
}
CASES.update(HM_CASES)
_BUILD_ONLY["distilgpt2"] = {"n_inner": None}      # the fixture's n_inner left out: 4 * n_embd as the release


def _write_real_config(tmp: Path, arch: str, real: dict) -> Path:
    """The built tiny checkpoint's config.json replaced by the release's (float32; the fixture's special token ids,
    which fit its vocabulary)."""
    built = json.loads((tmp / "config.json").read_text())
    cfg = {**real, "architectures": [arch], "torch_dtype": "float32"}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg.pop(k, None)
        if k in built:
            cfg[k] = built[k]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    return tmp


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
    if "qk_rope_head_dim" not in ov and "num_attention_heads" in ov:   # (MLA: head_dim from qk_rope_head_dim;
                                                                      # attention-free Mamba: none)
        ov.setdefault("head_dim", ov["hidden_size"] // ov["num_attention_heads"])   # transformers' value where absent
    make_tiny_checkpoint(arch, tmp, overrides={**ov, **(build_only or {})})
    return _write_real_config(tmp, arch, real)


@pytest.mark.slow      # ~10 s each: a transformers model and an engine per checkpoint
@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_real_settings_verify(case, tmp_path):
    from xllm_gen.codegen.verify import verify

    arch, spec, make, prompt_lens = CASES[case]
    ckpt = _build(tmp_path / case, arch, make(), _BUILD_ONLY.get(case))
    report = verify(ROOT / "specs" / f"{spec}.yaml", ckpt, prompt_lens=prompt_lens)
    assert report.ok, report.text()
