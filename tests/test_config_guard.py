"""The config guard and the compiler's static checks (issue 20): a checkpoint the spec does not model is refused
at load naming the spec and the field, and a spec that would accept a field and ignore it does not compile."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from spec_sample import sampled

from xllm_gen.codegen.compiler import compile_spec
from xllm_gen.codegen.errors import SpecError, SpecErrors
from xllm_gen.codegen.loader import load_spec
from xllm_gen.codegen.resolver import resolve
from xllm_gen.runtime.loading.hf_config import GENERIC_FIELDS, ConfigError

REPO = Path(__file__).resolve().parent.parent
SPECS = REPO / "specs"


def _mutant(tmp_path: Path, spec: str, *edits: tuple[str, str], name: str = "mutant.yaml") -> tuple[Path, str]:
    text = (SPECS / spec).read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / name
    path.write_text(text)
    return path, text


def _line_of(text: str, needle: str) -> int:
    return text.count("\n", 0, text.index(needle)) + 1


def _compile_error(path: Path) -> SpecError:
    with pytest.raises((SpecError, SpecErrors)) as info:
        compile_spec(path)
    err = info.value
    return err.errors[0] if isinstance(err, SpecErrors) else err


def _hf(**kw):
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
               tie_word_embeddings=True, rope_parameters={"rope_theta": 5000.0, "rope_type": "default"},
               eos_token_id=[7, 8])
    cfg.update(kw)
    return cfg


# ---- 1. min / max on a derived symbol: for every variant, and at load ---------------------------------------

NOPE = ("  layer_types:\n", "  no_rope_layers:          {type: int_tuple, from: no_rope_layers, default: [1]}\n"
        "  min_rope:                {type: int, expr: \"min(no_rope_layers)\", min: 1, guard: true}\n"
        "  layer_types:\n")


def test_derived_bounds_refused_at_load(tmp_path):
    path, _ = _mutant(tmp_path, "qwen3.yaml", NOPE)
    model = compile_spec(path).module()
    assert model.Config.from_hf(_hf(no_rope_layers=[1, 1])).min_rope == 1
    with pytest.raises(ConfigError, match=r"mutant\.yaml: derived symbol 'min_rope = min\(no_rope_layers\)' = 0 must be >= 1"):
        model.Config.from_hf(_hf(no_rope_layers=[1, 0]))


def test_derived_bounds_checked_for_every_variant(tmp_path):
    path, text = _mutant(tmp_path, "qwen3.yaml", NOPE,
                         ("  Qwen3-8B:\n    {", "  Qwen3-8B:\n    {no_rope_layers: [1, 0], "))
    err = _compile_error(path)
    assert "variants.Qwen3-8B: config.min_rope = min(no_rope_layers)" in err.message and "[1, None]" in err.message
    assert err.location.line == _line_of(text, "  min_rope:")


def test_derived_values_checked_at_load(tmp_path):
    path, _ = _mutant(tmp_path, "qwen3.yaml", (
        "  layer_types:\n", "  act_kind: {type: str, expr: \"'gated_' + hidden_act\", values: [gated_silu], guard: true}\n"
                            "  layer_types:\n"),
        ("values: [silu]}", "values: [silu, gelu]}"))
    model = compile_spec(path).module()
    with pytest.raises(ConfigError, match=r"act_kind.*'gated_gelu'"):
        model.Config.from_hf(_hf(hidden_act="gelu"))


def test_str_tuple_values_checked_per_entry(tmp_path):
    """`values` on a str_tuple symbol: every entry one of them (a per-layer kind the spec does not model, such as
    chunked attention in layer_types, was served as full attention), the refusal naming the entry."""
    path, _ = _mutant(tmp_path, "qwen3.yaml", ("    from: layer_types\n",
                                               "    from: layer_types\n    values: [full_attention, sliding_attention]\n"))
    model = compile_spec(path).module()
    ok = model.Config.from_hf(_hf(layer_types=["full_attention", "sliding_attention"], sliding_window=8))
    assert ok.layer_types == ("full_attention", "sliding_attention")
    assert model.Config.from_hf(_hf()).layer_types == ("full_attention", "full_attention")    # the default_expr's
    with pytest.raises(ConfigError, match=r"does not model layer_types\[1\]='chunked_attention'"):
        model.Config.from_hf(_hf(layer_types=["full_attention", "chunked_attention"]))


# ---- 2. absent means transformers' default -------------------------------------------------------------------

def _hf_defaults(architecture: str):
    """transformers' config class of an architecture, instantiated with its defaults, as a dict (None: unknown)."""
    from transformers.models.auto import configuration_auto, modeling_auto
    best = None
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                    modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        for model_type, cls in mapping.items():
            cname = configuration_auto.CONFIG_MAPPING_NAMES.get(model_type, "")
            if cls == architecture and cls.startswith(cname[:-len("Config")]) and \
                    (best is None or len(cname) > len(best[1])):
                best = (model_type, cname)
    return configuration_auto.CONFIG_MAPPING[best[0]]().to_dict() if best else None


