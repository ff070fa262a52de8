"""How a stacked expert parameter of FusedMoE (layers/moe.py) or a routed linear (layers/routed.py) is split over
the TP ranks and loaded (ExpertSplit, attached as the parameter's `tp_split` and `weight_loader`).

Loading (`param.weight_loader(param, loaded, shard_id)`): shard_id "e.gate" / "e.up" (gate_up_proj) or "e"
(down_proj) fills expert e from a per-expert checkpoint tensor, reading only this rank's rows; shard_id None
means `loaded` is the whole stacked tensor, [E, out, in]; a checkpoint that stores each expert [in, out] is read
through the spec's declared `transpose: true` layout. The orientation is never guessed from the
shape: a square expert cannot show it, so a spec that forgot `transpose` would load such experts transposed
silently; a non-square [E, in, out] is refused naming the fix. The weight plan names every expert's tensors
(`param.tp_split.expert_ids`: all experts, so that every checkpoint tensor is accounted for); an expert another
rank holds is skipped without reading its bytes (`param.tp_split.local_expert_ids` are this rank's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from xllm_gen.runtime.executor.sharding import ParamSplit, SegmentSlice, WeightLoadError, source_shape


class _ExpertWindow:
    """Expert e of a stacked [E, rows, cols] tensor or lazy slice, itself sliceable lazily ([rows], [:, cols])."""

    def __init__(self, base, e: int):
        self.base, self.e = base, e

    def get_shape(self) -> list[int]:
        return list(source_shape(self.base)[1:])

    def __getitem__(self, idx):
        idx = (idx if isinstance(idx, tuple) else (idx,)) + (slice(None),) * 2
        rows, cols = idx[0], idx[1]
        if len(source_shape(self.base)) == 2:                    # a stacked bias [E, rows]
            return self.base[(slice(self.e, self.e + 1), rows)][0]
        return self.base[(slice(self.e, self.e + 1), rows, cols)][0]


class _FlatExperts:
    """A tensor (or lazy slice) storing the experts' matrices one after another along dim 0, [E * rows, cols] (one release's
    `experts.mlp.w1`), seen as the stacked [E, rows, cols]; reads only the rows asked for."""

    def __init__(self, base, num_experts: int):
        shape = source_shape(base)
        self.base, self.rows, self.cols, self.e = base, shape[0] // num_experts, shape[1], num_experts

    def get_shape(self) -> list[int]:
        return [self.e, self.rows, self.cols]

    def __getitem__(self, idx):
        idx = (idx if isinstance(idx, tuple) else (idx,)) + (slice(None),) * 3
        ea, eb, _ = idx[0].indices(self.e)
        ra, rb, _ = idx[1].indices(self.rows)
        return torch.stack([self.base[(slice(e * self.rows + ra, e * self.rows + rb), idx[2])] for e in range(ea, eb)])


def _stacked(loaded, want: tuple):
    """`loaded` as a stacked [E, a, b] source of the stacked parameter shape `want` [E, ...]: a flat 2-D tensor
    [E * a, b] (experts one after another) is viewed as [E, a, b]; one declared transposed (a `weights` entry's
    `transpose`: each expert's matrix stored [in, out], flat [E * in, out]) as its experts' matrices transposed, so
    that a square expert is read in the declared layout, not guessed from its shape; anything else is returned as
    it is."""
    from xllm_gen.runtime.loading.weights import LayoutView, TensorLayout
    if isinstance(loaded, LayoutView) and loaded.layout == TensorLayout(loaded.layout.source, transpose=True) \
            and len(want) == 3:
        base = tuple(source_shape(loaded.base))
        if len(base) == 2 and base[0] % want[0] == 0 and (base[0] // want[0], base[1]) == (want[2], want[1]):
            return LayoutView(_FlatExperts(loaded.base, want[0]), loaded.layout)
    shape = tuple(source_shape(loaded))
    if len(want) == 3 and len(shape) == 2 and shape[0] % want[0] == 0 and \
            (shape[0] // want[0], shape[1]) in ((want[1], want[2]), (want[2], want[1])):
        return _FlatExperts(loaded, want[0])      # [E, in, out] is refused by the caller, naming `transpose`
    return loaded


def _orientation_error(what: str, shape: tuple, want: tuple) -> WeightLoadError:
    if len(want) == 3 and shape == (want[0], want[2], want[1]):
        return WeightLoadError(f"{what}: shape {shape} is (experts, in, out), the spec reads (experts, out, in) "
                               f"{want}: if the checkpoint stores each expert's matrix [in, out], say so in the spec's "
                               f"`weights` (`<parameter>: {{transpose: true}}`); the loader does not guess it from "
                               f"the shape (a square expert cannot show it)")
    return WeightLoadError(f"{what}: shape {shape}, expected {want} (experts, out, in)")


@dataclass(frozen=True)
class ExpertSplit:
    """How a stacked expert parameter [E_local, rows, cols] is split, for this rank; `load` is its weight loader.

    `inner` splits one expert's matrix (column: rows per segment; row: columns); experts
    [expert_start, expert_start + E_local) are held. Reads as a ParamSplit for the TP plan: kind, dim,
    segments, global_shape()."""
    inner: ParamSplit
    num_experts: int
    expert_start: int
    expert_stop: int
    mode: str                              # tensor | expert
    owner: str = ""

    # ---- the ParamSplit view (tp_check, loader) ----
    @property
    def kind(self) -> str:
        return "expert" if self.mode == "expert" else self.inner.kind

    @property
    def dim(self) -> Optional[int]:
        if self.mode == "expert":
            return 0 if self.tp_size > 1 else None
        return None if self.inner.dim is None else self.inner.dim + 1

    @property
    def segments(self) -> tuple[SegmentSlice, ...]:
        if self.mode == "expert":
            return (SegmentSlice("experts", self.num_experts, self.expert_start, self.expert_stop),)
        return self.inner.segments

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.expert_stop - self.expert_start,) + tuple(self.inner.shape)

    @property
    def tp_size(self) -> int:
        return self.inner.tp_size

    @property
    def tp_rank(self) -> int:
        return self.inner.tp_rank

    @property
    def expert_ids(self) -> range:
        """Every expert: the shard ids the weight plan fills (another rank's are skipped at load)."""
        return range(self.num_experts)

    @property
    def local_expert_ids(self) -> range:
        return range(self.expert_start, self.expert_stop)

    def global_shape(self) -> tuple[int, ...]:
        return (self.num_experts,) + tuple(self.inner.global_shape())

    @property
    def segment_names(self) -> tuple[str, ...]:
        names = self.inner.segment_names if len(self.inner.segments) > 1 else ("",)
        return tuple(f"{e}.{n}" if n else str(e) for e in self.expert_ids for n in names)

    def segment_index(self, shard_id: Union[int, str]) -> int:
        segs = self.inner.segment_names if len(self.inner.segments) > 1 else ()
        e, dot, seg = str(shard_id).partition(".") if isinstance(shard_id, str) else ("", "", "")
        if e.isdigit() and int(e) < self.num_experts and str(int(e)) == e and bool(dot) == bool(segs) \
                and (not segs or seg in segs):
            return int(e) * max(1, len(segs)) + (segs.index(seg) if segs else 0)
        raise WeightLoadError(f"{self.owner or 'the layer'} has no expert segment {shard_id!r}: shard ids are 'e' "
                              f"(e < {self.num_experts}) or 'e.<segment>' ({', '.join(self.inner.segment_names)})")

    def segment_indices(self, shard_id: Union[int, str]) -> tuple[int, ...]:
        """The segments a shard id fills: one ('e' / 'e.<segment>'), or a segment of every expert (a bare segment
        name: one stacked tensor per segment, e.g. w1 = gate, v1 = up of all experts)."""
        segs = self.inner.segment_names if len(self.inner.segments) > 1 else ()
        if isinstance(shard_id, str) and shard_id in segs:
            k = segs.index(shard_id)
            return tuple(e * len(segs) + k for e in self.expert_ids)
        return (self.segment_index(shard_id),)

    def load(self, param: torch.Tensor, loaded, shard_id: Union[int, str, None] = None) -> None:
        segs = self.inner.segment_names if len(self.inner.segments) > 1 else ()
        if isinstance(shard_id, str) and shard_id in segs:        # one segment of every expert, stacked (or flat)
            k = segs.index(shard_id)
            inner = self.inner.global_shape()
            rows = inner[0] // len(segs)
            want = (self.num_experts, rows, inner[1])
            loaded = _stacked(loaded, want)
            shape = tuple(source_shape(loaded))
            if shape != want:
                raise _orientation_error(f"segment {shard_id!r} of all experts", shape, want)
            for e in self.local_expert_ids:
                self.inner.load(param[e - self.expert_start], _ExpertWindow(loaded, e), segs[k])
            return
        if shard_id is None:                                      # the whole stacked tensor [E, out, in] / [E, in, out]
            loaded = _stacked(loaded, self.global_shape())
            shape, want = tuple(source_shape(loaded)), self.global_shape()
            if len(want) == 2 and shape != want:                  # a stacked bias [E, out]
                raise WeightLoadError(f"shape {shape}, expected {want} (experts, out)")
            if shape != want:
                raise _orientation_error("the stacked experts", shape, want)
            for e in self.local_expert_ids:
                self.inner.load(param[e - self.expert_start], _ExpertWindow(loaded, e), None)
            return
        self.segment_index(shard_id)                              # raises for an unknown id
        e, _, seg = str(shard_id).partition(".")
        if not self.expert_start <= int(e) < self.expert_stop:    # another rank's expert: nothing read
            return
        self.inner.load(param[int(e) - self.expert_start], loaded, seg or None)


def _attach_experts(param: nn.Parameter, split: ExpertSplit) -> None:
    param.tp_split = split
    param.weight_loader = split.load
