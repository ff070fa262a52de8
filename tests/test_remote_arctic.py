"""Snowflake Arctic (ArcticForCausalLM, model_type "arctic"; remote code: transformers ships no class) served by
specs/arctic.yaml, against a plain-PyTorch reference written from modeling_arctic.py / vLLM's arctic.py: Llama's
attention (q/k/v/o, no bias, neox rotary, GQA) and RMSNorms; `ArcticMLP` w2(silu(w1(x)) * w3(x)); on the MoE layers
((layer + 1) % moe_layer_frequency == 0) with parallel_attn_mlp_res, `ArcticDecoderLayer.forward`'s dense-MoE
hybrid: residual_attn = x + attn(input_layernorm(x)); out = residual_attn + residual_mlp(residual_layernorm(
residual_attn)) + moe(post_attention_layernorm(x)) (the MoE reads the layer's input), the residual MLP
hidden_size wide; the other layers post_attention_layernorm -> block_sparse_moe.mlp. Routing: softmax over the
experts, top-k, renormalized when top_k > 1."""
from __future__ import annotations

import json

import pytest
import remote_ref as R
import torch
import torch.nn.functional as F

H, HEADS, KV, I, V, E = 32, 4, 2, 24, 128, 4
D = H // HEADS
BASE = {
    "architectures": ["ArcticForCausalLM"], "model_type": "arctic",
    "auto_map": {"AutoConfig": "configuration_arctic.ArcticConfig",
                 "AutoModelForCausalLM": "modeling_arctic.ArcticForCausalLM"},
    "attention_dropout": 0, "bos_token_id": 1, "enable_expert_tensor_parallelism": False, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": I,
    "max_position_embeddings": 64, "moe_eval_capacity_factor": 1, "moe_layer_frequency": 2, "moe_min_capacity": 0,
    "moe_token_dropping": True, "moe_train_capacity_factor": 1, "num_attention_heads": HEADS,
    "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": KV, "num_local_experts": E,
    "parallel_attn_mlp_res": True, "quantization": None, "rms_norm_eps": 1e-5, "rope_scaling": None,
    "rope_theta": 10000, "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "float32", "transformers_version": "4.39.0", "use_cache": True, "use_residual": True,
    "vocab_size": V,
}
RELEASE_FORM = {**BASE, "moe_layer_frequency": 1}     # every layer a dense-MoE hybrid (snowflake-arctic-*)


def _is_moe(cfg, i):
    return (i + 1) % cfg["moe_layer_frequency"] == 0


def _tensors(cfg, seed=7):
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": R.rand(g, V, H, std=1.0), "model.norm.weight": R.norm_weight(g, H),
         "lm_head.weight": R.rand(g, V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": R.norm_weight(g, H), p + "post_attention_layernorm.weight":
              R.norm_weight(g, H), p + "self_attn.q_proj.weight": R.rand(g, HEADS * D, H),
              p + "self_attn.k_proj.weight": R.rand(g, KV * D, H), p + "self_attn.v_proj.weight": R.rand(g, KV * D, H),
              p + "self_attn.o_proj.weight": R.rand(g, H, HEADS * D)}
        if _is_moe(cfg, i):
            t[p + "block_sparse_moe.gate.weight"] = R.rand(g, E, H, std=0.5)
            for e in range(E):
                q = p + f"block_sparse_moe.experts.{e}."
                t |= {q + "w1.weight": R.rand(g, I, H), q + "w3.weight": R.rand(g, I, H), q + "w2.weight": R.rand(g, H, I)}
            t |= {p + "residual_layernorm.weight": R.norm_weight(g, H), p + "residual_mlp.w1.weight": R.rand(g, H, H),
                  p + "residual_mlp.w3.weight": R.rand(g, H, H), p + "residual_mlp.w2.weight": R.rand(g, H, H)}
        else:
            q = p + "block_sparse_moe.mlp."
            t |= {q + "w1.weight": R.rand(g, I, H), q + "w3.weight": R.rand(g, I, H), q + "w2.weight": R.rand(g, H, I)}
    return t