def _lookup(cfg, path):
    for part in path.split("."):
        if not isinstance(cfg, dict) or cfg.get(part) is None:
            return None
        cfg = cfg[part]
    return cfg


def _same(a, b):
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


@pytest.mark.parametrize("spec", sampled("defaults", sorted(p.name for p in SPECS.glob("*.yaml")),
                                          lambda n: n[:-len(".yaml")]))
def test_spec_defaults_are_transformers_defaults(spec):
    """A checkpoint that omits a field has transformers' default for its family: every literal `default` of a
    read symbol, and the effective value of every assumed field (config_defaults, else the assumed value), equal
    the default of the architecture's transformers config class (fields the class does not have are skipped;
    generation token ids do not change the math)."""
    pytest.importorskip("transformers")
    s = load_spec(SPECS / spec).spec
    hf = _hf_defaults(s.architectures[0])
    if hf is None:
        pytest.skip(f"transformers has no config class for {s.architectures[0]}")
    wrong = []
    for name, f in s.config.items():
        if f.from_ is None or f.type == "rope":
            continue
        paths = [f.from_] if isinstance(f.from_, str) else f.from_
        if paths[0].split(".")[-1] in GENERIC_FIELDS:
            continue
        want = next((v for v in (_lookup(hf, p) for p in paths) if v is not None), None)
        if f.default is None and f.optional and f.default_expr is None:
            # optional without a default: absent means None here, so transformers' default must be None too
            if want is not None and not isinstance(want, (dict, list)):
                wrong.append(f"config.{name}: optional without a default means None when absent, transformers: "
                             f"{want!r} (give `default: {want!r}`)")
            continue
        if f.default is None:
            continue
        if f.type.endswith("_tuple") and want is not None and not isinstance(want, (list, tuple)):
            want = [want]               # a tuple symbol reads a scalar as a 1-tuple (Hunyuan's moe_topk: int or list)
        if want is not None and not _same(f.default, want):
            wrong.append(f"config.{name}.default: {f.default!r}, transformers: {want!r}")
    for key, assumed in s.config_assume.items():
        want = _lookup(hf, key)
        have = s.config_defaults.get(key, assumed)
        alike = list(have.any_of) if hasattr(have, "any_of") else [have]     # {any_of: [...]}: values alike
        if want is not None and not any(_same(h, want) for h in alike):
            wrong.append(f"config_assume.{key}: absent means {have!r} here, transformers: {want!r} (state it in "
                         f"config_defaults)")
    assert not wrong, wrong


def test_assumed_field_absent_means_the_family_default(tmp_path):
    """partial_rotary_factor: 1.0 is what the spec computes; a family whose transformers default is 0.5 refuses a
    checkpoint that omits the field (it means 0.5), and serves one that states 1.0."""
    path, text = _mutant(tmp_path, "qwen3.yaml", ("\ndecoder:\n", "\nconfig_assume: {partial_rotary_factor: 1.0}\n"
                                                  "config_defaults: {partial_rotary_factor: 0.5}\n\ndecoder:\n"))
    model = compile_spec(path).module()
    assert model.Config.from_hf(_hf(partial_rotary_factor=1.0)).hidden_size == 64
    with pytest.raises(ConfigError, match=r"omits partial_rotary_factor, which means 0.5 \(transformers' default"):
        model.Config.from_hf(_hf())
    with pytest.raises(ConfigError, match=r"has partial_rotary_factor=0.25"):
        model.Config.from_hf(_hf(partial_rotary_factor=0.25))
    # a default of a field that is not assumed is a located error
    bad, text = _mutant(tmp_path, "qwen3.yaml", ("\ndecoder:\n", "\nconfig_defaults: {rope_theta: 5.0}\n\ndecoder:\n"),
                        name="bad.yaml")
    err = _compile_error(bad)
    assert "config_defaults.rope_theta: this field is read by a config symbol" in err.message
    assert err.location.line == _line_of(text, "config_defaults:")


