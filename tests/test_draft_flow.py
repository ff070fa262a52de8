"""`xllm-gen draft` of a decoder layer's dataflow read as data flow under the config flags its forward tests
(codegen/draft_flow.py), of a fused q/k/v's row layout and KV heads found by running the attention (codegen/draft_qkv.py),
and of the checkpoint's own names for the decoder's parts (codegen/draft_parts.py), never from a family's name:

  - GPT-NeoX's `use_parallel_residual`: x + attn(ln1(x)) + mlp(ln2(x)) (a parallel step over two norms) or the
    sequential layer, the choice `dataflow: {if: use_parallel_residual}`; q/k/v stored per head;
  - Falcon's three forms: the sequential one where `not parallel_attn`, else one parallel step over ln_attn / ln_mlp,
    the two-norm form and the one-shared-norm form merged (codegen/draft_forms.py: one residual shape, norms differ
    only in name): ln_attn / ln_mlp load from input_layernorm unless `new_decoder_architecture and
    num_ln_in_parallel_attn == 2` (a null read as 2, as the layer's `__init__` sets it), nothing held; q/k/v per KV
    group, its KV heads `num_kv_heads if new_decoder_architecture or not multi_query else 1` (multi-query);
    `transformer.h.` / `word_embeddings` / `ln_f` as checkpoint_prefixes;
  - StableLM's `use_parallel_residual` (default false: the sequential form, the one whose norms are those the default
    layer builds): one shared input_layernorm in parallel or input_layernorm / post_attention_layernorm in sequence,
    the choice drafted (it was assumed false);
  - the spec's name is the config class's model_type (`gpt_neox`, not `gptneo_x`; a text config's without `_text`);
  - verify (slow): tiny GPT-NeoX (parallel and sequential), Falcon (new decoder architecture with GQA and its own MLP
    width; the old multi-query form with one shared norm; the old sequential form) and StableLM (both residual forms)
    verify OK as drafted; with the parallel step made sequential (or the sequential made parallel), the two norms
    swapped (in the dataflow or in the merged form's `weights` sources) or the q/k/v layout made stacked, verify fails at layer 0;
  - a fused q/k/v blocked or per head by a config flag (a GPT-NeoX so changed, tests/fixtures/flag_qkv.py, as ChatGLM
    does by multi_query_attention): the layout drafted is chosen by that flag, and (slow) the draft verifies on a
    checkpoint of each flag value, the branches swapped failing at layer 0.
"""
from __future__ import annotations

import pytest
import yaml
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


def test_falcon_forms_of_one_shape_merged_by_their_norm_names():
    flow = _flow("FalconForCausalLM", "transformer.h.{i}.", "self_attention")
    assert flow.cond == "parallel_attn" and not flow.held
    assert flow.forms == [((("ln_attn", "self_attention", None), ("ln_mlp", "mlp", None)),),
                          ((("input_layernorm", "self_attention", None),), (("post_attention_layernorm", "mlp", None),))]
    assert len(flow.members) == 3
    cond = "new_decoder_architecture and num_ln_in_parallel_attn == 2"
    assert flow.renames == [(n, f"{{'{n}' if {cond} else 'input_layernorm'}}", ["weight", "bias"])
                            for n in ("ln_attn", "ln_mlp")]
    assert set(flow.symbols) == {"parallel_attn", "new_decoder_architecture", "num_ln_in_parallel_attn"}


def test_choice_whose_default_form_has_fewer_norms_is_drafted():
    flow = _flow("StableLmForCausalLM", "model.layers.{i}.", "self_attn")
    assert flow.cond == "use_parallel_residual" and not flow.held and not flow.renames
    assert flow.forms[0] == ((("input_layernorm", "self_attn", None), ("input_layernorm", "mlp", None)),)


def test_spec_name_is_the_model_type():
    from xllm_gen.codegen.draft import _snake
    assert _snake("GPTNeoXForCausalLM", "gpt_neox") == "gpt_neox"
    assert _snake("XForCausalLM", "x-lm") == "x_lm" and _snake("FooBarForCausalLM", "") == "foo_bar"
    assert _snake("Llama4ForCausalLM", "llama4_text") == "llama4" and _snake("E3ForCausalLM", "e3_text_model") == "e3"


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


@pytest.fixture
def flag_qkv(monkeypatch):
    """A GPT-NeoX whose fused q/k/v is blocked where `blocked_qkv`, per head where not (tests/fixtures/flag_qkv.py),
    reachable by name as a transformers class (the draft and verify look architectures up there)."""
    import sys

    from fixtures.flag_qkv import FlagQKVForCausalLM
    monkeypatch.setattr(sys.modules["transformers"], "FlagQKVForCausalLM", FlagQKVForCausalLM, raising=False)
    return FlagQKVForCausalLM


def test_fused_qkv_layout_chosen_by_a_flag_is_read(flag_qkv):
    """No layout fits every combination of the attention's flags, but `blocked_qkv` splits them into two that each
    agree: the layout drafted is chosen by it (`layout: {if: blocked_qkv, then: per tensor, else: per head}`)."""
    from xllm_gen.codegen.draft_qkv import LayoutIf, probe_qkv
    for blocked in (True, False):
        config = flag_qkv.config_class(blocked_qkv=blocked)
        found = probe_qkv(flag_qkv, config, "gpt_neox.layers.{i}.", "attention.query_key_value", "attention",
                          set(config.to_dict()))
        assert found.layout == LayoutIf("blocked_qkv", "tensor", "head"), blocked


