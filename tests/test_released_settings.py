"""Tiny checkpoints at the settings of released checkpoints (every non-size config.json field as published, only the
sizes shrunk), served against transformers: the forms the default tiny configs do not reach.

- Falcon-11B: the new decoder architecture (GQA, qkv per KV group) with ONE shared input_layernorm
  (`num_ln_in_parallel_attn: 1`) and its leftover `ff_factor`; it was refused by the guard (min 2).
- Command R+ (c4ai-command-r-plus): `use_qk_norm: true`, a LayerNorm of each q / k head with a weight per head
  (`[heads, head_dim]`), before the interleaved rotary; it was refused (assumed false). Command R's config.json also
  carries `model_max_length` (a tokenizer leftover), which was refused as unknown.
- GPT-NeoX-20B: `attention_probs_dropout_prob` / `hidden_dropout_prob` (older names of the dropouts), refused as
  unknown.
- SmolLM3-3B: its config.json carries `max_window_layers: 28` (a Qwen2-config leftover SmolLM3's transformers class has
  no field for), refused as unknown. And transformers' SmolLM3 masks the layers `layer_types` marks sliding with
  `sliding_window` whatever `use_sliding_window` says, which the spec ignored (served with another window: wrong
  tokens); it reads layer_types / sliding_window / use_sliding_window now.
- Qwen3-Coder-30B-A3B-Instruct / 480B-A35B-Instruct (Qwen3MoeForCausalLM): `qkv_bias: false`, `use_qk_norm: true`,
  `shared_expert_intermediate_size: 0`, fields transformers' Qwen3-MoE never reads, refused as unknown.
- Hunyuan-7B-Instruct / Hunyuan-A13B-Instruct: their rope_scaling is `type: dynamic` + `alpha: 1000.0` with yarn keys
  beside it (beta_fast, beta_slow, mscale, mscale_all_dim) that transformers' NTK-alpha rotary never reads, refused;
  and leftovers of Tencent's code (attention_head_dim, use_qk_norm, use_cla, norm_type, use_rotary_pos_emb, mlp_bias;
  A13B also its vision-tower fields, use_mixed_mlp_moe, num_shared_expert / moe_intermediate_size lists, ...). The
  MoE spec refused the NTK-alpha rope outright and A13B's per-layer `moe_topk: [8, 8, ...]` list (transformers'
  gate reads moe_topk[layer_idx]): a uniform list is served now, a mixed one refused.
- MiniCPM3-4B: `rope_scaling: {type: longrope, short_factor / long_factor (one per rotating frequency of the rope
  dims), original_max_position_embeddings: 32768}` (= max_position_embeddings: the short factors at every context);
  the spec admitted only default rope and refused the release (transformers' MiniCPM3 reads it with its longrope).
- dbrx-instruct: `router_aux_loss_coef` (refused as unknown) and its rope base in attn_config.rope_theta (read; transformers
  5 drops it); with square experts (ffn_hidden_size == d_model) the experts' w2 ([in, out] per expert) was read as
  [out, in] by its shape: served wrong, now declared transposed. Llama 4 Scout / Maverick: `attn_temperature_tuning: 4`
  (an int; refused, now read by its truth, as transformers 4.51 and vLLM do) and `for_llm_compressor`. Apertus-8B /
  70B: qk_norm / mlp_bias / post_norm / hidden_dropout leftovers. dots.llm1.inst: DeepSeek-V3 leftovers (scoring_func,
  topk_method, moe_layer_freq, pretraining_tp, use_sliding_window) and null n_group / topk_group. Llama 4's
  `no_rope_layers: []` (transformers' default; a traceback before) and dbrx-instruct re-serialized with
  PretrainedConfig's fields in its sub-configs.
- (hG) recurrentgemma-2b / 9b: the layer pattern stored as `_block_types` (transformers 4.40's attribute), refused as
  unknown; transformers 5 ignores it and builds block_types (default = every release's value): accepted where equal,
  refused otherwise. Gemma 3 4b / 12b / 27b: the multimodal releases' sparse text_config (no vocab_size, context, on 4b
  no head counts) was refused (vocab_size) or read with Gemma 2's defaults; now Gemma3TextConfig's. Command R7B /
  Command A: Cohere's own fields (layer_switch, order_of_interleaved_layers, position_embedding_type, rotary_pct,
  use_embedding_sharing, use_gated_activation, use_parallel_block, use_parallel_embedding; Tiny Aya's use_qk_norm),
  refused as unknown; transformers reads none and builds what they state: accepted at those values, refused at others.
- Minitron-8B / 4B (hJ): their config.json names the partial rotary factor `rope_percent` (transformers 4.4x read it,
  transformers 5 ignores it: 0.5 either way in the releases), refused as unknown; accepted where it equals the
  factor served, refused otherwise.
- Phi-3.5-MoE-instruct (hJ): its config.json carries `hidden_dropout` (a remote-code field PhimoeConfig lacks),
  refused as unknown. And at the engine's default max_model_len (131072 > the original 4096) the engine turned at
  long_factor (vLLM's regime), where transformers' PhiMoE turns at short_factor at every length (only its mscale
  follows the regime; the release's two mscales are equal): every sequence was served wrong. The rotary's
  `longrope_factors: short` serves short_factor in both regimes. Its `architectures: [PhiMoEForCausalLM]` (the
  remote-code class; transformers loads it by model_type as PhimoeForCausalLM) was refused as not served.
- Mamba-Codestral-7B (Mamba2ForCausalLM): `intermediate_size`, `norm_before_gate: true`, `rms_norm: true`,
  `time_step_init_scheme`, `time_step_scale`, fields transformers' Mamba2 never reads (its gated norm always gates
  first), refused as unknown; rms_norm is assumed true now (false, mamba_ssm's LayerNorm model, is refused).
- LFM2-350M / 1.2B (first releases): the feed-forward width as `block_ff_dim` and the tie as `tie_embedding`, which
  transformers' Lfm2Config pops over intermediate_size / tie_word_embeddings (a copy of LFM2-1.2B carries the adjusted
  width 8192 in intermediate_size: the spec read that), and the training code's restated sizes / init settings
  (block_dim, conv_dim, num_heads, block_norm_eps, use_pos_enc, ...), refused as unknown.
- Jamba-v0.1 (its remote-code-era config.json): `calc_logits_for_entire_prompt`, `n_ctx`, fields transformers'
  Jamba never reads, refused as unknown.
- Granite 4.0-H (granite-4.0-h-tiny / -h-small): `position_embedding_type: nope` (no rotary: transformers builds one only
  for 'rope') was refused (only 'rope' admitted), and `normalization_function: rmsnorm` (an IBM-training leftover) as
  unknown; the legacy layer names ('mamba' / 'attention') are read as transformers remaps them. Granite 4.0 dense
  (granite-4.0-micro, -h-1b): `num_local_experts: 0` with `num_experts_per_tok: 0` was refused (min 1).
- Bamba-9B: `attn_rotary_emb: 64` (the rotary dims, = head_dim * 0.5) and `use_mamba_kernels` were refused as unknown;
  a top-level `partial_rotary_factor`, which transformers' BambaConfig replaces by 0.5, was read (served wrong at any
  other value): now assumed 0.5.
- ERNIE-4.5-21B-A3B-PT: Baidu's leftovers (moe_capacity, moe_gate, moe_use_aux_free, use_rmsnorm,
  num_nextn_predict_layers, multi_token_pred_lambda) were refused as unknown; its MTP head tensors (mtp_*) and GLM-4.5's
  / GLM-4.5-Air's MTP layer (model.layers.92.* / 46.*), which transformers skips, were refused by the loader as
  unexpected tensors.
- (hO) Qwen3.5-9B (text_config; Qwen3.5-MoE alike): attn_output_gate / mtp_num_hidden_layers /
  mtp_use_dedicated_embeddings / mamba_ssm_dtype, which transformers never reads, were refused as unknown; the gate
  is assumed true (false refused), the rest ignored.
- (hO) K-EXAONE-236B-A23B: scoring_func / topk_method (assumed sigmoid / noaux_tc, the router transformers builds),
  is_moe_layer / first_last_k_dense_replace (ignored: transformers lays the layers out by mlp_layer_types), refused as
  unknown. MiniMax-M2.5, LongCat-Flash-Chat, Devstral-Small-2 served as released (slow cases in test_real_settings).
- (hN) OPT-125m / 350m: `activation_dropout` and fairseq's `prefix: </s>`; BLOOM-560m / bloomz-560m: Megatron flags
  (attention_softmax_in_fp32, bias_dropout_fusion, skip_bias_add, skip_bias_add_qkv); MPT-7b / -8k / -storywriter:
  `init_config`, `verbose`, `tokenizer_name`, and -8k's `ffn_config.ffn_type: mptmlp` / `fc_type: torch` (another
  kind refused): leftovers transformers never reads, refused as unknown before; and MPT's `architectures:
  [MPTForCausalLM]` (the remote-code class; transformers loads it by model_type) was refused as not served. BLOOM
  (176B)'s `n_embed` / `num_attention_heads` names (BloomConfig's aliases) were refused (no hidden_size). Later
  llm-foundry MPT exports' attn_config defaults (rope false + its settings, sliding_window_size -1, kv_n_heads).
- (hM) gpt-neo-125m / 1.3B / 2.7B, gpt-j-6b, codegen-350M / 2B-mono: the GPT-2 double-heads `summary_*` leftovers,
  GPT-J's `rotary: true` and GPT-J's / CodeGen's `scale_attn_weights: true` (fields their transformers classes lack;
  accepted at true only), starcoderbase's BigCode-fork runtime options (inference_runner, pad_key_length,
  pre_allocate_kv_cache, validate_runner_input) and distilgpt2's `_num_labels`, all refused as unknown before.
"""
from __future__ import annotations

