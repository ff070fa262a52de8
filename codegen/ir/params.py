"""Parameters and their checkpoint sources: `SegmentIR` (a fused projection's segment, its TP split),
`ParamIR` (a parameter, its shape and sharding), `AllOf`, `WeightIR` (where a parameter comes from), `LayoutChoice`
(a fused tensor's row layout chosen by the checkpoint's config), `SegmentGroupIR` (one tensor holding several segments
of a fused parameter)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

from .values import Size


@dataclass(frozen=True)
class SegmentIR:
    name: str
    heads: Size
    unit: Size
    replicate_ok: bool = False

    def py(self) -> str:
        unit = "" if self.unit.terms == ((1,),) else f", {self.unit.py()}"
        rep = ", replicate_ok=True" if self.replicate_ok else ""
        return f'Segment("{self.name}", {self.heads.py()}{unit}{rep})'


@dataclass(frozen=True)
class ParamIR:
    name: str                     # e.g. "model.layers.{i}.self_attn.qkv_proj.weight"
    block: str                    # spec path of the block that creates it, e.g. "decoder.layers.blocks.self_attn"
    shape: Tuple[Size, ...]
    shard: str                    # the sharding its layer implies: replicated | colwise | rowwise | vocab
    segments: Tuple[SegmentIR, ...] = ()
    vocab: Optional[Size] = None
    per_layer: bool = False
    only_if_untied: Optional[str] = None   # lm_head: exists only when this bool config symbol is false
    repeat: Optional[Size] = None          # vision: one per block / deepstack level ({i}); None: once or per layer
    tp_if: Optional[Tuple[str, Size]] = None   # vision: (flag, units): sharded only when TP divides units,
                                               # else replicated (the runtime vision layers decide alike)
    experts: Optional[Size] = None         # a stacked expert parameter [experts, ...]: sources name `{e}`; the
                                           # split dim of colwise / rowwise is the one after the expert dim
    when: Optional[Tuple[Any, bool]] = None    # per-layer choice: exists in layer i iff cond(i) == the bool
    stacked: bool = False                  # a fused parameter the checkpoint stores whole under its own name

    def in_layer(self, values: Mapping[str, Any], layer: int) -> bool:
        return self.when is None or bool(self.when[0].eval(values, layer)) == self.when[1]


@dataclass(frozen=True)
class AllOf:
    """A conjunction of parameter conditions ((bool expression, value), ...): a parameter that exists only under its
    block's own condition (MLA's low-rank q where q_lora_rank is set) inside a per-layer block choice."""
    conds: Tuple[Tuple[Any, bool], ...]

    def eval(self, values: Mapping[str, Any], layer: Optional[int] = None) -> bool:
        return all(bool(c.eval(values, layer)) == v for c, v in self.conds)

    def __str__(self) -> str:
        return " and ".join(f"({c})" if v else f"not ({c})" for c, v in self.conds)


def layout_text(layout: Optional[tuple]) -> str:
    """A fixed row layout as explain prints it: `per head: q k v`, `per group of 4: q v k`; None: `blocked`."""
    if layout is None:
        return "blocked"
    return f"per {layout[0]}{' of ' + str(layout[2]) if len(layout) > 2 else ''}: {' '.join(layout[1])}"


@dataclass(frozen=True)
class LayoutChoice:
    """`layout: {if: cond, then: A, else: B}`: the row layout the checkpoint's config chooses, A where `cond` (a
    Value over config symbols, never `layer`) holds, else B. A and B are fixed layouts as WeightIR.layout holds them,
    or None where the branch is the blocked tensor itself (`per: tensor` in the segments' order: nothing to undo)."""
    cond: Any                     # a Value
    then: Optional[tuple]
    else_: Optional[tuple]

    def __str__(self) -> str:
        return f"{layout_text(self.then)} if {self.cond}, else {layout_text(self.else_)}"


@dataclass(frozen=True)
class SegmentGroupIR:
    """Consecutive segments of a fused parameter read from one checkpoint tensor (a `from` mapping's key `k+v`): its
    rows hold them blocked in their order (`layout` None) or in a fixed row layout (as WeightIR.layout holds one) or
    a LayoutChoice over these segments alone."""
    segments: Tuple[str, ...]
    layout: Any = None

    @property
    def key(self) -> str:
        return "+".join(self.segments)

    @property
    def layout_choice(self) -> Optional[LayoutChoice]:
        return self.layout if isinstance(self.layout, LayoutChoice) else None

    @property
    def fixed_layouts(self) -> Tuple[tuple, ...]:
        c = self.layout_choice
        return tuple(x for x in ((c.then, c.else_) if c else (self.layout,)) if x is not None)

    def __str__(self) -> str:
        lay = self.layout
        return str(lay) if isinstance(lay, LayoutChoice) else layout_text(lay)


@dataclass(frozen=True)
class WeightIR:
    param: ParamIR
    sources: Tuple[str, ...]      # with "{i}" for the layer index
    # (per, interleave) of one fused tensor's rows; (per, interleave, groups) for per: group; or a LayoutChoice
    layout: Any = None
    transpose: bool = False       # the tensor stores [..., in, out]
    interleave: int = 1           # n > 1: the n segments interleaved along the output dim
    squeeze: Any = False          # True: one extra leading unit dim; a tuple: unit dims at those stored positions
    # sources with `{<expression>}` placeholders: each source as a Python f-string body over `layer_idx`, `config`
    fstrings: Tuple[str, ...] = ()
    # a `from` mapping's keys `k+v`: the segments one tensor holds (sources still lists one name per segment)
    groups: Tuple[SegmentGroupIR, ...] = ()

    @property
    def shard(self) -> str:
        return self.param.shard

    @property
    def layout_choice(self) -> Optional[LayoutChoice]:
        """The LayoutChoice of a row layout chosen by a config flag (None: fixed, or none)."""
        return self.layout if isinstance(self.layout, LayoutChoice) else None

    @property
    def fixed_layouts(self) -> Tuple[tuple, ...]:
        """The fixed row layouts the generated module names (a choice's branches other than the blocked one), its
        segment groups' included."""
        c = self.layout_choice
        own = tuple(x for x in ((c.then, c.else_) if c else (self.layout,)) if x is not None)
        return own + tuple(x for g in self.groups for x in g.fixed_layouts)

    @property
    def layout_choices(self) -> Tuple[LayoutChoice, ...]:
        """Every LayoutChoice the generated module names: the tensor's own, its segment groups'."""
        return tuple(c for c in (self.layout_choice,) + tuple(g.layout_choice for g in self.groups) if c is not None)
