"""The multi-head latent attention (MLA) part of `xllm-gen draft` (codegen/draft.py): DeepSeek-V2 / V3 and the families
built on their attention (Kimi, GLM-4-MoE-Lite, Youtu, MiniCPM3, ...), found by what the model *is*, not by its name:

  - detection: the config class has `kv_lora_rank` and a decoder layer of the HF model built on the meta device holds
    a `kv_a_proj_with_mqa` and a `kv_b_proj` (the compressed KV latent and its per-head expansion);
  - the block: `mla_attention` with transformers' module names (q_proj, or q_a_proj / q_a_layernorm / q_b_proj;
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; the output projection found), `q_lora_rank` read as an optional
    symbol (null: a direct q_proj, as DeepSeek-V2-Lite), the four head sizes as symbols checked against the
    parameter shapes;
  - from the attention class's source: the rotary layout of the rope dims (the rotary function it calls:
    interleaved pairs, or `rotate_half` halves, or chosen by a config flag such as `rope_interleave`), the softmax
    scale (yarn's mscale folded in by `yarn_apply_mscale` / `mscale_all_dim`: `scale_mscale: true`, and yarn
    admitted), the latent norms' eps; what it cannot map (other scale attributes, a rope-first split, extra modules)
    goes on the checklist.
"""
from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass, field

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# the modules of the block (relative to the attention module); the output projection is found by name
MLA_MODULES = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")
OUT_NAMES = ("o_proj", "out_proj", "dense", "wo")
# the rope types the runtime computes as transformers does (codegen/resolver_config.py HF_ROPE_TYPES)
RUNTIME_ROPE = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


@dataclass
class MLA:
    module: str                         # "model.layers.{i}.self_attn" (full, with {i})
    o: str                              # the output projection, full module name
    low_rank_q: bool                    # in the default config's model
    attn_cls: type | None
    owned: set = field(default_factory=set)     # parameter names ({i}) of the block
    layout: str = "neox"                # interleaved | neox | the `rope_layout` symbol
    mscale: bool = False
    latent_eps: str | None = None       # None: the block's default 1e-6


def find_mla(d, cls, config, names: set, layer_prefix: str) -> MLA | None:
    """The MLA of the decoder layers at `layer_prefix`, or None where the layers hold no latent KV projections."""
    if "kv_lora_rank" not in config.to_dict():
        return None
    kv_a = sorted(n for n in names if n.startswith(layer_prefix) and n.endswith(".kv_a_proj_with_mqa.weight"))
    if not kv_a:
        return None
    module = kv_a[0][: -len(".kv_a_proj_with_mqa.weight")]
    if f"{module}.kv_b_proj.weight" not in names:
        return None
    inside = {n for n in names if n.startswith(module + ".")}
    o = next((f"{module}.{o}" for o in OUT_NAMES if f"{module}.{o}.weight" in inside), None)
    if o is None:
        from .draft import DraftError
        raise DraftError(f"{d.architecture}: multi-head latent attention at {module} without an output projection "
                         f"(tried {', '.join(OUT_NAMES)})")
    known = {f"{module}.{m}" for m in MLA_MODULES} | {o}
    owned = {n for n in inside if n.rsplit(".", 1)[0] in known}
    mla = MLA(module, o, f"{module}.q_a_proj.weight" in names, _attention_class(cls, config, module), owned)
    extra = sorted(n[len(module) + 1:] for n in inside - owned)
    if extra:
        d.checklist.append(f"the latent attention holds parameters the draft does not map: {', '.join(extra[:6])}"
                           f"{', ...' if len(extra) > 6 else ''} (an output gate `out_gate`, an `indexer`, a "
                           f"`rope_key_norm`, sinks?): model them")
        mla.owned |= inside     # named once, here (not again as unused layer parameters)
    return mla


def _attention_class(cls, config, module: str):
    """The class of the attention module (the model built on the meta device with one layer)."""
    import copy

    import torch
    cfg = copy.deepcopy(config)
    if hasattr(cfg, "num_hidden_layers"):
        cfg.num_hidden_layers = 1
        if isinstance(getattr(cfg, "layer_types", None), list):
            cfg.layer_types = cfg.layer_types[:1]
    try:
        with torch.device("meta"):
            model = cls(cfg)
        return type(model.get_submodule(module.replace("{i}", "0")))
    except Exception:  # noqa: BLE001 - the source hints are then not read (on the checklist)
        return None