import pytest
from fixtures.tiny_hf import edit_config
from test_spec_battery import Tokens, _assert_same

_TOKENS = Tokens()


def _flat(tokens) -> bool:
    return all(len(set(t)) <= 2 for t in tokens)


def _served_as_transformers(ckpt, what: str, tp: int = 1) -> list:
    want = _TOKENS.hf(ckpt)
    assert not _flat(want), f"{what}: transformers' greedy tokens are flat"
    _assert_same(_TOKENS.engine(ckpt, tp), want, f"{what} tp={tp}")
    return want


# Falcon-11B's config.json (tiiuae/falcon-11B), sizes shrunk
_FALCON_11B = {"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 1,
               "parallel_attn": True, "bias": False, "alibi": False, "tie_word_embeddings": False,
               "ffn_hidden_size": 256, "rope_parameters": {"rope_theta": 500042.0}}


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_falcon_11b_one_shared_norm(tiny_checkpoint, tmp_path, tp):
    ckpt = tiny_checkpoint("FalconForCausalLM", overrides=_FALCON_11B)
    ckpt = edit_config(ckpt, tmp_path / "falcon11b", lambda c: c.update(ff_factor=4))
    want = _served_as_transformers(ckpt, "Falcon-11B form", tp)
    # the shared norm is not the two-norm form of the same weights' family (transformers differs between them)
    two = tiny_checkpoint("FalconForCausalLM", overrides={**_FALCON_11B, "num_ln_in_parallel_attn": 2})
    assert _TOKENS.hf(two) != want


# c4ai-command-r-plus's config.json, sizes shrunk (GQA 12 / 4 heads of 16)
_COMMAND_R_PLUS = {"hidden_size": 192, "num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 528,
                   "use_qk_norm": True, "logit_scale": 0.8333333333333334, "attention_bias": False,
                   "rope_parameters": {"rope_theta": 75000000.0}}


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_command_r_plus_per_head_qk_norm(tiny_checkpoint, tmp_path, tp):
    ckpt = tiny_checkpoint("CohereForCausalLM", overrides=_COMMAND_R_PLUS)
    ckpt = edit_config(ckpt, tmp_path / "crplus", lambda c: c.update(model_max_length=131072))
    want = _served_as_transformers(ckpt, "Command R+ form", tp)
    # sensitivity: the q/k norms matter (transformers' tokens without them differ)
    off = tiny_checkpoint("CohereForCausalLM", overrides={**_COMMAND_R_PLUS, "use_qk_norm": False})
    assert _TOKENS.hf(off) != want


def test_gpt_neox_20b_dropout_leftovers_are_accepted(tiny_checkpoint):
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.runtime.loading import registry

    cfg = tiny_config("GPTNeoXForCausalLM", {"hidden_act": "gelu_fast"}).to_dict()
    cfg.update(attention_probs_dropout_prob=0, hidden_dropout_prob=0)
    module, _ = registry.resolve(cfg)
    assert module.Config.from_hf(cfg).hidden_act == "gelu_fast"


def test_olmo3_legacy_rope_theta_other_than_the_sliding_theta_is_refused():
    """OLMo 3's releases (written by transformers 4.57) carry a top-level rope_theta, no rope_parameters. transformers 5
    reads that form with the sliding layers at theta 500000 whatever rope_theta says (Olmo3Config pops rope_theta
    twice); 4.57 turned them at rope_theta. They agree at 500000, every release's value (served); another value was
    served at rope_theta on the sliding layers, unlike transformers 5 (now refused by name)."""
    import json
    from pathlib import Path

    from transformers import Olmo3Config

    from xllm_gen.runtime.loading import registry

    real = json.loads((Path(__file__).parent / "data" / "real_configs" / "olmo3__Olmo-3.1-32B-Instruct.json").read_text())
    module, _ = registry.resolve(real)
    assert module.Config.from_hf(real).rope_local_theta == 500000.0
    legacy = {**real, "rope_theta": 10000.0}
    assert Olmo3Config(**{k: v for k, v in legacy.items() if k != "architectures"}).rope_parameters[
        "sliding_attention"]["rope_theta"] == 500000.0           # transformers 5's reading: the fix's premise
    with pytest.raises(Exception, match="rope_theta_legacy"):
        module.Config.from_hf(legacy)
    # transformers 5's own form (rope_parameters per layer type) states the sliding theta: read as written
    v5 = {k: v for k, v in real.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}}
    c = module.Config.from_hf(v5)
    assert (c.rope_theta, c.rope_local_theta) == (10000.0, 20000.0)


# HuggingFaceTB/SmolLM3-3B's config.json, sizes shrunk (36 -> 4 layers: NoPE every 4th, as no_rope_layers lists)
_SMOLLM3_3B = {"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 256,
               "num_hidden_layers": 4, "no_rope_layer_interval": 4, "no_rope_layers": [1, 1, 1, 0],
               "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": True, "attention_bias": False,
               "mlp_bias": False, "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 5000000.0, "rope_type": "default"}}
_SMOLLM3_3B_LEFTOVERS = {"max_window_layers": 28, "pretraining_tp": 2, "layer_types": ["full_attention"] * 4}


def test_smollm3_3b_leftovers_are_accepted(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("SmolLM3ForCausalLM", overrides=_SMOLLM3_3B)
    ckpt = edit_config(ckpt, tmp_path / "smollm3", lambda c: c.update(_SMOLLM3_3B_LEFTOVERS))
    _served_as_transformers(ckpt, "SmolLM3-3B form")


def test_smollm3_layer_types_window_without_use_sliding_window(tiny_checkpoint, tmp_path):
    """transformers' SmolLM3 masks a layer layer_types marks sliding with sliding_window even with
    use_sliding_window false (its config does not null the window); the spec served it without the window."""
    window = {**_SMOLLM3_3B, "sliding_window": 4, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]}
    want = _served_as_transformers(tiny_checkpoint("SmolLM3ForCausalLM", overrides=window), "SmolLM3 sliding layer")
    assert _TOKENS.hf(tiny_checkpoint("SmolLM3ForCausalLM", overrides=_SMOLLM3_3B)) != want   # the window matters


def test_smollm3_sliding_layer_without_window_is_refused():
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.runtime.loading import registry

    cfg = tiny_config("SmolLM3ForCausalLM", _SMOLLM3_3B).to_dict()
    cfg["layer_types"] = ["full_attention"] * 3 + ["sliding_attention"]
    module, _ = registry.resolve(cfg)
    with pytest.raises(ValueError, match="sliding_layers_have_window"):
        module.Config.from_hf(cfg)


# Qwen/Qwen3-Coder-30B-A3B-Instruct's config.json, sizes shrunk (32 / 4 heads of 128 beside hidden 2048 -> 8 / 1 of 16
# beside 64; 128 experts top-8 -> 8 top-4)
_QWEN3_CODER_30B = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 16,
                    "intermediate_size": 192, "moe_intermediate_size": 32, "num_experts": 8, "num_local_experts": 8,
                    "num_experts_per_tok": 4, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                    "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": False,
                    "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"}}
_QWEN3_CODER_LEFTOVERS = {"qkv_bias": False, "use_qk_norm": True, "shared_expert_intermediate_size": 0,
                          "max_window_layers": 28, "router_aux_loss_coef": 0.0}


