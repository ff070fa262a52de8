"""The mixture-of-experts part of `xllm-gen draft`: finds a layer's experts, router and shared expert in the HF model
built on the meta device, the sparse layers, the config fields of their sizes, and the tensor names a checkpoint
holds them under (transformers converts some at load, e.g. per-expert tensors stacked into one; the draft maps the
names as saved, by reverting transformers' own conversion on the meta state_dict).

The routing itself (scoring, grouped top-k, scaling, renormalization) and the sparse layers' condition are read from
the modeling source by draft_routing.py (over the meta model this module keeps in `MoE.model`); what neither can tell
goes on the checklist.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .errors import SpecError

EXPERTS_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "top_k", "moe_k", "moe_topk", "top_k_experts",
                "router_top_k")
# size fields that are never an expert's width, whatever their value
NOT_WIDTHS = ("hidden_size", "vocab_size", "head_dim", "max_position_embeddings", "num_hidden_layers")
# per-expert projection names in checkpoints: (gate, up, down)
EXPERT_PROJ = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
# config fields that choose the sparse layers, as the expressions the families' modeling code uses
SPARSE_RULES = (
    (("first_k_dense_replace",), "layer >= first_k_dense_replace"),
    (("mlp_only_layers", "decoder_sparse_step"),
     "layer not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0"),
    (("num_dense_layers",), "layer >= num_dense_layers"),
    (("first_k_dense",), "layer >= first_k_dense"),
)
# values of those fields that make layer 0 dense: the probe that shows the dense layers' MLP when the default config
# has none
DENSE_PROBES = {"first_k_dense_replace": 1, "mlp_only_layers": [0], "num_dense_layers": 1, "first_k_dense": 1}


class DraftMoEError(SpecError):
    pass


@dataclass
class MoE:
    """A sparse layer's mixture of experts, as found in the meta model (module names relative to the layer)."""
    module: str                         # "mlp": the module holding router and experts
    experts: int
    hidden: int
    intermediate: int
    router: str                         # "gate", relative to `module`
    router_bias: bool
    selection_bias: bool                # <router>.e_score_correction_bias
    shared: str | None                  # "shared_expert", relative to `module`
    shared_intermediate: int | None
    shared_gate: str | None             # "shared_expert_gate", relative to `module`
    sparse_layers: list                 # of the layers built
    built_layers: int
    probe: dict = field(default_factory=dict)    # config changes under which the model shows its dense layers
    rule: str | None = None                      # the sparse layers' condition (SPARSE_RULES), where one held
    owned: set = field(default_factory=set)      # in-memory names ({i}) that belong to the MoE
    shapes: dict = field(default_factory=dict)   # a sparse layer's {name relative to the layer: shape}
    weights: list = field(default_factory=list)  # (runtime name, source: str | {segment: str}, extra keys)
    model: Any = None                            # the meta model built (its classes' source: draft_routing.py)
    routing_read: str | None = None              # what draft_routing read of the routing, for the spec's description


def _layer_names(params: dict, prefix_re: str) -> dict[int, dict[str, tuple]]:
    out: dict[int, dict[str, tuple]] = {}
    for n, shape in params.items():
        m = re.match(prefix_re + r"(\d+)\.(.+)$", n)
        if m:
            out.setdefault(int(m.group(1)), {})[m.group(2)] = shape
    return out


def build_meta(cls, config, layers: int, keep: dict | None = None, **changes):
    """The HF model on the meta device with `layers` decoder layers, its {name: shape} and the checkpoint names of
    its tensors ({in-memory name: saved name}, and the saved names transformers' conversion creates)."""
    import copy

    import torch
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = (cfg.layer_types * layers)[:layers]
    for k, v in changes.items():
        setattr(cfg, k, v)
    with torch.device("meta"):
        model = cls(cfg)
    if keep is not None:
        keep["model"] = model
    sd = dict(model.state_dict())
    params = {n: tuple(t.shape) for n, t in sd.items()}
    try:
        from transformers.core_model_loading import revert_weight_conversion
        ids = {id(t): n for n, t in sd.items()}
        saved = revert_weight_conversion(model, dict(sd))
    except Exception:  # noqa: BLE001 - no conversion API (older transformers): names as in memory
        return cfg, params, {n: n for n in sd}, {}
    renamed = {ids[id(t)]: n for n, t in saved.items() if id(t) in ids}
    created = {n: tuple(t.shape) for n, t in saved.items() if id(t) not in ids}
    return cfg, params, renamed, created


