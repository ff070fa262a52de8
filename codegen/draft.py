"""`xllm-gen draft ARCH_OR_CHECKPOINT_DIR -o specs/x.yaml`: a first spec from transformers' own classes.

What it reads (transformers is imported here only, lazily: a normal compile never imports it):
  - the config class of the architecture (`transformers.<Arch>.config_class`), or a checkpoint's config.json
    (its `architectures[0]` names the class; its fields are drafted, with the class's defaults);
  - the parameter names and shapes of the HF model built on the meta device from that config (2 layers), and,
    for every bool config field, of the model built with the field flipped: the parameters a flag adds or
    removes tell which projection bias (or which tying) the flag controls;
  - the source of the modeling module, for hints only (rotate-half layout, (1 + w) norms, soft-capping, ...).

What it writes: a Llama-like decoder (embedding; per layer norm -> attention (fused q/k/v, rotary, with the q/k
norms, rotary layout / fraction, window, scale, soft-cap read by draft_attention.py, or multi-head latent attention:
draft_mla.py) -> norm -> gated or plain MLP, or a mixture of experts (draft_moe.py); the pre- / post-norms as the
layer's forward calls them, draft_layer.py; final norm; lm_head) with the module
names found in the state_dict,
`weights` entries for the fused q/k/v and gate/up parameters, every config field as a symbol, under
`config_assume` (its default: a checkpoint with another value is refused) or `config_ignore` (dropouts), and
a CHECKLIST at the top of the file: what the draft could not infer and a person must decide (extra norms,
q/k norms, interleaved rotary, partial rotary, windows, scalings, unknown fields). Then run
`xllm-gen --dry-run` and `xllm-gen verify SPEC CHECKPOINT_DIR`.
"""
from __future__ import annotations

import inspect
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .draft_attention import drop_answered, find_attention
from .draft_checklist import other_fields, source_hints, unused_parameters
from .draft_flow import drop_flow_hints, flow_symbols
from .draft_layer import final_softcap, norm_roles
from .draft_mla import MLA, find_mla, mla_symbols
from .draft_moe import MoE, find_moe, moe_symbols, sparse_condition
from .draft_parts import fused_qkv, mlp_width, model_parts
from .draft_render import _act_field, _render, _yaml_scalar
from .draft_routing import find_routing
from .draft_source import _fixed_default, _if_null, drop_answered_hints, find_scalings  # noqa: F401 - tests use _fixed_default
from .errors import SpecError

# config.json field -> (symbol, type) for the sizes every decoder has (the draft's fixed vocabulary)
CORE = {
    "vocab_size": "int", "hidden_size": "int", "intermediate_size": "int", "num_hidden_layers": "int",
    "num_attention_heads": "int", "num_key_value_heads": "int", "head_dim": "int",
    "max_position_embeddings": "int", "tie_word_embeddings": "bool", "eos_token_id": "int_tuple",
}
EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "norm_epsilon", "layer_norm_epsilon", "norm_eps")
ATTN_NAMES = {"q": ("q_proj", "query", "Wq"), "k": ("k_proj", "key", "Wk"), "v": ("v_proj", "value", "Wv"),
              "o": ("o_proj", "dense", "out_proj", "c_proj", "Wo")}
FUSED_QKV = ("qkv_proj", "query_key_value", "Wqkv", "c_attn", "qkv")
FUSED_GATE_UP = ("gate_up_proj", "Wi")
MLP_NAMES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3", "fc1", "c_fc", "dense_h_to_4h"),
             "down": ("down_proj", "w2", "fc2", "c_proj", "dense_4h_to_h", "Wo")}


class DraftError(SpecError):
    pass


@dataclass
class Draft:
    architecture: str
    name: str
    prefix: str
    config: dict                                # the config values (text level) the draft read
    symbols: dict = field(default_factory=dict)    # symbol -> YAML flow mapping text
    assume: dict = field(default_factory=dict)
    ignore: list = field(default_factory=list)
    checklist: list = field(default_factory=list)
    # a core symbol -> the config.json field the class's attribute_map reads it from (GPT-2: hidden_size <- n_embd)
    sources: dict = field(default_factory=dict)
    # embedding / residual-branch / logit scalings read from the modeling source (draft_source.find_scalings):
    # {"embed" | "residual" | "logit": a symbol or number}
    scales: dict = field(default_factory=dict)


