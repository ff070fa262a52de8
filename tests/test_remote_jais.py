"""Jais (JAISLMHeadModel, model_type "jais"; remote code: transformers ships no class) served by specs/jais.yaml,
against a plain-PyTorch reference written from the release's modeling_jais.py: GPT-2's Conv1D projections
(`x @ W + b` with W stored [in, out]), `c_attn` split `[hidden] * 3`, LayerNorms ln_1 / ln_2 / ln_f; the hidden
states `(wte(ids) + wpe(positions)) * mup_embeddings_scale` (no wpe with ALiBi); `_attn`'s scores divided by
`head_dim ** attn_scale_power` (1 with mup_scale_qk_dot_by_d, else 0.5) when scale_attn_weights, then
`AlibiPositionEmbeddingLayer`'s bias `(slopes / -scale) * |key - query|` (scale: alibi_scaling's factor, or
keys / train_seq_len past train_seq_len); `JAISMLP` `c_proj(c_fc(x) * silu(c_fc2(x)))` (SwiGLUActivation(x1, x2) =
x1 * silu(x2)) or `c_proj(act(c_fc(x)))`; the logits times `mup_output_alpha * mup_width_scale`."""
from __future__ import annotations

import json

import pytest
import remote_ref as R
import torch
import torch.nn.functional as F

H, HEADS, I, V, L = 48, 6, 80, 128, 2           # 6 heads: the slopes' non-power-of-two branch
D = H // HEADS
NPOS = 64
BASE = {
    "architectures": ["JAISLMHeadModel"], "model_type": "jais",
    "auto_map": {"AutoConfig": "configuration_jais.JAISConfig",
                 "AutoModel": "modeling_jais.JAISModel",
                 "AutoModelForCausalLM": "modeling_jais.JAISLMHeadModel"},
    "activation_function": "swiglu", "attn_pdrop": 0.0, "bos_token_id": 0, "embd_pdrop": 0.0, "eos_token_id": 0,
    "initializer_range": 0.02, "layer_norm_epsilon": 1e-5, "mup_embeddings_scale": 3.5, "mup_output_alpha": 2.22,
    "mup_scale_qk_dot_by_d": True, "mup_width_scale": 0.5, "n_embd": H, "n_head": HEADS, "n_inner": I,
    "n_layer": L, "n_positions": NPOS, "pad_token_id": 0, "position_embedding_type": "alibi",
    "reorder_and_upcast_attn": False, "resid_pdrop": 0.0, "scale_attn_by_inverse_layer_idx": False,
    "scale_attn_weights": True, "torch_dtype": "float32", "transformers_version": "4.28.0", "use_cache": True,
    "vocab_size": V, "alibi_scaling": {"type": "linear", "factor": 2.0},
}
# GPT-2's form: learned positions, a gelu_new MLP, an untied head, the plain 1 / sqrt(d)
LEARNED = {**BASE, "activation_function": "gelu_new", "position_embedding_type": "learned", "alibi_scaling": None,
           "mup_scale_qk_dot_by_d": False, "tie_word_embeddings": False, "mup_embeddings_scale": 2.5}


def _tensors(cfg, seed=3):
    g = torch.Generator().manual_seed(seed)
    t = {"transformer.wte.weight": R.rand(g, V, H), "transformer.ln_f.weight": R.norm_weight(g, H),
         "transformer.ln_f.bias": R.rand(g, H, std=0.1)}
    if cfg["position_embedding_type"] == "alibi":
        t["transformer.relative_pe.slopes"] = R.alibi_slopes(HEADS)[:, None]
    else:
        t["transformer.wpe.weight"] = R.rand(g, NPOS, H)
    if cfg.get("tie_word_embeddings") is False:
        t["lm_head.weight"] = R.rand(g, V, H)
    for i in range(L):
        p = f"transformer.h.{i}."
        t |= {p + "ln_1.weight": R.norm_weight(g, H), p + "ln_1.bias": R.rand(g, H, std=0.1),
              p + "ln_2.weight": R.norm_weight(g, H), p + "ln_2.bias": R.rand(g, H, std=0.1),
              p + "attn.c_attn.weight": R.rand(g, H, 3 * H), p + "attn.c_attn.bias": R.rand(g, 3 * H),
              p + "attn.c_proj.weight": R.rand(g, H, H), p + "attn.c_proj.bias": R.rand(g, H),
              p + "attn.bias": torch.ones(1, 1, NPOS, NPOS).tril(),       # GPT-2's mask buffer, stored by old saves
              p + "mlp.c_fc.weight": R.rand(g, H, I), p + "mlp.c_fc.bias": R.rand(g, I),
              p + "mlp.c_proj.weight": R.rand(g, I, H), p + "mlp.c_proj.bias": R.rand(g, H)}
        if cfg["activation_function"] == "swiglu":
            t |= {p + "mlp.c_fc2.weight": R.rand(g, H, I), p + "mlp.c_fc2.bias": R.rand(g, I)}
    return t


