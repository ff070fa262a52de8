"""The vision tower: its blocks (patch embedding, position embedding, attention, MLP, patch merger), its steps
and `VisionIR`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from .params import WeightIR
from .values import Ratio, Size, Value


@dataclass(frozen=True)
class PatchEmbedIR:
    name: str
    in_channels: Size
    temporal_patch: Size
    patch: Size
    dim: Size


@dataclass(frozen=True)
class PosEmbedIR:
    name: str
    positions: Size
    dim: Size


@dataclass(frozen=True)
class VisionAttentionIR:
    kind: str
    name: str
    hidden: Size
    heads: Size
    head_dim: Ratio
    theta: Value


@dataclass(frozen=True)
class VisionMLPIR:
    kind: str
    name: str
    hidden: Size
    intermediate: Size
    activation: str               # gelu_tanh | gelu

    @property
    def approximate(self) -> str:
        return "tanh" if self.activation == "gelu_tanh" else "none"


@dataclass(frozen=True)
class PatchMergerIR:
    name: str
    dim: Size
    out: Size
    merged: Size                  # dim * merge * merge
    norm: str                     # before_merge | after_merge
    eps: Value


@dataclass(frozen=True)
class VisionStepIR:
    norm: str
    block: str
    takes_rotary: bool            # attention gets (x, cu_seqlens, rotary); the MLP (x)


@dataclass(frozen=True)
class VisionIR:
    prefix: str                   # e.g. model.visual
    class_name: str
    block_class: str
    merge: Size
    patch_embed: PatchEmbedIR
    pos_embed: PosEmbedIR
    attention: VisionAttentionIR  # the blocks' attention: its head_dim and theta make the shared rotary
    count: Size
    blocks: Tuple[Any, ...]       # NormIR | VisionAttentionIR | VisionMLPIR
    steps: Tuple[VisionStepIR, ...]
    merger: PatchMergerIR
    deepstack_taps: Optional[Value]        # int_tuple symbol or literal tuple
    deepstack_count: Optional[Size]        # number of deepstack mergers (= levels)
    deepstack_merger: Optional[PatchMergerIR]
    weights: Tuple["WeightIR", ...] = ()

    @property
    def attr(self) -> str:
        return self.prefix.rsplit(".", 1)[-1]

    @property
    def tp_flags(self) -> Tuple[Tuple[str, Size], ...]:
        seen: dict = {}
        for w in self.weights:
            if w.param.tp_if and w.param.tp_if[0] not in seen:
                seen[w.param.tp_if[0]] = w.param.tp_if[1]
        return tuple(seen.items())
