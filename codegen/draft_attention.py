"""The features of an ordinary (non-MLA) attention layer for `xllm-gen draft` (codegen/draft.py), read from the attention
class the decoder layer builds and from the config class, never from a family's name:

  - q/k norms: the norm modules the attention's `__init__` builds beside q/k/v/o (found in the meta model, also with
    the bool flag that adds them flipped on: GLM-4-MoE's / Cohere's `use_qk_norm`, read as `qk_norm.enabled`); per head
    (weight `[head_dim]`), over the whole projection (`[heads * head_dim]`, OLMo 2) or a weight per head (`[heads,
    head_dim]`, Cohere); rmsnorm or layernorm (the norm class's name), its eps (the call's `eps=` or the config field
    passed), a `(1 + w)` scale (`weight_offset: 1`, Gemma 3), before or after the rotary call in the forward;
  - the rotary: the layout from the rotary function the forward calls and the functions it calls (`rotate_half` over
    even / odd slices: `layout: interleaved`), the partial rotary factor the modeling code reads
    (`partial_rotary_factor`, in `rope_parameters` or at the top level: `fraction`);
  - the window: `self.sliding_window = <expr>` in `__init__` translated (the layer's type read from `layer_types`),
    with `layer_types` read as a symbol whose default is the list the config class computes (a pattern checked against
    the class at several layer counts and field values);
  - the softmax scale (`self.scaling` other than `head_dim ** -0.5`: Gemma's `query_pre_attn_scalar ** -0.5`,
    Granite's `attention_multiplier`) and a soft-cap the forward passes (`softcap=self.<attr>`).
What it cannot read goes on the checklist.
"""
from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
from dataclasses import dataclass, field

from .draft_layer_types import WINDOW, _layer_types_symbol
from .draft_mla import _attention_class, _fn_layout, _init_call
from .draft_rope_layers import rotary_enabled, with_locals
from .draft_source import add_symbol, class_source, meta_model, self_assignments, translate


@dataclass
class Attn:
    """What the draft writes into the attention block beyond projections (each None / empty where not drafted)."""
    qk_norm: str | None = None          # the `qk_norm:` flow mapping
    layout: str | None = None           # interleaved
    fraction: str | None = None         # a symbol
    window: str | None = None           # the per-layer sliding_window expression
    scale: str | None = None
    softcap: str | None = None
    clip: str | None = None
    theta: str | None = None            # per layer type (transformers 5's rope_parameters per layer type)
    scaling: str | None = None
    rope_enabled: str | None = None     # the layers that apply rotary (draft_rope_layers.py)
    weights: list = field(default_factory=list)     # `weights` lines (per-head norm lists stacked)
    answered: set = field(default_factory=set)      # checklist topics answered: qk_norm, interleaved, window, ...


def _strip_hasattr(node: ast.expr, fields: set) -> ast.expr:
    """`X if hasattr(config, "f") else Y` -> X where f is a config field (Gemma 3 / Dots1's layer_type)."""
    class T(ast.NodeTransformer):
        def visit_IfExp(self, n):
            self.generic_visit(n)
            t = n.test
            if isinstance(t, ast.Call) and isinstance(t.func, ast.Name) and t.func.id == "hasattr" and \
                    len(t.args) == 2 and isinstance(t.args[1], ast.Constant) and t.args[1].value in fields:
                return n.body
            return n
    return T().visit(node)


def _method(cls, name: str) -> str:
    """The source of method `name` as the class's text holds it (a decorator may wrap `__init__`: Dots1's kernels)."""
    src = class_source(cls)
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return ""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return textwrap.dedent(ast.get_source_segment(src, node) or "")
    return ""


def _fn_calls_layout(module, name: str, depth: int = 0) -> str | None:
    """The layout of rotary function `name`, following the functions it calls (apply_rotary_pos_emb -> rotate_half)."""
    if module is None or depth > 2:
        return None
    try:
        src = inspect.getsource(module)
    except (OSError, TypeError):
        return None
    m = re.search(rf"\ndef {name}\(.*?(?=\n(?:def |class |@)|\Z)", src, re.S)
    if m is None:
        return None
    body = re.sub(r'"""(.*?)"""', "", m.group(0), flags=re.S)
    if re.search(r"view_as_complex|\[\.\.\., *0?::2\]|\[\.\.\., *1::2\]", body):
        return "interleaved"
    inner = [f for f in dict.fromkeys(re.findall(r"\b(\w+)\(", body.split(":", 1)[-1])) if f != name
             and re.search(rf"\ndef {f}\(", src)]
    found = {lay for f in inner for lay in [_fn_calls_layout(module, f, depth + 1)] if lay}
    if "interleaved" in found:
        return "interleaved"
    return "neox" if found or _fn_layout(module, name) == "neox" else None


