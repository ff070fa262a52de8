"""An absent config field means transformers' default for that family (issue 20), never "anything goes".

For every served family and every symbol its spec reads from a top-level config.json field: the field (and
only that field: a fallback path is another field, present) is removed from transformers' own default config of the class, then the
spec's value (generated Config.from_hf) must equal the config class's (`cls.from_dict`). A refusal is fine
(never served wrong). Found this way: Qwen3-Next / Qwen3.5 / Flint / Mellum computed head_dim as hidden / heads
where transformers defaults it (256 / 128: a loud shape error at load), and Cohere Compass scaled its logits by
Cohere's 0.0625 where transformers takes 1.0 (silently: greedy tokens are unchanged, every probability is not);
57 specs fell back from num_key_value_heads to num_attention_heads where the class has its own default (transformers
5's Qwen3Config: 32 whatever the heads), and Flint from num_experts to a num_local_experts its class never reads.

tests/test_config_guard.py test_spec_defaults_are_transformers_defaults checks each declared `default:` (and
config_assume) against the class; this checks the value the spec ends up with, fallbacks included.

The arms and the known spellings of one meaning are codegen/defaults_check.py (`xllm-gen verify` runs them on a
checkpoint's own config.json). An explicit null is checked too: Qwen3Config reads num_key_value_heads null as
num_attention_heads (absent: 32), and 64 specs refused or misread such a config before `if_null`.

Default run: a few families; `--runslow`: every served family.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from conformance import families as F

from xllm_gen.codegen.defaults_check import default_mismatches

# hunyuan_v1_moe: an `int | list[int]` field (moe_topk) read as a tuple symbol, which a scalar default must match
# cwm / gpt_oss: the rope arm (their config classes fill in a scaled rope where config.json has no mapping)
DEFAULT_ARM = {"qwen3_next", "flint", "cohere_compass", "llama", "gemma2", "hunyuan_v1_moe", "cwm", "gpt_oss"}


def _plans():
    out = []
    for p in F.served_plans():
        if p.spec is None or p.error is not None:
            continue
        out.append(pytest.param(p, id=p.spec.name, marks=() if p.spec.name in DEFAULT_ARM else pytest.mark.slow))
    return out


@pytest.mark.parametrize("plan", _plans())
def test_absent_field_is_transformers_default(plan):
    """Every arm of codegen/defaults_check.py around the class's own default config."""
    import transformers

    from xllm_gen.codegen.compiler import compile_spec
    cls = getattr(transformers, plan.family.architecture).config_class
    wrong = default_mismatches(compile_spec(plan.spec.path).ir.config, F.generated_model(plan.spec).Config, cls,
                               cls().to_dict(), plan.family.architecture, plan.spec.name)
    assert not wrong, f"{plan.spec.rel}: " + "; ".join(wrong)


def test_a_field_the_class_computes_is_no_default():
    """Zamba2Config raises max_position_embeddings to 16384 under use_long_context whatever config.json says: a
    spec that derives the same (`16384 if use_long_context else <the field>`) is right, and the check must not
    report the field's own default (4096) as a disagreement; without the flag the field is an ordinary one."""
    import transformers

    from xllm_gen.codegen.defaults_check import _overwritten
    cls = transformers.Zamba2Config
    base = cls(use_long_context=True).to_dict()
    assert base["max_position_embeddings"] == 16384
    assert _overwritten(cls, base, "max_position_embeddings", "Zamba2ForCausalLM")
    assert _overwritten(cls, {**base, "max_position_embeddings": 4096}, "max_position_embeddings", "Zamba2ForCausalLM")
    plain = cls(use_long_context=False).to_dict()
    assert not _overwritten(cls, plain, "max_position_embeddings", "Zamba2ForCausalLM")
    assert not _overwritten(cls, plain, "hidden_size", "Zamba2ForCausalLM")


