"""`decoder.schedule` resolved: rewrites of the residual stream before chosen layers (`BeforeLayerIR`), over the
stream, carried values, the schedule's learned vectors and its norms."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .blocks import NormIR
from .values import Size, Value


@dataclass(frozen=True)
class BeforeLayerIR:
    when: Value                                   # a bool over config symbols and `layer`
    target: str                                   # "stream" or a carried value's name
    terms: Tuple[Tuple[str, Optional[str]], ...]  # (value name, norm name or None), summed left to right


@dataclass(frozen=True)
class ScheduleIR:
    norms: Tuple[NormIR, ...]
    vectors: Tuple[Tuple[str, Size], ...]
    ops: Tuple[BeforeLayerIR, ...]

    @property
    def carried(self) -> Tuple[str, ...]:
        return tuple(dict.fromkeys(op.target for op in self.ops if op.target != "stream"))

    def term_py(self, name: str, norm: Optional[str]) -> str:
        """The Python expression of one term inside the generated `before_layer` (locals: stream, carried)."""
        vectors = dict(self.vectors)
        v = ("stream" if name == "stream" else f"self.{name}.to(stream.dtype).expand_as(stream)" if name in vectors
             else f'carried["{name}"]')
        return f"self.{norm}({v})" if norm else v
