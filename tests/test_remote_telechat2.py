"""TeleChat2 (TeleChat2ForCausalLM, remote code: transformers ships no class; vLLM serves telechat2.py) served by
specs/telechat2.yaml, against a plain-PyTorch reference written from modeling_telechat2.py: q from `query` viewed
(heads, head_dim); k and v from one `key_value` viewed (kv_heads, 2 * head_dim) and split in halves (so its rows are
each KV head's [k v]: the spec fills the fused q/k/v parameter from `query` and from `key_value` read per head);
neox rotary (`rotate_half`) with base 10000 * ntk_alpha ** (d / (d - 2)) and cos / sin times mscale, both from
max(sequence, training_seqlen) and base_seqlen; `dense` with a bias; RMSNorms (`layer_norm_epsilon`);
`down_proj(silu(gate_proj(x)) * up_proj(x))` with a bias on down_proj; the residual from the stream or (with
apply_residual_connection_post_layernorm) from the normed input; `ln_f`; lm_head (tied to the embedding by
tie_word_embeddings). Grouped-query (2 KV heads of 4) at TP 1 and (slow) TP 2; read blocked instead of per head the
key_value serves another model; what the spec does not model is refused by name; TeleChat2-7B's shapes load at real
size (meta device)."""
from __future__ import annotations

import importlib
import json
import math

import pytest
import remote_ref as R
import torch
import torch.nn.functional as F

H, HEADS, KV, I, V, L = 64, 4, 2, 96, 128, 2
D = H // HEADS
CONFIG = {
    "architectures": ["TeleChat2ForCausalLM"], "model_type": "telechat",
    "auto_map": {"AutoConfig": "configuration_telechat2.Telechat2Config",
                 "AutoModelForCausalLM": "modeling_telechat2.TeleChat2ForCausalLM"},
    "apply_residual_connection_post_layernorm": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 3, "embed_layernorm": False, "ffn_hidden_size": I, "flash_attn": True,
    "hidden_act": "silu", "hidden_dropout": 0.0, "hidden_size": H, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-5, "logn": True, "n_head": HEADS, "n_layer": L, "num_key_value_heads": KV,
    "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.44.2",
    # within training_seqlen the rotary base is 10000 * ntk_alpha ** (d / (d - 2)) with ntk_alpha from
    # training_seqlen / base_seqlen: 64 / 32 gives 3 (the fixture shows it matters)
    "training_seqlen": 64, "base_seqlen": 32, "use_cache": True, "vocab_size": V,
}


def _tensors(seed=5, kv=KV, lm_head=True):
    g = torch.Generator().manual_seed(seed)
    t = {"transformer.word_embeddings.weight": R.rand(g, V, H, std=1.0), "transformer.ln_f.weight": R.norm_weight(g, H)}
    if lm_head:
        t["lm_head.weight"] = R.rand(g, V, H)
    for i in range(L):
        p = f"transformer.h.{i}."
        t |= {p + "input_layernorm.weight": R.norm_weight(g, H), p + "post_attention_layernorm.weight": R.norm_weight(g, H),
              p + "self_attention.query.weight": R.rand(g, HEADS * D, H),
              p + "self_attention.key_value.weight": R.rand(g, 2 * kv * D, H),
              p + "self_attention.dense.weight": R.rand(g, H, HEADS * D), p + "self_attention.dense.bias": R.rand(g, H),
              p + "mlp.gate_proj.weight": R.rand(g, I, H), p + "mlp.up_proj.weight": R.rand(g, I, H),
              p + "mlp.down_proj.weight": R.rand(g, H, I), p + "mlp.down_proj.bias": R.rand(g, H)}
    return t


