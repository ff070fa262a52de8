"""MiniCPM 1 / 2 (MiniCPMForCausalLM, remote code: transformers ships no class) served by specs/minicpm.yaml,
against a plain-PyTorch reference written from modeling_minicpm.py: Llama's layer with
`inputs_embeds = embed_tokens(ids) * scale_emb`, `residual + h * (scale_depth / sqrt(num_hidden_layers))` after
the attention and after the MLP, `lm_head(h / (hidden_size / dim_model_base))` with the head tied to the
embedding, GQA, no biases."""
from __future__ import annotations

import json

import pytest
import remote_ref as R
import torch

H, HEADS, KV, D, I, V, L = 64, 4, 2, 16, 96, 128, 3
CONFIG = {
    "architectures": ["MiniCPMForCausalLM"], "model_type": "minicpm",
    "auto_map": {"AutoConfig": "configuration_minicpm.MiniCPMConfig",
                 "AutoModelForCausalLM": "modeling_minicpm.MiniCPMForCausalLM"},
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.1,
    "intermediate_size": I, "max_position_embeddings": 64, "num_attention_heads": HEADS, "num_hidden_layers": L,
    "num_key_value_heads": KV, "rms_norm_eps": 1e-5, "rope_scaling": None, "torch_dtype": "float32",
    "transformers_version": "4.36.0", "use_cache": True, "vocab_size": V,
    "scale_emb": 12, "dim_model_base": 16, "scale_depth": 1.4,
}


def _tensors(seed=1):
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": R.rand(g, V, H, std=0.1), "model.norm.weight": R.norm_weight(g, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": R.norm_weight(g, H), p + "post_attention_layernorm.weight": R.norm_weight(g, H),
              p + "self_attn.q_proj.weight": R.rand(g, HEADS * D, H), p + "self_attn.k_proj.weight": R.rand(g, KV * D, H),
              p + "self_attn.v_proj.weight": R.rand(g, KV * D, H), p + "self_attn.o_proj.weight": R.rand(g, H, HEADS * D),
              p + "mlp.gate_proj.weight": R.rand(g, I, H), p + "mlp.up_proj.weight": R.rand(g, I, H),
              p + "mlp.down_proj.weight": R.rand(g, H, I)}
    return t


def reference(t, cfg):
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
    res = cfg["scale_depth"] / L ** 0.5
    emb = t["model.embed_tokens.weight"]

    def forward(ids):
        x = emb[ids] * cfg["scale_emb"]
        pos = torch.arange(len(ids))
        for i in range(L):
            p = f"model.layers.{i}."
            h = R.rms_norm(x, t[p + "input_layernorm.weight"], eps)
            q = (h @ t[p + "self_attn.q_proj.weight"].T).view(-1, HEADS, D)
            k = (h @ t[p + "self_attn.k_proj.weight"].T).view(-1, KV, D)
            v = (h @ t[p + "self_attn.v_proj.weight"].T).view(-1, KV, D)
            o = R.causal_attention(R.rope_neox(q, pos, theta), R.rope_neox(k, pos, theta), v, D ** -0.5)
            x = x + (o @ t[p + "self_attn.o_proj.weight"].T) * res
            h = R.rms_norm(x, t[p + "post_attention_layernorm.weight"], eps)
            a = torch.nn.functional.silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)
            x = x + (a @ t[p + "mlp.down_proj.weight"].T) * res
        h = R.rms_norm(x, t["model.norm.weight"], eps)
        return (h / (H / cfg["dim_model_base"])) @ emb.T
    return forward


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return R.write_checkpoint(tmp_path_factory.mktemp("minicpm"), CONFIG, _tensors())


def test_minicpm_matches_reference(ckpt):
    t = _tensors()
    assert R.distinct(reference(t, CONFIG), reference(t, {**CONFIG, "scale_depth": L ** 0.5})), \
        "fixture: the residual scale matters"
    assert R.distinct(reference(t, CONFIG), reference(t, {**CONFIG, "scale_emb": 1})), "fixture: scale_emb matters"
    scaled = R.ref_greedy(reference(t, CONFIG), R.PROMPTS[0])[1][0]
    flat = R.ref_greedy(reference(t, {**CONFIG, "dim_model_base": H}), R.PROMPTS[0])[1][0]
    assert (scaled - flat).abs().max() > 1e-2, "fixture: the logit scale matters"
    R.assert_matches(R.engine_greedy(ckpt), reference(t, CONFIG), what="minicpm")


@pytest.mark.parametrize("edit, named", [
    ({"num_experts": 8, "num_experts_per_tok": 2}, "num_experts"),          # MiniCPM-MoE-8x2B: not modeled
    ({"head_dim": 32}, "head_dim"),                                       # modeling_minicpm.py never reads it
])
def test_minicpm_refuses_what_it_does_not_model(ckpt, tmp_path, edit, named):
    from xllm_gen import LLM
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**CONFIG, **edit}))
    (bad / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    with pytest.raises(Exception, match=named):
        LLM(model=str(bad), device="cpu", dtype="float32")
