"""Reading the modeling source for `xllm-gen draft` (codegen/draft.py): Python expressions over `config` translated into
spec expressions, config symbols with the class's defaults, and the MiniCPM / Granite-style scalings (embedding,
residual branches, logits) found where the modeling code applies them.

The translation is the modeling code's own arithmetic: `config.X` / `self.config.X` -> the symbol X, `self.attr` -> the
expression the class's `__init__` assigns to it, `layer_idx` -> `layer`, `math.sqrt(x)` -> `x ** 0.5`; anything else
(a module call, an attribute of another object) makes the translation fail (None), and the draft says so on its
checklist rather than guess.
"""
from __future__ import annotations

import ast
import inspect
import re
import textwrap

LAYER_NAMES = ("layer_idx", "layer_id", "layer_index", "layer_number")


def class_source(obj) -> str:
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return ""


def self_assignments(src: str) -> dict[str, ast.expr]:
    """{attr: value expression} of every `self.attr = value` in `src` (the last one wins)."""
    out: dict[str, ast.expr] = {}
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return out
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            t = node.targets[0]
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out[t.attr] = node.value
    return out


class _Untranslatable(Exception):
    pass


def translate(node: ast.expr | str, attrs: dict | None = None, fields: set | None = None) -> tuple[str, set] | None:
    """(spec expression text, the config fields it reads) of a Python expression of the modeling code, or None where it
    reads something that is not config arithmetic. `attrs`: {self attribute: its assigned expression}; `fields`: the
    config fields that exist (a name outside it fails)."""
    attrs = attrs or {}
    used: set = set()

    def conv(n, depth=0):
        if depth > 8:
            raise _Untranslatable
        if isinstance(n, ast.Attribute):
            base = n.value
            if isinstance(base, ast.Name) and base.id == "config" or (
                    isinstance(base, ast.Attribute) and base.attr == "config" and isinstance(base.value, ast.Name)
                    and base.value.id == "self"):
                if fields is not None and n.attr not in fields:
                    raise _Untranslatable
                used.add(n.attr)
                return ast.Name(n.attr, ast.Load())
            if isinstance(base, ast.Name) and base.id == "self":
                if n.attr in LAYER_NAMES:
                    return ast.Name("layer", ast.Load())
                if n.attr in attrs:
                    return conv(attrs[n.attr], depth + 1)
            raise _Untranslatable
        if isinstance(n, ast.Name):
            if n.id in LAYER_NAMES:
                return ast.Name("layer", ast.Load())
            if n.id in ("True", "False", "None"):
                return n
            raise _Untranslatable
        if isinstance(n, ast.Call):
            f = n.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if fname == "sqrt" and len(n.args) == 1:
                return ast.BinOp(conv(n.args[0], depth + 1), ast.Pow(), ast.Constant(0.5))
            if fname in ("float", "int", "min", "max", "len", "bool") and isinstance(f, ast.Name):
                return ast.Call(f, [conv(a, depth + 1) for a in n.args], [])
            raise _Untranslatable
        if isinstance(n, ast.Constant):
            return n
        if isinstance(n, (ast.BinOp,)):
            return ast.BinOp(conv(n.left, depth + 1), n.op, conv(n.right, depth + 1))
        if isinstance(n, ast.UnaryOp):
            return ast.UnaryOp(n.op, conv(n.operand, depth + 1))
        if isinstance(n, ast.BoolOp):
            return ast.BoolOp(n.op, [conv(v, depth + 1) for v in n.values])
        if isinstance(n, ast.Compare):
            return ast.Compare(conv(n.left, depth + 1), n.ops, [conv(c, depth + 1) for c in n.comparators])
        if isinstance(n, ast.Subscript):
            return ast.Subscript(conv(n.value, depth + 1), conv(n.slice, depth + 1), ast.Load())
        if isinstance(n, ast.IfExp):
            return ast.IfExp(conv(n.test, depth + 1), conv(n.body, depth + 1), conv(n.orelse, depth + 1))
        if isinstance(n, (ast.Tuple, ast.List)):
            return type(n)([conv(e, depth + 1) for e in n.elts], ast.Load())
        raise _Untranslatable

    try:
        if isinstance(node, str):
            node = ast.parse(node.strip(), mode="eval").body
        out = conv(node)
    except (_Untranslatable, SyntaxError):
        return None
    return ast.unparse(ast.fix_missing_locations(out)).replace('"', "'"), used


