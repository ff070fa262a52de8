"""The rotary part of the resolver: the axes of an attention block's `rotary` that compose with its kind and
scaling (partial `fraction` / `dim`, `layout`, per-layer `enabled`, a per-layer `scaling` choice), and their
checks per variant. A mixin of resolver._Resolver (through resolver_blocks.BlockResolver), which provides err /
num / dim / symbol / expr."""
from __future__ import annotations

from typing import Any, Optional

from .expr import is_symbol
from .ir import AttentionIR, Value, size_at


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class RotaryResolver:
    def rope_scaling(self, path, value: str) -> Value:
        """`scaling`: a `type: rope` symbol, or an expression (may read `layer`) whose value is a rope mapping or
        None, e.g. "rope_global if layer_types[layer] == 'full_attention' else rope_local"."""
        if is_symbol(value):
            self.symbol(path, value, ("rope",))
            return Value(symbol=value)
        e = self.expr(path, value, per_layer=True)
        if not any(n != "layer" and self.config[n].type == "rope" for n in e.names):
            raise self.err(path, f"{self._where(path)}: a scaling expression chooses among `type: rope` config "
                                 f"symbols; '{value}' reads none")
        return Value(expr=e)

    def rotary_axes(self, rp, rot):
        """(fraction, dim, layout, enabled, layout_symbol) of a rotary mapping, checked statically (a layout chosen
        by a str symbol: its first value, and the symbol)."""
        fraction = rdim = None
        if rot.fraction is not None and rot.dim is not None:
            raise self.err(rp + ("dim",), f"{self._where(rp)}: give the rotary dims as `fraction` or as `dim`, "
                                          f"not both")
        layout, layout_symbol = rot.layout, None
        if layout not in ("neox", "interleaved"):      # a str symbol selects the layout from the checkpoint's config
            f = self.symbol(rp + ("layout",), layout, ("str",))
            bad = [v for v in (f.values or ()) if v not in ("neox", "interleaved")]
            if not f.values or bad:
                raise self.err(rp + ("layout",), f"{self._where(rp)}.layout: config symbol '{layout}' selects the "
                                                 f"rotary layout: its `values` must list layouts (neox, interleaved)"
                                                 + (f", not {bad[0]!r}" if bad else ""))
            layout, layout_symbol = f.values[0], rot.layout
        if rot.kind != "neox" and (rot.fraction is not None or rot.dim is not None or rot.layout != "neox"):
            key = "fraction" if rot.fraction is not None else "dim" if rot.dim is not None else "layout"
            raise self.err(rp + (key,), f"{self._where(rp)}.{key}: partial or interleaved rotary is for kind "
                                        f"neox only (not {rot.kind})")
        if rot.fraction is not None:
            fraction = self.num(rp + ("fraction",), rot.fraction, per_layer=True)   # may read `layer`
            if fraction.expr is None and fraction.symbol is None and not 0 < fraction.literal <= 1:
                raise self.err(rp + ("fraction",), f"{self._where(rp)}.fraction: must be in (0, 1], got "
                                                   f"{fraction.literal}")
        if rot.dim is not None:
            self.dim(rp + ("dim",), rot.dim)            # a size: literal > 0, int symbol or expression
            if isinstance(rot.dim, int):
                if rot.dim % 2:
                    raise self.err(rp + ("dim",), f"{self._where(rp)}.dim: rotary dims must be even, got {rot.dim}")
                rdim = Value(literal=rot.dim)
            else:
                rdim = Value(symbol=rot.dim) if is_symbol(rot.dim) else Value(expr=self.expr(rp + ("dim",), rot.dim))
        enabled = self.rotary_enabled(rp + ("enabled",), rot.enabled)
        return fraction, rdim, layout, enabled, layout_symbol

    def rotary_enabled(self, path, value) -> Value:
        if isinstance(value, bool):
            return Value(literal=value)
        if is_symbol(value):
            self.symbol(path, value, ("bool",))
            return Value(symbol=value)
        return Value(expr=self.expr(path, value, per_layer=True))

    def check_rotary_variant(self, name: str, b: AttentionIR, values, layers: int, at) -> None:
        """Per variant: the rotary dims are even and within head_dim, `enabled` is a bool and `scaling` a rope
        mapping (or None) on every layer."""
        rot = b.rotary
        rp = ("decoder", "layers", "blocks", b.name, "rotary")
        per_layer = rot.fraction is not None and rot.fraction.per_layer or b.per_layer_shape
        for li in (range(min(layers, 256)) if per_layer else (None,)):
            hd = size_at(b.head_dim, values, li)
            rd = rotary_dims(rot, hd, values, li)
            if rd is not None:
                src = rot.fraction if rot.fraction is not None else rot.dim
                where = at(src.symbol) if src.symbol else rp + ("fraction" if rot.fraction is not None else "dim",)
                if not _is_int(rd) or not 0 < rd <= hd or rd % 2:
                    raise self.err(where, f"variants.{name}: {b.name} rotates {rd!r} dims of head_dim {hd}"
                                          + (f" in layer {li}" if li is not None else "")
                                          + "; the rotary dims must be an even int in 2..head_dim")
        for li in range(min(layers, 256)):
            on = rot.enabled.eval(values, li)
            if not isinstance(on, (bool, int)) or isinstance(on, float):
                raise self.err(at(rot.enabled.symbol) if rot.enabled.symbol else rp + ("enabled",),
                               f"variants.{name}: {b.name}.rotary.enabled of layer {li} is {on!r}; expected a bool")
            if rot.scaling is not None and rot.scaling.expr is not None:
                sc = rot.scaling.eval(values, li)
                if sc is not None and not isinstance(sc, dict):
                    raise self.err(rp + ("scaling",), f"variants.{name}: {b.name}.rotary.scaling of layer {li} is "
                                                      f"{sc!r}; expected a rope mapping or None")


def rotary_dims(rot, head_dim: int, values, layer: Optional[int] = None) -> Optional[int]:
    """The number of rotating dims of a variant (None: the whole head), as the generated code computes it (in
    `layer`, for a per-layer fraction)."""
    if rot.fraction is not None:
        f = rot.fraction.eval(values, layer) if rot.fraction.per_layer else rot.fraction.eval(values)
        return int(head_dim * f) if isinstance(f, (int, float)) and not isinstance(f, bool) else f
    if rot.dim is not None:
        return rot.dim.eval(values)
    return None