def find_attention(d, cls, config, layer, controls: dict, defaults: dict) -> Attn:
    """The attention features of `layer` (draft._Layer) as spec text; symbols added to `d`."""
    a = Attn()
    attn_cls = _attention_class(cls, config, layer.attn_mod)
    if attn_cls is None:
        return a
    module = sys.modules.get(attn_cls.__module__)
    init_src, fwd_src = _method(attn_cls, "__init__"), _method(attn_cls, "forward")
    fields = set(d.config) | set(defaults)
    attrs = {k: _strip_hasattr(v, fields) for k, v in with_locals(init_src, self_assignments(init_src)).items()}
    _qk_norm(d, a, cls, config, layer, controls, defaults, init_src, fwd_src)
    _window(d, a, attrs, fields, defaults, type(config))
    _window_by_mask(d, a, module, fields, defaults, type(config))
    _rotary(d, a, fwd_src, module, defaults, type(config))
    rotary_enabled(d, a, fwd_src, attrs, fields, defaults, type(config),
                   lambda: _layer_types_symbol(d, defaults, type(config)))
    _scale(d, a, init_src, fwd_src, attrs, fields, defaults, type(config))
    _clip(d, a, fwd_src, attrs, fields, defaults)
    return a


def _qk_norm(d, a: Attn, cls, config, layer, controls, defaults, init_src, fwd_src) -> None:
    mod = layer.attn_mod
    # a norm per head held as a list of modules (StableLM's `q_layernorm.norms.{h}`): module -> the list's name
    lists = {f"{mod}.{m.group(1)}": m.group(2) for n in set(controls) | {f"{x}.weight" for x in layer.inner_norms}
             for m in [re.fullmatch(re.escape(mod) + r"\.(\w*norm\w*)\.(\w+)\.0\.weight", n, re.I)] if m}
    cands = sorted({n.rsplit(".", 1)[0] for n in set(controls) | {f"{m}.weight" for m in layer.inner_norms}
                    if n.startswith(mod + ".") and n.count(".") == mod.count(".") + 2
                    and re.search(r"norm", n.rsplit(".", 2)[-2], re.I)} | set(lists))
    if not cands:
        return
    rel = [c[len(mod) + 1:] for c in cands]
    q = next((r for r in rel if r.startswith("q")), None)
    k = next((r for r in rel if r.startswith("k")), None)
    if q is None or k is None or len(rel) != 2:
        d.checklist.append(f"norms inside the attention ({', '.join(rel)}): not one q and one k norm, write `qk_norm` "
                           f"by hand")
        return
    flags = {controls.get(f"{c}.{lists[c]}.0.weight" if c in lists else f"{c}.weight") for c in cands}
    flag = flags.pop() if len(flags) == 1 else None
    qn = kn = None
    # the model as configured, else with the flag that adds the norms flipped
    for change in ({}, {flag: not d.config.get(flag, False)} if flag else None):
        model = meta_model(cls, config, 2, **change) if change is not None else None
        try:
            qn = model.get_submodule(f"{mod}.{q}".replace("{i}", "0"))
            kn = model.get_submodule(f"{mod}.{k}".replace("{i}", "0"))
            break
        except Exception:  # noqa: BLE001 - model None or the module missing
            continue
    if qn is None or kn is None:
        d.checklist.append(f"q/k norms {q}, {k}: not built on the meta device, write `qk_norm` by hand")
        return
    cfg = config.to_dict()
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    heads = cfg["num_attention_heads"]
    per_head = _norm_lists(a, layer, qn, kn, lists, f"{mod}.{q}", f"{mod}.{k}", heads, head_dim)
    if per_head:
        qn, kn = per_head
    qw, kw = getattr(qn, "weight", None), getattr(kn, "weight", None)
    if qw is None or kw is None:
        d.checklist.append(f"q/k norms {q}, {k} hold no `weight` (weightless, or per-head norm modules): write "
                           f"`qk_norm` by hand")
        return
    shape = (heads, head_dim) if per_head else tuple(qw.shape)
    over = "projection" if shape == (heads * head_dim,) else "per_head" if shape == (heads, head_dim) else \
        "head" if shape == (head_dim,) else None
    if over is None or heads * head_dim == head_dim:
        d.checklist.append(f"q norm {q} weight {list(shape)}: not [head_dim], [heads * head_dim] or [heads, head_dim]; "
                           f"write `qk_norm` by hand")
        return
    norm_cls = type(qn)
    name = norm_cls.__name__
    kind = "layernorm" if re.search(r"LayerNorm", name) and not re.search(r"RMS", name, re.I) else "rmsnorm"
    nsrc = class_source(norm_cls)
    call = _init_call(init_src, q)
    eps = None
    if call:
        m = re.search(r"eps\s*=\s*([\w.]+)", call[1]) or re.search(r",\s*(config\.\w*eps\w*)\s*$", call[1].strip())
        if m:
            eps = m.group(1)[7:] if m.group(1).startswith("config.") else m.group(1)
    if eps is None:
        eps = repr(getattr(qn, "variance_epsilon", getattr(qn, "eps", 1e-6)))
    elif eps not in d.symbols and not re.fullmatch(r"[\d.e-]+", eps):
        add_symbol(d, eps, defaults, type(config))
    parts = [f"kind: {kind}", f"eps: {eps}", f"q: {q}", f"k: {k}"]
    if over == "projection":
        parts.append("over: projection")
    elif over == "per_head":
        parts.append("weights: per_head")
    if re.search(r"1(\.0)? \+ self\.weight|self\.weight(\.float\(\))? \+ 1(\.0)?\b|\(1(\.0)? \+ self\.weight", nsrc):
        parts.append("weight_offset: 1")
    if getattr(qn, "bias", None) is not None:
        parts.append("bias: true")
    iq = re.search(rf"self\.{q}\(", fwd_src)
    ir = re.search(r"\b\w*(?:rotary|rope)\w*\(", fwd_src)
    if iq and ir and ir.start() < iq.start():
        parts.append("at: after_rotary")
    if flag:
        d.symbols[flag] = f"{{type: bool, from: {flag}, default: {'true' if defaults.get(flag) else 'false'}}}"
        parts.append(f"enabled: {flag}")
    a.qk_norm = "{" + ", ".join(parts) + "}"
    a.answered.add("qk_norm")