def test_a_null_partial_rotary_factor_rotates_the_whole_head_as_transformers(tiny_checkpoint, tmp_path):
    """GLM-4 with `partial_rotary_factor: null`: transformers keeps the null out of rope_parameters and its rotary
    takes 1.0 (the whole head); the spec's if_null reads the same (it refused the null). Logits against transformers
    in float32; the class default 0.5 must differ."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from xllm_gen import LLM
    src = tiny_checkpoint("Glm4ForCausalLM")
    out = {}
    for name, factor in (("null", None), ("half", 0.5)):
        ckpt = tmp_path / name
        shutil.copytree(src, ckpt)
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg["partial_rotary_factor"] = factor
        cfg.get("rope_parameters", {}).pop("partial_rotary_factor", None)
        (ckpt / "config.json").write_text(json.dumps(cfg))
        ids = [3, 17, 99, 5, 42, 7, 11]
        llm = LLM(str(ckpt), dtype="float32", max_num_seqs=2, num_kv_blocks=32, max_model_len=64, enforce_eager=True)
        with torch.inference_mode():
            ours = llm.prefill_logits(ids).float()
        llm.shutdown()
        hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        with torch.inference_mode():
            ref = hf(torch.tensor([ids]), use_cache=False).logits[0].float()
        out[name] = (ours, ref)
        assert (ours - ref).abs().max() < 1e-4 * ref.abs().max(), name
    assert (out["null"][1] - out["half"][1]).abs().max() > 1e-3      # the null means something else than 0.5


# ---- 3. fields of transformers' base config never change the math ------------------------------------------

def test_base_pretrained_config_fields_are_generic():
    """Every field transformers' PretrainedConfig writes by itself (a config.json saved by transformers carries
    them) is in GENERIC_FIELDS, except those that change the math and that a spec must read or assume."""
    transformers = pytest.importorskip("transformers")
    base = transformers.PretrainedConfig().to_dict()
    math_fields = {"tie_word_embeddings"}
    missing = sorted(k for k in base if k not in GENERIC_FIELDS and k not in math_fields)
    assert not missing, missing


def test_gguf_converted_smollm2_config_loads():
    """A SmolLM2-135M config as transformers writes it after converting the GGUF file (`from_pretrained(...,
    gguf_file=...)` then `save_pretrained`): unk_token_id, output flags, id2label etc. are accepted."""
    from xllm_gen.generated.llama import model
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "unk_token_id": 0,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.02,
        "intermediate_size": 1536, "max_position_embeddings": 8192, "mlp_bias": False, "num_attention_heads": 9,
        "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "tie_word_embeddings": True,
        "dtype": "float32", "transformers_version": "5.0.0", "use_cache": True, "vocab_size": 49152,
        "output_hidden_states": False, "output_attentions": False, "return_dict": True, "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0}, "problem_type": None, "chunk_size_feed_forward": 0, "is_encoder_decoder": False,
        "tie_encoder_decoder": False, "prefix": None, "task_specific_params": None, "finetuning_task": None,
        "tokenizer_class": None, "sep_token_id": None, "cls_token_id": None,
    }
    c = model.Config.from_hf(hf)
    assert c.hidden_size == 576 and c.eos_token_id == (2,)
    # a field that does change the math is still refused by name
    with pytest.raises(ConfigError, match="rope_parameters.partial_rotary_factor"):
        model.Config.from_hf({**hf, "rope_parameters": {"rope_theta": 1e5, "rope_type": "default",
                                                        "partial_rotary_factor": 0.5}})


# ---- 4. a symbol read from config.json and used by no block is a compile error ------------------------------

UNUSED = {   # the fuzzer's five mutants: the spec reads the field, then does not use it
    "rope_scaling": ("qwen3.yaml", (", scaling: rope_scaling}", "}")),
    "sliding_window": ("starcoder2.yaml", ("        sliding_window: sliding_window\n", "")),
    "hidden_act": ("qwen3.yaml", ("        activation: hidden_act\n", "        activation: silu\n")),
    "rope_theta": ("qwen3.yaml", ("theta: rope_theta,", "theta: 10000.0,")),
    "tie_word_embeddings": ("qwen3.yaml", ("tie: tie_word_embeddings}", "tie: false}")),
}


@pytest.mark.parametrize("symbol", sorted(UNUSED))
def test_read_but_unused_symbol_is_a_compile_error(symbol, tmp_path):
    spec, edit = UNUSED[symbol]
    path, text = _mutant(tmp_path, spec, edit)
    err = _compile_error(path)
    assert err.message.startswith(f"config.{symbol}: reads config.json") and "accepted and ignored" in err.message
    assert err.location.file.endswith("mutant.yaml")
    assert err.location.line == _line_of(text, f"\n  {symbol}:") + 1


def test_guard_symbol_needs_a_restriction(tmp_path):
    path, text = _mutant(tmp_path, "qwen3.yaml", ("values: [default, linear, dynamic, yarn]}",
                                                  "values: [default, linear, dynamic, yarn], guard: true}"),
                         ("{type: int, from: max_window_layers, default: 28}",
                          "{type: int, from: max_window_layers, default: 28, guard: true}"))
    err = _compile_error(path)
    assert "config.max_window_layers.guard: a guard-only symbol restricts its field" in err.message
    assert err.location.line == _line_of(text, "  max_window_layers:")


# ---- 5. a per-layer expression that fails for a variant is a located error ---------------------------------

def test_short_layer_types_is_a_located_error(tmp_path):
    path, text = _mutant(tmp_path, "gemma2.yaml", (
        "  gemma-2-2b:\n    {", "  gemma-2-2b:\n    {layer_types: [sliding_attention, full_attention], "))
    err = _compile_error(path)
    assert "variants.gemma-2-2b: decoder.layers.blocks.self_attn.sliding_window" in err.message
    assert "fails for layer 2: IndexError" in err.message
    assert err.location.line == _line_of(text, "        sliding_window: \"sliding_window if")


# ---- 6. expression bounds ---------------------------------------------------------------------------------

@pytest.mark.parametrize("expr,msg", [
    ("9 ** 9 ** 9", "the exponent of `**` must be a number literal"),
    ("10 ** 100", "exponent 100 is too large"),
    ("hidden_size ** num_hidden_layers", "the exponent of `**` must be a number literal"),
    ("hidden_size ** (num_hidden_layers * 2)", "the exponent of `**` must be a number literal"),
    ("2 ** 63 + hidden_size", "out of range"),
    ("len([0] * 10 ** 7)", "more than 1000000"),
])
def test_expression_bounds(expr, msg, tmp_path):
    path, text = _mutant(tmp_path, "gemma2.yaml", ('scale: "hidden_size ** 0.5"', f'scale: "{expr}"'))
    err = _compile_error(path)
    assert msg in err.message, err.message
    assert err.location.line == _line_of(text, f'scale: "{expr}"')


def test_derived_int_out_of_range_refused_at_load(tmp_path):
    path, _ = _mutant(tmp_path, "qwen3.yaml", (
        "  layer_types:\n", "  big: {type: int, expr: \"vocab_size * vocab_size * vocab_size\", min: 0, guard: true}\n"
                            "  layer_types:\n"))
    model = compile_spec(path).module()
    with pytest.raises(ConfigError, match="out of range"):
        model.Config.from_hf(_hf(vocab_size=2 ** 31 - 1))


# ---- 7. a multimodal architecture needs its vision tower ---------------------------------------------------

def test_vl_spec_without_vision_does_not_compile(tmp_path):
    text = (SPECS / "qwen3_vl.yaml").read_text()
    head, _, _ = text.partition("\nvision:\n")
    path = tmp_path / "qwen3_vl.yaml"
    path.write_text(head + "\n")
    (tmp_path / "qwen3.yaml").write_text((SPECS / "qwen3.yaml").read_text())
    err = _compile_error(path)
    assert "Qwen3VLForConditionalGeneration" in err.message and "vision" in err.message
    assert err.location.line == _line_of(head, "architectures:")
    assert "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES" in err.message     # why it is multimodal: transformers says


@pytest.mark.parametrize("arch, multimodal", [
    ("ChatGLMForConditionalGeneration", False),    # remote code (ChatGLM2/3, GLM-4): a text decoder, so named
    ("Gemma3ForConditionalGeneration", True),      # transformers registers it as image-text-to-text
    ("LlavaForConditionalGeneration", True),
])
def test_multimodal_suffix_follows_what_transformers_registers(tmp_path, arch, multimodal):
    """The spec decides what a model takes (a `vision` section or not); a `*ForConditionalGeneration` name is refused
    by a text-only spec only where transformers registers that class as taking images (text-only remote-code
    families name their class so too)."""
    path, text = _mutant(tmp_path, "llama.yaml", ("architectures: [", f"architectures: [{arch}, "))
    if not multimodal:
        assert arch in compile_spec(path).ir.architectures
        return
    err = _compile_error(path)
    assert arch in err.message and "vision" in err.message and "transformers" in err.message
    assert err.location.line == _line_of(text, "architectures:")


# ---- 8. compile time is linear in the variants ---------------------------------------------------------------

def _with_variants(tmp_path, n):
    text = (SPECS / "qwen3.yaml").read_text()
    head, _, _ = text.partition("\nvariants:")
    rows = "".join(f"  v{i}: {{hidden_size: {64 * (1 + i % 8)}, num_hidden_layers: {1 + i % 30}, "
                   f"num_attention_heads: 8, num_key_value_heads: 8, head_dim: 64, intermediate_size: 1024, "
                   f"vocab_size: {1000 + i}}}\n" for i in range(n))
    path = tmp_path / "big.yaml"
    path.write_text(head + "\nvariants:\n" + rows)
    return path, head + "\nvariants:\n" + rows


def test_many_variants_refused_fast(tmp_path):
    """A 0.5 MB spec of 3,000 variants: a clear error at `variants`, in seconds (it took over a minute)."""
    path, text = _with_variants(tmp_path, 3000)
    assert len(text) > 400_000
    t = time.perf_counter()
    err = _compile_error(path)
    assert "variants: 3000 variants; at most 64" in err.message
    assert err.location.line == _line_of(text, "\nvariants:") + 1
    assert time.perf_counter() - t < 20


def test_variants_resolve_in_linear_time(tmp_path):
    path, _ = _with_variants(tmp_path, 64)
    loaded = load_spec(path)
    t = time.perf_counter()
    ir = resolve(loaded)
    assert len(ir.variants) == 64 and time.perf_counter() - t < 5


# ---- 9. a fact the computation depends on is a read symbol the primitive uses ----------------------------------

def _vl_mutant(tmp_path, *edits):
    (tmp_path / "qwen3.yaml").write_text((SPECS / "qwen3.yaml").read_text())
    return _mutant(tmp_path, "qwen3_vl.yaml", *edits, name="qwen3_vl.yaml")


def test_mrope_layout_is_read_by_the_rotary(tmp_path):
    """Qwen3-VL's rotary kind is selected by text_config.rope_parameters.mrope_interleaved: a spec cannot say
    "interleaved" beside a blocked rotary. Blocking the kind leaves the field unread by any block (an error), and
    admitting only the blocked kind contradicts the default checkpoints (an error at the symbol)."""
    path, text = _vl_mutant(tmp_path, ("rotary: {kind: mrope_kind,", "rotary: {kind: mrope_blocked,"))
    err = _compile_error(path)
    assert err.message.startswith("config.mrope_interleaved: reads config.json text_config.rope_parameters."
                                  "mrope_interleaved") and "accepted and ignored" in err.message
    assert err.location.line == _line_of(text, "  mrope_interleaved:")
    path, text = _vl_mutant(tmp_path, ("    values: [mrope_interleaved]\n", "    values: [mrope_blocked]\n"))
    err = _compile_error(path)
    assert "config.mrope_kind" in err.message and "'mrope_interleaved' is not one of the values" in err.message
    assert err.location.line == _line_of(text, "  mrope_kind:")
    path, text = _vl_mutant(tmp_path, ("    values: [mrope_interleaved]\n", "    values: [mrope_interleaved, neox]\n"))
    err = _compile_error(path)
    assert "neox and the mrope kinds take different positions" in err.message
    assert err.location.line == _line_of(text, "rotary: {kind: mrope_kind")


def test_mrope_blocked_checkpoint_is_refused_by_name():
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.generated.qwen3_vl import model
    cfg = json.loads(tiny_config("Qwen3VLForConditionalGeneration").to_json_string())
    assert model.Config.from_hf(cfg).mrope_kind == "mrope_interleaved"
    cfg["text_config"]["rope_parameters"]["mrope_interleaved"] = False
    with pytest.raises(ConfigError, match="mrope_kind.*'mrope_blocked'"):
        model.Config.from_hf(cfg)


# ---- an explicit null: what transformers' config class makes of None (`if_null`) --------------------------------

def test_explicit_null_reads_as_the_class_computes_it():
    """Qwen3Config: num_key_value_heads absent is 32, null is num_attention_heads (`if_null`); a bool null is false
    (the modeling code tests it by truth); a number without an `if_null` is refused naming the field (transformers
    has no value for it), where absent reads its default."""
    import transformers
    model = compile_spec(SPECS / "qwen3.yaml").module()
    hf = _hf(num_attention_heads=8)
    hf.pop("num_key_value_heads")
    assert model.Config.from_hf(hf).num_key_value_heads == 32
    assert model.Config.from_hf({**hf, "num_key_value_heads": None}).num_key_value_heads == 8
    assert transformers.Qwen3Config(**{**hf, "num_key_value_heads": None}).num_key_value_heads == 8
    assert model.Config.from_hf({**hf, "attention_bias": None}).attention_bias is False
    with pytest.raises(ConfigError, match=r"qwen3\.yaml: config\.json field 'max_window_layers' is null, and the spec "
                                          r"says nothing of what a null 'max_window_layers' means"):
        model.Config.from_hf({**hf, "max_window_layers": None})


def test_if_null_is_checked_at_compile(tmp_path):
    path, text = _mutant(tmp_path, "qwen3.yaml", ("if_null: num_attention_heads}", "if_null: num_attention_head}"))
    err = _compile_error(path)
    assert "config.num_key_value_heads.if_null: unknown config symbol 'num_attention_head'" in err.message
    path, _ = _mutant(tmp_path, "qwen3.yaml", ("  sliding_window:          {type: int, from: sliding_window, optional: true,",
                                               "  sliding_window:          {type: int, from: sliding_window, optional: true, if_null: 4,"),
                      name="m2.yaml")
    assert "an optional symbol reads null as None" in _compile_error(path).message


def test_default_expr_failing_on_a_checkpoint_names_the_symbol(tmp_path):
    """A default_expr that cannot be computed from a config.json (an index past a list) is a config error naming the
    spec and the symbol, as a derived symbol's is (it was a bare IndexError)."""
    path, _ = _mutant(tmp_path, "qwen3.yaml", (
        "  layer_types:\n", "  picks:                   {type: int_tuple, from: picks, default: [0, 1, 2, 3]}\n"
                            "  first_pick:              {type: int, from: first_pick, default_expr: \"picks[3]\", guard: true, min: 0}\n"
                            "  layer_types:\n"))
    model = compile_spec(path).module()
    with pytest.raises(ConfigError, match=r"mutant\.yaml: symbol 'first_pick': its default_expr cannot be computed "
                                          r"from config\.json: IndexError"):
        model.Config.from_hf(_hf(picks=[1]))