def reference(t, cfg, moe_reads_attn_out=False, renormalize=True):
    """modeling_arctic.py's forward, no cache. `moe_reads_attn_out`: the MoE reads the post-attention stream (the
    non-parallel form's input); `renormalize=False`: the top-k softmax weights left unnormalized (wrong readings,
    for the fixture's sensitivity checks)."""
    eps, theta, k_top = cfg["rms_norm_eps"], float(cfg["rope_theta"]), cfg["num_experts_per_tok"]

    def mlp(x, p):
        return (F.silu(x @ t[p + "w1.weight"].T) * (x @ t[p + "w3.weight"].T)) @ t[p + "w2.weight"].T

    def moe(x, p):
        probs = (x @ t[p + "gate.weight"].T).float().softmax(-1)
        w, ids = probs.topk(k_top, -1)
        if renormalize and k_top > 1:
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for s in range(k_top):
            for e in range(E):
                sel = ids[:, s] == e
                if sel.any():
                    out[sel] += w[sel, s, None] * mlp(x[sel], p + f"experts.{e}.")
        return out

    def forward(ids):
        n = len(ids)
        pos = torch.arange(n)
        x = t["model.embed_tokens.weight"][ids]
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = R.rms_norm(x, t[p + "input_layernorm.weight"], eps)
            q = (h @ t[p + "self_attn.q_proj.weight"].T).view(n, HEADS, D)
            k = (h @ t[p + "self_attn.k_proj.weight"].T).view(n, KV, D)
            v = (h @ t[p + "self_attn.v_proj.weight"].T).view(n, KV, D)
            q, k = R.rope_neox(q, pos, theta), R.rope_neox(k, pos, theta)
            attn_res = x + R.causal_attention(q, k, v, D ** -0.5) @ t[p + "self_attn.o_proj.weight"].T
            if _is_moe(cfg, i):
                r = mlp(R.rms_norm(attn_res, t[p + "residual_layernorm.weight"], eps), p + "residual_mlp.")
                moe_in = attn_res if moe_reads_attn_out else x
                x = attn_res + r + moe(R.rms_norm(moe_in, t[p + "post_attention_layernorm.weight"], eps),
                                       p + "block_sparse_moe.")
            else:
                x = attn_res + mlp(R.rms_norm(attn_res, t[p + "post_attention_layernorm.weight"], eps),
                                   p + "block_sparse_moe.mlp.")
        return R.rms_norm(x, t["model.norm.weight"], eps) @ t["lm_head.weight"].T
    return forward


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("arctic")
    return {name: R.write_checkpoint(root / name, cfg, _tensors(cfg))
            for name, cfg in (("mixed", BASE), ("release", RELEASE_FORM))}


@pytest.mark.parametrize("name, cfg", [("mixed", BASE), ("release", RELEASE_FORM)])
def test_arctic_matches_reference(ckpts, name, cfg):
    """Dense layers and dense-MoE hybrid layers (moe_layer_frequency 2), and every layer a hybrid (the releases)."""
    t = _tensors(cfg)
    ref = reference(t, cfg)
    assert R.distinct(ref, reference(t, cfg, moe_reads_attn_out=True)), "fixture: which stream the MoE reads matters"
    assert R.distinct(ref, reference(t, cfg, renormalize=False)), "fixture: the top-k renormalization matters"
    R.assert_matches(R.engine_greedy(ckpts[name]), ref, what=f"arctic {name}")


@pytest.mark.parametrize("edit, named", [
    ({"parallel_attn_mlp_res": False, "use_residual": False}, "parallel_attn_mlp_res_on"),
    ({"use_residual": False}, "residual_flags_agree"),
    ({"quantization": {"q_bits": 8}}, "quantization"),
    ({"sliding_window": 16}, "sliding_window"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_arctic_refuses_what_it_does_not_model(ckpts, tmp_path, edit, named):
    from xllm_gen import LLM
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**BASE, **edit}))
    (bad / "model.safetensors").symlink_to(ckpts["mixed"] / "model.safetensors")
    with pytest.raises(Exception, match=named):
        LLM(model=str(bad), device="cpu", dtype="float32")


def test_arctic_instruct_release_config():
    """snowflake-arctic-instruct's config.json values (the spec's variant of the same name, its shapes and TP sizes
    checked when the spec compiles): every layer a hybrid of 128 experts, top-2."""
    from xllm_gen.generated.arctic.model import Config
    c = Config.from_hf({**BASE, "hidden_size": 7168, "intermediate_size": 4864, "num_hidden_layers": 35,
                        "num_attention_heads": 56, "num_key_value_heads": 8, "num_local_experts": 128,
                        "moe_layer_frequency": 1, "max_position_embeddings": 4096, "vocab_size": 32000,
                        "torch_dtype": "bfloat16"})
    assert (c.head_dim, c.num_local_experts, c.num_experts_per_tok, c.moe_layer_frequency) == (128, 128, 2, 1)