def _norm_lists(a: Attn, layer, qn, kn, lists: dict, qmod: str, kmod: str, heads: int, head_dim: int):
    """(the q and k norms' first per-head modules) where each is a list of one norm per head (`[head_dim]` weights, as
    many as the q / k heads), with the `weights` entries that stack them into the `[heads, head_dim]` parameter; None
    otherwise."""
    import torch.nn as nn
    if qmod not in lists or kmod not in lists:
        return None
    ql, kl = getattr(qn, lists[qmod], None), getattr(kn, lists[kmod], None)
    if not (isinstance(ql, nn.ModuleList) and isinstance(kl, nn.ModuleList) and len(ql) == heads and len(kl) >= 1
            and all(getattr(n, "weight", None) is not None and tuple(n.weight.shape) == (head_dim,)
                    for n in [*ql, *kl])):
        return None
    for m, lst in ((qmod, ql), (kmod, kl)):
        for p in ("weight", "bias") if getattr(lst[0], "bias", None) is not None else ("weight",):
            a.weights += [f"  {m}.{p}:", f"    from: {m}.{lists[m]}.{{h}}.{p}"]
        layer.inner_norms += [f"{m}.{lists[m]}.{j}" for j in range(len(lst))]      # the checkpoint's tensors: used
    return ql[0], kl[0]


def _rotary(d, a: Attn, fwd_src: str, module, defaults: dict, config_cls) -> None:
    layouts = {lay for f in dict.fromkeys(re.findall(r"\b(\w*(?:rotary|rope)\w*)\(", fwd_src))
               for lay in [_fn_calls_layout(module, f)] if lay}
    if layouts == {"interleaved"}:
        a.layout = "interleaved"
        a.answered.add("interleaved")
    elif len(layouts) > 1:
        d.checklist.append("the attention's forward calls rotary functions of both layouts: check `rotary.layout`")
    try:
        msrc = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        msrc = ""
    rope = defaults.get("rope_parameters")
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        _rope_per_type(d, a, rope)
    if "rope_theta" not in d.symbols:
        return
    if "partial_rotary_factor" in msrc:
        rope = defaults.get("rope_parameters") if isinstance(defaults.get("rope_parameters"), dict) else {}
        dv = rope.get("partial_rotary_factor", defaults.get("partial_rotary_factor"))
        dv = 1.0 if dv is None else float(dv)
        d.symbols["partial_rotary_factor"] = (f"{{type: float, from: [rope_parameters.partial_rotary_factor, "
                                              f"partial_rotary_factor], default: {dv!r}, min: 0.0, max: 1.0}}")
        d.symbols["rotary_dims"] = '{type: int, expr: "int(head_dim * partial_rotary_factor)", min: 2, guard: true}'
        a.fraction = "partial_rotary_factor"
        a.answered.add("partial")