def test_variant_rope_mapping_keeps_the_variants_theta(tmp_path):
    """A variant's config is written at each symbol's config.json path: a rope symbol's mapping (rope_parameters)
    declared after rope_theta (rope_parameters.rope_theta) overwrote the variant's theta, and a guard over the theta
    refused a correct variant (a blind DBRX spec)."""
    path, _ = _mutant(tmp_path, "qwen3.yaml", (
        "values: [default, linear, dynamic, yarn]}",
        "values: [default, linear, dynamic, yarn], default: {rope_type: default}}\n"
        "  theta_floor:             {type: float, expr: rope_theta, min: 1000000.0, guard: true}"))
    compile_spec(path)          # the variants' rope_theta 1e6 reaches the guard (it read 10000 before)


def test_apertus_without_a_rope_mapping_takes_the_class_theta():
    """ApertusConfig fills Llama 3 scaling at theta 12e6 when config.json has no rope mapping, whatever a top-level
    rope_theta says (a blind Apertus spec read 5e5 there and served a wrong model; the guard had nothing to refuse)."""
    import importlib

    import transformers
    model = importlib.import_module("xllm_gen.generated.apertus.model")
    hf = {k: v for k, v in transformers.ApertusConfig().to_dict().items() if k != "rope_parameters"}
    hf.update(architectures=["ApertusForCausalLM"], rope_theta=500000.0)
    want = transformers.ApertusConfig(**{k: v for k, v in hf.items() if k != "architectures"}).rope_parameters
    assert model.Config.from_hf(hf).rope_theta == want["rope_theta"] == 12000000.0
    mapped = {**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    assert model.Config.from_hf(mapped).rope_theta == 500000.0


def test_lm_head_reading_the_stream_has_its_width(tmp_path):
    """Without decoder.project_out the LM head reads the residual stream: a variant whose head dim differs from the
    stream's (OPT-350m: 512 vs 1024) is a located compile error (it compiled, and failed at load with a bare matmul
    error)."""
    path, _ = _mutant(tmp_path, "opt.yaml", (
        '  project_out: {in: hidden_size, out: word_embed_proj_dim, enabled: "word_embed_proj_dim != hidden_size"}\n',
        ""))
    err = _compile_error(path)
    assert "lm_head.dim is word_embed_proj_dim = 512, but it reads the residual stream, hidden_size = 1024" in \
        err.message, err.message


def test_rope_scaling_beside_rope_parameters_wins_as_in_transformers():
    """config.json with a legacy `rope_scaling` beside `rope_parameters`: transformers' configs take rope_scaling
    (PreTrainedConfig.convert_rope_params_to_dict), with the top-level rope_theta where it has none; the engine reads
    the same (a spec reading rope_parameters first served the other rope, silently). Checked against transformers."""
    import importlib

    from transformers import LlamaConfig
    model = importlib.import_module("xllm_gen.generated.llama.model")
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-6}
    hf = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
          "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 500.0}
    ref = LlamaConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")}).rope_parameters
    c = model.Config.from_hf(hf)
    assert ref["rope_type"] == "linear" and ref["rope_theta"] == 500.0
    assert c.rope_scaling["rope_type"] == "linear" and c.rope_scaling["factor"] == 2.0 and c.rope_theta == 500.0
    assert hf["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}      # the caller's dict untouched
    plain = model.Config.from_hf({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 9.0}})
    assert plain.rope_theta == 9.0