def find_moe(d, cls, config, layer_prefix: str) -> MoE | None:
    """The MoE of the decoder layers at `layer_prefix` ("model.layers.{i}."), or None for a dense model. Built with up
    to 8 layers (on the meta device: no memory), so that dense first layers do not hide it."""
    total = int(getattr(config, "num_hidden_layers", 2) or 2)
    n = max(2, min(total, 8))
    keep: dict = {}
    try:
        cfg, params, renamed, created = build_meta(cls, config, n, keep)
    except Exception:  # noqa: BLE001 - the caller's own meta build reports why a model does not build
        return None
    prefix_re = re.escape(layer_prefix.split("{i}")[0])
    per_layer = _layer_names(params, prefix_re)
    sparse = sorted(i for i, names in per_layer.items() if any(".experts." in k for k in names))
    if not sparse:
        return None
    probe, rule = _dense_probe(cls, config, n, prefix_re) if len(sparse) == n else ({}, None)
    names = per_layer[sparse[0]]
    experts = sorted(k for k in names if ".experts." in k)
    module = experts[0].split(".experts.")[0]
    if len({k.split(".experts.")[0] for k in experts}) > 1:
        raise DraftMoEError(f"{d.architecture}: experts in several modules of a layer "
                            f"({', '.join(sorted({k.split('.experts.')[0] for k in experts}))}): write the MoE by hand")
    down = names.get(f"{module}.experts.down_proj")
    gate_up = names.get(f"{module}.experts.gate_up_proj")
    if down is None or len(down) != 3:
        raise DraftMoEError(f"{d.architecture}: experts stored as {', '.join(experts)}: not the stacked "
                            f"gate_up_proj / down_proj transformers uses; write the MoE block by hand (codegen/README.md "
                            f"`moe`)")
    E, a, b = down
    H = int(getattr(cfg, "hidden_size", a))
    hidden, inter = (a, b) if a == H else (b, a)
    if a != H:
        d.checklist.append(f"`{module}.experts.down_proj` is stored [experts, intermediate, hidden] in memory: check "
                           f"`transpose: true` on the stacked experts in `weights`")
    children = {k: s for k, s in names.items() if k.startswith(module + ".") and ".experts." not in k}
    router = next((k[len(module) + 1:-len(".weight")] for k, s in sorted(children.items())
                   if k.endswith(".weight") and len(s) == 2 and s[0] >= E and s[1] == hidden
                   and "shared" not in k), None)
    if router is None:
        raise DraftMoEError(f"{d.architecture}: no router [experts, hidden] found beside {module}.experts: write the "
                            f"MoE block by hand")
    if names.get(f"{module}.{router}.weight", (E,))[0] != E:
        d.checklist.append(f"the router `{module}.{router}` scores more choices than the {E} experts: identity / "
                           f"zero experts (`identity_experts`)?")
    shared_mods = sorted({k[len(module) + 1:].rsplit(".", 2)[0] for k in children
                          if "shared" in k and re.search(r"\.(down_proj|w2|c_proj|fc2)\.weight$", k)})
    shared = shared_mods[0] if shared_mods else None
    shared_inter = None
    if shared:
        sd = next((s for k, s in children.items() if k.startswith(f"{module}.{shared}.")
                   and re.search(r"\.(down_proj|w2)\.weight$", k)), None)
        shared_inter = sd[1] if sd else None
    shared_gate = next((k[len(module) + 1:-len(".weight")] for k, s in sorted(children.items())
                        if "shared" in k and k.endswith(".weight") and s == (1, hidden)), None)
    moe = MoE(module, E, hidden, inter, router, f"{module}.{router}.bias" in names,
              any(k.endswith("e_score_correction_bias") for k in children), shared, shared_inter, shared_gate,
              sparse, n, probe, rule, model=keep.get("model"))
    moe.owned = {f"{layer_prefix}{k}" for k in names if k.startswith(module + ".")
                 and (".experts." in k or k.startswith(f"{module}.{router}.")
                      or (shared and k.startswith(f"{module}.{shared}."))
                      or (shared_gate and k.startswith(f"{module}.{shared_gate}."))
                      or k.endswith("e_score_correction_bias"))}
    moe.shapes = dict(names)
    known = {f"{layer_prefix}{module}.experts.gate_up_proj", f"{layer_prefix}{module}.experts.down_proj",
             f"{layer_prefix}{module}.{router}.weight", f"{layer_prefix}{module}.{router}.bias"}
    strange = sorted(k for k in moe.owned if ".experts." in k and k not in known)
    if strange:
        d.checklist.append(f"expert parameters the draft does not map: {', '.join(s[len(layer_prefix):] for s in strange)}"
                           f" (expert biases: `expert_bias`; check the modeling file)")
    if gate_up is None:
        d.checklist.append("the experts have no gate_up_proj: plain (non-gated) experts? (`expert_mlp: plain`)")
    _saved_names(d, moe, layer_prefix, sparse[0], renamed, created)
    return moe


