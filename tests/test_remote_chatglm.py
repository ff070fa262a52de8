"""ChatGLM2 / ChatGLM3 / GLM-4 remote (ChatGLMModel, remote code: transformers ships no class of these releases)
served by specs/chatglm.yaml, against a plain-PyTorch reference written from modeling_chatglm.py:
`query_key_value` split `[np * hn, g * hn, g * hn]` (multi-query groups) with its bias, `apply_rotary_pos_emb` on the
first `rot_dim = kv_channels // 2` dims as (even, odd) pairs with `theta = 1 / (10000 * rope_ratio) ** (2j / rot_dim)`,
`swiglu` = `silu(x0) * x1` of `dense_h_to_4h`'s two halves, RMSNorms, the residual from the stream or (with
apply_residual_connection_post_layernorm) from the normed input, `final_layernorm` where post_layer_norm,
`transformer.output_layer`. Without multi_query_attention `query_key_value`'s output is viewed as (heads, 3 * head_dim)
and each head's slice split into its q, k, v (per head [h0: q k v, ...]): the spec's layout chosen by that flag, at TP
1 and (slow) 2, and read in the other branch's layout it serves another model."""
from __future__ import annotations

import importlib
import json

import pytest
import remote_ref as R
import torch
import torch.nn.functional as F

H, HEADS, G, D, I, V, L = 64, 4, 2, 16, 96, 128, 2
CONFIG = {
    "architectures": ["ChatGLMModel"], "model_type": "chatglm",
    "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig",
                 "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
                 "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration"},
    "add_bias_linear": False, "add_qkv_bias": True, "apply_query_key_layer_scaling": True,
    "apply_residual_connection_post_layernorm": False, "attention_dropout": 0.0, "attention_softmax_in_fp32": True,
    "bias_dropout_fusion": True, "ffn_hidden_size": I, "fp32_residual_connection": False, "hidden_dropout": 0.0,
    "hidden_size": H, "kv_channels": D, "layernorm_epsilon": 1e-5, "multi_query_attention": True,
    "multi_query_group_num": G, "num_attention_heads": HEADS, "num_layers": L, "original_rope": True,
    "padded_vocab_size": V, "post_layer_norm": True, "rmsnorm": True, "rope_ratio": 3.0, "seq_length": 64,
    "use_cache": True, "torch_dtype": "float32", "transformers_version": "4.30.2", "tie_word_embeddings": False,
    "eos_token_id": 2, "pad_token_id": 0,
}