def _yaml(v) -> str:
    from .draft_render import _yaml_scalar
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_yaml_scalar(x) for x in v) + "]"
    return _yaml_scalar(v)


def _layer_derived(config_cls, f: str, value) -> str | None:
    """The default_expr of a field the class computes from num_hidden_layers when it is absent (a list of a prefix and
    a repeated item, Glm4MoeLite's mlp_layer_types; an int at a fixed offset, ERNIE's moe_layer_end_index), else None."""
    try:
        by = {n: getattr(config_cls(num_hidden_layers=n), f) for n in (3, 5, 7)}
    except Exception:  # noqa: BLE001 - a class that cannot be built so
        return None
    if len({repr(v) for v in by.values()}) == 1:
        return None
    if all(isinstance(v, int) and not isinstance(v, bool) for v in by.values()):
        off = {v - n for n, v in by.items()}
        if len(off) == 1:
            o = off.pop()
            return "num_hidden_layers" + (f" + {o}" if o > 0 else f" - {-o}" if o < 0 else "")
    if all(isinstance(v, list) and len(v) == n and v for n, v in by.items()):
        firsts = {v[0] for v in by.values()}
        heads = {sum(1 for x in v if x == v[0]) if len(set(v)) == 1 else v.index(next(x for x in v if x != v[0]))
                 for v in by.values()}
        rests = {x for v in by.values() for x in v if x != v[0]}
        if len(firsts) == 1 and len(heads) == 1 and len(rests) == 1:
            a, k, b = firsts.pop(), heads.pop(), rests.pop()
            if all(v == [a] * k + [b] * (n - k) for n, v in by.items()):
                return f"[{a!r} if i < {k} else {b!r} for i in range(num_hidden_layers)]"
    return None


def add_symbol(d, f: str, defaults: dict, config_cls, **extra) -> None:
    """A symbol reading config field `f` (typed by its value, the class's default: a constant, or the formula the class
    computes from the layer count), unless one exists. `extra`: more keys (min, ...)."""
    if f in d.symbols:
        return
    v = d.config.get(f, defaults.get(f))
    dv = defaults.get(f, v)
    if isinstance(v, bool):
        typ = "bool"
    elif isinstance(v, int):
        typ = "int"
    elif isinstance(v, float):
        typ = "float"
    elif isinstance(v, str):
        typ = "str"
    elif isinstance(v, (list, tuple)) and v and all(isinstance(x, str) for x in v):
        typ = "str_tuple"
    elif isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v):
        typ = "int_tuple"
    elif isinstance(v, (list, tuple)):
        typ = "float_tuple"
    else:
        typ = "float"
    ann = {}
    for k in reversed(getattr(config_cls, "__mro__", ())):
        ann.update(getattr(k, "__annotations__", {}))
    if typ == "int" and "float" in str(ann.get(f, "")):      # `int | float` (MiniCPM3's scale_emb): read a float
        typ = "float"
    if typ == "float" and isinstance(dv, int) and not isinstance(dv, bool):
        dv = float(dv)
    derived = _layer_derived(config_cls, f, dv) if config_cls is not None else None
    if derived is None and isinstance(v, (list, tuple)) and config_cls is not None:
        from .draft_config_lists import read_list_default  # the class's own computation of the list

        if read_list_default(d, f, defaults, config_cls, typ):
            return
    default = f'default_expr: "{derived}"' if derived else f"default: {_yaml(dv)}"
    if typ == "str":
        default += f", values: [{_yaml(dv)}" + (f", {_yaml(v)}]" if v != dv else "]")
    if typ in ("int", "float") and config_cls is not None:     # a null the class computes (MiniCPM3's scale_depth)
        m = re.search(rf"if self\.{f} is None:\s*\n\s*self\.{f}\s*=\s*(.+)", class_source(config_cls))
        t = translate(m.group(1).replace("self.", "config."), {}, set(d.config) | set(defaults)) if m else None
        if t is not None:
            extra = {"if_null": f'"{t[0]}"', **extra}
    more = "".join(f", {k}: {x}" for k, x in extra.items())
    d.symbols[f] = f"{{type: {typ}, from: {f}, {default}{more}}}"


