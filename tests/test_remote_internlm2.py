"""InternLM2 (InternLM2ForCausalLM, remote code: transformers ships no class) served by specs/internlm2.yaml,
against a plain-PyTorch reference written from modeling_internlm2.py: the fused `wqkv` laid out per KV group
(`rearrange(qkv, "b q (h gs d) -> b q h gs d", gs=2 + groups)`: q heads, then k, then v of each KV head),
`feed_forward.w2(silu(w1(x)) * w3(x))`, RMSNorms `attention_norm` / `ffn_norm`, `tok_embeddings`, `output`,
biases on wqkv / wo where `bias`, linear rope scaling (`t / factor`)."""
from __future__ import annotations

import json

import pytest
import remote_ref as R
import torch

H, HEADS, KV, D, I, V, L = 64, 4, 2, 16, 96, 128, 2
CONFIG = {
    "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2",
    "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config",
                 "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"},
    "attn_implementation": "eager", "bias": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": I,
    "max_position_embeddings": 64, "num_attention_heads": HEADS, "num_hidden_layers": L,
    "num_key_value_heads": KV, "pretraining_tp": 1, "rms_norm_eps": 1e-5,
    "rope_scaling": {"type": "linear", "factor": 3.0}, "rope_theta": 1000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "transformers_version": "4.41.0", "use_cache": True, "vocab_size": V,
}


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {"model.tok_embeddings.weight": R.rand(g, V, H, std=1.0), "model.norm.weight": R.norm_weight(g, H),
         "output.weight": R.rand(g, V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        t |= {p + "attention_norm.weight": R.norm_weight(g, H), p + "ffn_norm.weight": R.norm_weight(g, H),
              p + "attention.wqkv.weight": R.rand(g, (HEADS + 2 * KV) * D, H),
              p + "attention.wqkv.bias": R.rand(g, (HEADS + 2 * KV) * D),
              p + "attention.wo.weight": R.rand(g, H, HEADS * D), p + "attention.wo.bias": R.rand(g, H),
              p + "feed_forward.w1.weight": R.rand(g, I, H), p + "feed_forward.w3.weight": R.rand(g, I, H),
              p + "feed_forward.w2.weight": R.rand(g, H, I)}
    return t


def reference(t, cfg, blocked=False):
    """modeling_internlm2.py's forward (eager attention). `blocked`: the rows read as [q | k | v] (a wrong layout,
    for the fixture's sensitivity check)."""
    groups, eps = HEADS // KV, cfg["rms_norm_eps"]
    factor = (cfg.get("rope_scaling") or {}).get("factor", 1.0)

    def forward(ids):
        x = t["model.tok_embeddings.weight"][ids]
        pos = torch.arange(len(ids))
        for i in range(L):
            p = f"model.layers.{i}."
            h = R.rms_norm(x, t[p + "attention_norm.weight"], eps)
            qkv = h @ t[p + "attention.wqkv.weight"].T + t[p + "attention.wqkv.bias"]
            if blocked:
                q, k, v = qkv.split([HEADS * D, KV * D, KV * D], -1)
                q, k, v = q.view(-1, HEADS, D), k.view(-1, KV, D), v.view(-1, KV, D)
            else:
                qkv = qkv.view(-1, KV, groups + 2, D)
                q, k, v = qkv[:, :, :groups].reshape(-1, HEADS, D), qkv[:, :, -2], qkv[:, :, -1]
            q, k = R.rope_neox(q, pos, cfg["rope_theta"], factor), R.rope_neox(k, pos, cfg["rope_theta"], factor)
            o = R.causal_attention(q, k, v, D ** -0.5)
            x = x + o @ t[p + "attention.wo.weight"].T + t[p + "attention.wo.bias"]
            h = R.rms_norm(x, t[p + "ffn_norm.weight"], eps)
            a = torch.nn.functional.silu(h @ t[p + "feed_forward.w1.weight"].T) * (h @ t[p + "feed_forward.w3.weight"].T)
            x = x + a @ t[p + "feed_forward.w2.weight"].T
        return R.rms_norm(x, t["model.norm.weight"], eps) @ t["output.weight"].T
    return forward


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return R.write_checkpoint(tmp_path_factory.mktemp("internlm2"), CONFIG, _tensors())


def test_internlm2_matches_reference(ckpt):
    t = _tensors()
    assert R.distinct(reference(t, CONFIG), reference(t, CONFIG, blocked=True)), "fixture: the wqkv layout matters"
    assert R.distinct(reference(t, CONFIG), reference(t, {**CONFIG, "rope_scaling": None})), "fixture: scaling matters"
    R.assert_matches(R.engine_greedy(ckpt), reference(t, CONFIG), what="internlm2")


@pytest.mark.parametrize("edit, named", [
    ({"rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}}, "yarn"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_internlm2_refuses_what_it_does_not_model(ckpt, tmp_path, edit, named):
    from xllm_gen import LLM
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**CONFIG, **edit}))
    (bad / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    with pytest.raises(Exception, match=named):
        LLM(model=str(bad), device="cpu", dtype="float32")