def test_qwen3_coder_moe_leftovers_are_accepted(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("Qwen3MoeForCausalLM", overrides=_QWEN3_CODER_30B)
    ckpt = edit_config(ckpt, tmp_path / "coder",     # the published name of the expert count, as the Hub file has it
                       lambda c: c.update(_QWEN3_CODER_LEFTOVERS, num_experts=c.pop("num_local_experts")))
    _served_as_transformers(ckpt, "Qwen3-Coder-30B-A3B form")


@pytest.mark.parametrize("field,value", [("qkv_bias", True), ("use_qk_norm", False),
                                         ("shared_expert_intermediate_size", 256)])
def test_qwen3_moe_other_leftover_values_are_refused(field, value):
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.runtime.loading import registry

    cfg = tiny_config("Qwen3MoeForCausalLM", _QWEN3_CODER_30B).to_dict()
    cfg[field] = value
    module, _ = registry.resolve(cfg)
    with pytest.raises(ValueError, match=field):
        module.Config.from_hf(cfg)


# tencent/Hunyuan-7B-Instruct's and Hunyuan-A13B-Instruct's config.json fields (sizes shrunk: head_dim 32, 3 layers)
_HUNYUAN_ROPE = {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                 "type": "dynamic"}
_HUNYUAN_7B = {"attention_head_dim": 32, "cla_share_factor": 2, "eod_token_id": 127967, "mlp_bias": False,
               "norm_type": "rms", "pad_id": 127961, "pretraining_tp": 1, "sep_token_id": 127962,
               "text_end_id": 127957, "text_start_id": 127956, "use_cla": False, "use_qk_norm": True,
               "use_rotary_pos_emb": True, "rope_theta": 10000.0, "rope_scaling": _HUNYUAN_ROPE}
_HUNYUAN_A13B = {**_HUNYUAN_7B, "add_classification_head": False, "anyres_pooling_size": 2, "class_num": 0,
                 "dense_list": [128, 0], "group_limited_greedy": False, "im_end_id": 5, "im_newline_id": 11,
                 "im_start_id": 4, "kv_lora_rank": None, "mask_init_id": 12, "moe_drop_tokens": False,
                 "moe_layer_num_skipped": 0, "moe_random_routing_dropped_token": False, "norm_topk_prob": True,
                 "num_media_embeds": 257, "pool_type": "last", "position_embedding_xdrope": False,
                 "routed_scaling_factor": 1.0, "skip_cls_token": False, "use_mixed_mlp_moe": True, "use_mla": False,
                 "video_end_id": 10, "video_start_id": 9, "vit_mapping_type": "resampler", "vit_patch_size": 14}
_HY_SIZES = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "num_hidden_layers": 3}
_HY_MOE_SIZES = {**_HY_SIZES, "intermediate_size": 64, "num_experts": 8, "moe_topk": 4}


def _hunyuan_released(c: dict, moe: bool) -> None:
    c.pop("rope_parameters", None)
    c.update(_HUNYUAN_A13B if moe else _HUNYUAN_7B)
    if moe:
        n = c["num_hidden_layers"]
        c.update(moe_topk=[c["moe_topk"]] * n, moe_intermediate_size=[c["intermediate_size"]] * n,
                 num_shared_expert=[1] * n)


@pytest.mark.parametrize("arch,moe", [("HunYuanDenseV1ForCausalLM", False), ("HunYuanMoEV1ForCausalLM", True)])
def test_hunyuan_released_ntk_alpha_config_is_served(tiny_checkpoint, tmp_path, arch, moe):
    ckpt = tiny_checkpoint(arch, overrides=_HY_MOE_SIZES if moe else _HY_SIZES)
    ckpt = edit_config(ckpt, tmp_path / "hy", lambda c: _hunyuan_released(c, moe))
    want = _served_as_transformers(ckpt, f"{arch} released form")
    # sensitivity: the alpha stretch of theta matters (transformers' tokens at the default rope differ)
    plain = edit_config(ckpt, tmp_path / "plain", lambda c: c.pop("rope_scaling"))
    assert _TOKENS.hf(plain) != want


@pytest.mark.parametrize("field,value", [("moe_topk", [4, 2, 4]), ("num_shared_expert", [1, 2, 1]),
                                         ("moe_intermediate_size", [64, 32, 64]), ("attention_head_dim", 16),
                                         ("use_cla", True), ("use_mixed_mlp_moe", False)])
def test_hunyuan_a13b_other_leftover_values_are_refused(tmp_path, field, value):
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.runtime.loading import registry

    cfg = tiny_config("HunYuanMoEV1ForCausalLM", _HY_MOE_SIZES).to_dict()
    _hunyuan_released(cfg, True)
    module, _ = registry.resolve(cfg)
    assert module.Config.from_hf(cfg).moe_topk == 4
    cfg[field] = value
    with pytest.raises(ValueError, match="moe_topk|released_leftovers|" + field):
        module.Config.from_hf(cfg)


# openbmb/MiniCPM3-4B's config.json, sizes shrunk (40 heads -> 4; qk_rope_head_dim 32 -> 8: the 16 longrope factors
# subsampled to 4; hidden 2560 / 40 heads gives v_head_dim 64, here 64 / 4 = 16, which config.json leaves implicit)
_MINICPM3_FACTORS = [1.0591234137867171, 3.1174739066063757, 16.43262007003069, 28.717843855233994]
_MINICPM3_4B = {"hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 160, "num_attention_heads": 4,
                "num_key_value_heads": 4, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                "q_lora_rank": 48, "kv_lora_rank": 32, "rms_norm_eps": 1e-05, "max_position_embeddings": 32768,
                "scale_emb": 12, "dim_model_base": 256, "scale_depth": 1.4, "initializer_range": 0.1}


def _minicpm3_released(c: dict) -> None:
    c.pop("rope_parameters", None)
    c.pop("v_head_dim", None)
    c.update(rope_scaling={"type": "longrope", "long_factor": _MINICPM3_FACTORS, "short_factor": _MINICPM3_FACTORS,
                           "original_max_position_embeddings": 32768})


def test_minicpm3_4b_longrope(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("MiniCPM3ForCausalLM", overrides=_MINICPM3_4B)
    ckpt = edit_config(base, tmp_path / "minicpm3", _minicpm3_released)
    want = _served_as_transformers(ckpt, "MiniCPM3-4B form")
    assert _TOKENS.hf(base) != want                  # the factors matter (transformers' tokens without them differ)


# Qwen/Qwen2.5-7B-Instruct-1M's config.json fields (sizes shrunk; the chunk kept at its real 262144 - 8192)
_QWEN25_1M_DCA = {"chunk_size": 262144, "local_size": 8192, "original_max_position_embeddings": 262144}


def test_qwen25_1m_dual_chunk_attention_served_within_one_chunk(tiny_checkpoint, tmp_path):
    """Qwen2.5-*-1M carry `dual_chunk_attention_config`, which transformers ignores (full attention at every length)
    and vLLM runs; both compute plain causal attention while the context fits one chunk of chunk_size - local_size
    tokens. It was refused as unknown; now the context is capped there (max_position_embeddings, the engine's
    max_model_len) and served as both compute it: transformers' tokens, and a request past the cap refused."""
    from xllm_gen import LLM, SamplingParams
    from xllm_gen.runtime.loading import registry

    ckpt = tiny_checkpoint("Qwen2ForCausalLM", overrides={"max_position_embeddings": 1010000,
                                                          "rope_parameters": {"rope_type": "default",
                                                                              "rope_theta": 10000000.0}})
    ckpt = edit_config(ckpt, tmp_path / "q1m", lambda c: c.update(dual_chunk_attention_config=dict(_QWEN25_1M_DCA)))
    _served_as_transformers(ckpt, "Qwen2.5-7B-Instruct-1M form")
    import json
    cfg = json.loads((ckpt / "config.json").read_text())
    module, _ = registry.resolve(cfg)
    c = module.Config.from_hf(cfg)
    assert c.max_position_embeddings == 262144 - 8192 and c.max_position_raw == 1010000
    small = dict(cfg, dual_chunk_attention_config={**_QWEN25_1M_DCA, "chunk_size": 40, "local_size": 8})
    assert module.Config.from_hf(small).max_position_embeddings == 32
    ckpt32 = edit_config(ckpt, tmp_path / "q1m32", lambda d: d.update(small))
    with LLM(model=str(ckpt32), device="cpu", dtype="float32", block_size=4) as llm:
        assert llm.engine.max_model_len == 32
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([{"prompt_token_ids": list(range(5, 5 + 33))}], SamplingParams(max_tokens=1))


# --- hI: glm, glm4, glm4_moe, ernie4_5, ernie4_5_moe, seed_oss ---
def _with_extra_tensors(src, dst, names_shapes: dict):
    """A copy of checkpoint `src` whose safetensors also hold `names_shapes` (name -> shape, random values): the
    tensors a released checkpoint stores beside the served model (a multi-token-prediction head)."""
    import torch
    from safetensors.torch import load_file, save_file

    dst = edit_config(src, dst, lambda c: None)
    (dst / "model.safetensors").unlink()
    tensors = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    tensors.update({n: torch.randn(*s, generator=g) for n, s in names_shapes.items()})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# baidu/ERNIE-4.5-21B-A3B-PT's config.json fields that transformers' Ernie4_5_MoeConfig has no field for
_ERNIE45_MOE_LEFTOVERS = {"moe_capacity": [64, 64, 64], "moe_gate": "topk", "moe_use_aux_free": True,
                          "num_nextn_predict_layers": 1, "multi_token_pred_lambda": 0.3}
_ERNIE45_MOE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
                "intermediate_size": 128, "moe_intermediate_size": 32, "moe_num_experts": 16, "moe_k": 6,
                "moe_num_shared_experts": 2, "tie_word_embeddings": True}