def _dense_probe(cls, config, n: int, prefix_re: str) -> tuple[dict, str | None]:
    """Where every layer of the default config is sparse: the config change (DENSE_PROBES) of a field that chooses the
    dense layers, under which the model builds layer 0 dense and the rule's expression gives its sparse layers."""
    full = config.to_dict()
    for fields, expr in SPARSE_RULES:
        if not all(f in full for f in fields):
            continue
        changes = {f: DENSE_PROBES[f] for f in fields if f in DENSE_PROBES}
        try:
            _, params, _, _ = build_meta(cls, config, n, None, **changes)
        except Exception:  # noqa: BLE001 - a probe the class does not take
            continue
        per_layer = _layer_names(params, prefix_re)
        sparse = sorted(i for i, names in per_layer.items() if any(".experts." in k for k in names))
        env = {f: (tuple(v) if isinstance(v, list) else v) for f, v in {**full, **changes}.items() if f in fields}
        try:
            want = [i for i in range(n) if eval(expr, {}, {**env, "layer": i})]  # noqa: S307
        except Exception:  # noqa: BLE001 - a field of another meaning
            continue
        if sparse == want and len(sparse) < n:
            return changes, expr
    return {}, None


def _saved_names(d, moe: MoE, layer_prefix: str, li: int, renamed: dict, created: dict) -> None:
    """`weights` entries for the MoE's tensors whose saved names differ from the runtime's (one sparse layer's names,
    with its index replaced by {i})."""
    lp = layer_prefix.replace("{i}", str(li))

    def generic(name: str) -> str:
        return layer_prefix + name[len(lp):] if name.startswith(lp) else name

    per_expert: dict[str, str] = {}
    for n in created:
        m = re.match(re.escape(lp) + r"(.+)\.experts\.(\d+)\.(\w+)\.weight$", n)
        if m and m.group(2) == "0":
            for role, projs in EXPERT_PROJ.items():
                if m.group(3) in projs:
                    per_expert[role] = f"{layer_prefix}{m.group(1)}.experts.{{e}}.{m.group(3)}.weight"
    run = f"{layer_prefix}{moe.module}.experts"
    if {"gate", "up", "down"} <= set(per_expert):
        moe.weights.append((f"{run}.gate_up_proj", {"gate": per_expert["gate"], "up": per_expert["up"]}, {}))
        moe.weights.append((f"{run}.down_proj", per_expert["down"], {}))
    elif created:
        d.checklist.append(f"transformers converts the experts at load from {', '.join(sorted(created)[:3])}: map "
                           f"them in `weights` by hand (`{{e}}` per expert, `transpose`, `segments_interleaved`)")
    else:
        d.checklist.append(f"the checkpoint stores the experts stacked ({run}.gate_up_proj / down_proj): check their "
                           f"orientation ([experts, out, in]; `transpose: true` where [experts, in, out]) and the "
                           f"gate/up order (`segments_interleaved` where alternating)")
    # the selection bias: the runtime's <router>.e_score_correction_bias, wherever the model holds it (ERNIE 4.5:
    # gate.moe_statics.e_score_correction_bias [1, experts])
    bias_rt = f"{layer_prefix}{moe.module}.{moe.router}.e_score_correction_bias"
    for mem, saved in sorted(renamed.items()):
        gm, gs = generic(mem), generic(saved)
        if gm.endswith(".e_score_correction_bias") and gm in moe.owned and gs != bias_rt:
            shape = moe.shapes.get(gm[len(layer_prefix):], ())
            moe.weights.append((bias_rt, gs, {"squeeze": "true"} if len(shape) == 2 and shape[0] == 1 else {}))
    # the router and shared expert: renamed tensors (Mixtral's block_sparse_moe.gate)
    for mem, saved in sorted(renamed.items()):
        gm, gs = generic(mem), generic(saved)
        if gm.endswith(".e_score_correction_bias"):
            continue
        if gm in moe.owned and gm != gs and ".experts." not in gm:
            if moe.shared and re.search(rf"\.{re.escape(moe.shared)}\.(gate_proj|up_proj)\.", gm):
                continue        # in the fused shared gate_up below
            moe.weights.append((gm, gs, {}))
    if moe.shared:
        sh = f"{layer_prefix}{moe.module}.{moe.shared}"
        gate, up = f"{sh}.gate_proj.weight", f"{sh}.up_proj.weight"
        if gate in moe.owned and up in moe.owned:
            saved_of = {generic(m): generic(s) for m, s in renamed.items()}
            moe.weights.append((f"{sh}.gate_up_proj.weight",
                                {"gate": saved_of.get(gate, gate), "up": saved_of.get(up, up)}, {}))
        else:
            d.checklist.append(f"the shared expert `{moe.module}.{moe.shared}` is not gate_proj / up_proj / down_proj: "
                               f"map its tensors by hand")


