"""Baichuan 1 / 2 (BaichuanForCausalLM, BaiChuanForCausalLM; remote code: transformers ships no class) served by
specs/baichuan.yaml, against a plain-PyTorch reference written from the releases' modeling_baichuan.py: `W_pack`
split as `proj.unflatten(-1, (3, hidden_size))` ([q | k | v]), Llama's RMSNorms and gated SiLU MLP; the 13Bs add
`_gen_alibi_mask` (slope_h * key position, `_get_interleave` slopes) to the scaled scores and have no rotary, the 7Bs
turn neox rotary (base 10000); Baichuan 2's `NormHead` multiplies by `F.normalize(lm_head.weight)` (rows, L2).
As vLLM, the spec tells the forms apart by hidden_size (4096: rotary) and vocab_size (125696: NormHead), so each arm's
tiny checkpoint keeps the size that selects its form: a 13B-style one (ALiBi, NormHead) with Baichuan 2's vocabulary,
a 7B-style one (rotary) of one layer at hidden_size 4096 with a small vocabulary (Baichuan 1's plain head)."""
from __future__ import annotations

import json

import pytest
import remote_ref as R
import torch
import torch.nn.functional as F

BASE = {
    "auto_map": {"AutoConfig": "configuration_baichuan.BaichuanConfig",
                 "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM"},
    "architectures": ["BaichuanForCausalLM"], "model_type": "baichuan", "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.29.2", "use_cache": True,
    "z_loss_weight": 0, "gradient_checkpointing": False, "model_max_length": 64,
}
# Baichuan2-13B's form: ALiBi (hidden_size != 4096), 40 heads in the release (not a power of two: the interleaved
# slopes); here 6 heads (slopes 4 + every other of the 8-series)
ALIBI = {**BASE, "hidden_size": 48, "intermediate_size": 64, "num_attention_heads": 6, "num_hidden_layers": 2,
         "vocab_size": 125696}
# Baichuan-7B's / Baichuan2-7B's form: rotary (hidden_size 4096), one layer; Baichuan 1's vocabulary size class (no
# NormHead)
ROPE = {**BASE, "architectures": ["BaiChuanForCausalLM"], "hidden_size": 4096, "intermediate_size": 32,
        "num_attention_heads": 32, "num_hidden_layers": 1, "vocab_size": 256, "max_position_embeddings": 64}


