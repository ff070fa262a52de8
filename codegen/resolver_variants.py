"""The spec resolver's per-variant checks (a mixin of resolver._Resolver): every variant's config values run
through the resolved expressions once at compile time (layer counts, per-layer patterns, widths, head counts,
deepstack levels, the vision tower, a projection that is off), so a variant the model cannot be built from is a
located spec error, not a failure at load."""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

from .errors import did_you_mean
from .expr import ExprError
from .ir import MLAIR, RGLRUIR, AttentionIR, GatedDeltaNetIR, Mamba2IR, MoEIR, NormIR, Size, VariantIR, size_at
from .resolver_blocks import _is_int

# Upper bounds on what a spec or a variant may declare (docs/reliability.md): a size is one tensor dimension
# (int32-indexable), the layer count bounds per-layer loops, an eps is a small positive number.
MAX_SIZE = 2 ** 31 - 1
MAX_LAYERS = 10_000


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_ITEM_OK = {"int_tuple": _is_int, "float_tuple": _is_num, "str_tuple": lambda v: isinstance(v, str),
            "bool_tuple": lambda v: isinstance(v, bool)}


def _type_ok(kind: str, value: Any, optional: bool = False, items_optional: bool = False) -> bool:
    """`items_optional`: a per-element read (`list[*].field`) that is `optional` holds None for an element's null or
    absent field."""
    if value is None:
        return optional
    if kind == "int":
        return _is_int(value)
    if kind == "float":
        return _is_num(value)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "rope":
        return isinstance(value, dict)
    return isinstance(value, (list, tuple)) and all(_ITEM_OK[kind](v) or (items_optional and v is None)
                                                    for v in value)


