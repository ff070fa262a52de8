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

Default run: a few families; `--runslow`: every served family.
"""
from __future__ import annotations

import json

import pytest
from conformance import families as F

# identity and generation-stop fields (the engine also reads generation_config.json), not the math
NOT_MATH = {"eos_token_id", "bos_token_id", "pad_token_id", "model_type"}

# (spec, symbol): the spec's value means what transformers' value means, spelled differently
SAME_MEANING = {
    ("bamba", "attn_layer_indices"): "() and None: no attention layer listed",
    # the original RefinedWeb names, as the first Falcon configs write them (transformers 4's FalconConfig mapped
    # them; 5.25's ignores them and builds its class defaults): the spec reads them as the model was trained
    ("falcon", "num_hidden_layers"): "n_layer: the RefinedWeb name of num_hidden_layers",
    ("falcon", "num_attention_heads"): "n_head: the RefinedWeb name of num_attention_heads",
    ("falcon", "num_kv_heads"): "n_head_kv: the RefinedWeb name of num_kv_heads",
    ("falcon", "num_ln_in_parallel_attn"): "None is 2 with new_decoder_architecture (transformers' modeling rule)",
    ("gpt2", "intermediate_size"): "n_inner None is 4 * hidden_size (modeling code)",
    ("gpt_bigcode", "intermediate_size"): "n_inner None is 4 * hidden_size (modeling code)",
    ("gpt_neo", "intermediate_size"): "None is 4 * hidden_size (modeling code)",
    ("hunyuan_v1_moe", "head_dim"): "None is hidden_size // num_attention_heads (modeling code)",
    ("hunyuan_v1_moe", "moe_topk_list"): "an int top-k is the same top-k on every layer",
    ("minimax", "head_dim"): "None is hidden_size // num_attention_heads (modeling code)",
    ("mixtral", "head_dim"): "None is hidden_size // num_attention_heads (modeling code)",
    ("lfm2", "full_attn_idxs"): "None is every layer (transformers' Lfm2Config)",
    ("gemma4", "use_bidirectional_attention"): "a guard on the vision tokens' attention: text prompts alike",
    ("llama4", "no_rope_layers_given"): "the raw field; the derived no_rope_layers applies the class's default",
}
# (3): a default computed from these (head_dim = hidden / heads) or constant (Qwen3Config's 128) only shows when
# they move away from the class defaults, where the two coincide
SIZES = ("num_attention_heads", "hidden_size")
DEFAULT_ARM = {"qwen3_next", "flint", "cohere_compass", "llama", "gemma2"}


def _plans():
    out = []
    for p in F.served_plans():
        if p.spec is None or p.error is not None:
            continue
        out.append(pytest.param(p, id=p.spec.name, marks=() if p.spec.name in DEFAULT_ARM else pytest.mark.slow))
    return out


def _norm(v):
    return tuple(v) if isinstance(v, (list, tuple)) else v


def _other(value, typ: str, values: tuple):
    """Another valid value of a field of type `typ` (None: none to offer)."""
    if typ == "str":
        return next((v for v in values if v != value), None)
    if isinstance(value, bool) or typ == "bool":
        return None if value is None else not value
    if typ == "int" and isinstance(value, int):
        return value * 2 if value else 1
    if typ == "float" and isinstance(value, (int, float)):
        return value * 2 if value else 0.5
    return None


def _mismatch(cls, config, hf: dict, field: str, name: str, what: str) -> str | None:
    """transformers' value of `field` on this config.json vs the spec's symbol `name` (None: the same, or no
    reference / a refusal)."""
    try:
        want = getattr(cls.from_dict(json.loads(json.dumps(hf))), field)
    except Exception:                        # transformers cannot build it: nothing to compare
        return None
    try:
        got = getattr(config.from_hf(json.loads(json.dumps(hf))), name)
    except ValueError:                       # refused by the guard: never served wrong
        return None
    if _norm(got) == _norm(want) or (isinstance(want, (int, float)) and not isinstance(want, bool)
                                     and isinstance(got, (int, float)) and not isinstance(got, bool)
                                     and float(got) == float(want)):
        return None
    return f"{what}: transformers' {cls.__name__} means {field} = {want!r}, the spec reads {name} = {got!r}"


@pytest.mark.parametrize("plan", _plans())
def test_absent_field_is_transformers_default(plan):
    """(1) the field absent (its fallbacks, other fields, as the class has them); (2) the field absent and each
    fallback field present with another valid value: a fallback transformers does not read (Gemma 2's hidden_act
    beside hidden_activation) must not change the spec's value; (3) the field absent and the heads or the hidden
    size doubled: a constant default and one computed from them differ only there."""
    import transformers

    from xllm_gen.codegen.compiler import compile_spec
    cls = getattr(transformers, plan.family.architecture).config_class
    base = cls().to_dict()
    config = F.generated_model(plan.spec).Config
    wrong = []
    for f in compile_spec(plan.spec.path).ir.config:      # the symbols read from config.json
        if f.expr is not None or f.present or not f.paths:
            continue
        name, typ, paths, values = f.name, f.type, list(f.paths), tuple(f.values or ())
        field = paths[0]
        if "." in field or typ == "rope" or field not in base or field in NOT_MATH:
            continue
        if (plan.spec.name, name) in SAME_MEANING:
            continue
        hf = {k: v for k, v in base.items() if k != field}
        hf["architectures"] = [plan.family.architecture]
        wrong.append(_mismatch(cls, config, hf, field, name, f"{field} absent"))
        for alias in paths[1:]:
            if "." in alias or alias in NOT_MATH:
                continue
            other = _other(base.get(alias, base[field]), typ, values)
            if other is not None:
                wrong.append(_mismatch(cls, config, {**hf, alias: other}, field, name,
                                       f"{field} absent, {alias} = {other!r}"))
        for size in SIZES:      # (3) a size another default may be computed from, doubled: constant or computed?
            if size != field and size not in paths and isinstance(base.get(size), int):
                wrong.append(_mismatch(cls, config, {**hf, size: base[size] * 2}, field, name,
                                       f"{field} absent, {size} = {base[size] * 2}"))
    wrong = [w for w in wrong if w]
    assert not wrong, f"{plan.spec.rel}: " + "; ".join(wrong)
