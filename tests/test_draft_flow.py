"""`xllm-gen draft` of a decoder layer's dataflow read as data flow under the config flags its forward tests
(codegen/draft_flow.py), of a fused q/k/v's row layout and KV heads found by running the attention (codegen/draft_qkv.py),
and of the checkpoint's own names for the decoder's parts (codegen/draft_parts.py), never from a family's name:

  - GPT-NeoX's `use_parallel_residual`: x + attn(ln1(x)) + mlp(ln2(x)) (a parallel step over two norms) or the
    sequential layer, the choice `dataflow: {if: use_parallel_residual}`; q/k/v stored per head;
  - Falcon's flags: ln_attn / ln_mlp in parallel where `new_decoder_architecture and num_ln_in_parallel_attn == 2` (a
    null read as 2, as the layer's `__init__` sets it), one shared input_layernorm otherwise; `parallel_attn` (a third
    form) held at its default and named; q/k/v per KV group, its KV heads `num_kv_heads if new_decoder_architecture or
    not multi_query else 1` (multi-query); `transformer.h.` / `word_embeddings` / `ln_f` as checkpoint_prefixes;
  - verify (slow): tiny GPT-NeoX (parallel and sequential) and Falcon (new decoder architecture with GQA and its own MLP
    width; the old multi-query form with one shared norm) verify OK as drafted; with the parallel step made sequential,
    the two norms swapped or the q/k/v layout made stacked, verify fails at layer 0.
"""
from __future__ import annotations

import pytest
from draft_util import checklist, draft_by_name, drafts_of_checkpoints


def _flow(arch: str, prefix: str, attn: str):
    import transformers

    from xllm_gen.codegen.draft_flow import read_flow
    cls = getattr(transformers, arch)
    config = cls.config_class()
    d = config.to_dict()
    return read_flow(cls, config, prefix, attn, "mlp", d, set(d))


def test_two_norm_parallel_residual_chosen_by_its_flag():
    flow = _flow("GPTNeoXForCausalLM", "gpt_neox.layers.{i}.", "attention")
    assert flow.cond == "use_parallel_residual" and not flow.held
    assert flow.forms[0] == ((("input_layernorm", "attention", None), ("post_attention_layernorm", "mlp", None)),)
    assert flow.forms[1] == ((("input_layernorm", "attention", None),), (("post_attention_layernorm", "mlp", None),))
    assert flow.symbols == {"use_parallel_residual": "{type: bool, from: use_parallel_residual, default: true}"}


def test_fused_qkv_rows_read_by_running_the_attention():
    import transformers

    from xllm_gen.codegen.draft_qkv import probe_qkv
    for arch, prefix, attn, layout, kv in [
            ("FalconForCausalLM", "transformer.h.{i}.", "self_attention", "kv_group",
             "num_kv_heads if new_decoder_architecture or not multi_query else 1"),
            ("GPTNeoXForCausalLM", "gpt_neox.layers.{i}.", "attention", "head", "num_attention_heads")]:
        cls = getattr(transformers, arch)
        config = cls.config_class()
        d = config.to_dict()
        found = probe_qkv(cls, config, prefix, f"{attn}.query_key_value", attn, set(d))
        assert (found.layout, found.kv_heads) == (layout, kv), arch


@pytest.mark.slow       # the whole draft by class name (~15 s: Falcon's flags built 12 ways on the meta device)
def test_falcon_layer_forms_heads_and_names():
    text, doc = draft_by_name("FalconForCausalLM")
    flow = doc["decoder"]["layers"]["dataflow"]
    assert flow["if"] == "new_decoder_architecture and num_ln_in_parallel_attn == 2"
    assert flow["then"] == [{"parallel": [{"norm": "ln_attn", "block": "self_attention"},
                                          {"norm": "ln_mlp", "block": "mlp"}]}]
    assert flow["else"] == [{"parallel": [{"norm": "input_layernorm", "block": "self_attention"},
                                          {"norm": "input_layernorm", "block": "mlp"}]}]
    cfg = doc["config"]
    assert cfg["num_ln_in_parallel_attn"]["if_null"] == 2 and cfg["num_kv_heads"]["from"] == [
        "num_kv_heads", "num_attention_heads"]
    assert cfg["intermediate_size"]["from"] == "ffn_hidden_size"
    assert doc["decoder"]["layers"]["blocks"]["self_attention"]["kv_heads"] == (
        "num_kv_heads if new_decoder_architecture or not multi_query else 1")
    assert doc["config_assume"]["parallel_attn"] is True and "`parallel_attn` is not True" in checklist(text)
    assert doc["checkpoint_prefixes"] == {"model.embed_tokens.": "transformer.word_embeddings.",
                                          "model.norm.": "transformer.ln_f.", "model.layers.": "transformer.h."}
    w = doc["weights"]["model.layers.{i}.self_attention.query_key_value.weight"]
    assert w["layout"] == {"interleave": ["q", "k", "v"], "per": "kv_group"}


# ---- verify (slow: a tiny checkpoint and two model runs each) -------------------------------------------------

CASES = {
    "neox": ("GPTNeoXForCausalLM", {}),                                     # use_parallel_residual true
    "neox-sequential": ("GPTNeoXForCausalLM", {"use_parallel_residual": False}),
    "falcon": ("FalconForCausalLM", {"ffn_hidden_size": 96}),               # new decoder architecture, GQA 4 / 2
    "falcon-mq": ("FalconForCausalLM", {"new_decoder_architecture": False, "multi_query": True, "num_kv_heads": 4}),
}


@pytest.fixture(scope="module")
def drafted(tiny_checkpoint, tmp_path_factory):
    return drafts_of_checkpoints(tiny_checkpoint, tmp_path_factory.mktemp("draft_flow"), CASES.__getitem__)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_verify_accepts_the_drafted_layer(drafted, case):
    from xllm_gen.codegen.verify import verify
    ckpt, spec = drafted(case)
    assert "dataflow:\n      if: " in spec.read_text()
    r = verify(spec, ckpt, max_tokens=4, prompt_lens=[3, 9])
    assert r.ok, r.text()


@pytest.mark.slow
@pytest.mark.parametrize("case, old, new", [
    pytest.param("neox", "- parallel: [{norm: input_layernorm, block: attention}, {norm: post_attention_layernorm, "
                         "block: mlp}]", "- {norm: input_layernorm, block: attention}\n"
                                         "        - {norm: post_attention_layernorm, block: mlp}", id="parallel-made-sequential"),
    pytest.param("falcon", "{norm: ln_attn, block: self_attention}, {norm: ln_mlp, block: mlp}",
                 "{norm: ln_mlp, block: self_attention}, {norm: ln_attn, block: mlp}", id="norms-swapped"),
    pytest.param("falcon", "per: kv_group", "per: tensor", id="qkv-stacked"),
])
def test_verify_fails_a_wrong_layer(drafted, case, old, new):
    from xllm_gen.codegen.verify import verify
    ckpt, spec = drafted(case)
    text = spec.read_text()
    assert old in text
    bad = spec.parent / f"bad_{case}.yaml"
    bad.write_text(text.replace(old, new))
    r = verify(bad, ckpt, max_tokens=4, prompt_lens=[9])
    assert not r.ok
    assert r.first_divergence()[2].layer == 0, r.text()