def test_rope_scaling_beside_a_mapping_per_layer_type_as_in_transformers():
    """Gemma 3's rope_parameters per layer type with a legacy rope_scaling: transformers merges rope_scaling into the
    full_attention entry (its theta kept) and leaves sliding_attention; the engine reads the same (it replaced the
    whole mapping: refused, naming fields that are not in config.json). Checked against transformers."""
    import importlib

    from transformers import Gemma3TextConfig
    model = importlib.import_module("xllm_gen.generated.gemma3.model")
    hf = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
          "head_dim": 8, "query_pre_attn_scalar": 8, "max_position_embeddings": 128, "sliding_window": 16,
          "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    ref = Gemma3TextConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")}).rope_parameters
    c = model.Config.from_hf(hf)
    assert ref["full_attention"]["rope_type"] == "linear" and ref["sliding_attention"]["rope_type"] == "default"
    assert c.rope_scaling["rope_type"] == "linear" and c.rope_scaling["factor"] == ref["full_attention"]["factor"]
    assert c.rope_theta == ref["full_attention"]["rope_theta"] and c.rope_local == {"rope_type": "default"}


def test_a_symbol_divided_by_is_refused_at_zero():
    """A symbol an expression divides by (Granite's `logit_scale: 1 / logits_scaling`) must be > 0: a config.json with
    0 is refused at load naming the field, not served until the first step fails with ZeroDivisionError (a blind
    exercise found it). A division under a conditional (`a / s if s else 0`) may be guarded: not implied."""
    import importlib

    from xllm_gen.codegen.expr import parse
    from xllm_gen.codegen.resolver_symbols import _divisors
    model = importlib.import_module("xllm_gen.generated.granite.model")
    base = {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 128}
    assert model.Config.from_hf({**base, "logits_scaling": 8.0}).logits_scaling == 8.0
    with pytest.raises(ConfigError, match="'logits_scaling' = 0.0 must be > 0"):
        model.Config.from_hf({**base, "logits_scaling": 0.0})
    assert _divisors(parse("(h / a) ** 0.5 + b // c - d % e").tree()) == {"a", "c", "e"}
    assert _divisors(parse("h / a if a else 0").tree()) == set()
    assert _divisors(parse("layer % period").tree()) == {"period"}


