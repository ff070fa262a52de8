"""`xllm-gen draft` of MoE routing, the sparse layers and MiniCPM-style scalings, read from the modeling source
(codegen/draft_routing.py, codegen/draft_source.py), never from a family's name; then `xllm-gen verify` of the drafts.

  - routing from the router's / MoE block's source: sigmoid scores, a float32 router, the selection-only correction
    bias, grouped top-k (n_group / topk_group, top-2 sum), routed_scaling_factor, norm_topk_prob (DeepSeek-V3,
    GLM-4-MoE, GLM-4-MoE-Lite); softmax with the renormalizing sum clamped (`moe_norm_min`) and the bias stored under
    `moe_statics` [1, experts] (ERNIE 4.5 MoE);
  - the sparse layers from the decoder layer's own condition: `layer >= first_k_dense_replace`, GLM-4-MoE-Lite's
    `mlp_layer_types[layer] == 'sparse'` (its default_expr from the layer count), ERNIE's interval / start / end;
  - MiniCPM3's scale_emb, scale_depth / sqrt(layers) on both residual branches (a null computed as the class does:
    `if_null`), the logits over hidden_size / dim_model_base;
  - the drafted specs of tiny checkpoints verify OK (slow); with the scoring made softmax or the correction bias
    dropped, the V3 draft fails verify at its first sparse layer.
Default arms draft by class name only (~1 s); the verify arms are slow.
"""
from __future__ import annotations

import pytest
import yaml

V3 = ("DeepseekV3ForCausalLM", {"num_hidden_layers": 3, "first_k_dense_replace": 1})
# at the tiny builder's defaults: its q/k norms and partial rotary are drafted too (codegen/draft_attention.py)
GLM4_MOE = ("Glm4MoeForCausalLM", {})
GLM4_LITE = ("Glm4MoeLiteForCausalLM", {})         # mlp_layer_types ['sparse', 'dense', 'sparse']
MINICPM3 = ("MiniCPM3ForCausalLM", {})


def _draft(target: str, out=None) -> tuple[str, dict]:
    from xllm_gen.codegen.draft import draft_spec
    text, _ = draft_spec(target)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return text, yaml.safe_load(text)


def _checklist(text: str) -> str:
    return "\n".join(l for l in text.splitlines() if l.startswith("# - [ ]"))


def _blocks(doc: dict) -> dict:
    return doc["decoder"]["layers"]["blocks"]


def _mlp_step(doc: dict) -> dict:
    return doc["decoder"]["layers"]["dataflow"][1]


# the routing the shipped specs write (specs/deepseek_v3.yaml, specs/glm4_moe.yaml)
V3_ROUTING = {"scoring": "sigmoid", "selection_bias": True, "norm_topk_prob": "norm_topk_prob",
              "groups": {"count": "n_group", "top": "topk_group", "score": "top2_sum"},
              "routed_scale": "routed_scaling_factor", "router": {"name": "gate", "float32": True}}


@pytest.mark.parametrize("arch, sparse_if", [
    ("DeepseekV3ForCausalLM", "layer >= first_k_dense_replace"),
    ("Glm4MoeForCausalLM", "layer >= first_k_dense_replace"),
    ("Glm4MoeLiteForCausalLM", "mlp_layer_types[layer] == 'sparse'"),
])
def test_draft_reads_sigmoid_grouped_routing(arch, sparse_if):
    text, doc = _draft(arch)
    moe = _blocks(doc)["moe"]
    for k, v in V3_ROUTING.items():
        assert moe.get(k) == v, (k, moe.get(k))
    assert "selection_bias_on" not in moe and "renormalize_min" not in moe
    assert moe["shared_expert"]["intermediate"] in ("n_shared_experts * moe_intermediate_size",
                                                    "moe_intermediate_size * n_shared_experts")
    c = doc["config"]
    assert c["n_group"]["from"] == "n_group" and c["topk_group"]["from"] == "topk_group"
    assert c["routed_scaling_factor"]["type"] == "float"
    assert c["group_limit_holds_top_k"]["guard"] is True
    assert _mlp_step(doc)["block"] == {"if": sparse_if, "then": "moe", "else": "mlp", "name": "mlp"}
    assert not {"n_group", "topk_group", "routed_scaling_factor"} & set(doc.get("config_assume") or {})
    items = _checklist(text)
    assert "routing" not in items and "e_score_correction_bias" not in items and "placeholder" not in items, items
    if arch.startswith("Glm4MoeLite"):      # the class computes the list from the layer count when absent
        assert c["mlp_layer_types"] == {"type": "str_tuple", "from": "mlp_layer_types", "default_expr":
                                        "['dense' if i < 1 else 'sparse' for i in range(num_hidden_layers)]"}