def test_same_meaning_is_the_specs_own_statement():
    """A read symbol whose value differs from transformers' class attribute with the same meaning says so in the
    spec (`same_meaning`), where a user's spec can say it too (no list of exempt shipped specs): Llama 4's raw
    `no_rope_layers` field is read as given and derived into the per-layer list the class builds. Without the
    statement the check reports it."""
    import dataclasses

    import transformers

    from xllm_gen.codegen.compiler import compile_spec
    plan = next(p for p in F.served_plans() if p.spec is not None and p.spec.name == "llama4")
    cls = getattr(transformers, plan.family.architecture).config_class
    fields = compile_spec(plan.spec.path).ir.config
    assert [f.name for f in fields if f.same_meaning] == ["no_rope_layers_given"]
    bare = [dataclasses.replace(f, same_meaning="") for f in fields]
    args = (F.generated_model(plan.spec).Config, cls, cls().to_dict(), plan.family.architecture, "llama4")
    assert not default_mismatches(fields, *args)
    assert any("no_rope_layers" in w for w in default_mismatches(bare, *args))


def _shipped_and_variant(tmp_path, spec_name: str, arch: str, config_yaml: str):
    """(config class, a small default config.json, [(the shipped spec's mismatches, False), (a variant's, True)]): the
    variant extends the shipped spec with `config_yaml` under `config:`; each compiled and checked by the defaults
    check around the same config."""
    import transformers

    from xllm_gen.codegen.compiler import compile_spec
    from xllm_gen.codegen.verify import _import_compiled
    cls = getattr(transformers, arch).config_class
    base = cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16).to_dict()
    shipped = Path(__file__).resolve().parents[1] / "specs" / f"{spec_name}.yaml"
    variant = tmp_path / "variant.yaml"
    variant.write_text(f"extends: {shipped}\nname: {spec_name}_variant\nclass_prefix: Variant\n"
                       f"config:\n  {config_yaml}\n")
    out = []
    for spec, wrong in ((shipped, False), (variant, True)):
        compiled = compile_spec(spec)
        model = _import_compiled(compiled.files, compiled.ir.name, tmp_path)[0]
        out.append((default_mismatches(compiled.ir.config, model.Config, cls, base, arch, spec_name), wrong))
    return base, out


@pytest.mark.slow      # two compiles of qwen3 (~12 s); tests/test_config_guard.py covers the Qwen3 fix itself
def test_a_default_that_hangs_on_a_flag_is_probed_with_the_flag_flipped(tmp_path):
    """Qwen3Config keeps sliding_window's 4096 only under use_sliding_window: probed with a checkpoint's own flag
    (off, as released), a spec that reads an absent window as None agrees, and it served full attention past 4096
    tokens to a checkpoint with the flag on (found by a blind exercise). Each bool field the checkpoint sets is also
    probed flipped: the None-reading spec is reported, the shipped one (4096 under the flag) is not."""
    base, results = _shipped_and_variant(tmp_path, "qwen3", "Qwen3ForCausalLM", "sliding_window: {default_expr: ~}")
    assert base["use_sliding_window"] is False
    for found, wrong in results:
        assert bool(found) == wrong and all("use_sliding_window = True" in w for w in found), found


@pytest.mark.slow      # two compiles of cwm (~15 s); the default arm runs the shipped cwm / gpt_oss through the rope arm
def test_an_absent_rope_mapping_means_the_class_rope(tmp_path):
    """CwmConfig fills in Llama 3 scaling (factor 16, ...) where config.json has no rope mapping; the spec read the
    absent mapping as the plain rope and served another model (found by a blind exercise: verify failed from layer 0
    while its defaults check said "agree", as rope symbols were not checked). The rope arm reports that reading and
    passes the shipped spec (the llama3 mapping as the symbol's default)."""
    _, results = _shipped_and_variant(tmp_path, "cwm", "CwmForCausalLM", "rope_scaling: {default: ~}")
    for found, wrong in results:
        assert bool(found) == wrong and all("rope type 'frequency_bands'" in w for w in found), found