# ---- MiniCPM / Granite-style scalings: embedding, residual branches, logits -------------------------------------

def _scaled_by(src: str, subject: str, attrs: dict, fields: set):
    """[(op, spec expression, fields)] of `<subject> * X` / `<subject> / X` in src, X translated."""
    out = []
    for m in re.finditer(rf"{subject}\s*([*/])\s*(self\.[\w.]+|config\.\w+|\([^()\n]*\))", src):
        t = translate(m.group(2), attrs, fields)
        if t is not None:
            out.append((m.group(1), *t))
    return out


def meta_model(cls, config, layers: int = 2, **changes):
    """The HF model on the meta device with `layers` decoder layers (None where it does not build)."""
    import copy

    import torch
    cfg = copy.deepcopy(config)
    if hasattr(cfg, "num_hidden_layers"):
        cfg.num_hidden_layers = layers
        if isinstance(getattr(cfg, "layer_types", None), list):
            cfg.layer_types = (cfg.layer_types * layers)[:layers]
    for k, v in changes.items():
        setattr(cfg, k, v)
    try:
        with torch.device("meta"):
            return cls(cfg)
    except Exception:  # noqa: BLE001 - the draft's own meta build reports why
        return None


def find_scalings(d, cls, config, layer_prefix: str, defaults: dict) -> None:
    """Fill d.scales {embed, residual, logit: expression} from the modeling source: the embedding module built with an
    `embed_scale=` (or the embeddings multiplied in the model's forward), the decoder layer's `residual + h * S` on
    its branches, the causal-LM head's `hidden_states / S` or `logits * S` before / after lm_head."""
    fields = set(d.config) | set(defaults) | {p for p in dir(type(config)) if isinstance(getattr(type(config), p, None),
                                                                                      property)}
    config_cls = type(config)

    def prop(name: str):      # a config property's body (MiniCPM3's logits_scaling = hidden_size / dim_model_base)
        p = getattr(config_cls, name, None)
        if isinstance(p, property):
            m = re.search(r"return (.+)", class_source(p.fget))
            t = translate(m.group(1).replace("self.", "config."), {}, set(d.config) | set(defaults)) if m else None
            return t
        return None

    def expr_of(text: str, used: set):
        """text with config properties expanded; the fields read get symbols."""
        for f in sorted(used):
            if f not in d.config and f not in defaults:
                p = prop(f)
                if p is None:
                    return None
                text = re.sub(rf"\b{f}\b", f"({p[0]})", text)
                used = (used - {f}) | p[1]
        for f in sorted(used):
            add_symbol(d, f, defaults, config_cls)
        return text

    model_meta = meta_model(cls, config)
    if model_meta is None:
        return
    inner = model_meta.get_submodule(layer_prefix.split(".{i}")[0].rsplit(".", 1)[0]) if "." in layer_prefix else None
    layer = model_meta.get_submodule(layer_prefix.replace("{i}", "0").rstrip("."))
    # the embedding
    embed = getattr(inner, "embed_tokens", None) if inner is not None else None
    msrc = class_source(type(inner)) if inner is not None else ""
    m = re.search(r"embed_scale\s*=\s*([^,)\n]+(?:\*\*\s*[\d.]+)?)", msrc)
    if embed is not None and m and hasattr(embed, "embed_scale"):
        t = translate(m.group(1), self_assignments(msrc), fields)
        e = expr_of(*t) if t else None
        if e:
            d.scales["embed"] = e
        else:
            d.checklist.append(f"the embedding is scaled by `{m.group(1).strip()}`: set embed_tokens `scale`")
    else:
        s = _scaled_by(msrc, r"inputs_embeds", self_assignments(msrc), fields)
        if s and s[0][0] == "*":
            e = expr_of(s[0][1], s[0][2])
            if e:
                d.scales["embed"] = e
    # the residual branches
    lsrc = class_source(type(layer))
    s = _scaled_by(lsrc, r"residual\s*\+\s*hidden_states", self_assignments(lsrc), fields)
    if s:
        if len(s) == 2 and s[0][:2] == s[1][:2]:
            e = expr_of(s[0][1] if s[0][0] == "*" else f"1.0 / ({s[0][1]})", s[0][2])
            if e:
                d.scales["residual"] = e
        else:
            d.checklist.append(f"the decoder layer scales {len(s)} residual branch(es) ({', '.join(x[0] + ' ' + x[1] for x in s)}): "
                               f"set the dataflow steps' `scale`")
    # the logits
    csrc = class_source(cls)
    s = [x for x in _scaled_by(csrc, r"(?:hidden_states|logits)", self_assignments(csrc), fields)
         if not any("softcap" in f for f in x[2])]      # soft-capping (its own checklist item), not a scale
    if len(s) == 1:
        e = expr_of(s[0][1] if s[0][0] == "*" else f"1.0 / {s[0][1]}", s[0][2])
        if e:
            d.scales["logit"] = e
    elif s:
        d.checklist.append("the causal-LM head scales the hidden states / logits more than once: set lm_head "
                           "`logit_scale` by hand")
    for key, sym in (("residual", "residual_scale"), ("logit", "logit_scale"), ("embed", "embed_scale")):
        e = d.scales.get(key)
        if e is not None and not re.fullmatch(r"\w+", e):
            d.symbols[sym] = f'{{type: float, expr: "{e}"}}'
            d.scales[key] = sym