def _rope_per_type(d, a: Attn, rope: dict) -> None:
    """transformers 5's rope parameters per layer type (Gemma 3: {full_attention: {...}, sliding_attention: {...}}): a
    theta and a rope symbol per type, chosen per layer by `layer_types` (as specs/gemma3.yaml)."""
    types = sorted(rope)
    if len(types) != 2 or "layer_types" not in d.symbols:
        d.checklist.append(f"rope_parameters is a mapping per layer type ({', '.join(types)}): read each type's theta / "
                           f"scaling and choose them per layer in `rotary` (specs/gemma3.yaml)")
        return
    for t in types:
        short = t.split("_")[0]
        theta = float(rope[t].get("rope_theta", 10000.0))
        d.symbols[f"rope_theta_{short}"] = (f"{{type: float, from: rope_parameters.{t}.rope_theta, "
                                           f"default: {theta!r}}}")
        d.symbols[f"rope_{short}"] = f"{{type: rope, from: rope_parameters.{t}, values: [default]}}"
    d.symbols.pop("rope_scaling", None)
    d.symbols["rope_theta"] = d.symbols.pop(f"rope_theta_{types[0].split('_')[0]}")     # the first type's theta
    (s0, s1) = (t.split("_")[0] for t in types)
    a.theta = f"\"rope_theta if layer_types[layer] == '{types[0]}' else rope_theta_{s1}\""
    a.scaling = f"\"rope_{s0} if layer_types[layer] == '{types[0]}' else rope_{s1}\""


def _window_default(config_cls, defaults: dict) -> str:
    """`default: N, ` of the class's window, or where the class nulls it unless a flag is set (Qwen3's
    use_sliding_window) `default_expr: "N if flag else None", `."""
    dv = defaults.get("sliding_window")
    if isinstance(dv, int):
        return f"default: {dv}, "
    for b, v in defaults.items():
        if isinstance(v, bool) and "sliding" in b:
            try:
                w = getattr(config_cls(**{b: not v}), "sliding_window", None)
            except Exception:  # noqa: BLE001 - the class refuses it: no evidence
                continue
            if isinstance(w, int):
                return f'default_expr: "{w} if {"not " if v else ""}{b} else None", '
    return ""


def _window(d, a: Attn, attrs: dict, fields: set, defaults: dict, config_cls) -> None:
    node = attrs.get("sliding_window")
    if node is None:
        return
    t = translate(node, attrs, fields)
    if t is None:
        d.checklist.append(f"the attention's window is `{ast.unparse(attrs['sliding_window'])}`: write "
                           f"`sliding_window` by hand")
        return
    expr, used = t
    for f in sorted(used):
        if f == "layer_types":
            _layer_types_symbol(d, defaults, config_cls)
        elif f == "sliding_window":
            d.symbols[f] = "{type: int, from: sliding_window, optional: true, " + _window_default(
                config_cls, defaults) + "min: 1}"
        else:
            add_symbol(d, f, defaults, config_cls)
    a.window = expr
    a.answered.add("window")


MASK_BY_TYPE = re.compile(r"""["']sliding_attention["']\]?\s*[:=]\s*create_sliding_window_causal_mask\(""")


def _window_by_mask(d, a: Attn, module, fields: set, defaults: dict, config_cls) -> None:
    """Where the model builds its masks per layer type (`"sliding_attention": create_sliding_window_causal_mask(...)`,
    the window `config.sliding_window`), the eager / sdpa window is that mask's whatever the attention's own
    `sliding_window` attribute (a flash-attention argument) says: EXAONE 4's attention holds the window on every layer,
    SmolLM3's only under use_sliding_window; the mask applies it on the layers `layer_types` marks."""
    try:
        msrc = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return
    if not MASK_BY_TYPE.search(msrc) or "sliding_window" not in fields or "layer_types" not in fields:
        return
    expr = f"sliding_window if layer_types[layer] == '{WINDOW}' else None"
    if a.window == expr:
        return
    _layer_types_symbol(d, defaults, config_cls)
    if "sliding_window" not in d.symbols:
        d.symbols["sliding_window"] = "{type: int, from: sliding_window, optional: true, " + _window_default(
            config_cls, defaults) + "min: 1}"
    a.window = expr
    a.answered.add("window")