def test_qwen2_sliding_layers_without_the_flag_are_refused():
    """Qwen2Config nulls sliding_window without use_sliding_window (transformers then fails on a sliding layer): a
    config.json whose layer_types name sliding layers without the flag is refused by name, not served with its
    window; with the flag, or without sliding layers, it loads."""
    import pytest as _pytest

    from xllm_gen.generated.qwen2.model import Qwen2Config
    base = dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=100, sliding_window=8)
    types = ["sliding_attention", "full_attention"]
    with _pytest.raises(ValueError, match="sliding_layers_need_the_flag"):
        Qwen2Config.from_hf({**base, "use_sliding_window": False, "layer_types": types})
    assert Qwen2Config.from_hf({**base, "use_sliding_window": True, "layer_types": types}).layer_types == tuple(types)
    assert set(Qwen2Config.from_hf({**base, "use_sliding_window": False}).layer_types) == {"full_attention"}


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_sliding_window_absent_under_use_sliding_window(family):
    """Qwen2 / Qwen3 / Qwen3-MoE configs null the window unless use_sliding_window, and otherwise keep their class
    default of 4096 where config.json omits it: a blind exercise found the specs reading absent as no window (full
    attention served past 4096 tokens, verify's defaults check blind to it because the checkpoint's own flag was
    off). The spec's reading must equal the config class's for each flag, absent and null."""
    import importlib

    import transformers
    cfg_cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
               "qwen3_moe": transformers.Qwen3MoeConfig}[family]
    Config = importlib.import_module(f"xllm_gen.generated.{family}.model").Config
    base = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_window_layers": 2,
            "architectures": [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                               "qwen3_moe": "Qwen3MoeForCausalLM"}[family]], "model_type": family}
    if family == "qwen3_moe":
        base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        base.pop("max_window_layers")
    for flag in (True, False):
        for window in ("absent", None, 7):
            hf = dict(base, use_sliding_window=flag)
            if window != "absent":
                hf["sliding_window"] = window
            want = cfg_cls(**hf).sliding_window
            got = Config.from_hf(hf).sliding_window
            assert (got if flag else None) == want, (family, flag, window, got, want)