def test_draft_reads_softmax_routing_with_a_clamped_sum():
    """ERNIE 4.5 MoE: softmax scores, the correction bias in a `moe_statics` submodule stored [1, experts] (squeezed
    into the router's), the top-k divided by their sum clamped to moe_norm_min, MoE layers by interval / start / end."""
    text, doc = _draft("Ernie4_5_MoeForCausalLM")
    moe = _blocks(doc)["moe"]
    assert "scoring" not in moe and moe["selection_bias"] is True and "groups" not in moe
    assert moe["norm_topk_prob"] is True and moe["renormalize_min"] == "moe_norm_min"
    assert moe["router"] == {"name": "gate", "float32": True}
    assert moe["shared_expert"]["intermediate"] == "moe_intermediate_size * moe_num_shared_experts"
    assert _mlp_step(doc)["block"]["if"] == ("(layer + 1) % moe_layer_interval == 0 and layer >= moe_layer_start_index"
                                             " and (layer <= moe_layer_end_index)")
    assert doc["config"]["moe_layer_end_index"]["default_expr"] == "num_hidden_layers - 1"
    bias = doc["weights"]["model.layers.{i}.mlp.gate.e_score_correction_bias"]
    assert bias == {"from": "model.layers.{i}.mlp.moe_statics.e_score_correction_bias", "squeeze": True}


def test_draft_reads_minicpm_scalings():
    text, doc = _draft("MiniCPM3ForCausalLM")
    c = doc["config"]
    assert doc["decoder"]["embed_tokens"]["scale"] == "scale_emb" and c["scale_emb"]["type"] == "float"
    assert c["residual_scale"]["expr"] == "scale_depth / num_hidden_layers ** 0.5"
    assert c["scale_depth"]["if_null"] == "num_hidden_layers ** 0.5"
    assert c["dim_model_base"]["if_null"] == "hidden_size"
    assert c["logit_scale"]["expr"] == "1.0 / (hidden_size / dim_model_base)"
    assert doc["lm_head"]["logit_scale"] == "logit_scale"
    assert all(step.get("scale") == "residual_scale" for step in doc["decoder"]["layers"]["dataflow"])
    items = _checklist(text)
    assert "embedding output is scaled" not in items and "residual or logit scaling" not in items, items


def test_a_dense_model_has_no_scalings_drafted():
    _, doc = _draft("Qwen3ForCausalLM")
    assert "scale" not in doc["decoder"]["embed_tokens"] and "logit_scale" not in doc["lm_head"]
    assert not any("scale" in s for s in doc["decoder"]["layers"]["dataflow"])


# ---- verify (slow: a tiny checkpoint and two model runs each) -------------------------------------------------

@pytest.fixture(scope="module")
def drafted(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_routing") / "specs"
    cache = {}

    def get(fam):
        if fam[0] not in cache:
            ckpt = tiny_checkpoint(fam[0], overrides=fam[1])
            spec = root / f"{fam[0]}.yaml"
            _draft(str(ckpt), spec)
            cache[fam[0]] = (ckpt, spec)
        return cache[fam[0]]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("fam", [V3, GLM4_MOE, GLM4_LITE, MINICPM3], ids=lambda f: f[0])
def test_verify_accepts_the_drafted_spec(drafted, fam):
    from xllm_gen.codegen.verify import verify
    ckpt, spec = drafted(fam)
    r = verify(spec, ckpt, max_tokens=4, prompt_lens=[3, 9])
    assert r.ok, r.text()


@pytest.mark.slow
@pytest.mark.parametrize("old, new", [
    pytest.param("        scoring: sigmoid\n", "        scoring: softmax\n", id="softmax-for-sigmoid"),
    pytest.param("        selection_bias: true\n", "", id="correction-bias-dropped"),
])
def test_verify_fails_a_draft_with_the_routing_wrong(drafted, old, new):
    """The tiny V3's correction bias is random (tiny_hf): dropping it changes the experts chosen."""
    from xllm_gen.codegen.verify import verify
    ckpt, spec = drafted(V3)
    text = spec.read_text()
    assert old in text
    bad = spec.parent / f"bad_{abs(hash(old))}.yaml"
    bad.write_text(text.replace(old, new, 1))
    if "selection_bias" in old:     # its tensor is then unused: the loader would refuse it before comparing
        bad.write_text(bad.read_text().replace("ignore_checkpoint_tensors:\n",
                                               "ignore_checkpoint_tensors:\n  - '.*e_score_correction_bias$'\n", 1))
    r = verify(bad, ckpt, max_tokens=4, prompt_lens=[5])
    assert not r.ok
    assert r.first_divergence()[2].layer == 1, r.text()      # layer 0 is dense (first_k_dense_replace 1)
