"""An absent config field means transformers' default for that family (issue 20), never "anything goes".

For every served family and every symbol its spec reads from a top-level config.json field: the field (and
only that field: a fallback path is another field, present) is removed from transformers' own default config of the class, then the
spec's value (generated Config.from_hf) must equal the config class's (`cls.from_dict`). A refusal is fine
(never served wrong). Found this way: Qwen3-Next / Qwen3.5 / Flint / Mellum computed head_dim as hidden / heads
where transformers defaults it (256 / 128: a loud shape error at load), and Cohere Compass scaled its logits by
Cohere's 0.0625 where transformers takes 1.0 (silently: greedy tokens are unchanged, every probability is not).

Default run: a few families; `--runslow`: every served family.
"""
from __future__ import annotations

import json
import re

import pytest
from conformance import families as F

# identity and generation-stop fields (the engine also reads generation_config.json), not the math
NOT_MATH = {"eos_token_id", "bos_token_id", "pad_token_id", "model_type"}

# (spec, symbol): the spec's value means what transformers' value means, spelled differently
SAME_MEANING = {
    ("bamba", "attn_layer_indices"): "() and None: no attention layer listed",
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


@pytest.mark.parametrize("plan", _plans())
def test_absent_field_is_transformers_default(plan):
    import inspect

    import transformers
    cls = getattr(transformers, plan.family.architecture).config_class
    base = cls().to_dict()
    config = F.generated_model(plan.spec).Config
    src = inspect.getsource(config.from_hf)
    wrong = []
    for m in re.finditer(r'r\.read\("(\w+)", "(\w+)", \(([^)]*)\)', src):
        name, typ = m.group(1), m.group(2)
        paths = [p.strip().strip('"') for p in m.group(3).split(",") if p.strip()]
        if "." in paths[0] or typ == "rope" or paths[0] not in base or paths[0] in NOT_MATH:
            continue
        if (plan.spec.name, name) in SAME_MEANING:
            continue
        hf = {k: v for k, v in base.items() if k != paths[0]}      # its fallbacks stay (other fields)
        hf["architectures"] = [plan.family.architecture]
        try:
            want = getattr(cls.from_dict(json.loads(json.dumps(hf))), paths[0])
        except Exception:                    # transformers cannot build it without the field: nothing to compare
            continue
        try:
            got = getattr(config.from_hf(json.loads(json.dumps(hf))), name)
        except ValueError:                   # refused by the guard: never served wrong
            continue
        same = _norm(got) == _norm(want) or (
            isinstance(want, (int, float)) and not isinstance(want, bool) and isinstance(got, (int, float))
            and not isinstance(got, bool) and float(got) == float(want))
        if not same:
            wrong.append(f"{paths[0]} absent: transformers' {cls.__name__} means {want!r}, the spec reads {name} = "
                         f"{got!r}")
    assert not wrong, f"{plan.spec.rel}: " + "; ".join(wrong)