def _field(full: dict, options, value: Any = None) -> str | None:
    return next((f for f in options if f in full and (value is None or full[f] == value)), None)


# the modeling code divides the top-k weights by their sum unconditionally (Mixtral, where no config flag says so)
RENORMALIZES = re.compile(r"\n(\s+)\w+ /= \w+\.sum\(dim=-1, keepdim=True\)")


def moe_symbols(d, moe: MoE, full: dict, source: str = "") -> dict:
    """Config symbols of the MoE sizes and flags (added to d.symbols); returns the block's field values. `source`:
    the modeling module's text (renormalization where no `norm_topk_prob` field says)."""
    out: dict[str, str] = {}
    vals = {**full, **d.config}     # sizes matched by the checkpoint's values (a tiny one's), defaults the class's
    ef = _field(vals, EXPERTS_FIELDS, moe.experts) or _field(vals, EXPERTS_FIELDS)
    if ef:
        d.symbols[ef] = f"{{type: int, from: {ef}, min: 1}}"
        out["experts"] = ef
    else:
        out["experts"] = str(moe.experts)
        d.checklist.append(f"no config field for the number of experts ({moe.experts} in the default config): a literal")
    kf = _field(full, TOP_K_FIELDS)
    if kf:
        d.symbols[kf] = f"{{type: int, from: {kf}, min: 1}}"
        out["top_k"] = kf
    else:
        out["top_k"] = "2"
        d.checklist.append("no config field for the experts per token found: top_k is a literal 2 (check the "
                           "modeling file)")
    # the field of that value, an MLP width by its name (GPT-OSS's hidden_size equals its intermediate_size)
    inter = sorted((f for f, v in vals.items() if v == moe.intermediate and isinstance(v, int)
                    and not isinstance(v, bool) and "size" in f and f not in NOT_WIDTHS),
                   key=lambda f: (not ("moe" in f or "expert" in f), not ("intermediate" in f or "ffn" in f), f))
    if inter:
        d.symbols.setdefault(inter[0], f"{{type: int, from: {inter[0]}}}")
        out["intermediate"] = inter[0]
    else:
        out["intermediate"] = str(moe.intermediate)
        d.checklist.append(f"no config field equal to the experts' width {moe.intermediate}: a literal")
    if "norm_topk_prob" in full:
        d.symbols["norm_topk_prob"] = f"{{type: bool, from: norm_topk_prob, default: " \
                                      f"{'true' if full['norm_topk_prob'] else 'false'}}}"
        out["norm_topk_prob"] = "norm_topk_prob"
    elif RENORMALIZES.search(source):
        out["norm_topk_prob"] = "true"
        d.checklist.append("routing: no `norm_topk_prob` field, and the modeling file divides the top-k weights by "
                           "their sum: `norm_topk_prob: true` (check it is unconditional)")
    else:
        out["norm_topk_prob"] = "false"
        d.checklist.append("routing: no `norm_topk_prob` field: the draft does not renormalize the top-k weights; "
                           "check the modeling file")
    d.checklist.append("routing: the draft scores experts by softmax then top-k; check the modeling file for sigmoid "
                       "scores (`scoring`), grouped top-k (`groups`), a scaling factor (`routed_scale`)")
    if moe.selection_bias:
        d.checklist.append("the router has an e_score_correction_bias: `selection_bias: true` is drafted; DeepSeek-V3-"
                           "style routers also score by sigmoid with grouped top-k and a routed scale")
    if moe.shared:
        sf = next((f for f, v in vals.items() if v == moe.shared_intermediate and "shared" in f and "size" in f), None)
        if sf:
            d.symbols.setdefault(sf, f"{{type: int, from: {sf}}}")
            out["shared_intermediate"] = sf
        elif isinstance(vals.get("n_shared_experts"), int) and "intermediate" in out and \
                vals["n_shared_experts"] * (vals.get(out["intermediate"]) or 0) == moe.shared_intermediate:
            d.symbols.setdefault("n_shared_experts", "{type: int, from: n_shared_experts, min: 1}")
            out["shared_intermediate"] = f"n_shared_experts * {out['intermediate']}"
        else:
            out["shared_intermediate"] = str(moe.shared_intermediate)
            d.checklist.append(f"the shared expert's width {moe.shared_intermediate}: no config field found, a literal")
    return out