def _snake(cls_name: str, model_type: str = "") -> str:
    """The spec's name: the config's model_type (`gpt_neox`, `llama4_text` -> `llama4`), else the class's."""
    mt = re.sub(r"_text(_model)?$", "", re.sub(r"[-.]", "_", (model_type or "").lower()))
    if re.fullmatch(r"[a-z][a-z0-9_]*", mt):
        return mt
    base = re.sub(r"(ForCausalLM|LMHeadModel)$", "", cls_name)
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).lower() or "model"


def _load(target: str):
    """(model class, config object, config.json dict or None) for a class name or a checkpoint dir."""
    import transformers

    path = Path(target)
    raw = None
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise DraftError(f"{target}: no config.json in this directory")
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
        archs = raw.get("architectures") or []
        if not archs:
            raise DraftError(f"{cfg_path}: no `architectures` list: cannot tell the model class")
        arch = archs[0]
    else:
        arch = target
    cls = getattr(transformers, arch, None)
    if cls is None or not hasattr(cls, "config_class"):
        raise DraftError(f"transformers {transformers.__version__} has no model class {arch!r}")
    if raw is not None:
        config = cls.config_class.from_pretrained(str(path))
    else:
        config = cls.config_class()
    return cls, config, raw


def _meta_params(cls, config, **changes) -> dict[str, tuple]:
    """{parameter name with layer index -> '{i}': shape} of the model built on the meta device (2 layers where
    the config class allows shrinking it, else all of them: on the meta device a model costs no memory)."""
    import copy

    import torch

    def build(shrink: bool):
        cfg = copy.deepcopy(config)
        if shrink and hasattr(cfg, "num_hidden_layers"):
            cfg.num_hidden_layers = 2
            if isinstance(getattr(cfg, "layer_types", None), list):
                cfg.layer_types = cfg.layer_types[:2]
        for k, v in changes.items():
            setattr(cfg, k, v)
        with torch.device("meta"):
            return cls(cfg), cfg

    try:
        model, cfg = build(shrink=True)
    except Exception:
        try:
            model, cfg = build(shrink=False)
        except Exception as e:
            from xllm_gen.runtime.loading.hf_config import GENERIC_FIELDS
            nulls = [k for k, v in config.to_dict().items()
                     if v is None and k not in GENERIC_FIELDS and not k.endswith("_token_id")][:4]
            raise DraftError(f"{cls.__name__}: cannot build the transformers model on the meta device "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                             + (f"; its config is null in {', '.join(nulls)}: where transformers' class defaults do "
                                f"not build, draft from a checkpoint directory (its config.json)" if nulls else "")
                             ) from None
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out[re.sub(r"\.(\d+)\.", ".{i}.", n, count=1)] = tuple(p.shape)
    if getattr(cfg, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out


def _find(names: set, layer: str, options) -> str | None:
    for o in options:
        for n in sorted(names):
            if n.startswith(layer) and re.search(rf"\.{re.escape(o)}\.weight$", n):
                return n[: -len(".weight")]
    return None


@dataclass
class _Layer:
    """Where the draft found a decoder layer's parts: full parameter-module names (None where absent)."""
    prefix: str                                 # "model.layers.{i}."
    q: str | None
    k: str | None
    v: str | None
    qkv_fused: str | None
    o: str
    attn_mod: str
    gate: str | None
    up: str | None
    down: str
    gate_up_fused: str | None
    mlp_mod: str
    attn_norm: str
    mlp_norm: str
    extra_norms: list
    inner_norms: list
    mla: MLA | None = None                      # multi-head latent attention in place of q/k/v (draft_mla.py)
    attn: object = None                         # q/k norms, rotary, window, scale (draft_attention.Attn)
    roles: object = None                        # pre / post norms read from the forward (draft_layer.Roles)
    final_norm: str = "model.norm"              # the final norm's module as saved (Phi: model.final_layernorm)
    qkv_layout: object = None                 # the fused q/k/v's row layout (draft_qkv.py): head, kv_group, ..., or a LayoutIf
    kv_heads: str | None = None                 # the attention's KV heads where not num_key_value_heads
    parts: dict = field(default_factory=dict)   # the embedding's and the head's module names (draft_parts.py)

    def rel(self, n: str) -> str:
        return n[len(self.prefix):]

    @property
    def gated(self) -> bool:
        return self.gate is not None or self.gate_up_fused is not None


def draft_spec(target: str, name: str | None = None) -> tuple[str, Draft]:
    """(spec YAML text, Draft) for a transformers class name or a checkpoint directory. The steps: the state_dict's
    layer layout (which modules, which flag controls which bias), the config symbols, the other fields (assumed,
    ignored or on the checklist), hints from the modeling source, then the text."""
    cls, config, raw = _load(target)
    arch = cls.__name__
    full = config.to_dict()
    values = dict(full)
    if raw is not None:
        values.update(raw)
    d = Draft(arch, name or _snake(arch, getattr(type(config), "model_type", "")), re.sub(r"(ForCausalLM|LMHeadModel)$", "", arch) or "Model", values)
    names = set(_meta_params(cls, config))
    prefix = _layer_prefix(d, names)
    moe = find_moe(d, cls, config, prefix)
    if moe is not None and moe.probe:     # every layer sparse by default: the names with a dense layer too
        names = set(_meta_params(cls, config, **moe.probe))
    controls = _bias_controls(cls, config, full, names, moe.probe if moe is not None else {})
    mla = find_mla(d, cls, config, names, prefix)     # multi-head latent attention (draft_mla.py)
    parts = model_parts(cls, config)                                            # draft_parts.py
    layer = _find_layer(d, names, prefix, moe, mla, lambda *a: norm_roles(cls, config, prefix, *a), parts.get("embed_memory"))
    layer.parts = parts
    norm_kind = "layernorm" if ((layer.attn_norm or layer.extra_norms[0]) + ".bias") in names else \
        "layernorm_nobias" if layer.roles is not None and layer.roles.mean_free_layernorm else "rmsnorm"
    # a symbol's default is what an absent field means to transformers (the class's default), not the checkpoint's
    # value: a drafted spec serves another checkpoint that omits the field as transformers does
    try:
        class_defaults = type(config)().to_dict()
    except Exception:  # noqa: BLE001 - a class that cannot be built with its defaults: the checkpoint's values
        class_defaults = {}
    defaults = {k: class_defaults.get(k, v) for k, v in full.items()}
    # the class's own names for the core sizes (attribute_map: GPT-2's n_embd is hidden_size): read under the core
    # symbol names, from the field config.json holds
    d.sources = {core: src for core, src in getattr(type(config), "attribute_map", {}).items()
                 if core in CORE and src in full and core not in full}
    defaults.update({core: defaults[src] for core, src in d.sources.items()})
    eps = _eps(d, defaults)
    _config_symbols(d, defaults, type(config))
    flow_symbols(d, layer)                                                      # draft_flow.py
    source = inspect.getsource(inspect.getmodule(cls))
    if "head_dim" in d.symbols and defaults.get("head_dim", 0) is None and re.search(
            r'getattr\(config, "head_dim", None\) or config\.hidden_size // config\.num_attention_heads', source):
        # the class's null head_dim is what the modeling code computes, the symbol's default (Mistral, Mixtral)
        d.symbols["head_dim"] = ('{type: int, from: head_dim, default_expr: "hidden_size // num_attention_heads", '
                                 'same_meaning: "None is hidden_size // num_attention_heads (modeling code)"}')
    if mla is not None:
        mla_symbols(d, mla, defaults, type(config))
    moe_fields = moe_symbols(d, moe, defaults, source) if moe else {}
    if moe is not None:
        find_routing(d, moe, prefix, defaults, type(config), moe_fields)     # draft_routing.py
    sparse_if = sparse_condition(d, moe, defaults, prefix, type(config)) if moe else None
    find_scalings(d, cls, config, prefix, defaults)                            # draft_source.py
    if moe is not None and layer.down is None and "intermediate_size" in d.symbols and \
            not any("intermediate_size" == v or "* intermediate_size" in v for v in moe_fields.values()):
        # every layer sparse: the dense MLP width configures no block of the draft
        del d.symbols["intermediate_size"]
        d.ignore.append("intermediate_size")
        d.checklist.append("every layer the draft built holds experts, so `intermediate_size` (the dense MLP's width) "
                           "is ignored: where a config field makes some layers dense, model that MLP and read it")
    if mla is None:
        layer.attn = find_attention(d, cls, config, layer, controls, defaults)     # draft_attention.py
        fused_qkv(d, layer, cls, config, defaults)                                 # draft_parts.py
    mlp_width(d, layer, type(config), defaults)                                    # draft_parts.py
    final_softcap(d, cls, defaults)
    other_fields(d, full, controls)
    source_hints(d, cls)
    drop_answered_hints(d)
    drop_flow_hints(d, layer)
    if layer.attn is not None:
        drop_answered(d, layer.attn, layer)
    unused_parameters(d, names - (moe.owned if moe else set()) - (mla.owned if mla else set()), layer)
    return _render(d, target, type(config).__name__, defaults, names, controls, layer, norm_kind, eps,
                   (moe, moe_fields, sparse_if)), d


def _layer_prefix(d: Draft, names: set) -> str:
    """The decoder layers' parameter prefix ("model.layers.{i}."): of several stacks of layers, one not named as a
    vision / audio tower or an encoder, then the one with the most parameters, then by name (never the set's order:
    the draft is the same on every run)."""
    stacks = Counter(n.split("{i}")[0] + "{i}." for n in names if "{i}" in n)
    tower = re.compile(r"vision|visual|image|audio|encoder|patch", re.I)
    layer = min(stacks, key=lambda s: (bool(tower.search(s)), -stacks[s], s)) if stacks else None
    if layer is None:
        raise DraftError(f"{d.architecture}: no per-layer parameters found in the model's state_dict")
    if layer != "model.layers.{i}.":
        d.checklist.append(f"decoder layers live at `{layer}` (not `model.layers.{{i}}.`): the draft maps the names "
                           f"with `checkpoint_prefixes` (the embedding, final norm and head as the model names them)")
    return layer


def _bias_controls(cls, config, full: dict, names: set, probe: dict) -> dict[str, str]:
    """parameter name -> the bool config field that adds or removes it (the model built with the field flipped, and
    the `probe` changes `names` was built with)."""
    from xllm_gen.runtime.loading.hf_config import GENERIC_FIELDS
    controls: dict[str, str] = {}
    for key, value in full.items():
        if isinstance(value, bool) and key not in GENERIC_FIELDS and key != "tie_word_embeddings":
            try:
                flipped = set(_meta_params(cls, config, **{**probe, key: not value}))
            except Exception:
                continue
            for n in (names ^ flipped):
                controls[n] = key
    return controls


def _find_layer(d: Draft, names: set, layer: str, moe: MoE | None = None, mla: MLA | None = None,
                roles_of=None, embed_module: str | None = None) -> _Layer:
    """The attention and MLP projections and the norms of a layer, by their usual names (the MLP of the dense layers
    where `moe` holds the sparse ones'); what does not fit a Llama-like pre-norm layer is refused or put on the
    checklist."""
    arch = d.architecture

    def rel(n: str) -> str:
        return n[len(layer):]

    q, k, v = (None, None, None) if mla else (_find(names, layer, ATTN_NAMES[r]) for r in "qkv")
    qkv_fused = None if (q and k and v) or mla else _find(names, layer, FUSED_QKV)
    if qkv_fused:
        q = k = v = None
        d.checklist.append(f"the checkpoint stores q/k/v fused in `{rel(qkv_fused)}`: the draft loads it as "
                           f"[q | k | v] stacked in that order (Phi-3's layout); a per-head interleaved layout "
                           f"(GPT-NeoX `query_key_value`) needs a row layout in `weights`")
    attn_mod = mla.module if mla else (q or qkv_fused).rsplit(".", 1)[0] if (q or qkv_fused) else None
    o = mla.o if mla else _find({n for n in names if attn_mod and n.startswith(attn_mod + ".")}, layer, ATTN_NAMES["o"]) if attn_mod else None
    # the MLP is not the attention, nor the experts, router or shared expert
    rest = {n for n in names if not (attn_mod and n.startswith(attn_mod + ".")) and not (moe and n in moe.owned)}
    gate = _find(rest, layer, MLP_NAMES["gate"])
    up = _find(rest, layer, MLP_NAMES["up"])
    down = _find(rest, layer, MLP_NAMES["down"])
    gate_up_fused = _find(rest, layer, FUSED_GATE_UP) if not (gate or up) else None
    if gate_up_fused:
        d.checklist.append(f"the checkpoint stores gate/up fused in `{rel(gate_up_fused)}`: the draft loads "
                           f"it as [gate | up] stacked in that order (Phi-3's layout); check the modeling file's chunk")
    if not ((q and k and v) or qkv_fused or mla) or not o:
        fused = sorted(n for n in names if n.startswith(layer) and re.search(r"(qkv|query_key_value|c_attn)", n))
        found = ", ".join(f"{r} = {rel(m)}" for r, m in (("q", q), ("k", k), ("v", v), ("o", o)) if m)
        raise DraftError(f"{arch}: no separate q/k/v/o projections found in the state_dict"
                         + (f" (fused: {', '.join(fused)}): write the attention and its `weights` row layout by hand"
                            if fused else f" (found: {found or 'none'}; the names tried: "
                                          f"{', '.join(sum(ATTN_NAMES.values(), ()))})"))
    if not ((up or gate_up_fused) and down) and moe is None:
        raise DraftError(f"{arch}: no up/down MLP projections found in the state_dict (a MoE or another MLP form: "
                         f"start from a spec in specs/ by hand)")

    norm_mods = sorted({n.rsplit(".", 1)[0] for n in names
                        if n.startswith(layer) and re.search(r"norm|ln_", n.rsplit(".", 2)[-2], re.I)})
    layer_norms = [m for m in norm_mods if m.count(".") == layer.count(".")]
    mlp_rel = rel(down.rsplit(".", 1)[0]) if down else moe.module if moe else ""
    roles = roles_of(layer_norms, rel(attn_mod), mlp_rel) if roles_of and layer_norms and "." not in mlp_rel else None
    if roles is not None:       # the pre- / post-norms read from the layer's forward (draft_layer.py)
        attn_norm, mlp_norm = roles.attn_pre, roles.mlp_pre
        extra_norms = [m for m in (roles.attn_post, roles.mlp_post) if m]
    else:
        attn_norm = next((m for m in layer_norms if "input" in m or "attn" in m or "ln_1" in m), None)
        mlp_norm = next((m for m in layer_norms if m != attn_norm and ("post_attention" in m or "ln_2" in m or "ffn"
                                                                        in m or "mlp" in m or "feedforward" in m)), None)
        extra_norms = [m for m in layer_norms if m not in (attn_norm, mlp_norm)]
    inner_norms = [m for m in norm_mods if m not in layer_norms and not (mla and m.startswith(mla.module + "."))]
    if extra_norms and roles is None:
        d.checklist.append(f"extra per-layer norms {', '.join(rel(m) for m in extra_norms)}: a sandwich / post-norm "
                           f"dataflow (dataflow `post_norm`); the draft has only the pre-norms")
    if inner_norms:
        d.checklist.append(f"norms inside a block: {', '.join(rel(m) for m in inner_norms)}: q/k norms -> "
                           f"attention `qk_norm`, check per-head or whole-projection, before or after rotary")
    if not layer_norms:
        raise DraftError(f"{arch}: no norm parameters in a decoder layer: weightless norms (`weight: false`) or none;"
                         f" write the norms and the dataflow by hand")
    if (attn_norm is None or mlp_norm is None) and roles is None:
        raise DraftError(f"{arch}: cannot tell the two pre-norms of a layer among {', '.join(map(rel, layer_norms))}"
                         f": not a pre-norm decoder layer, write the dataflow by hand")
    final_norm = next((n.rsplit(".", 1)[0] for n in sorted(names) if not n.startswith(layer.split("{i}")[0])
                       and re.search(r"norm|(^|\.)ln_f\.", n) and n.endswith(".weight")), None)
    embed = next((n for n in sorted(names) if re.search(r"(embed_tokens|wte|word_embeddings|tok_embeddings)\.weight$", n)),
                 None) or (embed_module and f"{embed_module}.weight" in names and f"{embed_module}.weight")
    if final_norm is None or embed is None:
        raise DraftError(f"{arch}: cannot find the embedding or the final norm in the state_dict")
    if not ((up or gate_up_fused) and down):        # every layer sparse: no dense MLP
        gate = up = down = gate_up_fused = None
    mlp_mod = down.rsplit(".", 1)[0] if down else layer + moe.module
    return _Layer(layer, q, k, v, qkv_fused, o, attn_mod, gate, up, down, gate_up_fused, mlp_mod,
                  attn_norm, mlp_norm, extra_norms, inner_norms, mla, roles=roles, final_norm=final_norm)


def _eps(d: Draft, full: dict) -> str:
    """The norms' epsilon: the config field that holds it, else a literal (on the checklist)."""
    eps_field = next((f for f in EPS_FIELDS if full.get(f) is not None), None)
    if eps_field is None:
        d.checklist.append("no norm epsilon field found: eps is a literal 1e-6 (check the modeling file)")
        return "1.0e-6"
    return eps_field


def _config_symbols(d: Draft, full: dict, config_cls=None) -> None:
    """The symbols every decoder reads (sizes, eps, rope, activation), with the checklist items they raise. An
    absent num_key_value_heads / head_dim means what it means to transformers: the class's constant default
    where it has one, else computed from the heads as transformers computes it."""
    def src(f: str) -> str:
        return d.sources.get(f, f)

    if "intermediate_size" not in full:        # no field of that name (GPT-2's n_inner, None: 4 * hidden_size)
        d.symbols["intermediate_size"] = '{type: int, from: intermediate_size, default_expr: "4 * hidden_size"}'
        d.checklist.append("no `intermediate_size` field: the draft reads the MLP width as 4 * hidden_size when absent; "
                           "find the class's own field for it (GPT-2: n_inner, null meaning 4 * hidden_size)")
    for f, typ in CORE.items():
        if f not in full and f not in ("head_dim", "num_key_value_heads"):
            continue
        fixed = _fixed_default(config_cls, f) if config_cls is not None and f in (
            "num_key_value_heads", "head_dim") else None
        if fixed is not None:
            d.symbols[f] = f"{{type: int, from: {src(f)}, default: {fixed}{_if_null(config_cls, f)}}}"
        elif f == "num_key_value_heads":
            d.symbols[f] = f"{{type: int, from: [{src(f)}, {src('num_attention_heads')}]}}"
        elif f == "head_dim":
            d.symbols[f] = '{type: int, from: head_dim, default_expr: "hidden_size // num_attention_heads"}'
        elif f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            d.symbols[f] = f"{{type: int, from: {src(f)}}}"
        elif f == "eos_token_id":       # the config class's own (an absent field means it: the stop token)
            try:                        # the class default, not a checkpoint's value (a checkpoint dir target)
                eos = config_cls().eos_token_id if config_cls is not None else full.get(f)
            except Exception:   # noqa: BLE001 - a class that cannot build with no arguments
                eos = full.get(f)
            eos = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
            d.symbols[f] = f"{{type: int_tuple, from: eos_token_id, default: {eos}}}"
        else:
            d.symbols[f] = f"{{type: {typ}, from: {src(f)}, default: {_yaml_scalar(full.get(f))}}}"
    eps_field = next((f for f in EPS_FIELDS if full.get(f) is not None), None)
    if eps_field:
        d.symbols[eps_field] = f"{{type: float, from: {eps_field}, default: {_yaml_scalar(float(full[eps_field]))}}}"
    rope = full.get("rope_parameters")
    if isinstance(rope, dict) or "rope_theta" in full:
        theta = (rope or {}).get("rope_theta", full.get("rope_theta", 10000.0))
        d.symbols["rope_theta"] = (f"{{type: float, from: [rope_parameters.rope_theta, rope_theta], "
                                   f"default: {_yaml_scalar(float(theta))}}}")
        d.symbols["rope_scaling"] = "{type: rope, from: [rope_parameters, rope_scaling], values: [default]}"
        kind = (rope or {}).get("rope_type", "default")
        if kind != "default":
            d.checklist.append(f"the default rope type is {kind!r}: add it to rope_scaling.values if the runtime "
                               f"models it (default, linear, dynamic, yarn, llama3)")
        d.checklist.append("rope types: rope_scaling admits only `default`; add the types the released checkpoints "
                           "use (`values: [default, linear, dynamic, yarn, llama3]`)")
        prf = (rope or {}).get("partial_rotary_factor", full.get("partial_rotary_factor", full.get("rotary_pct")))
        if prf is not None and prf != 1.0:
            d.checklist.append(f"config has partial_rotary_factor / rotary_pct = {prf}: only part of each head "
                               f"rotates: check rotary.fraction")
    else:
        d.checklist.append("no rope parameters in the config: the attention may not use rotary (ALiBi, learned "
                           "positions): not a Llama-like decoder")
    act_field = _act_field(full)
    if act_field:
        act = full.get(act_field, "silu")
        acts = sorted({act, d.config.get(act_field, act)})      # the class's default and the checkpoint's
        d.symbols[act_field] = f"{{type: str, from: {act_field}, default: {act}, values: [{', '.join(acts)}]}}"
    else:
        d.checklist.append("no activation field in the config: the draft uses silu (check the modeling file)")