def _fn_layout(module, name: str) -> str | None:
    """interleaved / neox from the source of the rotary function `name` of the modeling module (the module's text: a
    function a kernel decorator wrapped has no source of its own); None where it cannot tell."""
    try:
        m = re.search(rf"\ndef {name}\(.*?(?=\n(?:def |class |@)|\Z)", inspect.getsource(module), re.S)
    except (OSError, TypeError):
        return None
    if m is None:
        return None
    src = re.sub(r'"""(.*?)"""', "", m.group(0), flags=re.S)       # not the docstring's words
    if re.search(r"view_as_complex|\[\.\.\., *0?::2\]|\[\.\.\., *1::2\]|interleave", src):
        return "interleaved"
    if "rotate_half" in src:
        return "neox"
    return None


def _init_call(src: str, attr: str) -> tuple[str, str] | None:
    """(callee, argument text) of `self.<attr> = Callee(args)` in `src`."""
    m = re.search(rf"self\.{attr}\s*=\s*\(?\s*([\w.]+)\(([^()]*(?:\([^()]*\)[^()]*)*)\)", src)
    return (m.group(1), m.group(2)) if m else None


def mla_symbols(d, mla: MLA, defaults: dict, config_cls) -> None:
    """The MLA's config symbols (sizes, q_lora_rank optional, the rope layout flag, guards) and what the attention
    class's source says about rotary, scale and latent norms; its checklist items."""
    module_src = sys.modules.get(mla.attn_cls.__module__) if mla.attn_cls is not None else None
    try:
        init_src = inspect.getsource(mla.attn_cls.__init__)
        fwd_src = inspect.getsource(mla.attn_cls.forward)
    except (OSError, TypeError, AttributeError):
        init_src = fwd_src = ""
        d.checklist.append("the attention class's source was not readable: check the rotary layout of the rope dims "
                           "and the softmax scale (`scale_mscale`) by hand")
    # the head sizes: a constant default, or the formula the class computes from None (MiniCPM3's v_head_dim)
    derived = _derived(config_cls)
    for f in MLA_FIELDS:
        if f not in defaults:
            d.checklist.append(f"no config field `{f}`: the latent attention's size is a literal; find the field")
            continue
        v = defaults[f]
        if f == "q_lora_rank":
            d.symbols[f] = "{type: int, from: q_lora_rank, optional: true" + (
                f", default: {v}" if v is not None else "") + ", min: 1}"
        elif f in derived:
            d.symbols[f] = f'{{type: int, from: {f}, default_expr: "{derived[f]}"}}'
        else:
            d.symbols[f] = f"{{type: int, from: {f}, default: {v}}}"
    amap = getattr(config_cls, "attribute_map", {}) or {}
    for alias, target in amap.items():      # GLM-4-MoE-Lite: config.json head_dim is qk_rope_head_dim
        if target in MLA_FIELDS and target in d.symbols:
            d.symbols[target] = d.symbols[target].replace(f"from: {target}", f"from: [{alias}, {target}]", 1)
    # head_dim / qk_head_dim: derived by the class from the MLA sizes (ignored), or fields of their own that must agree
    for f, expr in (("head_dim", "qk_rope_head_dim"), ("qk_head_dim", "qk_nope_head_dim + qk_rope_head_dim")):
        if f in amap:
            d.symbols.pop(f, None)
            continue
        if f not in defaults:
            d.symbols.pop(f, None)
            continue
        if _follows(config_cls, f):
            d.symbols.pop(f, None)
            d.ignore.append(f)
        else:
            d.symbols[f] = f"{{type: int, from: {f}, default: {defaults[f]}}}" if isinstance(defaults[f], int) \
                else f'{{type: int, from: {f}, default_expr: "{expr}"}}'
            d.symbols[f"{f}_agrees"] = f'{{type: int, expr: "{f} - ({expr})", min: 0, max: 0, guard: true}}'
            d.checklist.append(f"`{f}` is a config field of its own (not derived from the MLA sizes): the draft requires "
                               f"{f} == {expr} (a guard); check what the modeling code uses it for")
    if "num_key_value_heads" in d.symbols:
        d.symbols["kv_heads_equal_heads"] = ('{type: int, expr: "num_key_value_heads - num_attention_heads", '
                                             'min: 0, max: 0, guard: true}')
    # the rotary layout of the rope dims, from the functions the forward calls
    flag = next((f for f in re.findall(r"config\.(\w*interleave\w*)", fwd_src) if f in defaults), None)
    layouts = set()
    for name in dict.fromkeys(re.findall(r"\b(\w*(?:rotary|rope)\w*)\(", fwd_src)):
        lay = _fn_layout(module_src, name) if module_src is not None else None
        if lay:
            layouts.add(lay)
    if flag:
        d.symbols[flag] = f"{{type: bool, from: {flag}, default: {'true' if defaults[flag] else 'false'}}}"
        d.symbols["rope_layout"] = (f"{{type: str, expr: \"'interleaved' if {flag} else 'neox'\", "
                                    f"values: [interleaved, neox]}}")
        mla.layout = "rope_layout"
    elif len(layouts) == 1:
        mla.layout = layouts.pop()
    else:
        d.checklist.append(f"the rotary layout of the rope dims is not clear from the attention's forward "
                           f"({', '.join(sorted(layouts)) or 'no rotary function recognized'}): the draft turns "
                           f"neox halves; interleaved pairs are `layout: interleaved`")
    if re.search(r"\[self\.qk_rope_head_dim, *self\.qk_nope_head_dim\]", fwd_src):
        d.checklist.append("the forward splits q / k as [rope | nope]: the block's layout is [nope | rope]")
    # the softmax scale
    scale = re.search(r"self\.scaling\s*=\s*(.+)", init_src)
    if re.search(r"yarn_apply_mscale|mscale_all_dim", init_src):
        mla.mscale = True
    elif scale and not re.fullmatch(r"self\.qk_head_dim\s*\*\*\s*\(?-0\.5\)?", scale.group(1).strip()):
        d.checklist.append(f"the softmax scale is `{scale.group(1).strip()}`: the block's is (nope + rope) ** -0.5 "
                           f"(set `scale`)")
    for attr, expr in re.findall(r"self\.(\w*scal\w*)\s*=\s*(.+)", init_src):
        if attr != "scaling" and not expr.startswith("yarn_apply_mscale"):
            d.checklist.append(f"the attention sets `{attr} = {expr.strip()}`: a scale the draft does not apply "
                               f"(`q_scale` / `latent_scale` / `scale`?)")
    for fn in dict.fromkeys(re.findall(r"\b(\w*scal\w*)\(", fwd_src)):
        d.checklist.append(f"the attention's forward calls `{fn}`: a scale of q / the scores the draft does not apply "
                           f"(a position-dependent temperature?)")
    # the latent norms' eps: the norm class's default unless the call passes one
    call = _init_call(init_src, "kv_a_layernorm")
    if call:
        eps = re.search(r"eps\s*=\s*([\w.]+)", call[1])
        if eps and eps.group(1).startswith("config.") and eps.group(1)[7:] in d.symbols:
            mla.latent_eps = eps.group(1)[7:]
        elif eps:
            d.checklist.append(f"the latent norms' eps is `{eps.group(1)}`: set `latent_eps`")
        else:
            norm_cls = getattr(module_src, call[0], None)
            try:
                default = inspect.signature(norm_cls).parameters["eps"].default
                if isinstance(default, float) and default != 1e-6:
                    mla.latent_eps = repr(default)
            except (TypeError, ValueError, KeyError):
                d.checklist.append(f"the latent norms ({call[0]}): check their eps (`latent_eps`, default 1e-6)")
    _rope_types(d, mla)