def reference(t, cfg, power=None, swap_gate=False, scale_wpe=True):
    """modeling_jais.py's forward, no cache. `power` overrides the attention scale's power, `swap_gate` gates c_fc
    instead of c_fc2, `scale_wpe=False` leaves wpe out of the embeddings scale (wrong readings, for the fixture's
    sensitivity checks)."""
    eps, es = cfg["layer_norm_epsilon"], cfg["mup_embeddings_scale"]
    power = power if power is not None else (1.0 if cfg["mup_scale_qk_dot_by_d"] else 0.5)
    alibi = cfg["position_embedding_type"] == "alibi"
    scaling = cfg.get("alibi_scaling")
    tied = cfg.get("tie_word_embeddings", True)

    def ln(x, p):
        return F.layer_norm(x, (H,), t[p + ".weight"], t[p + ".bias"], eps)

    def forward(ids):
        n = len(ids)
        pos = torch.arange(n)
        x = t["transformer.wte.weight"][ids]
        if not alibi:
            wpe = t["transformer.wpe.weight"][pos]
            x = (x + wpe) * es if scale_wpe else x * es + wpe
        else:
            x = x * es
        bias = None
        if alibi:
            scale = 1.0
            if scaling and scaling.get("factor") is not None:
                scale = scaling["factor"]
            elif scaling and n > scaling["train_seq_len"]:
                scale = n / scaling["train_seq_len"]
            rel = (pos[None, :] - pos[:, None]).abs().float()
            bias = (R.alibi_slopes(HEADS)[:, None, None] / -scale) * rel[None]
        for i in range(L):
            p = f"transformer.h.{i}."
            h = ln(x, p + "ln_1")
            q, k, v = (h @ t[p + "attn.c_attn.weight"] + t[p + "attn.c_attn.bias"]).split(H, -1)
            q, k, v = q.view(n, HEADS, D), k.view(n, HEADS, D), v.view(n, HEADS, D)
            a = R.causal_attention(q, k, v, D ** -power, bias)
            x = x + a @ t[p + "attn.c_proj.weight"] + t[p + "attn.c_proj.bias"]
            h = ln(x, p + "ln_2")
            h1 = h @ t[p + "mlp.c_fc.weight"] + t[p + "mlp.c_fc.bias"]
            if cfg["activation_function"] == "swiglu":
                h2 = h @ t[p + "mlp.c_fc2.weight"] + t[p + "mlp.c_fc2.bias"]
                m = F.silu(h1) * h2 if swap_gate else h1 * F.silu(h2)
            else:
                m = F.gelu(h1, approximate="tanh")
            x = x + m @ t[p + "mlp.c_proj.weight"] + t[p + "mlp.c_proj.bias"]
        head = t["transformer.wte.weight"] if tied else t["lm_head.weight"]
        return ln(x, "transformer.ln_f") @ head.T * (cfg["mup_output_alpha"] * cfg["mup_width_scale"])
    return forward


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("jais")
    return {name: R.write_checkpoint(root / name, cfg, _tensors(cfg))
            for name, cfg in (("alibi", BASE), ("learned", LEARNED))}


def test_jais_alibi_swiglu_mup_matches_reference(ckpts):
    """ALiBi (6 heads, alibi_scaling factor 2), SwiGLU, scores / head_dim, muP embedding and logit scales."""
    t = _tensors(BASE)
    ref = reference(t, BASE)
    assert R.distinct(ref, reference(t, BASE, power=0.5)), "fixture: 1 / d vs 1 / sqrt(d) matters"
    assert R.distinct(ref, reference(t, BASE, swap_gate=True)), "fixture: which of c_fc / c_fc2 is gated matters"
    assert R.distinct(ref, reference(t, {**BASE, "alibi_scaling": None})), "fixture: the ALiBi factor matters"
    R.assert_matches(R.engine_greedy(ckpts["alibi"]), ref, what="jais alibi")