def sparse_condition(d, moe: MoE, full: dict, layer_prefix: str | None = None, config_cls=None) -> str | None:
    """The per-layer expression that is true on the sparse layers (None: every layer is sparse): the decoder layer's
    own condition (draft_routing.sparse_from_source), else from the fields the families use; checked against the
    layers built (with the checkpoint's values). None found: on the checklist."""
    values = {**full, **d.config}
    if layer_prefix is not None and (moe.probe or len(moe.sparse_layers) < moe.built_layers):
        from .draft_routing import sparse_from_source
        expr = sparse_from_source(d, moe, layer_prefix, values, full, config_cls)
        if expr is not None:
            return expr
    if moe.rule is not None:        # found by the dense probe: the default config's values are the defaults
        for fields, expr in SPARSE_RULES:
            if expr == moe.rule:
                for f in fields:
                    typ = "int_tuple" if isinstance(full[f], (list, tuple)) else "int"
                    default = f"default: {list(full[f])}" if typ == "int_tuple" else f"default: {full[f]}"
                    d.symbols.setdefault(f, f"{{type: {typ}, from: {f}, {default}}}")
        return moe.rule
    if len(moe.sparse_layers) == moe.built_layers:
        return None
    for fields, expr in SPARSE_RULES:
        if all(f in full for f in fields):
            env = {f: (tuple(values[f]) if isinstance(values[f], list) else values[f]) for f in fields}
            try:
                got = [i for i in range(moe.built_layers) if eval(expr, {}, {**env, "layer": i})]  # noqa: S307
            except Exception:  # noqa: BLE001 - a field of another meaning
                continue
            if got == moe.sparse_layers:
                for f in fields:
                    typ = "int_tuple" if isinstance(full[f], list) else "int"
                    default = f", default: {list(full[f])}" if typ == "int_tuple" else f", default: {full[f]}"
                    d.symbols.setdefault(f, f"{{type: {typ}, from: {f}{default}}}")
                return expr
    d.checklist.append(f"of the first {moe.built_layers} layers, {moe.sparse_layers} hold experts and the others a "
                       f"dense MLP: write the condition over the config field that chooses them (the draft's is a "
                       f"placeholder)")
    return "layer in " + str(tuple(moe.sparse_layers))


def render_block(moe: MoE, fields: dict, act: str, name: str) -> list:
    L = [f"      {name}:", "        kind: moe", "        hidden: hidden_size", f"        experts: {fields['experts']}",
         f"        top_k: {fields['top_k']}", f"        intermediate: {fields['intermediate']}",
         f"        activation: {act}", f"        norm_topk_prob: {fields['norm_topk_prob']}",
         f"        router: {{name: {moe.router}" + (", bias: true" if moe.router_bias else "")
         + (", float32: true}" if fields.get("router_float32") else "}")]
    if "scoring" in fields:
        L.append(f"        scoring: {fields['scoring']}")
    if moe.selection_bias:
        L.append("        selection_bias: true")
    for key in ("selection_bias_on", "groups", "routed_scale", "renormalize_min"):
        if key in fields:
            L.append(f"        {key}: {fields[key]}")
    if moe.shared:
        gate = f", gate: {moe.shared_gate}" if moe.shared_gate else ""
        L.append(f"        shared_expert: {{name: {moe.shared}, intermediate: {fields['shared_intermediate']}{gate}}}")
    return L


def render_weights(moe: MoE) -> list:
    L = []
    for target, src, extra in moe.weights:
        L.append(f"  {target}:")
        if isinstance(src, str):
            L.append(f"    from: {src}")
            L += [f"    {k}: {v}" for k, v in extra.items()]
        else:
            L.append("    from:")
            L += [f"      {seg}: {s}" for seg, s in src.items()]
    return L