def _derived(config_cls) -> dict:
    """{MLA field: expression} for a field whose class default is computed from the hidden size and heads (None ->
    hidden_size // num_attention_heads)."""
    out = {}
    try:
        base = config_cls().to_dict()
        probe = config_cls.from_dict({"hidden_size": base["hidden_size"] * 2}).to_dict()
    except Exception:  # noqa: BLE001
        return out
    for f in MLA_FIELDS:
        if base.get(f) is not None and probe.get(f) != base.get(f) and \
                probe.get(f) == probe["hidden_size"] // probe["num_attention_heads"]:
            out[f] = "hidden_size // num_attention_heads"
    return out


def _follows(config_cls, f: str) -> bool:
    """Whether the class computes `f` from the MLA sizes (it changes when they do)."""
    try:
        base = config_cls().to_dict()
        probe = config_cls.from_dict({"qk_rope_head_dim": base["qk_rope_head_dim"] * 2,
                                      "qk_nope_head_dim": base["qk_nope_head_dim"] * 3}).to_dict()
        return probe.get(f) != base.get(f)
    except Exception:  # noqa: BLE001
        return False


def _rope_types(d, mla: MLA) -> None:
    """The rope types admitted: default, yarn where the scale folds its mscale in (the family uses it), and the
    checkpoint's own type where the runtime models it."""
    if "rope_scaling" not in d.symbols:
        return
    rope = d.config.get("rope_parameters") or d.config.get("rope_scaling") or {}
    own = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    types = ["default"] + (["yarn"] if mla.mscale else [])
    if own in RUNTIME_ROPE and own not in types:
        types.append(own)
    d.symbols["rope_scaling"] = f"{{type: rope, from: [rope_parameters, rope_scaling], values: [{', '.join(types)}]}}"
    d.checklist[:] = [c for c in d.checklist if not c.startswith("rope types: rope_scaling admits only")]
    d.checklist.append(f"rope types: rope_scaling admits {', '.join(types)}; add the types the released checkpoints "
                       f"use")