def test_jais_learned_positions_gelu_matches_reference(ckpts):
    """GPT-2's form: wpe (scaled with wte by mup_embeddings_scale), gelu_new MLP, 1 / sqrt(d), an untied head."""
    t = _tensors(LEARNED)
    ref = reference(t, LEARNED)
    assert R.distinct(ref, reference(t, LEARNED, scale_wpe=False)), "fixture: scaling wpe too matters"
    assert R.distinct(ref, reference(t, LEARNED, power=1.0)), "fixture: the attention scale matters"
    R.assert_matches(R.engine_greedy(ckpts["learned"]), ref, what="jais learned")


def test_jais_train_seq_len_caps_the_context(ckpts, tmp_path):
    """alibi_scaling {train_seq_len: T}: the slopes rescale past T keys (per forward call, which a KV cache cannot
    follow) and are the identity within T: the context is min(n_positions, T), a longer one refused."""
    from xllm_gen import LLM
    cfg = {**BASE, "alibi_scaling": {"type": "linear", "train_seq_len": 40}}
    t = _tensors(cfg)
    assert not torch.allclose(reference(t, cfg)(torch.arange(48) % V), reference(
        t, {**cfg, "alibi_scaling": None})(torch.arange(48) % V), atol=1e-3), "fixture: the scaling acts past T"
    ck = R.write_checkpoint(tmp_path / "t", cfg, t)
    R.assert_matches(R.engine_greedy(ck), reference(t, cfg), what="jais train_seq_len")
    with LLM(model=str(ck), device="cpu", dtype="float32") as llm:
        assert llm.engine.max_model_len == 40
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=str(ck), device="cpu", dtype="float32", max_model_len=41)


@pytest.mark.parametrize("base, edit, named", [
    ("learned", {"alibi_scaling": {"type": "linear", "factor": 2.0}}, "alibi_scaling_fits"),
    ("alibi", {"alibi_scaling": {"type": "dynamic", "factor": 2.0}}, "alibi_scaling"),
    ("alibi", {"position_embedding_type": "rotary"}, "position_embedding_type"),
    ("alibi", {"add_cross_attention": True}, "add_cross_attention"),
    ("alibi", {"activation_function": "geglu"}, "activation_function"),
    # other Jais releases' names that this modeling_jais.py does not read (vLLM reads them): refused, not ignored
    ("alibi", {"width_scale": 0.1}, "width_scale"),
    ("alibi", {"embeddings_scale": 9.0}, "embeddings_scale"),
    ("alibi", {"scale_qk_dot_by_d": True}, "scale_qk_dot_by_d"),
])
def test_jais_refuses_what_it_does_not_model(ckpts, tmp_path, base, edit, named):
    from xllm_gen import LLM
    cfg = {"alibi": BASE, "learned": LEARNED}[base]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, **edit}))
    (bad / "model.safetensors").symlink_to(ckpts[base] / "model.safetensors")
    with pytest.raises(Exception, match=named):
        LLM(model=str(bad), device="cpu", dtype="float32")


def test_jais_13b_release_config():
    """jais-13b's config.json (its fields and values; the spec's variant jais-13b has the same sizes, checked with
    the TP sizes when the spec compiles) reads as modeling_jais.py reads it: ALiBi, SwiGLU, scores / 128, embeddings
    times 14.6, logits times 2.22 / 32."""
    from xllm_gen.generated.jais.model import Config
    release = {**BASE, "n_embd": 5120, "n_head": 40, "n_inner": 13653, "n_layer": 40, "n_positions": 2048,
               "vocab_size": 84992, "mup_embeddings_scale": 14.6, "mup_output_alpha": 2.22,
               "mup_width_scale": 0.03125, "torch_dtype": "float32"}
    del release["alibi_scaling"]
    c = Config.from_hf(release)
    assert (c.alibi, c.swiglu, c.head_dim, c.max_position_embeddings, c.tie_word_embeddings) == (
        True, True, 128, 2048, True)
    assert c.alibi_slope_scale == 1.0 and c.mup_output_alpha * c.mup_width_scale == pytest.approx(2.22 / 32)