def _scale(d, a: Attn, init_src, fwd_src, attrs, fields, defaults, config_cls) -> None:
    node = attrs.get("scaling")
    if node is not None and not re.fullmatch(r"self\.head_dim\s*\*\*\s*\(?-0\.5\)?", ast.unparse(node)):
        t = translate(node, attrs, fields)
        if t is not None:
            for f in sorted(t[1]):
                add_symbol(d, f, defaults, config_cls)
            a.scale = t[0]
        else:
            d.checklist.append(f"the softmax scale is `{ast.unparse(node)}`: set the attention's `scale`")
    m = re.search(r"softcap\w*\s*=\s*self\.(\w+)", fwd_src)
    if m and m.group(1) in attrs:
        t = translate(attrs[m.group(1)], attrs, fields)
        if t is not None and len(t[1]) == 1 and re.fullmatch(r"\w+", t[0]):
            f = t[0]
            dv = defaults.get(f)
            d.symbols[f] = "{type: float, from: " + f + ", optional: true" + (
                f", default: {float(dv)!r}" if isinstance(dv, (int, float)) else "") + ", min: 0.0}"
            a.softcap = f
            a.answered.add("softcap")


def _clip(d, a: Attn, fwd_src: str, attrs: dict, fields: set, defaults: dict) -> None:
    """q / k / v clamped right after the projections: `x.clamp_(min=-C, max=C)` with C a config field (OLMo's
    `clip_qkv`), read as an optional symbol (null: no clipping)."""
    hits = set(re.findall(r"(query|key|value)_states\.clamp_?\(min=-((?:self\.)?(?:config\.)?\w+), *max=\2\)", fwd_src))
    if {h[0] for h in hits} != {"query", "key", "value"} or len({h[1] for h in hits}) != 1:
        return
    t = translate(hits.pop()[1], attrs, fields)
    if t is None or not re.fullmatch(r"\w+", t[0]):
        return
    dv = defaults.get(t[0])
    d.symbols[t[0]] = "{type: float, from: " + t[0] + ", optional: true" + (
        f", default: {float(dv)!r}" if isinstance(dv, (int, float)) else "") + ", min: 0.0}"
    a.clip = t[0]
    a.answered.add("clip")


def attention_lines(a: Attn) -> list:
    """The attention block's extra lines (after out:), without the rotary line."""
    L = []
    if a.qk_norm:
        L.append(f"        qk_norm: {a.qk_norm}")
    if a.scale:
        L.append(f'        scale: "{a.scale}"')
    if a.softcap:
        L.append(f"        softcap: {a.softcap}")
    if a.clip:
        L.append(f"        clip_qkv: {a.clip}")
    if a.window:
        L.append(f'        sliding_window: "{a.window}"')
    return L


def rotary_keys(a: Attn) -> str:
    return (f'enabled: "{a.rope_enabled}", ' if a.rope_enabled else "") + (f"layout: {a.layout}, " if a.layout else "") + (f"fraction: {a.fraction}, " if a.fraction else "")


ANSWERS = {     # a checklist item's start -> the topic that answers it
    "norms inside a block": "qk_norm", "q/k norms appear": "qk_norm", "the modeling file's rotate_half is interleaved":
    "interleaved", "config has partial_rotary_factor": "partial", "the modeling file uses a sliding window": "window",
    "q/k/v activations are clipped": "clip", "the modeling file soft-caps logits": "softcap", "a norm scales by (1 + weight)": "offset",
}


def drop_answered(d, a: Attn, layer) -> None:
    """The checklist items the drafted attention answers (the inner norms only where all are the q/k norms)."""
    if any(not m.startswith(layer.attn_mod + ".") for m in layer.inner_norms):
        a.answered.discard("qk_norm")
    if "softcap" in d.scales:
        a.answered.add("softcap")
    if getattr(layer, "roles", None) is not None and layer.roles.offset:
        a.answered.add("offset")
    d.checklist[:] = [c for c in d.checklist if not any(c.startswith(k) and v in a.answered
                                                        for k, v in ANSWERS.items())]
