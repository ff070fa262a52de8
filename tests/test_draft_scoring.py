"""`xllm-gen draft` of a config switch between the router's score functions (codegen/draft_scoring.py), read from the
router's source (`if self.<attr> == "softmax": ... elif self.<attr> == "sigmoid": ...`), never from a family's name:

  - the field the branches test becomes a `str` symbol with `values: [softmax, sigmoid]` and the moe's `scoring`;
  - each branch's renormalization read on its own: Cohere 2 MoE's softmax over the top-k logits sums to 1, its sigmoid
    branch divides by the sum under `if self.norm_topk_prob:` -> a derived `renormalize` symbol;
  - the per-layer lists its config class computes from a keyword it pops (`first_k_dense_replace`:
    mlp_layer_types, layer_types) and (slow) the parallel layer's block choice between the dense MLP and the experts;
  - verify (slow): tiny Cohere 2 MoE with sigmoid scores, and with softmax scores and norm_topk_prob false, verify OK as
    drafted; with the scores made softmax, or the renormalization read from norm_topk_prob alone, verify fails at the
    first sparse layer (1).
"""
from __future__ import annotations

import pytest
import yaml
from draft_util import draft_by_name, drafts_of_checkpoints

ARCH = "Cohere2MoeForCausalLM"


def _draft() -> tuple[str, dict]:
    return draft_by_name(ARCH)


def test_a_scoring_switch_is_a_str_symbol():
    text, doc = _draft()
    moe = next(b for b in doc["decoder"]["layers"]["blocks"].values() if b.get("kind") == "moe")
    assert moe["scoring"] == "expert_selection_fn"
    cfg = doc["config"]
    assert cfg["expert_selection_fn"] == {"type": "str", "from": "expert_selection_fn", "default": "softmax",
                                          "values": ["softmax", "sigmoid"]}
    assert moe["norm_topk_prob"] == "renormalize"
    assert cfg["renormalize"]["expr"] == (
        "expert_selection_fn == 'softmax' or expert_selection_fn == 'sigmoid' and norm_topk_prob")
    checklist = "\n".join(line for line in text.splitlines() if line.startswith("# - [ ]"))
    assert "scoring" not in checklist and "expert_selection_fn" not in checklist
    assert "expert_selection_fn" not in (doc.get("config_assume") or {})


def test_lists_from_a_popped_keyword():
    _, doc = _draft()
    cfg = doc["config"]
    assert cfg["mlp_layer_types"]["default_expr"] == (
        "['dense' if i < first_k_dense_replace else 'sparse' for i in range(num_hidden_layers)]")
    assert cfg["first_k_dense_replace"] == {"type": "int", "from": "first_k_dense_replace", "default": 0}
    assert "range(num_hidden_layers - first_k_dense_replace)" in cfg["layer_types"]["default_expr"]


# ---- verify (slow: a tiny checkpoint and two model runs each) -------------------------------------------------

LAYERS = {"first_k_dense_replace": 1, "layer_types": ["full_attention", "sliding_attention", "full_attention"]}
CASES = {
    "sigmoid": {**LAYERS, "expert_selection_fn": "sigmoid"},        # the tiny builder's Cohere 2 MoE
    "softmax-unnormalized": {**LAYERS, "expert_selection_fn": "softmax", "norm_topk_prob": False},
}


@pytest.fixture(scope="module")
def drafted(tiny_checkpoint, tmp_path_factory):
    return drafts_of_checkpoints(tiny_checkpoint, tmp_path_factory.mktemp("draft_scoring"),
                                 lambda case: (ARCH, CASES[case]))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_verify_accepts_the_drafted_scoring(drafted, case):
    from xllm_gen.codegen.verify import verify
    ckpt, spec = drafted(case)
    # a dense first layer: the parallel layer's feed-forward is a block choice between the MLP and the experts
    step = yaml.safe_load(spec.read_text())["decoder"]["layers"]["dataflow"][0]["parallel"][1]
    assert step["block"]["then"] == "moe" and step["block"]["else"] == "mlp"
    r = verify(spec, ckpt, max_tokens=4, prompt_lens=[3, 9])
    assert r.ok, r.text()


@pytest.mark.slow
@pytest.mark.parametrize("case, old, new", [
    pytest.param("sigmoid", "scoring: expert_selection_fn", "scoring: softmax", id="sigmoid-scored-as-softmax"),
    # the softmax over the top-k logits sums to 1 whatever norm_topk_prob says
    pytest.param("softmax-unnormalized",
                 "expr: \"expert_selection_fn == 'softmax' or expert_selection_fn == 'sigmoid' and norm_topk_prob\"",
                 'expr: "norm_topk_prob"', id="renormalization-from-the-flag-alone"),
])
def test_verify_fails_a_draft_with_the_scoring_wrong(drafted, case, old, new):
    from xllm_gen.codegen.verify import verify
    ckpt, spec = drafted(case)
    text = spec.read_text()
    assert old in text
    bad = spec.parent / f"bad_{case}.yaml"
    bad.write_text(text.replace(old, new, 1))
    r = verify(bad, ckpt, max_tokens=4, prompt_lens=[9])
    assert not r.ok
    assert r.first_divergence()[2].layer == 1, r.text()