def _tensors(seed=3, mqa=True):
    g = torch.Generator().manual_seed(seed)
    kv = G if mqa else HEADS                  # without multi-query attention k and v have every head
    t = {"transformer.embedding.word_embeddings.weight": R.rand(g, V, H, std=1.0),
         "transformer.encoder.final_layernorm.weight": R.norm_weight(g, H),
         "transformer.output_layer.weight": R.rand(g, V, H),
         "transformer.rotary_pos_emb.inv_freq": torch.zeros(D // 4)}     # saved by the release: unused here
    for i in range(L):
        p = f"transformer.encoder.layers.{i}."
        t |= {p + "input_layernorm.weight": R.norm_weight(g, H), p + "post_attention_layernorm.weight": R.norm_weight(g, H),
              p + "self_attention.query_key_value.weight": R.rand(g, (HEADS + 2 * kv) * D, H),
              p + "self_attention.query_key_value.bias": R.rand(g, (HEADS + 2 * kv) * D),
              p + "self_attention.dense.weight": R.rand(g, H, HEADS * D),
              p + "mlp.dense_h_to_4h.weight": R.rand(g, 2 * I, H), p + "mlp.dense_4h_to_h.weight": R.rand(g, H, I)}
    return t


def glm_rope(x, pos, base):
    """modeling_chatglm.py's apply_rotary_pos_emb over the cache of RotaryEmbedding(kv_channels // 2)."""
    rot = x.shape[-1] // 2
    theta = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    f = pos.float()[:, None] * theta[None]                       # [T, rot / 2]
    cos, sin = f.cos()[:, None], f.sin()[:, None]
    xr, xp = x[..., :rot], x[..., rot:]
    xs = xr.reshape(*xr.shape[:-1], rot // 2, 2)
    out = torch.stack([xs[..., 0] * cos - xs[..., 1] * sin, xs[..., 1] * cos + xs[..., 0] * sin], -1)
    return torch.cat([out.flatten(-2), xp], -1)


def reference(t, cfg, qkv_rows=None):
    """`qkv_rows`: how the fused output is split, as modeling_chatglm.py does per multi_query_attention (None), or
    forced ("blocked" / "per_head": the sensitivity arm's reading of the other layout)."""
    eps, post_ln = cfg["layernorm_epsilon"], cfg["apply_residual_connection_post_layernorm"]
    base = 10000 * cfg["rope_ratio"]
    mqa = cfg["multi_query_attention"]
    kv = G if mqa else HEADS
    rows = qkv_rows or ("blocked" if mqa else "per_head")

    def forward(ids):
        x = t["transformer.embedding.word_embeddings.weight"][ids]
        pos = torch.arange(len(ids))
        for i in range(L):
            p = f"transformer.encoder.layers.{i}."
            ln = R.rms_norm(x, t[p + "input_layernorm.weight"], eps)
            qkv = ln @ t[p + "self_attention.query_key_value.weight"].T + t[p + "self_attention.query_key_value.bias"]
            if rows == "blocked":             # [np * hn | g * hn | g * hn]
                q, k, v = qkv.split([HEADS * D, kv * D, kv * D], -1)
                q, k, v = q.view(-1, HEADS, D), k.view(-1, kv, D), v.view(-1, kv, D)
            else:                             # view (np, 3 * hn), then split_tensor_along_last_dim(x, 3)
                q, k, v = qkv.view(-1, HEADS, 3 * D).split(D, -1)
            o = R.causal_attention(glm_rope(q, pos, base), glm_rope(k, pos, base), v, D ** -0.5)
            x = o @ t[p + "self_attention.dense.weight"].T + (ln if post_ln else x)
            ln = R.rms_norm(x, t[p + "post_attention_layernorm.weight"], eps)
            a, b = (ln @ t[p + "mlp.dense_h_to_4h.weight"].T).chunk(2, -1)
            x = (F.silu(a) * b) @ t[p + "mlp.dense_4h_to_h.weight"].T + (ln if post_ln else x)
        if cfg["post_layer_norm"]:
            x = R.rms_norm(x, t["transformer.encoder.final_layernorm.weight"], eps)
        return x @ t["transformer.output_layer.weight"].T
    return forward


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return R.write_checkpoint(tmp_path_factory.mktemp("chatglm3"), CONFIG, _tensors())


def test_chatglm_matches_reference(ckpt):
    t = _tensors()
    want = reference(t, CONFIG)
    assert R.distinct(want, reference(t, {**CONFIG, "rope_ratio": 1.0})), "fixture: rope_ratio matters"
    R.assert_matches(R.engine_greedy(ckpt), want, what="chatglm")


@pytest.mark.parametrize("edit", [{"apply_residual_connection_post_layernorm": True}, {"post_layer_norm": False}])
def test_chatglm_forms_match_reference(ckpt, tmp_path, edit):
    t, cfg = _tensors(), {**CONFIG, **edit}
    assert R.distinct(reference(t, CONFIG), reference(t, cfg)), f"fixture: {edit} matters"
    arm = R.write_checkpoint(tmp_path / "arm", cfg, t if cfg["post_layer_norm"] else
                             {k: v for k, v in t.items() if "final_layernorm" not in k})
    R.assert_matches(R.engine_greedy(arm), reference(t, cfg), what=f"chatglm {edit}")


NO_MQA = {**CONFIG, "multi_query_attention": False}


@pytest.fixture(scope="module")
def ckpt_no_mqa(tmp_path_factory):
    return R.write_checkpoint(tmp_path_factory.mktemp("chatglm_no_mqa"), NO_MQA, _tensors(mqa=False))


def test_chatglm_without_multi_query_matches_reference(ckpt_no_mqa):
    """multi_query_attention false: query_key_value per head [h0: q k v, ...] (the layout's `else` branch)."""
    t = _tensors(mqa=False)
    want = reference(t, NO_MQA)
    assert R.distinct(want, reference(t, NO_MQA, qkv_rows="blocked")), "fixture: the row layout matters"
    R.assert_matches(R.engine_greedy(ckpt_no_mqa), want, what="chatglm without multi-query attention")


@pytest.mark.slow      # an engine of two ranks (~10 s); the multi-query form at TP 2: tests/test_remote_tp2.py
def test_chatglm_without_multi_query_matches_reference_at_tp2(ckpt_no_mqa):
    """Each rank reads its heads' [q k v] rows of the per-head tensor (and bias): the layout the flag chooses is the
    one the TP slicing follows."""
    R.assert_matches(R.engine_greedy(ckpt_no_mqa, tp=2), reference(_tensors(mqa=False), NO_MQA),
                     what="chatglm without multi-query attention at TP 2")


def test_chatglm_other_layout_branch_changes_the_output(ckpt, ckpt_no_mqa, monkeypatch):
    """The sensitivity arm: the same non-MQA checkpoint read in the other branch's layout (blocked [q | k | v]) serves
    another model; the MQA checkpoint read per head is refused (its k and v have fewer heads than q)."""
    import dataclasses

    mod = importlib.import_module("xllm_gen.generated.chatglm.model")
    choices = {k: v for k, v in mod.WEIGHT_LAYOUTS.items() if "query_key_value" in k}
    assert len(choices) == 2 and all(c.cond_text == "multi_query_attention" for c in choices.values())
    monkeypatch.setattr(mod, "WEIGHT_LAYOUTS", {**mod.WEIGHT_LAYOUTS, **{
        k: dataclasses.replace(c, then=c.else_, else_=c.then) for k, c in choices.items()}})
    got = [tokens for tokens, _ in R.engine_greedy(ckpt_no_mqa)]
    want = [R.ref_greedy(reference(_tensors(mqa=False), NO_MQA), p)[0] for p in R.PROMPTS]
    assert got != want, "reading the per-head query_key_value as blocked does not change the output"
    assert got == [R.ref_greedy(reference(_tensors(mqa=False), NO_MQA, qkv_rows="blocked"), p)[0] for p in R.PROMPTS]
    with pytest.raises(Exception, match="per: head needs segments of equal heads"):
        R.engine_greedy(ckpt)


@pytest.mark.parametrize("edit, named", [
    ({"pre_seq_len": 16}, "pre_seq_len"),               # P-tuning v2 prefix
    ({"rmsnorm": False}, "rmsnorm"),
])
def test_chatglm_refuses_what_it_does_not_model(ckpt, tmp_path, edit, named):
    from xllm_gen import LLM
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**CONFIG, **edit}))
    (bad / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    with pytest.raises(Exception, match=named):
        LLM(model=str(bad), device="cpu", dtype="float32")