class VariantResolver:
    def check_projection_variant(self, name, values, embed, stream, project_in, project_out, lm_head,
                                 head_transform: bool = False) -> None:
        """Per variant: a projection that is off leaves the widths equal (the embedding's = the residual's = the LM
        head's); one that is on changes nothing else (its in / out were checked symbolically). Without project_out
        or a head transform the LM head reads the residual stream: its dim is the stream's width (OPT-350m's 512-wide
        head on a 1024-wide stream, project_out dropped, compiled and failed at load with a bare matmul error)."""
        if project_out is None and not head_transform and str(stream.dim) != str(lm_head.dim) \
                and stream.dim.eval(values) != lm_head.dim.eval(values):
            raise self.err(("lm_head", "dim"), f"variants.{name}: lm_head.dim is {lm_head.dim} = "
                                               f"{lm_head.dim.eval(values)}, but it reads the residual stream, "
                                               f"{stream.dim} = {stream.dim.eval(values)} wide (no decoder.project_out)")
        if lm_head.tie.literal is not False and str(lm_head.vocab) != str(embed.vocab) and lm_head.tie.eval(values) \
                and lm_head.vocab.eval(values) != embed.vocab.eval(values):
            raise self.err(("lm_head",), f"variants.{name}: lm_head: a tied head must have the embedding's shape: "
                                         f"vocab {lm_head.vocab} = {lm_head.vocab.eval(values)} vs {embed.vocab} = "
                                         f"{embed.vocab.eval(values)} (the variant ties it)", at_key=True)
        for proj, a, b in ((project_in, embed.dim, stream.dim), (project_out, stream.dim, lm_head.dim)):
            if proj is None or proj.enabled.literal is True:
                continue
            on = proj.enabled.eval(values)
            if not isinstance(on, bool):
                raise self.err(("decoder", proj.name, "enabled"), f"variants.{name}: decoder.{proj.name}.enabled is "
                                                                  f"{on!r}, not a bool")
            if not on and a.eval(values) != b.eval(values):
                raise self.err(("decoder", proj.name, "enabled"),
                               f"variants.{name}: decoder.{proj.name} is off, but the widths it maps differ "
                               f"({a} = {a.eval(values)}, {b} = {b.eval(values)})")

    def resolve_variant_located(self, name: str, *args) -> "VariantIR":
        """resolve_variant, with an expression that fails on this variant's values (a division by zero, a bad
        operand) reported at the variant instead of as an internal error."""
        try:
            return self.resolve_variant(name, *args)
        except ExprError as exc:
            raise self.err(("variants", name), f"variants.{name}: an expression of the spec fails on this "
                                                f"variant's values: {exc}") from None

    def resolve_variant(self, name, layer, lm_head, params, tp_sizes, deepstack, levels=None, vision=None,
                        embed=None) -> VariantIR:
        vp = ("variants", name)
        given = self.spec.variants[name]
        for key, value in given.items():
            if key not in self.config:
                raise self.err(vp + (key,), f"variants.{name}: unknown config symbol '{key}'"
                                            f"{did_you_mean(key, self.config)}", at_key=True)
            f = self.config[key]
            if f.derived:
                raise self.err(vp + (key,), f"variants.{name}.{key}: '{key}' is derived ({f.expr}): set the "
                                            f"symbols it reads instead", at_key=True)
            if not _type_ok(f.type, value, f.optional, f.optional and any("[*]" in p for p in f.paths)):
                raise self.err(vp + (key,), f"variants.{name}.{key}: {value!r} is not {f.type}")
            self.check_value(vp + (key,), f"variants.{name}.{key}", f, value)
        values: Dict[str, Any] = {}
        for sym, f in self.config.items():
            if f.derived or (sym not in given and f.default_expr is not None):
                continue
            if sym in given:
                values[sym] = tuple(given[sym]) if isinstance(given[sym], list) else given[sym]
            elif f.has_default:
                values[sym] = f.default if f.type != "rope" or f.default is not None else {"rope_type": "default"}
            else:
                raise self.err(vp, f"variants.{name}: no value for '{sym}' (it has no default)", at_key=True)
        for _ in range(len(self.config)):   # expressions in dependency order (cycles are refused earlier)
            for sym, f in self.config.items():
                e = f.expr if f.derived else (f.default_expr if sym not in values else None)
                if e is not None and sym not in values and all(n in values for n in e.names):
                    try:
                        values[sym] = e.eval(values)
                    except Exception as exc:  # noqa: BLE001 - any failure of a spec formula is the spec's error
                        raise self.err(("config", sym), f"variants.{name}: config.{sym} = {e} fails: "
                                                        f"{type(exc).__name__}: {exc}", at_key=True) from None
                    if not _type_ok(f.type, values[sym], f.optional):
                        raise self.err(("config", sym), f"variants.{name}: config.{sym} = {e} gives "
                                                        f"{values[sym]!r}, not {f.type}", at_key=True)
        values = {sym: values[sym] for sym in self.config}
        for sym, f in self.config.items():       # a computed value (derived, or a default_expr) within its bounds
            if (f.derived or (sym not in given and f.default_expr is not None)) and values[sym] is not None:
                self.check_value(("config", sym), f"variants.{name}: config.{sym} = "
                                                  f"{f.expr or f.default_expr}", f, values[sym], at_key=True)

        def at(sym: Optional[str]):
            f = self.config.get(sym) if sym else None
            if f is not None and f.derived and len(f.expr.names) == 1:
                sym = f.expr.names[0]
            return vp + (sym,) if sym in given else vp

        def layer_range():
            """The layers of this variant (a per-layer size is checked in each)."""
            try:
                n = layer.count.eval(values)
            except Exception:  # noqa: BLE001 - the count's own formula is checked as a size
                return range(0)
            return range(min(n, MAX_LAYERS)) if _is_int(n) else range(0)

        for path, size in self.sizes:
            for li in (layer_range() if getattr(size, "per_layer", False) else (None,)):
                try:
                    x = size.eval(values) if li is None else size.eval(values, li)
                except Exception as exc:  # noqa: BLE001 - a spec formula that fails is the spec's error
                    at_layer = f" for layer {li}" if li is not None else ""
                    raise self.err(path, f"variants.{name}: {self._where(path)} = {size} fails{at_layer}: "
                                         f"{type(exc).__name__}: {exc}") from None
                if not _is_int(x) or not 0 < x <= MAX_SIZE:
                    sym = getattr(size, "symbol", None) if isinstance(size, Size) else None
                    where = at(sym) if sym and at(sym) != vp else path
                    at_layer = f" in layer {li}" if li is not None else ""
                    raise self.err(where, f"variants.{name}: {self._where(path)} is {x!r}{at_layer}; a size is an "
                                          f"int in 1..2**31-1")
        if layer.count.eval(values) > MAX_LAYERS:
            sym = layer.count.symbol if isinstance(layer.count, Size) else None
            raise self.err(at(sym) if sym and at(sym) != vp else ("decoder", "layers", "count"),
                           f"variants.{name}: {layer.count.eval(values)} decoder layers; at most {MAX_LAYERS}")
        def ev(path, v, li=None):
            """A value of this variant (for layer li): a failing formula is a located error."""
            try:
                return v.eval(values, li) if li is not None else v.eval(values)
            except Exception as exc:  # noqa: BLE001 - the spec's formula fails for this variant
                at_layer = f" for layer {li}" if li is not None else ""
                raise self.err(path, f"variants.{name}: {self._where(path)} = {v} fails{at_layer}: "
                                     f"{type(exc).__name__}: {exc}") from None

        for path, v, bound in self.below:
            x = ev(path, v, 0) if v.per_layer else ev(path, v)
            if _is_num(x) and x >= bound:
                where = at(v.symbol) if v.symbol and at(v.symbol) != vp else path
                raise self.err(where, f"variants.{name}: {self._where(path)} is {x!r}; it must be < {bound}")
        for path, v in self.positives:
            for li in (range(layer.count.eval(values)) if v.per_layer else (None,)):
                x = ev(path, v, li)
                if x is not None and (not _is_num(x) or x <= 0):
                    where = at(v.symbol) if v.symbol and at(v.symbol) != vp else path
                    raise self.err(where, f"variants.{name}: {self._where(path)} is {x!r}; it must be > 0")

        def check_ints(size):
            if not isinstance(size, Size):
                for li in (layer_range() if getattr(size, "per_layer", False) else (None,)):
                    x = size.eval(values) if li is None else size.eval(values, li)
                    if not _is_int(x) or x <= 0:
                        raise self.err(vp, f"variants.{name}: {size} is {x!r}"
                                           + (f" in layer {li}" if li is not None else "")
                                           + "; a size must be a positive int", at_key=True)
                return
            for t in size.terms:
                for f in t:
                    if isinstance(f, str) and values[f] <= 0:
                        raise self.err(at(f), f"variants.{name}.{f}: must be positive, got {values[f]}", at_key=f not in given)

        for p in params:
            if p.when is not None and not any(p.in_layer(values, li) for li in range(layer.count.eval(values))):
                continue                  # exists in no layer of this variant (e.g. an optional rank that is None)
            for s in p.shape:
                if isinstance(s, Size) or hasattr(s, "source"):
                    check_ints(s)
        layers = layer.count.eval(values)
        check_ints(layer.count)
        for b in layer.blocks:
            if isinstance(b, NormIR) and b.enabled.literal is not True:
                ep = ("decoder", "layers", "blocks", b.name, "enabled")
                for li in range(layers):
                    on = ev(ep, b.enabled, li)
                    if not isinstance(on, bool):
                        raise self.err(at(b.enabled.symbol) if b.enabled.symbol else ep,
                                       f"variants.{name}: {b.name}.enabled of layer {li} is {on!r}; expected a bool")
            if isinstance(b, AttentionIR):
                for li in (range(layers) if b.per_layer_shape else (None,)):     # each layer's shape
                    h, kv, hd = (size_at(x, values, li) for x in (b.heads, b.kv_heads, b.head_dim))
                    in_layer = f" in layer {li}" if li is not None else ""
                    if (b.rotary is not None and b.rotary.kind == "neox" and hd % 2 and b.rotary.fraction is None
                            and b.rotary.dim is None):
                        raise self.err(at(b.head_dim.symbol) if isinstance(b.head_dim, Size) else vp,
                                       f"variants.{name}: {b.name}.head_dim is {hd}{in_layer}; rotary needs an even "
                                       f"head_dim")
                    if h % kv:
                        sym = b.kv_heads.symbol if isinstance(b.kv_heads, Size) else None
                        raise self.err(at(sym), f"variants.{name}: {b.name}.heads ({h}) must be a multiple of "
                                                f"{b.name}.kv_heads ({kv}){in_layer}")
                hd = size_at(b.head_dim, values, 0 if b.per_layer_shape else None)
                if b.sliding_window is not None:
                    for li in range(layers):
                        w = ev(("decoder", "layers", "blocks", b.name, "sliding_window"), b.sliding_window, li)
                        if w is not None and (not _is_int(w) or w < 1):
                            raise self.err(("decoder", "layers", "blocks", b.name, "sliding_window"),
                                           f"variants.{name}: {b.name}.sliding_window of layer {li} is {w!r}; a "
                                           f"window is an int >= 1 or None")
                if b.chunk_size is not None:
                    for li in range(layers):
                        c = ev(("decoder", "layers", "blocks", b.name, "chunk_size"), b.chunk_size, li)
                        if c is not None and (not _is_int(c) or c < 1):
                            raise self.err(("decoder", "layers", "blocks", b.name, "chunk_size"),
                                           f"variants.{name}: {b.name}.chunk_size of layer {li} is {c!r}; a "
                                           f"chunk is an int >= 1 or None")
                if b.rotary is not None:
                    self.check_rotary_variant(name, b, values, layers, at)
                if b.experts is not None:
                    h, kv = (size_at(x, values, 0 if b.per_layer_shape else None) for x in (b.heads, b.kv_heads))
                    n, k = b.experts.count.eval(values), b.experts.top_k.eval(values)
                    if k > n:
                        raise self.err(("decoder", "layers", "blocks", b.name, "experts", "top_k"),
                                       f"variants.{name}: {b.name}.experts.top_k ({k}) exceeds its experts ({n})")
                    if h != k * kv:
                        raise self.err(("decoder", "layers", "blocks", b.name, "heads"),
                                       f"variants.{name}: {b.name}.heads is {h}; a mixture of attention heads has "
                                       f"experts.top_k * kv_heads = {k} * {kv} query heads per token")
                if b.rotary is not None and b.rotary.mrope_section is not None:
                    sec = b.rotary.mrope_section.eval(values)
                    if len(sec) != 3 or any(x < 0 for x in sec):
                        where = at(b.rotary.mrope_section.symbol) if b.rotary.mrope_section.symbol else \
                            ("decoder", "layers", "blocks", b.name, "rotary", "mrope_section")
                        raise self.err(where, f"variants.{name}: mrope_section {list(sec)}: three sections (t, h, "
                                              f"w), each >= 0")
                    if sum(sec) != hd // 2 or hd % 2:
                        where = at(b.rotary.mrope_section.symbol) if b.rotary.mrope_section.symbol else \
                            ("decoder", "layers", "blocks", b.name, "rotary", "mrope_section")
                        raise self.err(where, f"variants.{name}: mrope_section {list(sec)} sums to {sum(sec)}, "
                                              f"expected head_dim / 2 = {hd // 2}")
            if isinstance(b, MLAIR):
                self.check_mla_variant(name, b, values, at, vp, layers)
            if isinstance(b, Mamba2IR) and b.heads.eval(values) % b.groups.eval(values):
                sym = b.heads.symbol if isinstance(b.heads, Size) else None
                raise self.err(at(sym) if sym else vp,
                               f"variants.{name}: {b.name}.heads ({b.heads.eval(values)}) must be a multiple of "
                               f"{b.name}.groups ({b.groups.eval(values)})")
            if isinstance(b, GatedDeltaNetIR) and b.value_heads.eval(values) % b.key_heads.eval(values):
                sym = b.value_heads.symbol if isinstance(b.value_heads, Size) else None
                raise self.err(at(sym) if sym else vp,
                               f"variants.{name}: {b.name}.value_heads ({b.value_heads.eval(values)}) must be a "
                               f"multiple of {b.name}.key_heads ({b.key_heads.eval(values)})")
            if isinstance(b, RGLRUIR) and b.width.eval(values) % b.heads.eval(values):
                sym = b.width.symbol if isinstance(b.width, Size) else None
                raise self.err(at(sym) if sym else vp,
                               f"variants.{name}: {b.name}.width ({b.width.eval(values)}) must be a multiple of "
                               f"{b.name}.heads ({b.heads.eval(values)}): the gates' diagonal blocks")
            if isinstance(b, MoEIR) and b.groups is not None:
                self.check_groups_variant(name, b, values, at, vp)
            if isinstance(b, MoEIR) and b.routing == "sparsemixer" and b.top_k.eval(values) != 2:
                raise self.err(at(b.top_k.symbol) if isinstance(b.top_k, Size) else vp,
                               f"variants.{name}: {b.name}.top_k is {b.top_k.eval(values)}; routing: sparsemixer "
                               f"chooses two experts (top_k must be 2)")
            if isinstance(b, MoEIR) and b.top_k.eval(values) > b.router_width.eval(values):
                raise self.err(at(b.top_k.symbol) if isinstance(b.top_k, Size) else vp,
                               f"variants.{name}: {b.name}.top_k ({b.top_k.eval(values)}) exceeds its experts "
                               f"({b.router_width.eval(values)})")
        self.check_dataflow_variant(name, values, layer)
        for i, stp in enumerate(layer.all_steps):
            for st in getattr(stp, "branches", (stp,)):
                if st.choice is None:
                    continue
                key = "select" if st.choice.cases else "if"
                for li in range(layers):
                    try:
                        x = st.choice.cond.eval(values, li)
                    except Exception as exc:  # noqa: BLE001 - the spec's formula fails for this variant
                        raise self.err(("decoder", "layers", "dataflow", i, "block", key),
                                       f"variants.{name}: the choice's `{key}` fails for layer {li}: "
                                       f"{type(exc).__name__}: {exc}") from None
                    if st.choice.cases and x not in [v for v, _, _ in st.choice.cases]:
                        raise self.err(("decoder", "layers", "dataflow", i, "block", key),
                                       f"variants.{name}: the choice's `select` gives {x!r} for layer {li}, which "
                                       f"no case names (cases: {', '.join(repr(v) for v, _, _ in st.choice.cases)})")
                    if not st.choice.cases and not isinstance(x, bool):
                        raise self.err(("decoder", "layers", "dataflow", i, "block", key),
                                       f"variants.{name}: the choice's `if` gives {x!r} for layer {li}, not a bool")
        if deepstack and deepstack[-1] >= layers:
            raise self.err(("decoder", "deepstack", "after_layers"),
                           f"decoder.deepstack.after_layers: layer {deepstack[-1]} does not exist in variant "
                           f"{name} ({layers} layers)")
        if levels is not None:
            n = levels.eval(values)
            sym = levels.symbol if isinstance(levels, Size) else None
            where = at(sym) if sym and at(sym) != vp else ("decoder", "deepstack", "levels")
            if n < 1 or n > layers:
                raise self.err(where, f"variants.{name}: decoder.deepstack.levels is {n}, but deepstack levels are "
                                      f"injected after decoder layers 0..levels-1 and there are {layers} layers"
                               if n > layers else f"variants.{name}: decoder.deepstack.levels must be >= 1, got {n}")
        if vision is not None:
            self.check_vision_variant(name, values, vision, embed, at, vp)
        tied = bool(lm_head.tie.eval(values))
        # the declared TP sizes are checked on the rendered model (compiler.check_tp_sizes), the runtime's plan
        return VariantIR(name, tuple(values.items()), tied, layers)
