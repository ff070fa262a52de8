"""DeciLM-7B (DeciLMForCausalLM, model_type "deci"; remote code: transformers ships no class) served by
specs/decilm.yaml, against a plain-PyTorch reference written from Deci/DeciLM-7B's modeling_decilm.py (over its
vendored transformers 4.35.2 Llama): `DeciLMAttention` with `num_key_value_heads_per_layer[layer_idx]` KV heads
(`repeat_kv`: KV head j serves query heads j * groups .. (j + 1) * groups - 1), head_dim = hidden_size // heads,
q/k/v/o and the MLP without biases, rotate_half rotary (`linear`: positions / factor), RMSNorms, an untied head."""
from __future__ import annotations

import json

import pytest
import remote_ref as R
import torch
import torch.nn.functional as F

H, HEADS, D, I, V = 64, 8, 8, 96, 128
KV = [4, 2, 1]                      # variable GQA: 2, 4 and 8 query heads per KV head
L = len(KV)
CONFIG = {
    "architectures": ["DeciLMForCausalLM"], "model_type": "deci",
    "auto_map": {"AutoConfig": "configuration_decilm.DeciLMConfig",
                 "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM"},
    "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": H,
    "initializer_range": 0.02, "intermediate_size": I, "max_position_embeddings": 64, "num_attention_heads": HEADS,
    "num_hidden_layers": L, "num_key_value_heads_per_layer": KV, "pretraining_tp": 1, "rms_norm_eps": 1e-5,
    "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "transformers_version": "4.35.2", "use_bfloat16": True, "use_cache": True,
    "vocab_size": V,
}


def _tensors(kv=KV, seed=7):
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": R.rand(g, V, H, std=1.0), "model.norm.weight": R.norm_weight(g, H),
         "lm_head.weight": R.rand(g, V, H)}
    for i, n_kv in enumerate(kv):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": R.norm_weight(g, H), p + "post_attention_layernorm.weight": R.norm_weight(g, H),
              p + "self_attn.q_proj.weight": R.rand(g, HEADS * D, H), p + "self_attn.k_proj.weight": R.rand(g, n_kv * D, H),
              p + "self_attn.v_proj.weight": R.rand(g, n_kv * D, H), p + "self_attn.o_proj.weight": R.rand(g, H, HEADS * D),
              p + "mlp.gate_proj.weight": R.rand(g, I, H), p + "mlp.up_proj.weight": R.rand(g, I, H),
              p + "mlp.down_proj.weight": R.rand(g, H, I)}
    return t


def reference(t, cfg, tiled=False):
    """modeling_decilm.py's forward (no cache). `tiled`: KV heads repeated as a block (head h reads KV head
    h % kv), a wrong grouping for the fixture's sensitivity check."""
    eps, theta, kv = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["num_key_value_heads_per_layer"]
    rs = cfg.get("rope_scaling") or {}
    factor = rs.get("factor", 1.0) if rs.get("type") == "linear" else 1.0

    def forward(ids):
        n = len(ids)
        pos = torch.arange(n)
        x = t["model.embed_tokens.weight"][ids]
        for i in range(L):
            p = f"model.layers.{i}."
            h = R.rms_norm(x, t[p + "input_layernorm.weight"], eps)
            q = (h @ t[p + "self_attn.q_proj.weight"].T).view(n, HEADS, D)
            k = (h @ t[p + "self_attn.k_proj.weight"].T).view(n, kv[i], D)
            v = (h @ t[p + "self_attn.v_proj.weight"].T).view(n, kv[i], D)
            q, k = R.rope_neox(q, pos, theta, factor), R.rope_neox(k, pos, theta, factor)
            if tiled:
                k, v = k.repeat(1, HEADS // kv[i], 1), v.repeat(1, HEADS // kv[i], 1)
            x = x + R.causal_attention(q, k, v, D ** -0.5) @ t[p + "self_attn.o_proj.weight"].T
            h = R.rms_norm(x, t[p + "post_attention_layernorm.weight"], eps)
            a = F.silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)
            x = x + a @ t[p + "mlp.down_proj.weight"].T
        return R.rms_norm(x, t["model.norm.weight"], eps) @ t["lm_head.weight"].T
    return forward


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return R.write_checkpoint(tmp_path_factory.mktemp("decilm"), CONFIG, _tensors())


def test_decilm_matches_reference(ckpt):
    t = _tensors()
    ref = reference(t, CONFIG)
    assert R.distinct(ref, reference(t, CONFIG, tiled=True)), "fixture: which query heads share a KV head matters"
    assert R.distinct(ref, reference(t, {**CONFIG, "rope_scaling": None})), "fixture: the linear rope scaling matters"
    R.assert_matches(R.engine_greedy(ckpt), ref, what="decilm")


@pytest.mark.parametrize("edit, named", [
    ({"num_key_value_heads_per_layer": [4, 4, 1]}, "k_proj"),          # a wrong per-layer list: weights of another shape
    ({"num_key_value_heads_per_layer": [4, 2]}, "kv_heads_per_layer"),
    ({"num_key_value_heads_per_layer": None}, "num_key_value_heads_per_layer"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}}, "yarn"),
    ({"hidden_size": 68}, "head_dim_fits"),         # 68 // 8 heads = 8: DeciLMAttention raises
    # both forms of the class at once (the Nemotron-NAS per-layer mappings beside the per-layer KV list)
    ({"model_type": "nemotron-nas", "block_configs": [{"attention": {"n_heads_in_group": 2, "no_op": False},
                                                       "ffn": {"ffn_mult": 1.5, "no_op": False}}] * L},
     "one_form"),
    ({"intermediate_size": None}, "dense_intermediate_size"),
])
def test_decilm_refuses_what_it_does_not_model(ckpt, tmp_path, edit, named):
    from xllm_gen import LLM
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**CONFIG, **edit}))
    (bad / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    with pytest.raises(Exception, match=named):
        LLM(model=str(bad), device="cpu", dtype="float32")
