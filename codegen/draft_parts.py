"""Where a checkpoint keeps the decoder's parts, and its fused q/k/v's row layout, for `xllm-gen draft` (codegen/draft.py):

  - the embedding and the output head are the modules the transformers model returns from `get_input_embeddings()` /
    `get_output_embeddings()` (built on the meta device), whatever they are named (GPT-NeoX's `gpt_neox.embed_in` and
    `embed_out`); with the decoder layers' stack (`transformer.h.{i}.`) and the final norm they become the spec's
    `checkpoint_prefixes` where they are not `model.embed_tokens` / `model.layers` / `model.norm` / `lm_head`;
  - a fused q/k/v's row layout and the attention's KV head count, found by running the attention (draft_qkv.py), become
    the `weights` entry's `layout` and the attention's `kv_heads`, with the symbols of the config fields it reads.
"""
from __future__ import annotations

import re

from .draft_qkv import LayoutIf, probe_qkv
from .draft_source import add_symbol


def model_parts(cls, config) -> dict:
    """{"embed": module name, "lm_head": module name} of the model built on the meta device, as the checkpoint names
    them (transformers' own renaming at load reverted: GPT-NeoX's head is `lm_head` in memory, `embed_out` saved)."""
    from .draft_moe import build_meta
    keep: dict = {}
    try:
        _, params, renamed, _ = build_meta(cls, config, 2, keep)
    except Exception:  # noqa: BLE001 - the draft's own meta build reports why
        return {}
    model = keep["model"]
    by_id = {id(m): n for n, m in model.named_modules()}
    out = {"shapes": {re.sub(r"\.0\.", ".{i}.", n, count=1): sh for n, sh in params.items()}}
    for key, get in (("embed", "get_input_embeddings"), ("lm_head", "get_output_embeddings")):
        try:
            mod = getattr(model, get)()
        except Exception:  # noqa: BLE001 - a model without the accessor
            continue
        name = by_id.get(id(mod)) if mod is not None else None
        if name:
            out[key] = renamed.get(name + ".weight", name + ".weight").rsplit(".", 1)[0]
            out[key + "_memory"] = name
    return out


def prefix_lines(layer, parts: dict) -> list:
    """`checkpoint_prefixes` lines where the checkpoint names the decoder's parts otherwise than the spec's model."""
    stack = layer.prefix.split("{i}")[0]
    pairs = [("lm_head.", parts.get("lm_head"))]
    if stack != "model.layers.":        # else the final norm's `weights` entries (draft_render.py)
        pairs = [("model.embed_tokens.", parts.get("embed")), ("model.norm.", layer.final_norm),
                 ("model.layers.", stack.rstrip("."))] + pairs
    lines = [f"  {a}: {b}." for a, b in pairs if b and b + "." != a]
    return ["", "checkpoint_prefixes:"] + lines if lines else []


def fused_qkv(d, layer, cls, config, defaults: dict) -> None:
    """layer.qkv_layout / layer.kv_heads of a fused q/k/v (draft_qkv.py), the symbols kv_heads reads, and the config's
    own KV-head field ignored where the attention does not read it."""
    if not layer.qkv_fused:
        return
    fields = set(d.config) | set(defaults)
    found = probe_qkv(cls, config, layer.prefix, layer.rel(layer.qkv_fused), layer.rel(layer.attn_mod), fields)
    if found is None:
        return
    layer.qkv_layout = found.layout
    if found.layout:        # the assumed order replaced by the one read
        how = {"tensor": "[q | k | v] stacked", "head": "per head [h0: q k v, ...]",
               "kv_group": "per KV group [g0: q * (heads / kv_heads), k, v, ...]"}
        if isinstance(found.layout, LayoutIf):     # a layout chosen by a flag: the flag becomes a symbol
            add_symbol(d, found.layout.flag, defaults, type(config))
            text = (f"{how[found.layout.then]} where {found.layout.flag}, {how[found.layout.else_]} where not "
                    f"(`layout: {{if: {found.layout.flag}, ...}}`)")
        else:
            text = how[found.layout]
        d.checklist[:] = [f"the checkpoint stores q/k/v fused in `{layer.rel(layer.qkv_fused)}`: {text}, read by "
                          f"running the attention on its rows (every combination of the attention's bool flags)"
                          if c.startswith("the checkpoint stores q/k/v fused") else c for c in d.checklist]
    if found.kv_heads is None or found.kv_heads == "num_key_value_heads":
        return
    layer.kv_heads = found.kv_heads
    for f in sorted(found.fields - set(d.symbols)):
        dv = defaults.get(f)
        if isinstance(dv, int) and not isinstance(dv, bool) and _follows_heads(type(config), f):
            d.symbols[f] = f"{{type: int, from: [{f}, num_attention_heads]}}"     # absent: as many as the heads
        else:
            add_symbol(d, f, defaults, type(config))
    if "num_key_value_heads" in d.symbols and "num_key_value_heads" not in found.fields:
        del d.symbols["num_key_value_heads"]
        if "num_key_value_heads" in defaults:
            d.ignore.append("num_key_value_heads")
            d.checklist.append(f"the attention reads its KV heads as `{found.kv_heads}`, not config field "
                               f"num_key_value_heads (ignored: check the class derives it from those)")


def _follows_heads(config_cls, f: str) -> bool:
    """The class fills an absent `f` with num_attention_heads (Falcon's num_kv_heads)."""
    try:
        return all(getattr(config_cls(num_attention_heads=h, **{f: None}), f) == h for h in (3, 5))
    except Exception:  # noqa: BLE001 - a class that cannot be built so
        return False


def mlp_width(d, layer, config_cls, defaults: dict) -> None:
    """Where the config has no `intermediate_size`: the int field whose value is the MLP's width (the up projection's
    rows, Falcon's ffn_hidden_size), read as `intermediate_size`, its null / absent value what the class computes."""
    if not layer.up or "intermediate_size" in defaults or layer.gate_up_fused:
        return
    rows = layer.parts.get("shapes", {}).get(layer.up + ".weight", (None,))[0]
    hits = [f for f, v in d.config.items() if v == rows and isinstance(v, int) and not isinstance(v, bool)
            and f not in d.symbols and f not in ("hidden_size", "vocab_size")]
    if rows is None or len(hits) != 1:
        return
    f = hits[0]
    try:
        h = defaults["hidden_size"]
        none_is = getattr(config_cls(**{f: None, "hidden_size": h * 2}), f) // (h * 2)
    except Exception:  # noqa: BLE001 - a class that cannot be built so
        none_is = None
    fill = (f'default_expr: "{none_is} * hidden_size", if_null: "{none_is} * hidden_size"' if
            isinstance(none_is, int) and none_is * h == defaults.get(f) else f"default: {defaults.get(f)}")
    d.symbols["intermediate_size"] = f"{{type: int, from: {f}, {fill}}}"
    d.sources["intermediate_size"] = f
    d.checklist[:] = [c for c in d.checklist if not c.startswith("no `intermediate_size` field")]
