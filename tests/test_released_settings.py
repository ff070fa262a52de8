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
