"""`xllm-gen draft` of multi-head latent attention (codegen/draft_mla.py), then `xllm-gen verify` of the draft.

MLA is found by what the model is (a `kv_lora_rank` config field and a layer holding `kv_a_proj_with_mqa` /
`kv_b_proj`), never by the family's name; the rotary layout of the rope dims, the yarn mscale of the softmax scale and
the latent norms' eps are read from the attention class's source.
  - DeepSeek-V3 (low-rank q, `rope_interleave` chooses the layout, yarn with mscale_all_dim) from its tiny checkpoint
    with every layer dense (the MLA is what is drafted here; MoE routing is draft_moe's, on its checklist): the
    draft compiles, writes the block as specs/deepseek_v3.yaml does, and verifies OK against transformers;
  - DeepSeek-V2-Lite-style (q_lora_rank null: a direct q_proj; the complex-number rotary: interleaved pairs);
  - by class name: MiniCPM3 (rotate_half: neox halves), GLM-4-MoE-Lite (config.json head_dim is qk_rope_head_dim);
  - sensitivity: the V3 draft with the mscale dropped, or with the rope layout flipped, fails verify at layer 0.
"""
from __future__ import annotations

import json

import pytest
import yaml

# every layer dense (first_k_dense_replace = the layers): the draft's subject is the attention
V3 = ("DeepseekV3ForCausalLM", {"num_hidden_layers": 2, "first_k_dense_replace": 2})
V2_LITE = ("DeepseekV2ForCausalLM", {"num_hidden_layers": 2, "first_k_dense_replace": 2, "q_lora_rank": None})


def _draft(target: str, out=None) -> tuple[str, dict]:
    from xllm_gen.codegen.draft import draft_spec
    text, _ = draft_spec(target)
    if out is not None:
        out.write_text(text)
    return text, yaml.safe_load(text)


def _attn(doc: dict) -> dict:
    return doc["decoder"]["layers"]["blocks"]["self_attn"]


def _checklist(text: str) -> str:
    return "\n".join(l for l in text.splitlines() if l.startswith("# - [ ]"))


@pytest.fixture(scope="module")
def v3(tiny_checkpoint, tmp_path_factory):
    ckpt = tiny_checkpoint(V3[0], overrides=V3[1])
    spec = tmp_path_factory.mktemp("draft_mla") / "specs" / "v3.yaml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    text, doc = _draft(str(ckpt), spec)
    return ckpt, spec, text, doc


def test_draft_writes_the_latent_attention_as_the_shipped_specs(v3):
    from xllm_gen.codegen.compiler import compile_spec
    ckpt, spec, text, doc = v3
    compile_spec(spec)
    a = _attn(doc)
    assert a["kind"] == "mla_attention"
    for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert a[f] == f and doc["config"][f]["from"] == f, f
    # null q_lora_rank means a direct q_proj: an optional symbol, absent = the class default
    assert doc["config"]["q_lora_rank"] == {"type": "int", "from": "q_lora_rank", "optional": True,
                                            "default": 1536, "min": 1}
    assert a["rotary"]["layout"] == "rope_layout" and "rope_interleave" in doc["config"]
    assert a["scale_mscale"] is True and "yarn" in doc["config"]["rope_scaling"]["values"]
    assert a["bias"] == "attention_bias" and a["out"] == {"name": "o_proj", "bias": "attention_bias"}
    assert doc["config"]["kv_heads_equal_heads"]["guard"] is True
    assert {"head_dim", "qk_head_dim"} <= set(doc["config_ignore"])
    # the MLA's modules are its own: nothing left unmapped, no q/k/v fusion
    assert "qkv_proj" not in text and "does not use" not in text and "norms inside a block" not in text
    assert "latent attention" not in _checklist(text), _checklist(text)
    assert json.loads((ckpt / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"


def test_draft_of_a_direct_q_and_complex_rotary(tiny_checkpoint):
    """DeepSeek-V2-Lite's form: q_lora_rank null in config.json (q_proj), the rope dims turned as complex numbers
    (view_as_complex: interleaved pairs), no layout flag."""
    ckpt = tiny_checkpoint(V2_LITE[0], overrides=V2_LITE[1])
    assert json.loads((ckpt / "config.json").read_text())["q_lora_rank"] is None
    text, doc = _draft(str(ckpt))
    a = _attn(doc)
    assert a["kind"] == "mla_attention" and a["q_lora_rank"] == "q_lora_rank"
    assert doc["config"]["q_lora_rank"]["optional"] is True
    assert a["rotary"]["layout"] == "interleaved" and "rope_interleave" not in doc["config"]
    assert a["scale_mscale"] is True


@pytest.mark.parametrize("arch, expect", [
    # rotate_half on the rope dims: neox halves (no layout); v_head_dim None is hidden_size // heads
    ("MiniCPM3ForCausalLM", {"layout": None, "v_head_dim": "hidden_size // num_attention_heads"}),
    # config.json's head_dim is an alias of qk_rope_head_dim (attribute_map)
    ("Glm4MoeLiteForCausalLM", {"layout": "rope_layout", "rope_from": ["head_dim", "qk_rope_head_dim"]}),
])
def test_draft_by_class_name(arch, expect):
    text, doc = _draft(arch)
    a = _attn(doc)
    assert a["kind"] == "mla_attention"
    assert a["rotary"].get("layout") == expect["layout"], a["rotary"]
    if "v_head_dim" in expect:
        assert doc["config"]["v_head_dim"].get("default_expr") == expect["v_head_dim"]
    if "rope_from" in expect:
        assert doc["config"]["qk_rope_head_dim"]["from"] == expect["rope_from"]
        assert "head_dim" not in doc["config"]


def test_verify_accepts_the_drafted_latent_attention(v3):
    from xllm_gen.codegen.verify import verify
    ckpt, spec, _, _ = v3
    r = verify(spec, ckpt, max_tokens=4, prompt_lens=[3, 9])
    assert r.ok, r.text()


def _variant(spec, name: str, old: str, new: str):
    text = spec.read_text()
    assert old in text, old
    out = spec.parent / name
    out.write_text(text.replace(old, new, 1))
    return out


@pytest.mark.parametrize("name, old, new", [
    # the softmax scale without yarn's mscale(factor, mscale_all_dim) ** 2
    pytest.param("no_mscale.yaml", "        scale_mscale: true\n", "", id="mscale-dropped"),
    # the rope dims turned in neox halves where the checkpoint's pairs are interleaved
    pytest.param("flipped_layout.yaml", "\"'interleaved' if rope_interleave else 'neox'\"",
                 "\"'neox' if rope_interleave else 'interleaved'\"", id="layout-flipped",
                 marks=pytest.mark.slow),       # ~4 s
])
def test_verify_fails_a_draft_with_one_mla_fact_wrong(v3, name, old, new):
    from xllm_gen.codegen.verify import verify
    ckpt, spec, _, _ = v3
    r = verify(_variant(spec, name, old, new), ckpt, max_tokens=4, prompt_lens=[5])
    assert not r.ok
    assert r.first_divergence()[2].layer == 0, r.text()


@pytest.mark.slow       # a second verify (~10 s cold)
def test_verify_accepts_the_drafted_direct_q(tiny_checkpoint, tmp_path):
    from xllm_gen.codegen.verify import verify
    ckpt = tiny_checkpoint(V2_LITE[0], overrides=V2_LITE[1])
    spec = tmp_path / "v2_lite.yaml"
    _draft(str(ckpt), spec)
    r = verify(spec, ckpt, max_tokens=6, prompt_lens=[3, 17])
    assert r.ok, r.text()