def drop_answered_hints(d) -> None:
    """The source hints (draft_checklist.SOURCE_HINTS) the drafted scalings answer."""
    keep = []
    for item in d.checklist:
        if item.startswith("the embedding output is scaled") and "embed" in d.scales:
            continue
        if item.startswith("a residual or logit scaling") and {"residual", "logit"} & set(d.scales):
            continue
        keep.append(item)
    d.checklist[:] = keep


# ---- the class's defaults of the head counts (draft.py _config_symbols) ------------------------------------------

def _fixed_default(config_cls, field: str):
    """The config class's default of `field` when it is a constant (not computed from num_attention_heads: a class
    built with twice the heads keeps it), else None: what an absent field means to transformers."""
    try:
        base = config_cls().to_dict()
        heads = base["num_attention_heads"]
        probe = config_cls.from_dict({"num_attention_heads": heads * 2}).to_dict()
    except Exception:  # noqa: BLE001 - a class that cannot be built with defaults: no constant to state
        return None
    value = base.get(field)
    return value if isinstance(value, int) and not isinstance(value, bool) and probe.get(field) == value else None


def _if_null(config_cls, field: str) -> str:
    """`, if_null: ...` where the class computes an explicit null of `field` from the heads (Qwen3Config:
    num_key_value_heads absent is 32, null is num_attention_heads; head_dim null is hidden / heads)."""
    # (the if_null, its value, the size moved so that it differs from the class default)
    formula, value, size = {
        "num_key_value_heads": ("num_attention_heads", lambda c: c["num_attention_heads"], "num_attention_heads"),
        "head_dim": ('"hidden_size // num_attention_heads"', lambda c: c["hidden_size"] // c["num_attention_heads"],
                     "hidden_size")}[field]
    try:
        base = config_cls().to_dict()
        probe = {**base, field: None, size: base[size] * 2}
        if getattr(config_cls.from_dict(probe), field) == value(probe):
            return f", if_null: {formula}"
    except Exception:  # noqa: BLE001 - a class that cannot be built so: the null stays refused by the reader
        pass
    return ""
