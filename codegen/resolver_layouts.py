"""The checkpoint-naming part of the resolver: `checkpoint_prefixes` (the checkpoint name of a parameter without a
`weights` entry) and the row `layout` of a fused checkpoint tensor (`weights[...].layout`), with its static checks:
the layout names the parameter's segments, the parameter is a fused column-parallel one, and in every variant the
segments' heads fit the groups. A mixin of resolver._Resolver, as resolver_blocks.py is."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

from .errors import did_you_mean
from .ir import ParamIR


class LayoutResolver:
    def checkpoint_name(self, name: str) -> str:
        """The checkpoint tensor a parameter without a `weights` entry loads: its own name, with the longest matching
        `checkpoint_prefixes` prefix replaced."""
        best: Optional[Tuple[str, str]] = None
        for pre, to in self.spec.checkpoint_prefixes.items():
            full = self.rename(pre)
            if name.startswith(full) and (best is None or len(full) > len(best[0])):
                best = (full, to)
        return name if best is None else best[1] + name[len(best[0]):]

    def check_prefixes(self, params: Tuple[ParamIR, ...]) -> None:
        for pre, to in self.spec.checkpoint_prefixes.items():
            path = ("checkpoint_prefixes", pre)
            if not pre or not to or "{" in pre + to or "}" in pre + to:
                raise self.err(path, f"checkpoint_prefixes: '{pre}: {to}': two non-empty name prefixes without "
                                     f"placeholders", at_key=True)
            if not any(p.name.startswith(self.rename(pre)) for p in params):
                raise self.err(path, f"checkpoint_prefixes: no parameter name starts with '{pre}'"
                                     f"{did_you_mean(pre, sorted({p.name.rsplit('.', 1)[0] + '.' for p in params}))}",
                               at_key=True)

    def resolve_layout(self, path: tuple, where: str, p: ParamIR, entry) -> Optional[Tuple[str, Tuple[str, ...]]]:
        lay = entry.layout
        if lay is None:
            return None
        lp = path + ("layout",)
        names = [s.name for s in p.segments]
        if not isinstance(entry.from_, str):
            raise self.err(lp, f"{where}.layout: a layout describes one fused checkpoint tensor: give `from` one name "
                               f"(a mapping of segments is already split)", at_key=True)
        if len(p.segments) < 2 or p.shard != "colwise" or p.experts is not None or p.tp_if is not None:
            raise self.err(lp, f"{where}.layout: only a fused column-parallel parameter (attention qkv, gated MLP "
                               f"gate_up, fused_linear) has segments to lay out", at_key=True)
        inter = list(lay.interleave)
        if sorted(inter) != sorted(names) or len(set(inter)) != len(inter):
            bad = next((n for n in inter if n not in names), None)
            raise self.err(lp + ("interleave",), f"{where}.layout.interleave: must name each of the parameter's "
                                                 f"segments {names} once, got {inter}"
                                                 f"{did_you_mean(bad, names) if bad else ''}")
        self.layouts_to_check.append((lp, where, p, lay.per))
        return lay.per, tuple(inter)

    def check_layout_variant(self, name: str, values: Mapping[str, Any]) -> None:
        """In a variant, each laid-out parameter's segments split into the layout's groups."""
        for lp, where, p, per in self.layouts_to_check:
            heads = {s.name: s.heads.eval(values) for s in p.segments}
            shown = ", ".join(f"{n}: {h}" for n, h in heads.items())
            if per == "head" and len(set(heads.values())) != 1:
                raise self.err(lp + ("per",), f"variants.{name}: {where}.layout per: head needs every segment to "
                                              f"have as many heads, got {shown}")
            if per == "kv_group":
                g = min(heads.values())
                bad = [n for n, h in heads.items() if h % g]
                if bad:
                    raise self.err(lp + ("per",), f"variants.{name}: {where}.layout per: kv_group: {shown}: segment "
                                                  f"'{bad[0]}' does not split into {g} groups")

