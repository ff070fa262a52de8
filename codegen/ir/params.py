"""Parameters and their checkpoint sources: `SegmentIR` (a fused projection's segment, its TP split),
`ParamIR` (a parameter, its shape and sharding), `AllOf`, `WeightIR` (where a parameter comes from)."""
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


@dataclass(frozen=True)
class WeightIR:
    param: ParamIR
    sources: Tuple[str, ...]      # with "{i}" for the layer index
    layout: Optional[tuple] = None   # (per, interleave) of one fused tensor's rows; (per, interleave, groups) for per: group
    transpose: bool = False       # the tensor stores [..., in, out]
    interleave: int = 1           # n > 1: the n segments interleaved along the output dim
    squeeze: Any = False          # True: one extra leading unit dim; a tuple: unit dims at those stored positions
    # sources with `{<expression>}` placeholders: each source as a Python f-string body over `layer_idx`, `config`
    fstrings: Tuple[str, ...] = ()

    @property
    def shard(self) -> str:
        return self.param.shard
