"""Nemotron-NAS (DeciLMForCausalLM, model_type "nemotron-nas": Llama-3_1-Nemotron-51B / -Super-49B / -Ultra-253B;
remote code) served by specs/decilm.yaml's block_configs form, against a plain-PyTorch reference written from the
releases' modeling_decilm.py / block_config.py: layer i reads `block_configs[i]`; an `attention.no_op` layer has no
input norm and no attention, another the Llama GQA attention with num_attention_heads // n_heads_in_group KV heads
(repeat_kv), llama3 rope scaling; an `ffn.no_op` layer no post-attention norm and no MLP, another the SiLU-gated MLP
of width _find_multiple(int(2 * round(ffn_mult, 6) * hidden / 3), 256); a `replace_with_linear` subblock (not no_op)
is one nn.Linear(hidden, hidden, bias=False) behind its norm, residual-added (DeciLMLinearAttention's
`self_attn.linear_attn`, DeciLMLinearMLP's `mlp.linear_mlp`); no biases; an untied head.

The fixture mixes KV heads 4 / 1 / 2 under 8 query heads, an attention-less layer, two linear-attention layers, an
MLP-less layer, a linear-MLP layer and three MLP widths (256, 512, 768), and one element in the older short form (no
window / sink / sparsify keys: BlockConfig's defaults). TP 2 runs in a slow arm (KV head 1 replicated on both ranks,
the linear subblocks row-parallel over the normed stream)."""
from __future__ import annotations

import json
import math

import pytest
import remote_ref as R
import torch
import torch.nn.functional as F

H, HEADS, D, V = 64, 8, 8, 128
ROPE = {"factor": 4.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 64,
        "rope_type": "llama3"}


def _attn(group=None, no_op=False, **extra):
    return {"n_heads_in_group": group, "no_op": no_op, "num_sink_tokens": None, "replace_with_linear": False,
            "sparsify": None, "unshifted_sink": False, "use_prefill_window_in_sink_attention": False,
            "window_length": None, **extra}


def _ffn(mult=None, no_op=False, **extra):
    return {"ffn_mult": mult, "no_op": no_op, "replace_with_linear": False, "sparsify": None, **extra}


BLOCKS = [
    {"attention": _attn(2), "ffn": _ffn(1.3125)},                         # 4 KV heads, width 256
    {"attention": _attn(no_op=True), "ffn": _ffn(7.0)},                   # no attention, width int(298.6) -> 512
    {"attention": _attn(8), "ffn": _ffn(no_op=True)},                     # 1 KV head, no MLP
    {"attention": {"n_heads_in_group": 4, "no_op": False, "replace_with_linear": False},   # the short form
     "ffn": {"ffn_mult": 13.0, "no_op": False, "replace_with_linear": False}},              # width 768
    {"attention": _attn(replace_with_linear=True), "ffn": _ffn(1.3125)},  # linear attention, width 256
    {"attention": _attn(2), "ffn": _ffn(replace_with_linear=True)},       # 4 KV heads, linear MLP
    {"attention": _attn(replace_with_linear=True), "ffn": _ffn(no_op=True)},   # linear attention, no MLP
]
L = len(BLOCKS)
CONFIG = {
    "_name_or_path": "tiny-nemotron-nas", "architectures": ["DeciLMForCausalLM"], "model_type": "nemotron-nas",
    "auto_map": {"AutoConfig": "configuration_decilm.DeciLMConfig",
                 "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM"},
    "attention_bias": False, "attention_dropout": 0.0, "block_configs": BLOCKS, "bos_token_id": 1, "eos_token_id": [2, 3],
    "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": None,
    "max_position_embeddings": 256, "mlp_bias": False, "num_attention_heads": HEADS, "num_hidden_layers": L,
    "num_key_value_heads": None, "pretraining_tp": 1, "rms_norm_eps": 1e-5, "rope_scaling": ROPE,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.45.1",
    "use_cache": True, "vocab_size": V,
}