def _rotary(x, pos, cfg, seq):
    """modeling_telechat2.py's RotaryEmbedding(head_dim, base=10000) at seq_len = max(seq, training_seqlen), applied
    with apply_rotary_pos_emb_torch (rotate_half) at the tokens' positions (in float32: the file rounds the table to
    float16, a precision matter)."""
    d = x.shape[-1]
    train = cfg["training_seqlen"]
    seq = max(seq, train)
    alpha = max(2 ** math.ceil(math.log2(seq / cfg.get("base_seqlen", train)) + 1) - 1, 1)
    mscale = 1.0 if seq / train <= 1 else 0.1 * math.log(seq / train) + 1.0
    base = 10000 * alpha ** (d / (d - 2))
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    f = pos.float()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    cos, sin = (mscale * emb.cos())[:, None], (mscale * emb.sin())[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference(t, cfg, kv_rows="per_head"):
    """The forward of modeling_telechat2.py (no cache). `kv_rows="blocked"`: key_value read as [k (all heads) | v]
    (the sensitivity arm's wrong reading)."""
    eps, post_ln = cfg["layer_norm_epsilon"], cfg["apply_residual_connection_post_layernorm"]
    heads = cfg["n_head"]
    kv = cfg.get("num_key_value_heads") or heads
    head = t["lm_head.weight"] if "lm_head.weight" in t else t["transformer.word_embeddings.weight"]

    def forward(ids):
        n = len(ids)
        pos = torch.arange(n)
        x = t["transformer.word_embeddings.weight"][ids]
        for i in range(cfg["n_layer"]):
            p = f"transformer.h.{i}."
            ln = R.rms_norm(x, t[p + "input_layernorm.weight"], eps)
            q = (ln @ t[p + "self_attention.query.weight"].T).view(n, heads, D)
            mixed = ln @ t[p + "self_attention.key_value.weight"].T
            if kv_rows == "per_head":       # view (kv_heads, 2 * head_dim), split(head_dim, -1)
                k, v = mixed.view(n, kv, 2 * D).split(D, -1)
            else:
                k, v = mixed.view(n, 2, kv, D).unbind(1)
            q, k = _rotary(q, pos, cfg, n), _rotary(k, pos, cfg, n)
            o = R.causal_attention(q, k, v, D ** -0.5)
            x = o @ t[p + "self_attention.dense.weight"].T + t[p + "self_attention.dense.bias"] + (ln if post_ln else x)
            ln = R.rms_norm(x, t[p + "post_attention_layernorm.weight"], eps)
            mlp = F.silu(ln @ t[p + "mlp.gate_proj.weight"].T) * (ln @ t[p + "mlp.up_proj.weight"].T)
            x = mlp @ t[p + "mlp.down_proj.weight"].T + t[p + "mlp.down_proj.bias"] + (ln if post_ln else x)
        return R.rms_norm(x, t["transformer.ln_f.weight"], eps) @ head.T
    return forward


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return R.write_checkpoint(tmp_path_factory.mktemp("telechat2"), CONFIG, _tensors())


def test_telechat2_matches_reference(ckpt):
    t = _tensors()
    want = reference(t, CONFIG)
    assert R.distinct(want, reference(t, CONFIG, kv_rows="blocked")), "fixture: key_value's per-head rows matter"
    assert R.distinct(want, reference(t, {**CONFIG, "base_seqlen": 64})), "fixture: the NTK alpha matters"
    R.assert_matches(R.engine_greedy(ckpt), want, what="telechat2")


@pytest.mark.parametrize("edit, tensors", [
    ({"apply_residual_connection_post_layernorm": True}, {}),
    # every head a KV head, named by neither field (`num_key_value_heads` absent: n_head), no base_seqlen (the
    # release's file needs one: read as training_seqlen, alpha 1), and the head tied to the embedding (no lm_head)
    ({"num_key_value_heads": None, "base_seqlen": None, "tie_word_embeddings": True}, {"kv": HEADS, "lm_head": False}),
])
def test_telechat2_forms_match_reference(ckpt, tmp_path, edit, tensors):
    cfg = {k: v for k, v in {**CONFIG, **edit}.items() if v is not None}
    t = _tensors(**tensors)
    if not tensors:
        assert R.distinct(reference(t, CONFIG), reference(t, cfg)), f"fixture: {edit} matters"
    arm = R.write_checkpoint(tmp_path / "arm", cfg, t)
    R.assert_matches(R.engine_greedy(arm), reference(t, cfg), what=f"telechat2 {edit}")


@pytest.mark.slow      # an engine of two ranks (~10 s); the per-rank reading of a FusedSource: tests/test_layouts.py
def test_telechat2_matches_reference_at_tp2(ckpt):
    """Each rank holds one KV head: it reads that head's [k v] rows of key_value (and its two query heads' rows of
    query), the per-head layout undone before the TP slicing."""
    R.assert_matches(R.engine_greedy(ckpt, tp=2), reference(_tensors(), CONFIG), what="telechat2 at TP 2")


def test_telechat2_key_value_read_blocked_changes_the_output(ckpt, monkeypatch):
    """The sensitivity arm: the same checkpoint with key_value read blocked [k | v] (its FusedSource without the
    per-head layout) serves another model: the one the blocked-read reference computes."""
    mod = importlib.import_module("xllm_gen.generated.telechat2.model")
    (key,) = [k for k in mod.WEIGHT_FUSED_SOURCES if "qkv_proj" in k]
    (fused,) = mod.WEIGHT_FUSED_SOURCES[key]
    assert fused.segments == ("k", "v") and fused.layout == mod.RowLayout("head", ("k", "v"))
    monkeypatch.setattr(mod, "WEIGHT_FUSED_SOURCES", {key: (mod.FusedSource(("k", "v")),)})
    got = [tokens for tokens, _ in R.engine_greedy(ckpt)]
    want = [R.ref_greedy(reference(_tensors(), CONFIG), p)[0] for p in R.PROMPTS]
    assert got != want, "reading key_value blocked does not change the output"
    assert got == [R.ref_greedy(reference(_tensors(), CONFIG, kv_rows="blocked"), p)[0] for p in R.PROMPTS]


@pytest.mark.parametrize("edit, named", [
    ({"embed_layernorm": True}, "embed_layernorm"),                  # word_embeddings_layernorm
    ({"training_seqlen": 1024}, "rope_ntk_alpha"),                   # 32 x base_seqlen: an alpha past the table
    ({"hidden_size": 66}, "head_dim_fits"),                          # heads that do not split hidden_size
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),   # read by nothing: refused, not ignored
])
def test_telechat2_refuses_what_it_does_not_model(ckpt, tmp_path, edit, named):
    from xllm_gen import LLM
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**CONFIG, **edit}))
    (bad / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    with pytest.raises(Exception, match=named):
        LLM(model=str(bad), device="cpu", dtype="float32")


def test_telechat2_key_value_of_the_wrong_rows_is_named(tmp_path):
    """A key_value whose rows do not hold k and v of the KV heads (one KV head's rows missing) is a load error naming
    the tensor, the parameter and the segments it should hold."""
    t = _tensors()
    t["transformer.h.1.self_attention.key_value.weight"] = t["transformer.h.1.self_attention.key_value.weight"][: -2 * D]
    bad = R.write_checkpoint(tmp_path / "bad", CONFIG, t)
    with pytest.raises(Exception, match=r"transformer\.h\.1\.self_attention\.key_value\.weight.*qkv_proj.*"
                                        r"cannot hold the segments k \[32\], v \[32\]"):
        R.engine_greedy(bad)


# TeleChat2-7B at its size (the spec's variant TeleChat2-7B, whose shapes and TP splits compile checks): the README's
# 30 layers of hidden 4096, 32 heads (no GQA), ffn 12288, an untied head; the config class's vocabulary
RELEASE_7B = {**CONFIG, "hidden_size": 4096, "ffn_hidden_size": 12288, "n_layer": 30, "n_head": 32,
              "num_key_value_heads": 32, "vocab_size": 160256, "training_seqlen": 8192, "base_seqlen": 8192,
              "torch_dtype": "bfloat16"}


def test_telechat2_7b_config_and_variant():
    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.generated.telechat2.model import Config
    c = Config.from_hf(RELEASE_7B)
    assert (c.head_dim, c.num_key_value_heads, c.rope_ntk_alpha, c.max_position_embeddings) == (128, 32, 1, 8192)
    compiled = compile_spec(R.ROOT / "specs" / "telechat2.yaml")
    (variant,) = [v for v in compiled.ir.variants if v.name == "TeleChat2-7B"]
    assert {k: dict(variant.values)[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                 "intermediate_size")} == {
        "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 12288}
    assert set(compiled.ir.tp_sizes) == {1, 2, 4, 8}


def test_telechat2_7b_loads_at_real_size(tmp_path, monkeypatch):
    """The release's tensor names and shapes at TeleChat2-7B's size fill every parameter through the loader (meta
    tensors: nothing is read), key_value's 8192 rows through its per-head FusedSource."""
    import test_real_configs as RC
    mod = importlib.import_module("xllm_gen.generated.telechat2.model")
    meta = {}
    hid, ffn, vocab = 4096, 12288, 160256
    meta |= {"transformer.word_embeddings.weight": (vocab, hid), "transformer.ln_f.weight": (hid,),
             "lm_head.weight": (vocab, hid)}
    for i in range(30):
        p = f"transformer.h.{i}."
        meta |= {p + "input_layernorm.weight": (hid,), p + "post_attention_layernorm.weight": (hid,),
                 p + "self_attention.query.weight": (hid, hid), p + "self_attention.key_value.weight": (2 * hid, hid),
                 p + "self_attention.dense.weight": (hid, hid), p + "self_attention.dense.bias": (hid,),
                 p + "mlp.gate_proj.weight": (ffn, hid), p + "mlp.up_proj.weight": (ffn, hid),
                 p + "mlp.down_proj.weight": (hid, ffn), p + "mlp.down_proj.bias": (hid,)}
    tensors = {k: torch.empty(s, dtype=torch.bfloat16, device="meta") for k, s in meta.items()}
    loaded = RC._load_at_size(mod, RELEASE_7B, tensors, tmp_path / "ckpt", monkeypatch)
    assert "model.layers.29.self_attention.qkv_proj.weight" in loaded