def render_mla(d, mla: MLA, controls: dict, names: set, full: dict, max_pos: str, rel) -> list:
    """The block's lines (under `blocks:`)."""
    def flag(*mods: str) -> str:
        fl = {controls.get(f"{m}.bias") for m in mods if f"{m}.bias" in names or controls.get(f"{m}.bias")}
        fl.discard(None)
        if len(fl) > 1:
            d.checklist.append(f"the biases of {', '.join(rel(m) for m in mods)} follow different flags "
                               f"({', '.join(sorted(fl))})")
        if fl:
            f = sorted(fl)[0]
            d.symbols[f] = f"{{type: bool, from: {f}, default: {'true' if full.get(f) else 'false'}}}"
            return f
        return "true" if any(f"{m}.bias" in names for m in mods) else "false"

    m = mla.module
    bias = flag(f"{m}.q_a_proj", f"{m}.kv_a_proj_with_mqa")
    if any(f"{m}.{p}.bias" in names or controls.get(f"{m}.{p}.bias") for p in ("q_proj", "q_b_proj", "kv_b_proj")):
        d.checklist.append("q_proj / q_b_proj / kv_b_proj carry a bias: the block has none there")
    L = [f"      {rel(m)}:", "        kind: mla_attention", "        hidden: hidden_size",
         "        heads: num_attention_heads"]
    L += [f"        {f}: {f}" for f in MLA_FIELDS if f in d.symbols]
    L += [f"        bias: {bias}", f"        out: {{name: {mla.o.rsplit('.', 1)[1]}, bias: {flag(mla.o)}}}"]
    layout = "" if mla.layout == "neox" else f"layout: {mla.layout}, "
    if "rope_theta" in d.symbols:
        L.append(f"        rotary: {{kind: neox, {layout}theta: rope_theta, max_position: {max_pos}, "
                 f"scaling: rope_scaling}}")
    else:       # no rope parameters: the rope dims turn by nothing (Kimi Linear's NoPE latent attention)
        L.append(f"        rotary: {{kind: neox, theta: 10000.0, max_position: {max_pos}, enabled: false}}")
        d.checklist.append("no rope parameters in the config: the latent attention's rope dims do not turn "
                           "(`rotary.enabled: false`, NoPE); check the attention's forward")
    if mla.mscale:
        L.append("        scale_mscale: true")
    if mla.latent_eps:
        L.append(f"        latent_eps: {mla.latent_eps}")
    return L
