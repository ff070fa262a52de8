"""`layer_types` for `xllm-gen draft` (codegen/draft_attention.py): the per-layer attention kinds read as a `str_tuple`
symbol with the list the config class computes when config.json lacks it: the class's source translated
(draft_config_lists.py: SmolLM3's loop over no_rope_layers, Cohere 2 MoE's dense prefix), else one of the patterns
below checked against the class built at several layer counts and field values (Qwen3's `use_sliding_window` /
`max_window_layers`, Gemma 3's `sliding_window_pattern` keyword, a constant period), else required and on the
checklist.
"""
from __future__ import annotations

import re

from .draft_config_lists import read_list_default
from .draft_source import add_symbol, class_source

WINDOW = "sliding_attention"


def _layer_types_default(config_cls, defaults: dict) -> tuple | None:
    """(default_expr, the int field or keyword it reads, the bool field it reads) of `layer_types` as the config class
    computes it when absent: a pattern checked against the class built at several layer counts and field values."""
    src = class_source(config_cls)
    ints = [f for f, v in defaults.items() if isinstance(v, int) and not isinstance(v, bool)
            and f != "num_hidden_layers" and re.search(rf"\b{f}\b", src)]
    kwargs = [k for k in re.findall(r'kwargs\.(?:get|pop)\("(\w+)"', src) if k not in defaults]
    bools = [f for f, v in defaults.items() if isinstance(v, bool) and re.search(rf"\b{f}\b", src) and "sliding" in f]
    cands = []
    for p in ints + kwargs:
        cands.append((f"['{WINDOW}' if (i + 1) % {p} else 'full_attention' for i in range(num_hidden_layers)]",
                      p, None))
        for b in bools:
            cands.append((f"['{WINDOW}' if {b} and sliding_window is not None and i >= {p} else 'full_attention' "
                          f"for i in range(num_hidden_layers)]", p, b))
        cands.append((f"['{WINDOW}' if sliding_window is not None and i >= {p} else 'full_attention' "
                      f"for i in range(num_hidden_layers)]", p, None))
    for n in range(2, 9):       # a constant period (Gemma 2: every other layer)
        cands.append((f"['{WINDOW}' if (i + 1) % {n} else 'full_attention' for i in range(num_hidden_layers)]",
                      None, None))
    for v in ("full_attention", WINDOW):
        cands.append((f"['{v}' for i in range(num_hidden_layers)]", None, None))

    def agrees(expr, p, b) -> bool:
        for n, pv, sw, bv in ((4, 2, 16, True), (7, 3, None, True), (5, 3, 8, False), (6, 4, 32, True)):
            kw = {"num_hidden_layers": n, "sliding_window": sw, **({p: pv} if p else {}), **({b: bv} if b else {})}
            try:
                got = getattr(config_cls(**kw), "layer_types", None)
            except Exception:  # noqa: BLE001 - the class refuses these values: no evidence
                return False
            env = {"num_hidden_layers": n, "sliding_window": sw, **({p: pv} if p else {}), **({b: bv} if b else {})}
            if got != eval(expr, {"range": range, **env}):      # noqa: S307 - the draft's own expression
                return False
        return True
    for expr, p, b in cands:
        if agrees(expr, p, b):
            return expr, p, b
    return None


def _pattern_symbols(d, read: tuple, defaults: dict, config_cls) -> None:
    """Symbols of the fields a layer_types default reads; a keyword the class keeps only privately (Gemma 3's
    `sliding_window_pattern`, saved as `_sliding_window_pattern`) read under its public name with its keyword default,
    the private field ignored."""
    for f in read:
        if f is None or f in d.symbols:
            continue
        if f in defaults:
            add_symbol(d, f, defaults, config_cls)
            continue
        m = re.search(rf'kwargs\.(?:get|pop)\("{f}",\s*(\d+)\)', class_source(config_cls))
        d.symbols[f] = f"{{type: int, from: {f}" + (f", default: {m.group(1)}" if m else "") + ", min: 1}"
        if f"_{f}" in defaults and f"_{f}" not in d.ignore:
            d.ignore.append(f"_{f}")


def _layer_types_symbol(d, defaults: dict, config_cls) -> None:
    """`layer_types` read with the list the config class computes when absent: its source translated
    (draft_config_lists.py), else one of the patterns above, else required (on the checklist)."""
    if "layer_types" in d.symbols or read_list_default(d, "layer_types", defaults, config_cls, "str_tuple"):
        return
    found = _layer_types_default(config_cls, defaults)
    if found:
        d.symbols["layer_types"] = f'{{type: str_tuple, from: layer_types, default_expr: "{found[0]}"}}'
        _pattern_symbols(d, found[1:], defaults, config_cls)
    else:
        d.symbols["layer_types"] = "{type: str_tuple, from: layer_types}"
        m = re.search(r"self\.layer_types\s*=\s*([^\n]+)", class_source(config_cls))
        d.checklist.append("`layer_types` is read from config.json (required): the list the config class "
                           "computes when it is absent was not recognized"
                           + (f" (`{config_cls.__name__}`: `self.layer_types = {m.group(1).strip()[:80]}`)" if m else "")
                           + "; write its `default_expr`")