def _width(mult: float) -> int:
    """block_config.py's FFNConfig (round(ffn_mult, 6)) and modeling_decilm.py's _ffn_mult_to_intermediate_size."""
    n = int(2 * round(mult, 6) * H / 3)
    return n if n % 256 == 0 else n + 256 - n % 256


def _tensors(blocks=BLOCKS, seed=11):
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": R.rand(g, V, H, std=1.0), "model.norm.weight": R.norm_weight(g, H),
         "lm_head.weight": R.rand(g, V, H)}
    for i, b in enumerate(blocks):
        p = f"model.layers.{i}."
        if b["attention"]["no_op"]:
            pass
        elif b["attention"]["replace_with_linear"]:
            t |= {p + "input_layernorm.weight": R.norm_weight(g, H), p + "self_attn.linear_attn.weight": R.rand(g, H, H)}
        else:
            kv = HEADS // b["attention"]["n_heads_in_group"]
            t |= {p + "input_layernorm.weight": R.norm_weight(g, H),
                  p + "self_attn.q_proj.weight": R.rand(g, HEADS * D, H), p + "self_attn.k_proj.weight": R.rand(g, kv * D, H),
                  p + "self_attn.v_proj.weight": R.rand(g, kv * D, H), p + "self_attn.o_proj.weight": R.rand(g, H, HEADS * D)}
        if b["ffn"]["no_op"]:
            pass
        elif b["ffn"]["replace_with_linear"]:
            t |= {p + "post_attention_layernorm.weight": R.norm_weight(g, H), p + "mlp.linear_mlp.weight": R.rand(g, H, H)}
        else:
            i_ = _width(b["ffn"]["ffn_mult"])
            t |= {p + "post_attention_layernorm.weight": R.norm_weight(g, H),
                  p + "mlp.gate_proj.weight": R.rand(g, i_, H), p + "mlp.up_proj.weight": R.rand(g, i_, H),
                  p + "mlp.down_proj.weight": R.rand(g, H, i_)}
    return t


def llama3_inv_freq(dim: int, theta: float, rs: dict | None) -> torch.Tensor:
    """transformers' _compute_llama3_parameters (the releases' Llama rotary)."""
    inv = R.inv_freq(dim, theta)
    if not rs or rs.get("rope_type") != "llama3":
        return inv
    factor, lo, hi, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(medium, smoothed, out)


def _rope(x, pos, inv):
    f = pos.float()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    d = x.shape[-1]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def reference(t, cfg, skip_mlp=(), skip_attn=()):
    """modeling_decilm.py's DeciLMDecoderLayer.forward (no cache); `skip_mlp` / `skip_attn`: layers whose MLP /
    attention subblock is dropped as if no_op (the fixture's sensitivity checks)."""
    eps, blocks = cfg["rms_norm_eps"], cfg["block_configs"]
    inv = llama3_inv_freq(D, cfg["rope_theta"], cfg.get("rope_scaling"))

    def forward(ids):
        n = len(ids)
        pos = torch.arange(n)
        x = t["model.embed_tokens.weight"][ids]
        for i, b in enumerate(blocks):
            p = f"model.layers.{i}."
            if b["attention"]["no_op"] or i in skip_attn:
                pass
            elif b["attention"]["replace_with_linear"]:      # DeciLMLinearAttention behind the input norm
                x = x + R.rms_norm(x, t[p + "input_layernorm.weight"], eps) @ t[p + "self_attn.linear_attn.weight"].T
            else:
                kv = HEADS // b["attention"]["n_heads_in_group"]
                h = R.rms_norm(x, t[p + "input_layernorm.weight"], eps)
                q = _rope((h @ t[p + "self_attn.q_proj.weight"].T).view(n, HEADS, D), pos, inv)
                k = _rope((h @ t[p + "self_attn.k_proj.weight"].T).view(n, kv, D), pos, inv)
                v = (h @ t[p + "self_attn.v_proj.weight"].T).view(n, kv, D)
                x = x + R.causal_attention(q, k, v, D ** -0.5) @ t[p + "self_attn.o_proj.weight"].T
            if b["ffn"]["no_op"] or i in skip_mlp:
                pass
            elif b["ffn"]["replace_with_linear"]:            # DeciLMLinearMLP behind the post-attention norm
                x = x + R.rms_norm(x, t[p + "post_attention_layernorm.weight"], eps) @ t[p + "mlp.linear_mlp.weight"].T
            else:
                h = R.rms_norm(x, t[p + "post_attention_layernorm.weight"], eps)
                a = F.silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)
                x = x + a @ t[p + "mlp.down_proj.weight"].T
        return R.rms_norm(x, t["model.norm.weight"], eps) @ t["lm_head.weight"].T
    return forward


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return R.write_checkpoint(tmp_path_factory.mktemp("nemotron_nas"), CONFIG, _tensors())