def _tensors(cfg, seed=2):
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    s = min(0.2, 2.0 / h ** 0.5)
    t = {"model.embed_tokens.weight": R.rand(g, v, h, std=1.0), "model.norm.weight": R.norm_weight(g, h),
         "lm_head.weight": R.rand(g, v, h, std=0.5)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t |= {p + "input_layernorm.weight": R.norm_weight(g, h), p + "post_attention_layernorm.weight": R.norm_weight(g, h),
              p + "self_attn.W_pack.weight": R.rand(g, 3 * h, h, std=s), p + "self_attn.o_proj.weight": R.rand(g, h, h, std=s),
              p + "mlp.gate_proj.weight": R.rand(g, i, h, std=s), p + "mlp.up_proj.weight": R.rand(g, i, h, std=s),
              p + "mlp.down_proj.weight": R.rand(g, h, i, std=0.2)}
    return t


def reference(t, cfg, alibi: bool, norm_head: bool):
    h, heads, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["rms_norm_eps"]
    d = h // heads
    head = F.normalize(t["lm_head.weight"]) if norm_head else t["lm_head.weight"]
    slopes = R.alibi_slopes(heads)

    def forward(ids):
        x = t["model.embed_tokens.weight"][ids]
        n = len(ids)
        pos = torch.arange(n)
        bias = (slopes[:, None, None] * pos[None, None, :].float()).expand(heads, n, n) if alibi else None
        for layer in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            y = R.rms_norm(x, t[p + "input_layernorm.weight"], eps)
            q, k, v = (y @ t[p + "self_attn.W_pack.weight"].T).unflatten(-1, (3, h)).unbind(-2)
            q, k, v = q.view(n, heads, d), k.view(n, heads, d), v.view(n, heads, d)
            if not alibi:
                q, k = R.rope_neox(q, pos, 10000.0), R.rope_neox(k, pos, 10000.0)
            x = x + R.causal_attention(q, k, v, d ** -0.5, bias) @ t[p + "self_attn.o_proj.weight"].T
            y = R.rms_norm(x, t[p + "post_attention_layernorm.weight"], eps)
            a = F.silu(y @ t[p + "mlp.gate_proj.weight"].T) * (y @ t[p + "mlp.up_proj.weight"].T)
            x = x + a @ t[p + "mlp.down_proj.weight"].T
        return R.rms_norm(x, t["model.norm.weight"], eps) @ head.T
    return forward


@pytest.fixture(scope="module")
def alibi_ckpt(tmp_path_factory):
    return R.write_checkpoint(tmp_path_factory.mktemp("baichuan2_13b"), ALIBI, _tensors(ALIBI))


def test_baichuan2_13b_form_matches_reference(alibi_ckpt):
    """ALiBi (no rotary) and the NormHead."""
    t = _tensors(ALIBI)
    want = reference(t, ALIBI, alibi=True, norm_head=True)
    assert R.distinct(want, reference(t, ALIBI, alibi=True, norm_head=False)), "fixture: the NormHead matters"
    assert R.distinct(want, reference(t, ALIBI, alibi=False, norm_head=True)), "fixture: ALiBi matters"
    R.assert_matches(R.engine_greedy(alibi_ckpt), want, what="baichuan (ALiBi, NormHead)")


def test_baichuan_7b_form_matches_reference(tmp_path):
    """Rotary, a plain head (the spec's test of the form is the release's hidden_size 4096)."""
    t = _tensors(ROPE)
    want = reference(t, ROPE, alibi=False, norm_head=False)
    assert R.distinct(want, reference(t, ROPE, alibi=True, norm_head=False)), "fixture: rotary vs ALiBi matters"
    R.assert_matches(R.engine_greedy(R.write_checkpoint(tmp_path / "b7", ROPE, t)), want, what="baichuan (rotary)")


@pytest.mark.parametrize("edit, named", [
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),     # no scaling in modeling_baichuan.py
])
def test_baichuan_refuses_what_it_does_not_model(alibi_ckpt, tmp_path, edit, named):
    from xllm_gen import LLM
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**ALIBI, **edit}))
    (bad / "model.safetensors").symlink_to(alibi_ckpt / "model.safetensors")
    with pytest.raises(Exception, match=named):
        LLM(model=str(bad), device="cpu", dtype="float32")


def test_released_configs_select_the_forms():
    """The releases' sizes give the forms vLLM serves: rotary only for the 7Bs, NormHead only for Baichuan 2."""
    from xllm_gen.generated.baichuan.model import Config
    release = {"Baichuan2-7B-Chat": (4096, 11008, 32, 125696, False, True),
               "Baichuan2-13B-Chat": (5120, 13696, 40, 125696, True, True),
               "Baichuan-13B-Chat": (5120, 13696, 40, 64000, True, False)}
    for name, (h, i, heads, v, alibi, norm_head) in release.items():
        c = Config.from_hf({**BASE, "hidden_size": h, "intermediate_size": i, "num_attention_heads": heads,
                            "num_hidden_layers": heads, "vocab_size": v, "model_max_length": 4096})
        assert (c.alibi, c.norm_head) == (alibi, norm_head), name


def test_normalized_tied_head_is_a_compile_error(tmp_path, capsys):
    from xllm_gen.codegen import cli
    spec = tmp_path / "x.yaml"
    spec.write_text(f"extends: {R.ROOT / 'specs' / 'llama.yaml'}\nname: x\nclass_prefix: X\n"
                    "architectures: [XForCausalLM]\nlm_head: {normalize: true}\n")
    assert cli.main(["--dry-run", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "x.yaml:" in err and "lm_head.normalize" in err and "untied" in err, err
