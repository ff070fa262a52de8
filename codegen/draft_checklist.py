"""What `xllm-gen draft` (codegen/draft.py) cannot infer and a person must decide: the config fields no symbol reads
(ignored, assumed at their default, or put on the checklist), hints from the modeling file's source, and layer
parameters the draft maps to nothing. Each adds to the Draft's assume / ignore / checklist."""
from __future__ import annotations

import inspect
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .draft import Draft, _Layer

IGNORE_WORDS = ("dropout", "pdrop", "initializer", "output_router_logits", "router_aux_loss_coef",
                "router_jitter_noise", "z_loss")


def other_fields(d: Draft, full: dict, controls: dict) -> None:
    """Every field no symbol reads: ignored (dropouts, init), assumed at its default, or on the checklist."""
    from xllm_gen.runtime.loading.hf_config import GENERIC_FIELDS
    read = set(d.symbols) | set(d.sources.values()) | {"rope_parameters", "rope_scaling", "rope_theta",
                                                        "num_key_value_heads"}
    for key, value in sorted(full.items()):
        if key in read or key in GENERIC_FIELDS or key in d.symbols or key in d.ignore:
            continue
        low = key.lower()
        if any(w in low for w in IGNORE_WORDS):
            d.ignore.append(key)
        elif isinstance(value, (bool, int, float, str)) and not isinstance(value, (list, dict)):
            adds = sorted(n for n, f in controls.items() if f == key)
            if adds and all(n.endswith(".bias") for n in adds):
                continue    # a bias flag: the projections read it (draft.py _render's bias_flag)
            d.assume[key] = value
            if adds:        # a flag that adds or removes other parameters (qk_layernorm, ...): not wired by the draft
                d.checklist.append(f"config field `{key}` = {value!r} is assumed (config_assume), but flipping it "
                                   f"changes the parameters ({', '.join(adds[:3])}"
                                   f"{', ...' if len(adds) > 3 else ''}): model them and read it as a symbol if the "
                                   f"released checkpoints set it")
            elif key != "pretraining_tp":
                d.checklist.append(f"config field `{key}` = {value!r} is assumed (config_assume): find what it "
                                   f"changes in the modeling file; read it as a symbol if the blocks must use it")
        elif value is None:
            d.checklist.append(f"config field `{key}` (default null) is not modeled: a checkpoint that sets it is "
                               f"refused by the config guard; model it if the released checkpoints set it")
        elif isinstance(value, list) and value:
            d.checklist.append(f"config field `{key}` (a list, e.g. {str(value[:4])[:-1]}, ...]) is not modeled: "
                               f"per-layer values (layer_types, windows, no-rope layers) need symbols and "
                               f"`layer` expressions")
        elif isinstance(value, dict) and value:
            d.checklist.append(f"config field `{key}` (a mapping) is not modeled")


# (pattern in the modeling file's source, checklist item)
SOURCE_HINTS = [
    (r"x\[\.\.\., *0::2\]|x\[\.\.\., *::2\]", "the modeling file's rotate_half is interleaved (rotate-every-two, "
                                              "GPT-J layout): the draft's neox rotary is wrong for it"),
    (r"1(\.0)? \+ self\.weight|self\.weight \+ 1(\.0)?\b", "a norm scales by (1 + weight): set weight_offset: 1 on "
                                                         "the norms"),
    (r"softcap", "the modeling file soft-caps logits: attention `softcap` / lm_head `softcap`"),
    (r"sliding_window", "the modeling file uses a sliding window: attention `sliding_window` (per layer?)"),
    (r"normalizer|embed_scale|\* *self\.config\.hidden_size *\*\* *0\.5|embedding_multiplier",
     "the embedding output is scaled: embed_tokens `scale`"),
    (r"residual_multiplier|logits_scaling|logit_scale", "a residual or logit scaling: dataflow `scale` / lm_head"),
    (r"clip_qkv|clamp_\(", "q/k/v activations are clipped"),
    (r"q_norm|k_norm|qk_norm|q_layernorm", "q/k norms appear in the modeling file"),
    (r"parallel_residual|parallel_attn", "a parallel-residual dataflow appears in the modeling file"),
]


def source_hints(d: Draft, cls) -> None:
    model_src = inspect.getsource(inspect.getmodule(cls))
    for pattern, hint in SOURCE_HINTS:
        if re.search(pattern, model_src):
            d.checklist.append(hint)


def unused_parameters(d: Draft, names: set, layer: _Layer) -> None:
    """Layer parameters the draft maps to nothing (the loader refuses a checkpoint with unused tensors)."""
    used = {m for m in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down, layer.qkv_fused,
                        layer.gate_up_fused, layer.attn_norm, layer.mlp_norm) if m}
    unused = sorted(layer.rel(n) for n in names if n.startswith(layer.prefix) and n.rsplit(".", 1)[0] not in used
                    and n.rsplit(".", 1)[0] not in layer.extra_norms + layer.inner_norms)
    if unused:
        d.checklist.append(f"layer parameters the draft does not use: {', '.join(unused[:8])}"
                           f"{', ...' if len(unused) > 8 else ''}: model them (the loader refuses unused tensors)")