@pytest.mark.slow       # two tiny checkpoints, a draft and four verify runs (~30 s)
def test_flag_chosen_qkv_layout_drafted_and_verified(flag_qkv, tmp_path):
    """The draft of one checkpoint names the flag and both layouts; the spec verifies against transformers on a
    checkpoint of each flag value, and with the branches swapped it fails at layer 0 on both."""
    from fixtures.tiny_hf import make_tiny_checkpoint

    from xllm_gen.codegen.draft import draft_spec
    from xllm_gen.codegen.verify import verify
    ckpts = {b: make_tiny_checkpoint("FlagQKVForCausalLM", tmp_path / f"blocked_{b}", overrides={
        "blocked_qkv": b, "rope_parameters.partial_rotary_factor": 1.0}) for b in (True, False)}
    text = draft_spec(str(ckpts[True]))[0]
    doc = yaml.safe_load(text)
    assert doc["config"]["blocked_qkv"] == {"type": "bool", "from": "blocked_qkv", "default": True}
    for suffix in ("weight", "bias"):
        assert doc["weights"][f"model.layers.{{i}}.attention.query_key_value.{suffix}"]["layout"] == {
            "if": "blocked_qkv", "then": {"interleave": ["q", "k", "v"], "per": "tensor"},
            "else": {"interleave": ["q", "k", "v"], "per": "head"}}
    spec, bad = tmp_path / "flag_qkv.yaml", tmp_path / "bad_flag_qkv.yaml"
    spec.write_text(text)
    bad.write_text(text.replace("if: blocked_qkv", 'if: "not blocked_qkv"'))
    for b, ckpt in ckpts.items():
        r = verify(spec, ckpt, max_tokens=4, prompt_lens=[3, 9])
        assert r.ok, r.text()
        r = verify(bad, ckpt, max_tokens=4, prompt_lens=[9])
        assert not r.ok and r.first_divergence()[2].layer == 0, r.text()


@pytest.mark.slow       # the whole draft by class name (~15 s: Falcon's flags built 12 ways on the meta device)
def test_falcon_layer_forms_heads_and_names():
    text, doc = draft_by_name("FalconForCausalLM")
    flow = doc["decoder"]["layers"]["dataflow"]
    assert flow["if"] == "parallel_attn"
    assert flow["then"] == [{"parallel": [{"norm": "ln_attn", "block": "self_attention"},
                                          {"norm": "ln_mlp", "block": "mlp"}]}]
    assert flow["else"] == [{"norm": "input_layernorm", "block": "self_attention"},
                            {"norm": "post_attention_layernorm", "block": "mlp"}]
    assert doc["weights"]["model.layers.{i}.ln_mlp.bias"]["from"] == (
        "transformer.h.{i}.{'ln_mlp' if new_decoder_architecture and num_ln_in_parallel_attn == 2 "
        "else 'input_layernorm'}.bias")
    cfg = doc["config"]
    assert cfg["num_ln_in_parallel_attn"]["if_null"] == 2 and cfg["num_kv_heads"]["from"] == [
        "num_kv_heads", "num_attention_heads"]
    assert cfg["intermediate_size"]["from"] == "ffn_hidden_size"
    assert doc["decoder"]["layers"]["blocks"]["self_attention"]["kv_heads"] == (
        "num_kv_heads if new_decoder_architecture or not multi_query else 1")
    assert "config_assume" not in doc and "parallel_attn" not in checklist(text)
    assert doc["name"] == "falcon" and cfg["parallel_attn"]["default"] is True
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
    "falcon-seq": ("FalconForCausalLM", {"new_decoder_architecture": False, "parallel_attn": False}),
    "stablelm": ("StableLmForCausalLM", {}),                                # use_parallel_residual false
    "stablelm-parallel": ("StableLmForCausalLM", {"use_parallel_residual": True}),
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
    pytest.param("stablelm", "        - {norm: input_layernorm, block: self_attn}\n"
                             "        - {norm: post_attention_layernorm, block: mlp}",
                 "        - parallel: [{norm: input_layernorm, block: self_attn}, {norm: post_attention_layernorm, "
                 "block: mlp}]", id="sequential-made-parallel"),
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


@pytest.mark.slow
def test_verify_fails_merged_norms_loading_each_others_tensors(drafted):
    """The merged form's `weights` entries are what loads ln_attn / ln_mlp: their sources swapped, layer 0 differs."""
    from xllm_gen.codegen.verify import verify
    ckpt, spec = drafted("falcon")
    text = spec.read_text()
    assert text.count("{'ln_mlp' if") == 2 and text.count("{'ln_attn' if") == 2
    bad = spec.parent / "bad_falcon_merged.yaml"
    bad.write_text(text.replace("{'ln_mlp' if", "{'X' if").replace("{'ln_attn' if", "{'ln_mlp' if")
                   .replace("{'X' if", "{'ln_attn' if"))
    r = verify(bad, ckpt, max_tokens=4, prompt_lens=[9])
    assert not r.ok
    assert r.first_divergence()[2].layer == 0, r.text()