def test_ernie45_21b_released_leftovers_and_mtp_tensors(tiny_checkpoint, tmp_path):
    """ERNIE-4.5-21B-A3B-PT was refused for moe_capacity / moe_gate / moe_use_aux_free / num_nextn_predict_layers /
    multi_token_pred_lambda; its checkpoint also stores the MTP head (mtp_*), which transformers skips and the loader
    refused as unexpected tensors."""
    ckpt = tiny_checkpoint("Ernie4_5_MoeForCausalLM", overrides=_ERNIE45_MOE)
    ckpt = edit_config(ckpt, tmp_path / "ernie", lambda c: c.update(_ERNIE45_MOE_LEFTOVERS))
    ckpt = _with_extra_tensors(ckpt, tmp_path / "ernie_mtp", {"model.mtp_linear_proj.0.weight": (64, 128),
                                                              "model.mtp_emb_norm.0.weight": (64,),
                                                              "model.mtp_block.0.mlp.down_proj.weight": (64, 128)})
    _served_as_transformers(ckpt, "ERNIE-4.5-21B-A3B form")


@pytest.mark.parametrize("field,value", [("moe_use_aux_free", False), ("moe_gate", "top2"), ("use_rmsnorm", False)])
def test_ernie45_moe_other_leftover_values_are_refused(field, value):
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.runtime.loading import registry

    cfg = {**tiny_config("Ernie4_5_MoeForCausalLM", _ERNIE45_MOE).to_dict(), **_ERNIE45_MOE_LEFTOVERS}
    module, _ = registry.resolve(cfg)
    module.Config.from_hf(cfg)
    with pytest.raises(ValueError, match=field):
        module.Config.from_hf({**cfg, field: value})


_GLM45_AIR = {"hidden_size": 64, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
              "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 16, "num_experts_per_tok": 8,
              "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 1.0,
              "use_qk_norm": False, "attention_bias": True, "partial_rotary_factor": 0.5,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}}


def test_glm45_mtp_layer_tensors_are_skipped(tiny_checkpoint, tmp_path):
    """GLM-4.5 / GLM-4.5-Air store their MTP layer as model.layers.92.* / model.layers.46.*, which transformers skips
    (the loader refused them as unexpected tensors); any other stray layer is still refused."""
    from xllm_gen import LLM

    ckpt = tiny_checkpoint("Glm4MoeForCausalLM", overrides=_GLM45_AIR)
    ckpt = edit_config(ckpt, tmp_path / "air", lambda c: c.update(num_nextn_predict_layers=1))
    mtp = {f"model.layers.{n}.{t}": (64, 128) for n in (46, 92) for t in ("eh_proj.weight", "mlp.down_proj.weight")}
    _served_as_transformers(_with_extra_tensors(ckpt, tmp_path / "air_mtp", mtp), "GLM-4.5-Air form + MTP layer")
    stray = _with_extra_tensors(ckpt, tmp_path / "stray", {"model.layers.47.eh_proj.weight": (64, 128)})
    with pytest.raises(Exception, match=r"unexpected tensor.*model\.layers\.47\.eh_proj"):
        LLM(model=str(stray), device="cpu", dtype="float32")


# --- main: dead multi-token-prediction skips ---
@pytest.mark.parametrize("arch,names", [
    ("DeepseekV3ForCausalLM", ["model.layers.61.eh_proj.weight", "model.layers.61.enorm.weight"]),
    ("NemotronHForCausalLM", ["mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight"]),
])
def test_mtp_layer_tensors_of_a_release_are_skipped(tiny_checkpoint, tmp_path, arch, names):
    """DeepSeek-V3 stores its MTP layer as model.layers.61.* (transformers skips it); Nemotron-H releases store mtp.*.
    The specs' skip patterns lacked '.*' and so matched nothing under the loader's whole-name match: such a release
    was refused as having unexpected tensors (the compiler now rejects a pattern that matches no name)."""
    ckpt = tiny_checkpoint(arch)
    ckpt = _with_extra_tensors(ckpt, tmp_path / "mtp", {n: (8, 8) if n.endswith("proj.weight") else (8,) for n in names})
    _served_as_transformers(ckpt, f"{arch} + MTP tensors")


# --- hH: granitemoehybrid, bamba ---
# ibm-granite/granite-4.0-h-tiny / -h-small's config.json beyond the sizes: no position embedding ('nope'), the legacy
# layer names, an IBM-training leftover
_GRANITE4_H_LEFTOVERS = {"position_embedding_type": "nope", "normalization_function": "rmsnorm",
                         "layer_types": ["attention", "mamba", "attention"]}