def test_a_tie_expression_is_refused_naming_the_way(tmp_path):
    """`lm_head.tie` takes true, false or a bool symbol (the head's parameter exists per checkpoint by that symbol); an
    expression was rendered as no tie at all, and the only error said its symbol was unused (a blind exercise)."""
    spec = tmp_path / "t.yaml"
    spec.write_text(f"extends: {Path(__file__).resolve().parents[1] / 'specs' / 'llama.yaml'}\nname: t_tie\n"
                    "class_prefix: TTie\nlm_head: {tie: \"not tie_word_embeddings\"}\n")
    err = _compile_error(spec)
    assert "lm_head.tie" in str(err) and "derive one" in str(err), str(err)


def test_a_null_variant_without_an_inherited_one_says_what_null_means(tmp_path):
    """`variants: {X: ~}` deletes an inherited variant; in a spec that inherits none it was a bare "expected a valid
    dictionary, got None" (a blind exercise)."""
    src = (Path(__file__).resolve().parents[1] / "specs" / "llama.yaml").read_text()
    spec = tmp_path / "v.yaml"
    spec.write_text(src.replace("name: llama", "name: v_null").replace("class_prefix: Llama", "class_prefix: VNull")
                    + "  NotInherited: ~\n")
    err = _compile_error(spec)
    assert "variants.NotInherited" in str(err) and "inherited through `extends`" in str(err), str(err)