def test_fixture_widths():
    assert [_width(b["ffn"]["ffn_mult"]) for b in BLOCKS
            if not b["ffn"]["no_op"] and not b["ffn"]["replace_with_linear"]] == [256, 512, 768, 256]


def test_nemotron_nas_matches_reference(ckpt):
    t = _tensors()
    ref = reference(t, CONFIG)
    assert R.distinct(ref, reference(t, CONFIG, skip_mlp=(1,))), "fixture: layer 1's MLP (behind no attention) matters"
    # an engine that ignored replace_with_linear (dropping the linear subblocks as no_op) would differ
    assert R.distinct(ref, reference(t, CONFIG, skip_attn=(4, 6))), "fixture: the linear attention layers matter"
    assert R.distinct(ref, reference(t, CONFIG, skip_mlp=(5,))), "fixture: the linear MLP matters"
    assert R.distinct(ref, reference(t, {**CONFIG, "rope_scaling": None})), "fixture: the llama3 rope scaling matters"
    R.assert_matches(R.engine_greedy(ckpt), ref, what="nemotron-nas")


def test_linear_subblocks_have_no_kv_cache_slot():
    """A linear-attention layer builds a linear (row-parallel over the whole normed stream), not an attention: like a
    no_op layer it has no KV-cache slot (the runner counts the attention modules)."""
    import xllm_gen.generated.decilm.model as m
    from xllm_gen.runtime import layers as RL
    model = m.Model(m.Config.from_hf(CONFIG))
    attn = [i for i, layer in enumerate(model.model.layers) if any(isinstance(x, RL.Attention) for x in layer.modules())]
    assert attn == [i for i, b in enumerate(BLOCKS) if not b["attention"]["no_op"]
                    and not b["attention"]["replace_with_linear"]] == [0, 2, 3, 5]
    for i in (4, 6):
        lin = model.model.layers[i].self_attn
        assert isinstance(lin, RL.RowParallelLinear) and tuple(lin.weight.shape) == (H, H) and lin.bias is None
    assert isinstance(model.model.layers[5].mlp, RL.RowParallelLinear) and model.model.layers[6].mlp is None


@pytest.mark.slow
def test_nemotron_nas_tp2_matches_reference(ckpt):
    R.assert_matches(R.engine_greedy(ckpt, tp=2), reference(_tensors(), CONFIG), what="nemotron-nas tp2")


def _edit(layer: int, part: str, **kw) -> list:
    blocks = json.loads(json.dumps(BLOCKS))
    blocks[layer][part].update(kw)
    return blocks


