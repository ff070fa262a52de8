"""DeepSeek-V2 / V3 (and GLM-4-MoE's reuse of the routing) features against transformers (float32, CPU, greedy): multi-head latent attention (low-rank or
direct q, v heads narrower than q/k, the shared rope key, interleaved rotary, YaRN's softmax mscale) and the MoE
routing variants (sigmoid scores, the selection-only correction bias, grouped top-k by top-2 sum or max, the routed
scale, dense first layers).

The spec battery (tests/test_spec_battery.py) checks the default tiny checkpoints of both specs (every feature on:
tests/fixtures/tiny_hf.py ARCH_DEFAULTS / ARCH_INIT). Each arm here switches one feature off (or to its other
form): transformers' tokens must change, and the engine must still agree. A config the specs do not model is
refused by name.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hf_ref import hf_greedy

ROOT = Path(__file__).resolve().parents[1]
V3, V2, GLM = "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "Glm4MoeForCausalLM"
PROMPT_LENS = (3, 9, 17, 30)
MAX_TOKENS = 12


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENS]


_HF: dict = {}


def _hf(ckpt) -> list[list[int]]:
    if str(ckpt) not in _HF:
        _HF[str(ckpt)] = [list(hf_greedy(ckpt, [p], MAX_TOKENS)[0]) for p in _prompts()]
    return _HF[str(ckpt)]


def _engine(ckpt, tp: int = 1) -> list[list[int]]:
    from xllm_gen import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4, tensor_parallel_size=tp) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                                                                    params)]


# (architecture, overrides, init): each switches one feature of the default tiny checkpoint off
ARMS = {
    "v3_q_direct": (V3, {"q_lora_rank": None}, None),                         # q_proj instead of q_a -> q_b
    "v3_no_groups": (V3, {"n_group": 1, "topk_group": 1}, None),              # plain top-k
    "v3_no_correction_bias": (V3, {}, {"bias_buffer_std": 0.0}),              # e_score_correction_bias zero
    "v3_no_mscale": (V3, {"rope_parameters": {"mscale_all_dim": None}}, None),   # YaRN without the softmax mscale
    "v3_not_renormalized": (V3, {"norm_topk_prob": False}, None),
    "v3_rope_neox": (V3, {"rope_interleave": False}, None),                   # the neox halves on the rope dims
    "v3_rope_default": (V3, {"rope_parameters": {"rope_type": "default", "factor": None, "mscale": None,
                                                 "mscale_all_dim": None, "original_max_position_embeddings": None}},
                        None),
    "v2_greedy": (V2, {"topk_method": "greedy"}, None),                       # no group limit
    "v2_q_direct": (V2, {"q_lora_rank": None}, None),                         # V2-Lite's direct q
    # GLM-4-MoE reuses the routing primitives over standard attention (specs/glm4_moe.yaml: no code of its own)
    "glm_no_correction_bias": (GLM, {}, {"bias_buffer_std": 0.0}),
    "glm_no_groups": (GLM, {"n_group": 1, "topk_group": 1}, None),
}


# the default suite keeps the cheap arms (YaRN's mscale, the rope layout); --runslow runs them all (the conformance
# battery serves the tiny default, grouped routing and the q LoRA on; the slow arms turn them off)
FAST_ARMS = ("v3_no_mscale", "v3_rope_neox")


@pytest.mark.engine
@pytest.mark.parametrize("arm", [a if a in FAST_ARMS else pytest.param(a, marks=pytest.mark.slow) for a in ARMS])
def test_feature_off_changes_hf_and_engine_agrees(arm, tiny_checkpoint):
    arch, overrides, init = ARMS[arm]
    base = tiny_checkpoint(arch)
    ckpt = tiny_checkpoint(arch, overrides=overrides, **({"init": init} if init else {}))
    want = _hf(ckpt)
    assert want != _hf(base), f"fixture: {arm} does not change transformers' tokens"
    assert _engine(ckpt) == want, f"{arm}: engine differs from transformers"


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("arch", [V3, V2, GLM])
def test_tp2_heads_split(arch, tiny_checkpoint):
    """TP 2: q / kv_b projections split by heads, o_proj by heads (row), latents replicated; experts split."""
    ckpt = tiny_checkpoint(arch)
    assert _engine(ckpt, tp=2) == _hf(ckpt)


@pytest.mark.parametrize("arch, edit, field", [
    (V3, {"num_key_value_heads": 2}, "kv_heads_equal_heads"),     # transformers cannot run it either
    (V3, {"scoring_func": "softmax"}, "scoring_func"),
    (V2, {"topk_method": "noaux_tc"}, "topk_method"),
    (V2, {"mlp_bias": True}, "mlp_bias"),
])
def test_unmodeled_configs_refused_by_name(arch, edit, field, tiny_checkpoint):
    from xllm_gen.runtime.loading.hf_config import ConfigError
    ckpt = tiny_checkpoint(arch)
    cfg = {**json.loads((ckpt / "config.json").read_text()), **edit}
    name = "deepseek_v3" if arch == V3 else "deepseek_v2"
    module = __import__(f"xllm_gen.generated.{name}.model", fromlist=["Config"])
    with pytest.raises(ConfigError, match=field):
        module.Config.from_hf(cfg)


def test_grouped_routing_reference():
    """select_experts against a direct transcription of transformers' two routers (V3 noaux_tc, V2
    group_limited_greedy) on random logits, including experts outside the chosen groups scoring highest."""
    import torch

    from xllm_gen.runtime.ops import moe as moe_ops

    g = torch.Generator().manual_seed(0)
    T, E, n_group, topk_group, k = 64, 16, 4, 2, 3
    logits = torch.randn(T, E, generator=g) * 3
    bias = torch.randn(E, generator=g)
    # V3
    scores = logits.sigmoid()
    choice = scores + bias
    gs = choice.view(T, n_group, -1).topk(2, dim=-1)[0].sum(-1)
    gmask = torch.zeros_like(gs).scatter_(1, gs.topk(topk_group, dim=-1)[1], 1)
    smask = gmask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(T, E)
    ids = choice.masked_fill(~smask.bool(), float("-inf")).topk(k, dim=-1)[1]
    w = scores.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * 2.5
    got_w, got_ids = moe_ops.select_experts(logits, k, True, "sigmoid", n_group, topk_group, "top2_sum", bias, 2.5)
    order, got_order = ids.sort(-1), got_ids.sort(-1)
    assert torch.equal(order.values, got_order.values)
    assert torch.allclose(w.gather(1, order.indices), got_w.gather(1, got_order.indices))
    # without the bias the choice differs for some tokens (the bias matters)
    _, plain_ids = moe_ops.select_experts(logits, k, True, "sigmoid", n_group, topk_group, "top2_sum", None, 2.5)
    assert not torch.equal(plain_ids.sort(-1).values, got_ids.sort(-1).values)
    # V2 group_limited_greedy
    scores = logits.softmax(-1)
    gs = scores.view(T, n_group, -1).max(-1).values
    gmask = torch.zeros_like(gs).scatter_(1, gs.topk(topk_group, dim=-1)[1], 1)
    smask = gmask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(T, E)
    w, ids = scores.masked_fill(~smask.bool(), 0.0).topk(k, dim=-1)
    got_w, got_ids = moe_ops.select_experts(logits, k, False, "softmax", n_group, topk_group, "max", None, 16.0)
    order, got_order = ids.sort(-1), got_ids.sort(-1)
    assert torch.equal(order.values, got_order.values)
    assert torch.allclose((w * 16.0).gather(1, order.indices), got_w.gather(1, got_order.indices))


@pytest.mark.engine
@pytest.mark.parametrize("arch", [V3, pytest.param(V2, marks=pytest.mark.slow)])
def test_expanded_kv_cache_form_matches_hf(arch, tiny_checkpoint, tmp_path, tmp_path_factory, monkeypatch):
    """`kv_cache: expanded` (per-head K/V, v zero-padded) serves the same checkpoint with transformers' tokens, as
    the default latent form does (the battery); the latent form's cache holds one head of kv_lora_rank + rope
    dims per token, the expanded one heads x (nope + rope)."""
    from fixtures.tiny_hf import edit_config

    from xllm_gen import LLM
    from xllm_gen.codegen.cli import main as cli_main

    base = "deepseek_v3.yaml" if arch == V3 else "deepseek_v2.yaml"
    spec = tmp_path / "expanded.yaml"
    spec.write_text(f"spec_version: 2\nextends: {ROOT / 'specs' / base}\nname: expanded_{base[:-5]}\n"
                    f"class_prefix: ExpandedMla\narchitectures: [Expanded{arch}]\n"
                    "decoder:\n  layers:\n    blocks:\n      self_attn: {kv_cache: expanded}\n")
    assert cli_main([str(spec), "--out", str(tmp_path / "generated")]) == 0
    monkeypatch.setenv("XLLM_GEN_PATH", str(tmp_path / "generated"))
    ckpt = tiny_checkpoint(arch)
    expanded = edit_config(ckpt, tmp_path_factory.mktemp("mla_expanded"),
                           lambda cfg: cfg.__setitem__("architectures", [f"Expanded{arch}"]))
    assert _engine(expanded) == _hf(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    for path, want in ((ckpt, (1, cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])),
                       (expanded, (cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]))):
        with LLM(model=str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=16) as llm:
            layer = llm.engine.runner.attn_layers[0]
            assert (layer.num_kv_heads, layer.head_dim) == want


@pytest.mark.parametrize("spec, variant, billions", [
    ("deepseek_v3", "DeepSeek-V3", 671.0), ("deepseek_v3", "Moonlight-16B-A3B", 16.0),
    ("deepseek_v2", "DeepSeek-V2", 235.7), ("deepseek_v2", "DeepSeek-V2-Lite", 15.7),
    ("glm4_moe", "GLM-4.5-Air", 106.9), ("glm4_moe_lite", "GLM-4.7-Flash", 29.9),
])
def test_published_parameter_counts(spec, variant, billions):
    """Parameters of the published checkpoints (without DeepSeek-V3's multi-token-prediction layer), from the
    runtime's plan of the rendered model: the MLA projections, q low-rank or direct, and the experts add up."""
    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.explain import tp_rank_table

    c = compile_spec(ROOT / "specs" / f"{spec}.yaml")
    v = {x.name: x for x in c.ir.variants}[variant]
    assert round(tp_rank_table(c.ir, c.files, v, 1).total_numel / 1e9, 1) == billions


# the config.json of the released DeepSeek-V3 and DeepSeek-V2-Lite checkpoints (as published, remote-code era)
_COMMON = {"attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "hidden_act": "silu",
           "initializer_range": 0.02, "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_layer_freq": 1,
           "pretraining_tp": 1, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
           "rope_theta": 10000, "seq_aux": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "use_cache": True, "v_head_dim": 128,
           "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekConfig",
                        "AutoModelForCausalLM": "modeling_deepseek.DeepseekForCausalLM"}}
RELEASED = {
    "deepseek_v3": {**_COMMON, "architectures": [V3], "model_type": "deepseek_v3", "bos_token_id": 0,
                    "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_size": 7168,
                    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_group": 8, "n_routed_experts": 256,
                    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
                    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
                    "q_lora_rank": 1536, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_group": 4,
                    "topk_method": "noaux_tc", "vocab_size": 129280,
                    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"}},
    "deepseek_v2": {**_COMMON, "architectures": [V2], "model_type": "deepseek_v2", "bos_token_id": 100000,
                    "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_size": 2048,
                    "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 64,
                    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
                    "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None,
                    "routed_scaling_factor": 1.0, "scoring_func": "softmax", "topk_group": 1, "topk_method": "greedy",
                    "vocab_size": 102400,
                    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                     "type": "yarn"}},
}


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_configs_pass_the_guard(name):
    """Every field of the released config.json is read, assumed or ignored; q_lora_rank null gives the direct q."""
    module = __import__(f"xllm_gen.generated.{name}.model", fromlist=["Config"])
    cfg = module.Config.from_hf(RELEASED[name])
    assert cfg.q_lora_rank == RELEASED[name]["q_lora_rank"]
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 40
