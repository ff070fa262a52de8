"""Checkpoint row layouts: how the rows of a fused checkpoint tensor are ordered, undone at load before sharding.

A fused parameter (attention q | k | v, gated MLP gate | up, a fused_linear) is blocked by segment in the model:
all of q's rows, then k's, then v's. Checkpoints store some of them otherwise:

    per: tensor     [s1 | s2 | ...] in the `order` given (a blocked tensor whose segments come in another order)
    per: head       [h0: s1 s2 ..., h1: s1 s2 ..., ...]: one group per head; every segment has the same number of
                    heads (a fused q|k|v stored per head as [q k v])
    per: kv_group   [g0: s1 s2 ..., g1: ...]: one group per head of the segment with the fewest heads, each group
                    holding heads / groups heads of every segment (a GQA q|k|v stored per KV group as
                    [q * (heads / kv_heads), k, v]; with one KV head it is the blocked multi-query [q * heads, k, v];
                    with as many KV heads as heads it is per head)
    per: group      the same with a fixed number of groups (`groups`; CodeGen: 4 groups of [q v k])

A spec may let the checkpoint's config choose the layout (`layout: {if: <flag>, then: ..., else: ...}`): the generated
module lists a `RowLayoutChoice`, resolved against the model's config when the weight plan is made (runtime.loading.
plan), so a checkpoint is read, and sharded, in the one layout its config says (ChatGLM2/3's `query_key_value`:
blocked [q | k | v] with multi_query_attention, per head without).

A checkpoint may also hold some segments of a fused parameter in one tensor and the others elsewhere (TeleChat2: q in
`query`, k and v in one `key_value` laid out per KV head [kv0: k v, kv1: k v, ...]): a `FusedSource` names the
segments that tensor holds and its RowLayout over them alone (a spec's `from: {q: ..., k+v: {from: ..., layout:
...}}`); each of those segments is read through `FusedSource.segment_view`, the rows of that segment in the tensor
seen blocked, so a rank reads its heads' rows of k and of v (one read of their groups for both).

A head is `unit` rows (head_dim for attention; 1 for an MLP's rows, so `per: head` over gate | up is the
row-interleaved [g0 u0 g1 u1 ...]). `LayoutView` presents the checkpoint tensor as the blocked one the parameter's
weight loader expects; a row range read through it reads only the whole groups holding those rows (a lazy
safetensors slice), once for all segments: each rank reads exactly its share of the tensor (tensor rows / TP), or,
when TP exceeds the groups (KV heads replicated), the one group it serves; never the whole tensor (`per: tensor`,
one group, reads each segment's rows of the rank, as a blocked fused tensor without a layout does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from xllm_gen.runtime.executor.sharding import RowWindow, WeightLoadError, source_shape

PER = ("tensor", "head", "kv_group", "group")


@dataclass(frozen=True)
class RowLayout:
    per: str                          # tensor | head | kv_group | group
    order: tuple[str, ...]            # the segments in the order the checkpoint stores them within a group
    groups: int | None = None         # per: group: the number of groups

    def __post_init__(self):
        if self.per not in PER:
            raise ValueError(f"RowLayout: per must be one of {', '.join(PER)}, not {self.per!r}")
        if (self.per == "group") != (self.groups is not None) or (self.groups is not None and self.groups < 1):
            raise ValueError(f"RowLayout: groups (>= 1) goes with per 'group' and only with it, got {self.groups!r}")
        object.__setattr__(self, "order", tuple(self.order))

    def view(self, loaded, segments: Sequence) -> "LayoutView":
        """`loaded` (a lazy slice or tensor) as the blocked tensor of `segments` (the parameter's split segments in
        the model's order: objects with name, heads, unit)."""
        return LayoutView(loaded, self, [(s.name, int(s.heads), int(s.unit)) for s in segments])


@dataclass(frozen=True)
class RowLayoutChoice:
    """A row layout chosen by the checkpoint's config (a spec's `layout: {if: ..., then: ..., else: ...}`): `then`
    where `cond(config)` holds, else `else_`; None is the blocked tensor itself (nothing to undo). `cond_text` is
    the spec's expression (what the choice reads, for a reader of the generated module and for tests)."""
    cond: Callable[[Any], Any]
    cond_text: str
    then: Optional[RowLayout]
    else_: Optional[RowLayout]

    def pick(self, config) -> Optional[RowLayout]:
        return self.then if self.cond(config) else self.else_


@dataclass(frozen=True)
class FusedSource:
    """Consecutive segments of a fused parameter that one checkpoint tensor holds (a spec's segment-mapping key
    `k+v`), its rows blocked in their order (`layout` None) or in `layout` (a RowLayout over these segments alone, or
    a RowLayoutChoice the model's config resolves: `resolved`)."""
    segments: tuple[str, ...]
    layout: "RowLayout | RowLayoutChoice | None" = None

    def __post_init__(self):
        object.__setattr__(self, "segments", tuple(self.segments))
        if len(self.segments) < 2 or len(set(self.segments)) != len(self.segments):
            raise ValueError(f"FusedSource: two or more distinct segments, got {self.segments!r}")
        if isinstance(self.layout, RowLayout) and sorted(self.layout.order) != sorted(self.segments):
            raise ValueError(f"FusedSource: layout order {list(self.layout.order)} must name the segments "
                             f"{list(self.segments)}")

    def resolved(self, config) -> "FusedSource":
        """The source with a RowLayoutChoice replaced by the layout `config` chooses."""
        if isinstance(self.layout, RowLayoutChoice):
            return FusedSource(self.segments, self.layout.pick(config))
        return self

    def view(self, loaded, segments: Sequence) -> "LayoutView":
        """`loaded` (the tensor) seen blocked [s1 | s2 | ...] in these segments' order; `segments`: the parameter's
        split segments (objects with name, heads, unit), those this tensor holds among them."""
        by = {s.name: s for s in segments}
        missing = [n for n in self.segments if n not in by]
        if missing:
            raise WeightLoadError(f"the tensor holds segments {'+'.join(self.segments)}, but the parameter has no "
                                  f"segment {missing[0]!r} (its segments are {', '.join(by)})")
        layout = self.layout or RowLayout("tensor", self.segments)      # blocked: its rows checked all the same
        return layout.view(loaded, [by[n] for n in self.segments])

    def segment_view(self, view: "LayoutView", name: str) -> RowWindow:
        """The rows of segment `name` in `view` (this source's blocked view), lazily sliceable."""
        for start, stop, seg, _ in view._segments:
            if seg == name:
                return RowWindow(view, start, stop)
        raise WeightLoadError(f"the tensor holds segments {'+'.join(self.segments)}, not {name!r}")


class LayoutView:
    """A fused checkpoint tensor stored in a RowLayout, seen as blocked by segment in the model's order (dim 0)."""

    def __init__(self, base, layout: RowLayout, segments: list[tuple[str, int, int]]):
        names = [n for n, _, _ in segments]
        if sorted(layout.order) != sorted(names):
            raise WeightLoadError(f"layout order {list(layout.order)} must name the parameter's segments {names}")
        heads = {n: h for n, h, _ in segments}
        if layout.per == "tensor":
            groups = 1
        elif layout.per == "head":
            if len(set(heads.values())) != 1:
                raise WeightLoadError(f"layout per: head needs segments of equal heads, got "
                                      f"{', '.join(f'{n}: {h}' for n, h in heads.items())}")
            groups = next(iter(heads.values()))
        else:
            groups = min(heads.values()) if layout.per == "kv_group" else layout.groups
            bad = [n for n, h in heads.items() if h % groups]
            if bad:
                raise WeightLoadError(f"layout per: {layout.per}: segment {bad[0]!r} has {heads[bad[0]]} heads, not a "
                                      f"multiple of the {groups} groups")
        self.base, self.groups = base, groups
        self._span = None                                                   # (lo, hi, rows) last read
        unit = {n: u for n, _, u in segments}
        per_group = {n: heads[n] // groups * unit[n] for n in names}       # rows of a segment in one group
        self.group_rows = sum(per_group.values())
        offset, self._in_group = 0, {}
        for n in layout.order:
            self._in_group[n] = offset
            offset += per_group[n]
        self._segments = []                                                 # (start, stop, name, rows/group)
        start = 0
        for n, h, u in segments:
            self._segments.append((start, start + h * u, n, per_group[n]))
            start += h * u
        self.rows = start
        shape = source_shape(base)
        if not shape or shape[0] != self.rows:
            raise WeightLoadError(f"a tensor of {shape[0] if shape else 0} rows cannot hold the segments "
                                  f"{', '.join(f'{n} [{b - a}]' for a, b, n, _ in self._segments)} ({self.rows} rows)")

    def get_shape(self) -> list[int]:
        return list(source_shape(self.base))

    def _rows(self, a: int, b: int) -> list[int]:
        """The checkpoint rows of the blocked rows [a, b)."""
        out = []
        for start, stop, name, per_group in self._segments:
            lo, hi = max(a, start), min(b, stop)
            for r in range(lo, hi):
                g, j = divmod(r - start, per_group)
                out.append(g * self.group_rows + self._in_group[name] + j)
        return out

    def __getitem__(self, idx):
        import torch

        idx = idx if isinstance(idx, tuple) else (idx,)
        first, rest = idx[0], idx[1:]
        if not isinstance(first, slice) or first.step not in (None, 1):
            raise TypeError("LayoutView supports plain row slices only")
        a, b, _ = first.indices(self.rows)
        rows = self._rows(a, max(a, b))
        if not rows:
            return self.base[(slice(0, 0),) + rest] if rest else self.base[0:0]
        # one contiguous read of the whole groups that hold the rows (blocked, one group: just the rows)
        g = self.group_rows
        lo, hi = min(rows) // g * g, -(-(max(rows) + 1) // g) * g
        if self.groups == 1:
            lo, hi = min(rows), max(rows) + 1
        if rest or self.groups == 1:
            return self.base[(slice(lo, hi),) + rest][torch.tensor(rows) - lo]
        if self._span is None or not (self._span[0] <= lo and hi <= self._span[1]):
            self._span = (lo, hi, self.base[lo:hi])  # q, k and v of a rank's groups: one read for all three
        return self._span[2][torch.tensor(rows) - self._span[0]]