def test_granite4_h_nope_form_is_served(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("GraniteMoeHybridForCausalLM")          # the tiny default: rotary ('rope')
    ckpt = edit_config(base, tmp_path / "g4h", lambda c: c.update(_GRANITE4_H_LEFTOVERS))
    want = _served_as_transformers(ckpt, "Granite 4.0-H form")
    assert _TOKENS.hf(base) != want                  # sensitivity: 'nope' (no rotary) changes transformers' tokens


# ibm-granite/granite-4.0-micro (and -h-1b / -h-350m): dense, num_local_experts 0 AND num_experts_per_tok 0
_GRANITE4_DENSE = {"num_local_experts": 0, "num_experts_per_tok": 0, "position_embedding_type": "rope"}


def test_granite4_dense_zero_top_k_is_served(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("GraniteMoeHybridForCausalLM", overrides=_GRANITE4_DENSE)
    ckpt = edit_config(base, tmp_path / "g4d", lambda c: c.update(normalization_function="rmsnorm",
                                                                  layer_types=["attention", "mamba", "attention"]))
    _served_as_transformers(ckpt, "Granite 4.0 dense form")


@pytest.mark.parametrize("edit,match", [
    ({"num_local_experts": 4, "num_experts_per_tok": 0}, "experts_have_top_k"),     # experts, none routed
    ({"layer_types": ["attention", "mamba", "sliding_attention"]}, "layer_types_other"),  # a kind it does not run
    ({"normalization_function": "layernorm"}, "normalization_function"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type"),
])
def test_granite4_other_values_are_refused(edit, match):
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.runtime.loading import registry

    cfg = tiny_config("GraniteMoeHybridForCausalLM", _GRANITE4_DENSE).to_dict()
    cfg.update(_GRANITE4_H_LEFTOVERS)
    module, _ = registry.resolve(cfg)
    module.Config.from_hf(cfg)
    cfg.update(edit)
    with pytest.raises(ValueError, match=match):
        module.Config.from_hf(cfg)


def test_bamba_9b_leftovers_are_accepted_and_the_rotary_agrees(tiny_checkpoint, tmp_path):
    """Bamba-9B's config.json carries attn_rotary_emb (64 of head_dim 128) and use_mamba_kernels, which transformers
    never reads: both were refused as unknown. attn_rotary_emb is accepted where it states the rotary dims transformers
    builds (head_dim * 0.5), refused otherwise; a top-level partial_rotary_factor, which transformers' BambaConfig
    replaces by 0.5 (the spec read it), is assumed 0.5."""
    import json

    from transformers import BambaConfig

    from xllm_gen.runtime.loading import registry

    base = tiny_checkpoint("BambaForCausalLM")
    cfg = json.loads((base / "config.json").read_text())
    half = cfg["hidden_size"] // cfg["num_attention_heads"] // 2
    ckpt = edit_config(base, tmp_path / "bamba9b", lambda c: c.update(attn_rotary_emb=half, use_mamba_kernels=True,
                                                                      num_logits_to_keep=1))
    want = _served_as_transformers(ckpt, "Bamba-9B form")
    module, _ = registry.resolve(cfg)
    for edit, match in (({"attn_rotary_emb": 2 * half}, "attn_rotary_emb"),
                        ({"partial_rotary_factor": 1.0}, "partial_rotary_factor")):
        with pytest.raises(ValueError, match=match):
            module.Config.from_hf({**cfg, **edit})
    # the premise: transformers turns half the head whatever the top-level field says, and the rotary dims matter
    assert BambaConfig(partial_rotary_factor=1.0).rope_parameters["partial_rotary_factor"] == 0.5
    whole = edit_config(base, tmp_path / "bamba_whole",
                        lambda c: c["rope_parameters"].update(partial_rotary_factor=1.0))
    assert _TOKENS.hf(whole) != want


# --- hK: mamba2 (Mamba-Codestral-7B), lfm2 (LFM2-350M / 1.2B), jamba (Jamba-v0.1) ---
_CODESTRAL_LEFTOVERS = {"intermediate_size": None, "norm_before_gate": True, "rms_norm": True,
                        "time_step_init_scheme": "random", "time_step_scale": 1.0, "rescale_prenorm_residual": False}


def _codestral_released(c: dict) -> None:
    c.update(_CODESTRAL_LEFTOVERS, intermediate_size=c["expand"] * c["hidden_size"])


def test_mamba_codestral_leftovers_are_accepted(tiny_checkpoint, tmp_path):
    """Mamba-Codestral-7B's config.json carries fields transformers' Mamba2 never reads (intermediate_size,
    norm_before_gate: its gated RMSNorm always gates first, time_step_init_scheme / time_step_scale; rms_norm true):
    refused as unknown before."""
    ckpt = edit_config(tiny_checkpoint("Mamba2ForCausalLM"), tmp_path / "codestral", _codestral_released)
    _served_as_transformers(ckpt, "Mamba-Codestral form")


def test_mamba2_layernorm_rms_norm_false_is_refused():
    import json
    from pathlib import Path

    from xllm_gen.runtime.loading import registry

    real = json.loads((Path(__file__).parent / "data" / "real_configs" / "mamba2__Mamba-Codestral-7B-v0.1.json")
                      .read_text())
    module, _ = registry.resolve(real)
    module.Config.from_hf(real)
    with pytest.raises(ValueError, match="rms_norm"):
        module.Config.from_hf({**real, "rms_norm": False})


# LFM2's first releases (LFM2-350M / 700M / 1.2B) as Liquid wrote them: the feed-forward width as block_ff_dim, the
# tie as tie_embedding, the training code's names for restated sizes and init settings
def _lfm2_first_release(c: dict, *, stale: int, tie: bool) -> None:
    c.update(block_ff_dim=c["intermediate_size"], intermediate_size=stale, tie_embedding=tie,
             block_dim=c["hidden_size"], conv_dim=c["hidden_size"], conv_dim_out=c["hidden_size"],
             num_heads=c["num_attention_heads"], block_norm_eps=c["norm_eps"], block_mlp_init_scale=1.0,
             block_out_init_scale=1.0, block_use_swiglu=True, block_use_xavier_init=True, conv_use_xavier_init=True,
             use_pos_enc=True)


def test_lfm2_first_release_names_block_ff_dim_and_tie_embedding(tiny_checkpoint, tmp_path):
    """transformers' Lfm2Config pops block_ff_dim over intermediate_size and tie_embedding over tie_word_embeddings;
    the spec read intermediate_size (a copy of LFM2-1.2B carries the adjusted 8192 there beside block_ff_dim 12288)
    and refused the leftovers. Here block_ff_dim disagrees with intermediate_size (reading the stale one builds
    another MLP width), and in the second arm tie_embedding with tie_word_embeddings (reading the latter looks for a
    head the checkpoint lacks)."""
    untied = tiny_checkpoint("Lfm2ForCausalLM", overrides={"tie_word_embeddings": False, "intermediate_size": 288})
    ckpt = edit_config(untied, tmp_path / "lfm2", lambda c: _lfm2_first_release(c, stale=160, tie=False))
    want = _served_as_transformers(ckpt, "LFM2 first-release form (untied)")
    # tied by tie_embedding (no lm_head tensor) although tie_word_embeddings says untied
    tied = tiny_checkpoint("Lfm2ForCausalLM", overrides={"tie_word_embeddings": True, "intermediate_size": 288})
    ckpt = edit_config(tied, tmp_path / "lfm2_tied", lambda c: _lfm2_first_release(c, stale=160, tie=True)
                       or c.update(tie_word_embeddings=False))
    assert _served_as_transformers(ckpt, "LFM2 first-release form (tied by tie_embedding)") != want


def test_lfm2_leftover_other_values_are_refused():
    import json
    from pathlib import Path

    from xllm_gen.runtime.loading import registry

    real = json.loads((Path(__file__).parent / "data" / "real_configs" / "lfm2__LFM2-1.2B.json").read_text())
    module, _ = registry.resolve(real)
    c = module.Config.from_hf(real)
    assert (c.intermediate_size, c.ff_size) == (12288, 8192)      # block_ff_dim, adjusted as transformers does
    for field, value in (("use_pos_enc", False), ("block_use_swiglu", False)):
        with pytest.raises(ValueError, match=field):
            module.Config.from_hf({**real, field: value})


def test_jamba_v01_remote_code_leftovers_are_accepted(tiny_checkpoint, tmp_path):
    """Jamba-v0.1's config.json from its remote-code days: calc_logits_for_entire_prompt and n_ctx (the context length
    transformers names max_position_embeddings, absent there: its default 262144), fields transformers' Jamba never
    reads, refused as unknown before; mamba_inner_layernorms true (what transformers builds) was already assumed."""
    def v01(c: dict) -> None:
        c.pop("max_position_embeddings", None)
        c.update(calc_logits_for_entire_prompt=False, n_ctx=262144, mamba_inner_layernorms=True,
                 use_mamba_kernels=True)

    ckpt = edit_config(tiny_checkpoint("JambaForCausalLM"), tmp_path / "jamba01", v01)
    _served_as_transformers(ckpt, "Jamba-v0.1 form")
    import json

    from xllm_gen.runtime.loading import registry
    cfg = json.loads((ckpt / "config.json").read_text())
    module, _ = registry.resolve(cfg)
    assert module.Config.from_hf(cfg).max_position_embeddings == 262144
    with pytest.raises(ValueError, match="mamba_inner_layernorms"):
        module.Config.from_hf({**cfg, "mamba_inner_layernorms": False})


# --- hJ: olmoe, olmo2, starcoder2, qwen2_moe, phimoe, phi, nemotron ---
# nvidia/Minitron-8B-Base's config.json, sizes shrunk (48 heads of 128 beside hidden 4096 -> 6 of 16 beside 64)
_MINITRON_8B = {"hidden_size": 64, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
                "intermediate_size": 192, "num_hidden_layers": 3, "norm_eps": 1e-05,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}


def _minitron_released(c: dict) -> None:
    c.pop("rope_parameters", None)
    c.update(rope_percent=0.5, rope_theta=10000)


def test_minitron_rope_percent_is_read_where_both_readings_agree(tiny_checkpoint, tmp_path):
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.runtime.loading import registry

    base = tiny_checkpoint("NemotronForCausalLM", overrides=_MINITRON_8B)
    ckpt = edit_config(base, tmp_path / "minitron", _minitron_released)
    want = _served_as_transformers(ckpt, "Minitron-8B form")
    # sensitivity: the partial rotary matters (transformers' tokens with the whole head rotating differ)
    full = tiny_checkpoint("NemotronForCausalLM", overrides={
        **_MINITRON_8B, "rope_parameters": {**_MINITRON_8B["rope_parameters"], "partial_rotary_factor": 1.0}})
    assert _TOKENS.hf(full) != want
    # a rope_percent transformers 4.4x would rotate by, and transformers 5 would not, is refused by name
    cfg = tiny_config("NemotronForCausalLM", _MINITRON_8B).to_dict()
    _minitron_released(cfg)
    module, _ = registry.resolve(cfg)
    assert module.Config.from_hf(cfg).partial_rotary_factor == 0.5
    with pytest.raises(ValueError, match="rope_percent"):
        module.Config.from_hf({**cfg, "rope_percent": 0.25})


# microsoft/Phi-3.5-MoE-instruct's config.json fields, sizes shrunk (head_dim 16: the 64 factors per list subsampled
# to the 8 rotating frequencies; the context 131072 (= its window) shrunk to 8192, still past the original 4096: the
# engine's default max_model_len is in the long regime)
_PHI35_MOE_SIZES = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
                    "num_hidden_layers": 3, "num_local_experts": 8, "attention_bias": True, "lm_head_bias": True,
                    "max_position_embeddings": 8192, "rms_norm_eps": 1e-05}
_PHI35_MOE_ROPE = {"long_factor": [1.0199999809265137, 1.0299999713897705, 1.0399999618530273, 1.0499999523162842,
                                   1.0499999523162842, 1.0499999523162842, 1.059999942779541, 1.059999942779541],
                   "long_mscale": 1.243163121016122, "original_max_position_embeddings": 4096,
                   "short_factor": [1.0, 1.0399999618530273, 1.0399999618530273, 1.0399999618530273,
                                    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842],
                   "short_mscale": 1.243163121016122, "type": "longrope"}


def _phi35_moe_released(c: dict, **rope) -> None:
    c.pop("rope_parameters", None)
    c.update(rope_scaling={**_PHI35_MOE_ROPE, **rope}, rope_theta=10000.0, original_max_position_embeddings=4096,
             hidden_dropout=0.0, input_jitter_noise=0.01, router_jitter_noise=0.01, router_aux_loss_coef=0.0,
             sliding_window=8192, output_router_logits=False,
             architectures=["PhiMoEForCausalLM"])          # the remote-code class name the release carries


def test_phi35_moe_short_factor_at_the_default_context(tiny_checkpoint, tmp_path):
    """Served at the engine's default max_model_len (max_position_embeddings, past the original 4096) as transformers
    computes it: short_factor at every length. The long arm's long_factor is 8x the release's: transformers never reads it, an
    engine turning at it (vLLM's long regime) differs; the short arm's 8x short_factor changes transformers' tokens."""
    base = tiny_checkpoint("PhimoeForCausalLM", overrides=_PHI35_MOE_SIZES)
    want = _served_as_transformers(edit_config(base, tmp_path / "released", _phi35_moe_released), "Phi-3.5-MoE form")
    big = [8 * f for f in _PHI35_MOE_ROPE["long_factor"]]
    long = edit_config(base, tmp_path / "long", lambda c: _phi35_moe_released(c, long_factor=big))
    assert _served_as_transformers(long, "Phi-3.5-MoE, long_factor x8") == want
    short = edit_config(base, tmp_path / "short", lambda c: _phi35_moe_released(c, short_factor=big))
    assert _TOKENS.hf(short) != want                 # the factor list the engine turns at matters


# --- hG: recurrent_gemma, gemma3, cohere2 (gemma, vaultgemma: served as released, tests/test_real_settings.py) ---
# google/recurrentgemma-2b's config.json fields (sizes shrunk): the pattern saved as `_block_types` (transformers 4.40)
_RG_SIZES = {"hidden_size": 64, "lru_width": 64, "intermediate_size": 192, "num_attention_heads": 4,
             "num_key_value_heads": 1, "num_hidden_layers": 4, "attention_window_size": 6}
_RG_RELEASED = {"_block_types": ["recurrent", "recurrent", "attention"], "embeddings_scale_by_sqrt_dim": True,
                "head_dim": 16, "partial_rotary_factor": 0.5, "rope_theta": 10000.0, "hidden_activation": "gelu_pytorch_tanh",
                "final_w_init_variance_scale": 0.5, "w_init_variance_scale": 0.01}


def _rg_released(c: dict) -> None:
    c.pop("block_types", None)
    c.pop("rope_parameters", None)
    c.update(_RG_RELEASED)


def test_recurrentgemma_released_block_types_field(tiny_checkpoint, tmp_path):
    """recurrentgemma-2b / 9b store the layer pattern as `_block_types`, which transformers 5 ignores (it builds
    block_types, default [recurrent, recurrent, attention], every release's value); it was refused as unknown."""
    ckpt = tiny_checkpoint("RecurrentGemmaForCausalLM", overrides=_RG_SIZES)
    ckpt = edit_config(ckpt, tmp_path / "rg", _rg_released)
    _served_as_transformers(ckpt, "recurrentgemma-2b form")


def test_recurrentgemma_other_legacy_block_types_is_refused():
    """Another `_block_types` than the pattern transformers 5 builds: transformers 4.x (which read it) and 5 build other
    layers, so it is refused by name rather than served as either."""
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.runtime.loading import registry

    cfg = tiny_config("RecurrentGemmaForCausalLM", _RG_SIZES).to_dict()
    _rg_released(cfg)
    module, _ = registry.resolve(cfg)
    assert module.Config.from_hf(cfg).block_types == ("recurrent", "recurrent", "attention")
    cfg["_block_types"] = ["recurrent", "attention"]
    with pytest.raises(ValueError, match="_block_types"):
        module.Config.from_hf(cfg)


# google/gemma-3-4b-it's text_config as published (sparse: transformers' Gemma3TextConfig defaults fill in vocab_size,
# context length, 8 / 4 heads of 256), sizes shrunk: hidden, intermediate, layers, vocab, window
_G3_4B_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 7,
               "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 6}
_G3_KEEP = ("architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype",
            "vocab_size")                  # (the tiny tokenizer's)


def _g3_sparse(c: dict) -> None:
    for k in list(c):
        if k not in _G3_KEEP:
            del c[k]
    c.update(_G3_4B_TEXT)


def test_gemma3_sparse_released_text_config(tiny_checkpoint, tmp_path):
    """The multimodal Gemma 3 releases' text_config omits what equals Gemma3TextConfig's defaults; the spec had none
    for vocab_size (refused) and Gemma 2's for the rest (kv heads = heads: refused at load; 8192 context)."""
    from xllm_gen.runtime.loading import registry

    built = tiny_checkpoint("Gemma3ForCausalLM", overrides={
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]})
    ckpt = edit_config(built, tmp_path / "g3", _g3_sparse)
    want = _served_as_transformers(ckpt, "gemma-3-4b text_config form")
    # sensitivity: the full layer's linear rope factor 8 matters (transformers' tokens without it differ)
    plain = edit_config(ckpt, tmp_path / "plain", lambda c: c.pop("rope_scaling"))
    assert _TOKENS.hf(plain) != want
    import json
    cfg = json.loads((ckpt / "config.json").read_text())
    module, _ = registry.resolve(cfg)
    c = module.Config.from_hf({k: v for k, v in cfg.items() if k != "vocab_size"})
    assert (c.vocab_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.max_position_embeddings) == (
        262208, 8, 4, 256, 131072)


# CohereLabs/c4ai-command-r7b-12-2024's config.json fields (sizes shrunk): Cohere's own fields beside transformers'
_R7B_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 5, "sliding_window": 6, "logit_scale": 0.25,
              "layer_types": ["sliding_attention"] * 3 + ["full_attention", "sliding_attention"],
              "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}
_R7B_LEFTOVERS = {"layer_switch": 4, "order_of_interleaved_layers": "local_attn_first",
                  "position_embedding_type": "rope_gptj", "rotary_pct": 1.0, "use_embedding_sharing": True,
                  "use_gated_activation": True, "use_parallel_block": True, "use_parallel_embedding": True,
                  "cache_implementation": "hybrid", "use_qk_norm": False}      # (the last: Tiny Aya's)


def _r7b_released(c: dict) -> None:
    c.pop("layer_types")                           # the release states the period, transformers derives the layers
    c.pop("rope_parameters", None)
    c.update(_R7B_LEFTOVERS, sliding_window_pattern=4, rope_theta=50000, rope_scaling=None, head_dim=16)


def test_command_r7b_released_leftovers_are_accepted(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("Cohere2ForCausalLM", overrides=_R7B_SIZES)
    ckpt = edit_config(ckpt, tmp_path / "r7b", _r7b_released)
    _served_as_transformers(ckpt, "Command R7B form")


@pytest.mark.parametrize("field,value", [("layer_switch", 2), ("use_embedding_sharing", False),
                                         ("order_of_interleaved_layers", "global_attn_first"),
                                         ("position_embedding_type", "rope_gpt_neox"), ("rotary_pct", 0.5),
                                         ("use_gated_activation", False), ("use_parallel_block", False),
                                         ("use_qk_norm", True)])
def test_command_r7b_other_leftover_values_are_refused(field, value):
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.runtime.loading import registry

    cfg = tiny_config("Cohere2ForCausalLM", _R7B_SIZES).to_dict()
    _r7b_released(cfg)
    module, _ = registry.resolve(cfg)
    assert module.Config.from_hf(cfg).layer_types == ("sliding_attention",) * 3 + ("full_attention", "sliding_attention")
    cfg[field] = value
    with pytest.raises(ValueError, match=field):
        module.Config.from_hf(cfg)


# --- hL: gpt_oss, dbrx, jetmoe, dots1, llama4, apertus, arcee ---
# (their released config.json files: tests/data/real_configs; the full settings: tests/test_real_settings.py CASES)
def _config(ckpt) -> dict:
    import json
    return json.loads((ckpt / "config.json").read_text())


def _read(cfg: dict):
    from xllm_gen.runtime.loading import registry
    module, _ = registry.resolve(cfg)
    return module.Config.from_hf(cfg)


# dbrx-instruct's settings, sizes shrunk, with SQUARE experts (ffn_hidden_size == d_model)
_DBRX_SQUARE = {"attn_config": {"kv_n_heads": 2, "clip_qkv": 8, "rope_theta": 500000},
                "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 8, "moe_top_k": 4}}


def _dbrx_release(c: dict) -> None:
    """The config.json as dbrx-instruct publishes it: the base in attn_config only, the router loss weight."""
    c.pop("rope_parameters", None)
    c["attn_config"]["rope_theta"] = 500000
    c.update(router_aux_loss_coef=0.05)


def _transpose_experts_w2(src, dst):
    """A copy of a DBRX checkpoint with each expert's w2 matrix transposed in place (same shape when square)."""
    from safetensors.torch import load_file, save_file
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).symlink_to(f.resolve())
    sd = load_file(src / "model.safetensors")
    for k in [k for k in sd if k.endswith("experts.mlp.w2")]:
        e, n = _DBRX_SQUARE["ffn_config"]["moe_num_experts"], _DBRX_SQUARE["ffn_config"]["ffn_hidden_size"]
        sd[k] = sd[k].view(e, n, -1).transpose(1, 2).reshape(e * n, -1).contiguous()
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_dbrx_instruct_release_with_square_experts(tiny_checkpoint, tmp_path):
    """dbrx-instruct's config.json carries router_aux_loss_coef (refused as unknown before) and its rope base in
    attn_config.rope_theta, which transformers 5's DbrxConfig drops (10000 then): the spec reads the release's base,
    equal to transformers given it the way it reads it (rope_parameters). And DBRX's w2 stores each expert's down
    matrix [in, out]: with square experts the loader took it as [out, in] by its shape (served wrong); the spec now
    declares it transposed."""
    built = tiny_checkpoint("DbrxForCausalLM", overrides=_DBRX_SQUARE)
    ckpt = edit_config(built, tmp_path / "release", _dbrx_release)
    ref = edit_config(ckpt, tmp_path / "as_tf5", lambda c: c.update(
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    assert _read(_config(ckpt)).rope_theta == 500000.0
    want = _TOKENS.hf(ref)
    assert not _flat(want)
    _assert_same(_TOKENS.engine(ckpt), want, "dbrx-instruct release, square experts")
    # sensitivity: transformers' own reading of the release (base 10000) differs
    assert _TOKENS.hf(ckpt) != want


@pytest.mark.slow      # a third transformers run of the DBRX checkpoint (~8 s)
def test_dbrx_square_experts_layout_matters(tiny_checkpoint, tmp_path):
    """The other reading of a square w2 (each expert's matrix transposed) changes transformers' tokens: the layout the
    spec declares is not a guess that any reading would pass."""
    built = tiny_checkpoint("DbrxForCausalLM", overrides=_DBRX_SQUARE)
    assert _TOKENS.hf(_transpose_experts_w2(built, tmp_path / "w2t")) != _TOKENS.hf(built)


def _scout_release(c: dict) -> None:
    c.update(attn_temperature_tuning=4, for_llm_compressor=False)


def test_llama4_scout_attn_temperature_tuning_int(tiny_checkpoint, tmp_path):
    """Llama 4 Scout / Maverick publish `attn_temperature_tuning: 4`, which the spec refused (not a bool) and
    transformers 5's strict config class refuses too (transformers 4.51 and vLLM test it by truth: on). The symbol
    reads an int by its truth now (`truthy`), and the engine's tokenizer loads although transformers refuses the
    field's type: served equal to transformers with `true`; `false` changes transformers' tokens."""
    built = tiny_checkpoint("Llama4ForCausalLM")          # (its tiny config: floor_scale 4, NoPE layer 1)
    ckpt = edit_config(built, tmp_path / "scout", _scout_release)
    on = edit_config(built, tmp_path / "on", lambda c: c.update(attn_temperature_tuning=True))
    off = edit_config(built, tmp_path / "off", lambda c: c.update(attn_temperature_tuning=False))
    assert _read(_config(ckpt)).attn_temperature_tuning is True
    assert _read({**_config(ckpt), "attn_temperature_tuning": 0}).attn_temperature_tuning is False
    want = _TOKENS.hf(on)
    assert not _flat(want)
    _assert_same(_TOKENS.engine(ckpt), want, "Llama 4 Scout attn_temperature_tuning: 4")
    assert _TOKENS.hf(off) != want


@pytest.mark.parametrize("value", ["yes", 4.0, [1]])
def test_llama4_attn_temperature_tuning_other_types_are_refused(tiny_checkpoint, value):
    from xllm_gen.runtime.loading.hf_config import ConfigError
    cfg = _config(tiny_checkpoint("Llama4ForCausalLM"))
    with pytest.raises(ConfigError, match="attn_temperature_tuning"):
        _read({**cfg, "attn_temperature_tuning": value})


def test_apertus_release_leftovers(tiny_checkpoint):
    """Apertus-8B / 70B carry qk_norm, mlp_bias, post_norm and hidden_dropout, which transformers' ApertusConfig never
    reads (refused as unknown before): accepted at the released values, another value refused by name."""
    from xllm_gen.runtime.loading.hf_config import ConfigError
    cfg = {**_config(tiny_checkpoint("ApertusForCausalLM")), "qk_norm": True, "mlp_bias": False, "post_norm": False,
           "hidden_dropout": 0.0}
    _read(cfg)
    for field, value in (("qk_norm", False), ("post_norm", True), ("mlp_bias", True)):
        with pytest.raises(ConfigError, match=field):
            _read({**cfg, field: value})


def _dots1_release(c: dict) -> None:
    c.update(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, pretraining_tp=1,
             use_sliding_window=False, n_group=None, topk_group=None)


def test_dots1_inst_release_leftovers_and_null_groups(tiny_checkpoint, tmp_path):
    """dots.llm1.inst carries DeepSeek-V3 leftovers transformers' Dots1Config never reads (scoring_func, topk_method,
    moe_layer_freq, pretraining_tp, use_sliding_window: refused as unknown before) and n_group / topk_group null (no
    group limit; transformers 5 cannot run null): served equal to transformers with one group; other values refused."""
    from xllm_gen.runtime.loading.hf_config import ConfigError
    built = tiny_checkpoint("Dots1ForCausalLM", overrides={"first_k_dense_replace": 1})
    ckpt = edit_config(built, tmp_path / "dots1", _dots1_release)
    ref = edit_config(ckpt, tmp_path / "one_group", lambda c: c.update(n_group=1, topk_group=1))
    assert _read(_config(ckpt)) == _read(_config(ref))
    _served_as_transformers(ref, "dots.llm1.inst form")
    _assert_same(_TOKENS.engine(ckpt), _TOKENS.hf(ref), "dots.llm1.inst, null groups")
    for field, value in (("scoring_func", "softmax"), ("topk_method", "greedy"), ("moe_layer_freq", 2)):
        with pytest.raises(ConfigError, match=field):
            _read({**_config(ckpt), field: value})


def test_llama4_empty_no_rope_layers_means_the_default(tiny_checkpoint, tmp_path):
    """`no_rope_layers: []` (a release may write the empty list): transformers' Llama4TextConfig takes the default
    (every no_rope_layer_interval-th layer NoPE) for an empty list; the spec indexed the empty tuple (a traceback).
    Served as transformers; the tiny config's own list ([1, 0, 1]) gives other tokens."""
    built = tiny_checkpoint("Llama4ForCausalLM")
    empty = edit_config(built, tmp_path / "empty", lambda c: c.update(no_rope_layers=[]))
    assert _read(_config(empty)).no_rope_layers == (1, 1, 1)
    want = _served_as_transformers(empty, "Llama 4 no_rope_layers: []")
    assert _TOKENS.hf(built) != want


# mlx-community's re-serialized dbrx-instruct: PretrainedConfig's fields dumped into both sub-configs
_PRETRAINED_NOISE = {"return_dict": True, "output_hidden_states": False, "torch_dtype": None,
                     "tie_word_embeddings": True, "max_length": 20, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                     "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "model_type": ""}


def test_dbrx_reserialized_sub_configs_are_read_alike():
    """The same release re-serialized with PretrainedConfig's fields in attn_config / ffn_config (a sub-config's
    tie_word_embeddings: true, refused before) and ffn_config.uniform_expert_assignment: false (llm-foundry's training
    switch, which transformers never reads) reads as the plain file; uniform routing (true) is refused by name."""
    import json
    from pathlib import Path

    from xllm_gen.runtime.loading.hf_config import ConfigError
    plain = json.loads((Path(__file__).parent / "data" / "real_configs" / "dbrx__dbrx-instruct.json").read_text())
    noisy = {**plain, "attn_config": {**_PRETRAINED_NOISE, **plain["attn_config"], "attn_pdrop": 0},
             "ffn_config": {**_PRETRAINED_NOISE, **plain["ffn_config"], "ffn_act_fn": {"name": "silu"},
                            "moe_normalize_expert_weights": 1, "uniform_expert_assignment": False}}
    assert _read(noisy) == _read(plain)
    with pytest.raises(ConfigError, match="uniform_expert_assignment"):
        _read({**noisy, "ffn_config": {**noisy["ffn_config"], "uniform_expert_assignment": True}})


# --- hM: gpt2, gpt_bigcode, gpt_neo, gptj, codegen ---
_SUMMARY = {"summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
            "summary_type": "cls_index", "summary_use_proj": True}
# each release's fields its transformers class never reads (tests/data/real_configs: gpt-neo-125m, gpt-j-6b,
# codegen-350M-mono, starcoderbase, distilgpt2)
_HM_LEFTOVERS = {
    "GPTNeoForCausalLM": dict(_SUMMARY, gradient_checkpointing=False),
    "GPTJForCausalLM": dict(_SUMMARY, rotary=True, scale_attn_weights=True, tokenizer_class="GPT2Tokenizer"),
    "CodeGenForCausalLM": dict(_SUMMARY, scale_attn_weights=True, n_ctx=2048),
    "GPTBigCodeForCausalLM": dict(_SUMMARY, inference_runner=0, pad_key_length=True, pre_allocate_kv_cache=False,
                                  validate_runner_input=True, max_batch_size=None, max_sequence_length=None),
    "GPT2LMHeadModel": dict(_SUMMARY, _num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}),
}


@pytest.mark.parametrize("arch", list(_HM_LEFTOVERS))
def test_gpt_family_release_leftovers_are_accepted(tiny_checkpoint, tmp_path, arch):
    """The releases' GPT-2 double-heads summary_* fields (GPT-Neo, GPT-J, CodeGen), GPT-J's `rotary: true` /
    `scale_attn_weights: true` (CodeGen's too), the BigCode fork's runtime options (starcoderbase / starcoder) and
    distilgpt2's `_num_labels` were refused as unknown; transformers reads none of them. Served as transformers."""
    ckpt = edit_config(tiny_checkpoint(arch), tmp_path / "release", lambda c: c.update(_HM_LEFTOVERS[arch]))
    _served_as_transformers(ckpt, f"{arch} with its release's leftovers")


@pytest.mark.parametrize("arch,field,value", [("GPTJForCausalLM", "rotary", False),
                                              ("GPTJForCausalLM", "scale_attn_weights", False),
                                              ("CodeGenForCausalLM", "scale_attn_weights", False)])
def test_gptj_codegen_other_leftover_values_are_refused(tiny_checkpoint, arch, field, value):
    """`rotary` / `scale_attn_weights` are accepted only at true (what transformers always computes): false, the
    original code's unrotated / unscaled attention, is refused by name."""
    from xllm_gen.runtime.loading.hf_config import ConfigError
    with pytest.raises(ConfigError, match=field):
        _read({**_config(tiny_checkpoint(arch)), field: value})


# --- hN: opt, bloom, mpt (xglm, biogpt: served as released, tests/test_real_settings.py) ---
def _real_file(stem: str) -> dict:
    import json
    from pathlib import Path
    return json.loads((Path(__file__).parent / "data" / "real_configs" / f"{stem}.json").read_text())


@pytest.mark.parametrize("stem,leftovers", [
    ("opt__opt-125m", ("activation_dropout", "prefix")),
    ("opt__opt-350m", ("activation_dropout", "prefix")),
    ("bloom__bloom-560m", ("attention_softmax_in_fp32", "bias_dropout_fusion", "skip_bias_add", "skip_bias_add_qkv")),
    ("mpt__mpt-7b", ("init_config", "verbose", "tokenizer_name")),
    ("mpt__mpt-7b-8k", ("init_config", "verbose", "tokenizer_name", "ffn_config", "fc_type")),
])
def test_released_leftovers_read_as_the_plain_file(stem, leftovers):
    """OPT's `activation_dropout` / fairseq `prefix`, BLOOM's Megatron flags (attention_softmax_in_fp32,
    bias_dropout_fusion, skip_bias_add, skip_bias_add_qkv), MPT's `init_config` / `verbose` / `tokenizer_name` and
    mpt-7b-8k's `ffn_config: {ffn_type: mptmlp}` / `fc_type: torch`: fields of the released config.json that
    transformers never reads, refused as unknown before. The release reads as the file without them."""
    real = _real_file(stem)
    assert _read(real) == _read({k: v for k, v in real.items() if k not in leftovers})


def test_mpt_other_ffn_or_linear_kind_is_refused():
    """llm-foundry's ffn_type / fc_type other than the plain MLP on nn.Linear (an MoE, Transformer Engine) are not
    what transformers' MptMLP builds: refused by name."""
    from xllm_gen.runtime.loading.hf_config import ConfigError
    real = _real_file("mpt__mpt-7b-8k")
    with pytest.raises(ConfigError, match="ffn_type"):
        _read({**real, "ffn_config": {"ffn_type": "mb_moe"}})
    with pytest.raises(ConfigError, match="fc_type"):
        _read({**real, "fc_type": "te"})


def test_opt_350m_release_form_served_as_transformers(tiny_checkpoint):
    """OPT-350m's form (project_in / project_out, post-norm, its leftovers) serves as transformers; pre-norm
    (do_layer_norm_before true) gives other tokens."""
    real = _real_file("opt__opt-350m")
    ov = {k: real[k] for k in ("activation_dropout", "prefix", "dropout", "layerdrop", "init_std",
                               "do_layer_norm_before", "activation_function")}
    post = tiny_checkpoint("OPTForCausalLM", overrides={**ov, "word_embed_proj_dim": 32})
    want = _served_as_transformers(post, "OPT-350m form")
    pre = tiny_checkpoint("OPTForCausalLM", overrides={**ov, "word_embed_proj_dim": 32, "do_layer_norm_before": True})
    assert _TOKENS.hf(pre) != want


def test_bloom_176b_field_names_read_as_transformers():
    """bigscience/bloom (176B) writes the width as `n_embed` and the heads as `num_attention_heads` (BloomConfig pops
    n_embed over hidden_size and maps num_attention_heads onto n_head); the spec refused it (no hidden_size). Read as
    transformers: n_embed wins over a hidden_size beside it."""
    import transformers
    base = _real_file("bloom__bloom-560m")
    named = {k: v for k, v in base.items() if k not in ("hidden_size", "n_head")}
    named.update(n_embed=base["hidden_size"], num_attention_heads=base["n_head"])
    assert _read(named) == _read(base)
    both = {**base, "n_embed": 512}
    assert _read(both).hidden_size == transformers.BloomConfig(**both).hidden_size == 512


_FOUNDRY_ATTN = {"rope": False, "rope_theta": 10000, "rope_impl": "dail", "sliding_window_size": -1, "kv_n_heads": 1,
                 "rope_dail_config": {"type": "original", "pos_idx_in_fp32": True, "xpos_scale_base": 512},
                 "rope_hf_config": {"type": "no_scaling", "factor": 1.0}}


def test_mpt_later_foundry_attn_config_defaults_read_as_the_plain_file():
    """Later llm-foundry exports write their attn_config defaults (rope false with its unused rope settings, no sliding
    window, kv_n_heads beside multihead attention), refused as unknown before; transformers reads none. At those
    values the file reads as without them; rotary or a window is refused by name."""
    from xllm_gen.runtime.loading.hf_config import ConfigError
    real = _real_file("mpt__mpt-7b-8k")
    noisy = {**real, "attn_config": {**real["attn_config"], **_FOUNDRY_ATTN}}
    assert _read(noisy) == _read(real)
    for field, value in (("rope", True), ("sliding_window_size", 512)):
        with pytest.raises(ConfigError, match=field):
            _read({**noisy, "attn_config": {**noisy["attn_config"], field: value}})


# --- hO: qwen3_5, qwen3_5_moe, exaone_moe ---
# Qwen/Qwen3.5-9B's text_config fields that transformers' Qwen3.5 (and Qwen3.5-MoE) never reads, with the release's values
_QWEN35_LEFTOVERS = {"attn_output_gate": True, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
                     "mamba_ssm_dtype": "float32"}


@pytest.mark.parametrize("arch", ["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"])
def test_qwen35_released_text_config_leftovers_and_mtp_tensors(tiny_checkpoint, tmp_path, arch):
    """Qwen3.5's released text_config (attn_output_gate, mtp_num_hidden_layers, mtp_use_dedicated_embeddings,
    mamba_ssm_dtype) was refused as unknown; served as transformers now, with an MTP tensor (mtp.*) the release stores."""
    ckpt = tiny_checkpoint(arch)
    ckpt = edit_config(ckpt, tmp_path / "q35", lambda c: c.update(_QWEN35_LEFTOVERS))
    ckpt = _with_extra_tensors(ckpt, tmp_path / "q35_mtp", {"mtp.fc.weight": (8, 16), "mtp.norm.weight": (8,)})
    _served_as_transformers(ckpt, f"{arch} Qwen3.5 release form")


@pytest.mark.parametrize("arch", ["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"])
def test_qwen35_ungated_attention_is_refused(arch):
    """attn_output_gate: false would be attention without the output gate transformers always builds: refused."""
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.runtime.loading import registry

    cfg = tiny_config(arch).to_dict()
    cfg.update(_QWEN35_LEFTOVERS, attn_output_gate=False)
    module, _ = registry.resolve(cfg)
    with pytest.raises(ValueError, match="attn_output_gate"):
        module.Config.from_hf(cfg)


# LGAI-EXAONE/K-EXAONE-236B-A23B's config.json fields that transformers' ExaoneMoe never reads (TensorRT-LLM's copy)
_K_EXAONE_LEFTOVERS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_last_k_dense_replace": 1,
                       "sliding_window_pattern": "LLLG"}


def test_k_exaone_released_leftovers_are_accepted(tiny_checkpoint, tmp_path):
    """K-EXAONE's scoring_func / topk_method / is_moe_layer / first_last_k_dense_replace were refused as unknown; the
    router transformers builds is assumed (sigmoid, noaux_tc), the layout restatements ignored."""
    ckpt = tiny_checkpoint("ExaoneMoeForCausalLM")

    def edit(c):
        c.update(_K_EXAONE_LEFTOVERS, is_moe_layer=[t == "sparse" for t in c["mlp_layer_types"]])
    _served_as_transformers(edit_config(ckpt, tmp_path / "kx", edit), "K-EXAONE release form")


@pytest.mark.parametrize("field,value", [("scoring_func", "softmax"), ("topk_method", "greedy")])
def test_k_exaone_other_router_values_are_refused(field, value):
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.runtime.loading import registry

    cfg = tiny_config("ExaoneMoeForCausalLM").to_dict()
    cfg.update(_K_EXAONE_LEFTOVERS, **{field: value})
    module, _ = registry.resolve(cfg)
    with pytest.raises(ValueError, match=field):
        module.Config.from_hf(cfg)