@pytest.mark.parametrize("edit, named", [
    # ignoring a no_op flag is not possible silently: the flipped layer has no size (and no weights)
    ({"block_configs": _edit(1, "attention", no_op=False)}, "layer_without_kv_heads"),
    ({"block_configs": _edit(2, "ffn", no_op=False)}, "layer_without_ffn_mult"),
    # a flipped size: weights of another shape
    ({"block_configs": _edit(0, "attention", n_heads_in_group=4)}, "k_proj"),
    ({"block_configs": _edit(3, "ffn", ffn_mult=7.0)}, "gate_proj|up_proj|down_proj"),
    # ignoring replace_with_linear (read as a normal subblock): it has no size (and no such weights)
    ({"block_configs": _edit(4, "attention", replace_with_linear=False)}, "layer_without_kv_heads"),
    ({"block_configs": _edit(5, "ffn", replace_with_linear=False)}, "layer_without_ffn_mult"),
    # ... or, where a size is given, a normal subblock whose weights the checkpoint lacks
    ({"block_configs": _edit(4, "attention", replace_with_linear=False, n_heads_in_group=2)}, "q_proj|k_proj|v_proj"),
    ({"block_configs": _edit(5, "ffn", replace_with_linear=False, ffn_mult=1.3125)}, "gate_proj|up_proj|down_proj"),
    # a linear subblock where the checkpoint has the normal one: its linear weight is missing
    ({"block_configs": _edit(0, "attention", replace_with_linear=True)}, "linear_attn"),
    ({"block_configs": _edit(3, "ffn", replace_with_linear=True)}, "linear_mlp"),
    # what the spec does not model, named by the layer's element
    ({"block_configs": _edit(0, "attention", window_length=16)}, r"block_configs\[0\]\.attention\.window_length=16"),
    ({"block_configs": _edit(3, "attention", sparsify=["attn"])}, r"block_configs\[3\]\.attention\.sparsify"),
    ({"block_configs": _edit(3, "ffn", hidden_act="relu")}, r"block_configs\[3\]\.ffn\.hidden_act='relu'"),
    ({"block_configs": _edit(0, "attention", n_heads_in_group=3)}, "layer_without_kv_heads"),
    ({"block_configs": _edit(0, "attention", no_op="no")}, r"block_configs\[0\]\.attention\.no_op' = 'no' is not a bool"),
    ({"block_configs": BLOCKS[:L - 1]}, "kv_heads_per_layer"),
    ({"block_configs": BLOCKS[:2] + [7] + BLOCKS[3:]}, r"block_configs\[2\]' = 7 is not a mapping"),
    ({"num_key_value_heads_per_layer": [4, 1, 1, 2, 1, 2, 1]}, "one_form"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_nemotron_nas_refuses_what_it_does_not_model(ckpt, tmp_path, edit, named):
    from xllm_gen import LLM
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**CONFIG, **edit}))
    (bad / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    with pytest.raises(Exception, match=named):
        LLM(model=str(bad), device="cpu", dtype="float32")


LINEAR_ATTN = "linear_attn: {kind: linear, in: hidden_size, out: hidden_size, parallel: row}"


@pytest.mark.parametrize("old, new, msg", [
    # a residual step's linear joins the stream whole: a column split (one shard per rank) is refused
    (LINEAR_ATTN, LINEAR_ATTN.replace("row", "column"), "linear_attn.parallel: column: a residual step's linear"),
    # on the stream: in and out are its width
    (LINEAR_ATTN, LINEAR_ATTN.replace("in: hidden_size", "in: head_dim"), "linear_attn.in: is head_dim, but the residual"),
    (LINEAR_ATTN, LINEAR_ATTN.replace("out: hidden_size", "out: head_dim"), "linear_attn.out: is head_dim"),
    # `when` with a per-layer choice, but not with add / after_norm
    ('when: "attention_no_op is None or not attention_no_op[layer]"',
     'when: "attention_no_op is None or not attention_no_op[layer]"\n        after_norm: input_layernorm',
     "when: a step `{norm: N, block: B}` or `{block: B}`, B a block or a per-layer choice"),
])
def test_linear_step_spec_errors_are_located(tmp_path, old, new, msg):
    from test_config_each import _compile_error
    err = _compile_error(tmp_path, old, new)
    assert msg in err.message, err.message
