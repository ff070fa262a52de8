"""Hyper-connections (`HyperIR`): the resolved `hyper_connection` block (codegen/schema/hyper.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .values import Size, Value


@dataclass(frozen=True)
class HyperIR:
    kind: str                     # hyper_connection
    name: str
    streams: Size
    dim: Size
    form: str                     # fused | low_rank
    norm_eps: Value
    per_stream: bool = False
    norm_weight: bool = False
    norm_offset: float = 0.0
    rank: Optional[Size] = None
    pre_eps: Value = Value(literal=0)
    post: bool = True
    magnitude: Value = Value(literal=1)
    post_eps: Value = Value(literal=0)
    mix: bool = False
    sinkhorn_iters: Optional[Size] = None
    mix_eps: Value = Value(literal=0)

    @property
    def hidden(self) -> Size:
        return self.dim

    def ctor(self) -> str:
        """The runtime constructor, its arguments from `config` (generated code)."""
        args = [self.streams.py(), self.dim.py(), repr(self.form), self.norm_eps.py()]
        kw = []
        if self.norm_weight:
            kw.append("norm_weight=True")
        if self.norm_offset:
            kw.append(f"norm_offset={self.norm_offset!r}")
        if self.per_stream:
            kw.append("per_stream=True")
        if self.rank is not None:
            kw.append(f"rank={self.rank.py()}")
        if self.pre_eps.literal != 0:
            kw.append(f"pre_eps={self.pre_eps.py()}")
        if not self.post:
            kw.append("post=False")
        else:
            if self.magnitude.literal != 1:
                kw.append(f"magnitude={self.magnitude.py()}")
            if self.post_eps.literal != 0:
                kw.append(f"post_eps={self.post_eps.py()}")
        if self.mix:
            kw.append(f"mix=True, sinkhorn_iters={self.sinkhorn_iters.py()}")
            if self.mix_eps.literal != 0:
                kw.append(f"mix_eps={self.mix_eps.py()}")
        return f"L.HyperConnection({', '.join(args + kw)})"

    def describe(self) -> str:
        norm = (f"rms(eps={self.norm_eps}, {'per stream' if self.per_stream else 'over all streams'}"
                + (f", weight = {self.norm_offset:g} + w" if self.norm_weight else "") + ")")
        out = f"hyper_connection(streams={self.streams}, dim={self.dim}, form={self.form}"
        out += f", rank={self.rank}" if self.rank is not None else ""
        out += f", norm={norm}"
        out += f", pre_eps={self.pre_eps}" if self.form == "fused" else ""
        out += f", post=({self.magnitude} * sigmoid + {self.post_eps})" if self.post else ", collapse only"
        out += (f", mix=sinkhorn(iters={self.sinkhorn_iters}, eps={self.mix_eps})" if self.mix
                else (", mix=identity" if self.post else ""))
        return out + ")"
