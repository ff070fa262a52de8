"""The weight plan: which checkpoint tensors fill each model parameter. Names only.

Generated model modules export `weight_plan(config) -> list[WeightRule]`; runtime.loading.loader executes
it by calling each parameter's `weight_loader` (runtime.executor.sharding): the layer that owns the
parameter decides how it is sharded, the plan never restates it.

    WeightRule(param, sources)                    one tensor fills the parameter (for a fused layer: all
                                                  its segments stacked, e.g. a checkpoint's fused qkv)
    WeightRule(param, sources, segments)          sources[i] fills the layer's segment segments[i]
                                                  (q/k/v of QKVParallelLinear; the segment_names, or
                                                  indexes, of MergedColumnParallelLinear)
    WeightRule(param, source, layout=RowLayout)   one fused tensor whose rows are laid out per head / per KV
                                                  group (runtime.loading.layout), undone before sharding

    WeightRule(param, sources, segments, fused=(None, FusedSource(..), FusedSource(..)))
                                                  source i holds the segments of fused[i] (one tensor, e.g. a
                                                  `key_value` of k and v per KV head): its segments[i]'s rows are
                                                  read through that FusedSource's layout, undone before sharding

    WeightRule(param, sources, stored=TensorLayout(...))  each source tensor is stored in another layout
                                                  (transposed, segments interleaved) and read through a
                                                  LayoutView that presents the parameter's layout

Nothing here knows a model family.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple, Union

from xllm_gen.runtime.executor.sharding import Segment, WeightLoadError

SHARD_KINDS = ("replicated", "colwise", "rowwise", "vocab")   # legacy `shard=` values (ignored)


@dataclass(frozen=True)
class TensorLayout:
    """How a checkpoint tensor's layout differs from its parameter's (a `weights` entry's `transpose` /
    `segments_interleaved`): `transpose` swaps the last two dims (the tensor stores [..., in, out]);
    `interleave` n > 1: along `dim` of the parameter layout, the n segments are interleaved element by element
    (segment s's row r at r * n + s) rather than stacked. `source` is the checkpoint tensor name (in a
    WEIGHT_SOURCES entry), or a mapping segment -> tensor name for a fused parameter stacked from one tensor per
    segment, each stored in the layout (Conv1D's [in, out] gate and up tensors: `transpose`)."""
    source: "str | Mapping[str, str]" = ""
    transpose: bool = False
    interleave: int = 1
    dim: int = 0
    # True: the tensor holds the parameter under one extra leading dim of size 1; a tuple of dims: under extra unit
    # dims at those positions of the stored shape (Kimi's A_log [1, 1, heads, 1] for [heads]: (0, 1, 3))
    squeeze: "bool | tuple" = False

    def squeezed_dims(self) -> tuple:
        return (0,) if self.squeeze is True else tuple(sorted(self.squeeze or ()))

    def view(self, base):
        return LayoutView(base, self) if self.transpose or self.interleave > 1 or self.squeeze else base


class LayoutView:
    """A lazy slice (or tensor) `base` in the layout of TensorLayout `layout`, presented in the parameter's
    layout: get_shape() / get_dtype() and basic slicing, reading only the covering range of the base."""

    def __init__(self, base, layout: TensorLayout):
        self.base, self.layout = base, layout
        shape = [int(s) for s in (base.get_shape() if hasattr(base, "get_shape") else base.shape)]
        if layout.squeeze:
            dims = layout.squeezed_dims()
            if any(d >= len(shape) or shape[d] != 1 for d in dims):
                what = "a leading unit dim" if layout.squeeze is True else f"unit dims at {list(dims)}"
                raise WeightLoadError(f"stored with {what} (a `weights` entry's squeeze), but it has shape "
                                      f"{tuple(shape)}")
            shape = [x for d, x in enumerate(shape) if d not in dims]
        if layout.transpose:
            if len(shape) < 2:
                raise WeightLoadError(f"stored transposed (a `weights` entry's transpose), but it has shape {tuple(shape)}: fewer than 2 dims")
            shape[-2], shape[-1] = shape[-1], shape[-2]
        n, d = layout.interleave, layout.dim
        if n > 1 and (d >= len(shape) or shape[d] % n):
            raise WeightLoadError(f"shape {tuple(shape)} (in the parameter's layout): dim {d} cannot hold {n} interleaved segments (`segments_interleaved`)")
        self.shape = shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self):
        return self.base.get_dtype() if hasattr(self.base, "get_dtype") else self.base.dtype

    def __getitem__(self, idx):
        import torch

        idx = idx if isinstance(idx, tuple) else (idx,)
        nd = len(self.shape)
        rngs = []
        for k in range(nd):
            sl = idx[k] if k < len(idx) else slice(None)
            if not isinstance(sl, slice) or sl.step not in (None, 1):
                raise TypeError("LayoutView supports plain slices only")
            a, b, _ = sl.indices(self.shape[k])
            rngs.append((a, max(a, b)))
        n, d = self.layout.interleave, self.layout.dim
        pick = None
        if n > 1:                                      # parameter row r of segment s = r // seg <- base row
            a, b = rngs[d]                             # (r % seg) * n + s; read the covering range, then pick
            seg = self.shape[d] // n
            rows = torch.arange(a, b)
            base_rows = (rows % seg) * n + rows // seg
            lo, hi = (int(base_rows.min()), int(base_rows.max()) + 1) if b > a else (0, 0)
            rngs[d] = (lo, hi)
            pick = base_rows - lo
        base_idx = [slice(a, b) for a, b in rngs]
        if self.layout.transpose:
            base_idx[-2], base_idx[-1] = base_idx[-1], base_idx[-2]
        dims = self.layout.squeezed_dims() if self.layout.squeeze else ()
        for d in dims:                                 # increasing: each unit dim at its stored position
            base_idx.insert(d, slice(0, 1))
        out = self.base[tuple(base_idx)]
        if dims:
            out = out.reshape([int(x) for d, x in enumerate(out.shape) if d not in dims])
        if self.layout.transpose:
            out = out.transpose(-2, -1)
        if pick is not None:
            out = out.index_select(d, pick)
        return out.contiguous()


class StackedRows:
    """Tensors `parts` (lazy slices, each of one shape) seen as one tensor stacked along a new dim 0: a parameter
    whose rows are stored one tensor each (a per-head norm as `norms.{h}.weight`, a `weights` source with `{h}`).
    get_shape() / get_dtype() and basic slicing; only the parts of the rows asked for are read."""

    def __init__(self, parts: list):
        if not parts:
            raise WeightLoadError("no tensor for row 0 of a stacked ({h}) source")
        shapes = [[int(x) for x in (q.get_shape() if hasattr(q, "get_shape") else q.shape)] for q in parts]
        bad = next((h for h, sh in enumerate(shapes) if sh != shapes[0]), None)
        if bad is not None:
            raise WeightLoadError(f"the tensor of row {bad} has shape {tuple(shapes[bad])}, row 0's "
                                  f"{tuple(shapes[0])}: a stacked ({{h}}) source needs one shape")
        self.parts, self.shape = parts, [len(parts)] + shapes[0]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self):
        q = self.parts[0]
        return q.get_dtype() if hasattr(q, "get_dtype") else q.dtype

    def __getitem__(self, idx):
        import torch

        idx = idx if isinstance(idx, tuple) else (idx,)
        rows = idx[0] if idx else slice(None)
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("StackedRows supports plain slices only")
        a, b, _ = rows.indices(self.shape[0])
        rest = tuple(idx[1:]) or (slice(None),)
        return torch.stack([self.parts[h][rest] for h in range(a, max(a, b))]).contiguous()


@dataclass(frozen=True)
class WeightRule:
    param: str                                   # parameter name in the model (model.named_parameters())
    sources: Tuple[str, ...]                     # checkpoint tensor names
    segments: Tuple[Union[str, int], ...] = ()   # the layer's segment each source fills (fused parameters)
    # Legacy (templates before the switch to names only): accepted and ignored. Remove with Segment.
    shard: str = field(default="", repr=False, compare=False)
    vocab_size: int = field(default=0, repr=False, compare=False)
    legacy: bool = field(default=False, repr=False, compare=False)
    layout: Any = None                           # a RowLayout for one fused tensor stored per head / KV group
    stored: Optional[TensorLayout] = None         # each source's storage layout, where it is not the parameter's
    # per source: None, or the FusedSource (runtime.loading.layout) of a tensor that holds several segments
    fused: Tuple[Any, ...] = ()

    def __init__(self, param: str, sources, *args, segments=(), shard: str = "", vocab_size: int = 0,
                 layout: Any = None, stored: Optional[TensorLayout] = None, fused=()):
        # Legacy positional form: WeightRule(param, sources, shard, segments).
        if args and isinstance(args[0], str) and args[0] in SHARD_KINDS:
            shard, args = args[0], args[1:]
        if args:
            if len(args) > 1 or segments:
                raise TypeError(f"WeightRule({param!r}): too many arguments")
            segments = args[0]
        sources = (sources,) if isinstance(sources, str) else tuple(sources)
        segments = (segments,) if isinstance(segments, (str, Segment)) else tuple(segments)
        if shard and shard not in SHARD_KINDS:
            raise ValueError(f"{param}: unknown shard kind {shard!r}")
        legacy = any(isinstance(s, Segment) for s in segments)
        legacy_segments = tuple(s for s in segments if isinstance(s, Segment))
        if legacy:
            # A legacy rule lists Segment sizes; only their order matters now. One source: the whole
            # (possibly fused) tensor, segments dropped; several: source i fills the layer's segment i.
            segments = tuple(range(len(segments))) if len(sources) > 1 else ()
        set_ = object.__setattr__
        set_(self, "param", param)
        set_(self, "sources", sources)
        set_(self, "segments", segments)
        set_(self, "shard", shard)
        set_(self, "vocab_size", vocab_size)
        set_(self, "legacy", legacy or bool(shard) or bool(vocab_size))
        set_(self, "legacy_segments", legacy_segments)     # for the transitional plan-vs-layer check only
        set_(self, "layout", layout)
        set_(self, "stored", stored)
        set_(self, "fused", tuple(fused) if any(f is not None for f in fused) else ())
        self._validate()

    def _validate(self) -> None:
        if not self.sources or not all(isinstance(s, str) and s for s in self.sources):
            raise ValueError(f"{self.param}: sources must be one or more checkpoint tensor names")
        if any(not isinstance(s, (str, int)) or isinstance(s, bool) for s in self.segments):
            raise ValueError(f"{self.param}: segments are the layer's segment names (or indexes), "
                             f"got {self.segments!r}")
        if self.segments and len(self.segments) != len(self.sources):
            raise ValueError(f"{self.param}: {len(self.sources)} sources need as many segments, "
                             f"got {len(self.segments)}")
        if not self.segments and len(self.sources) > 1:
            raise ValueError(f"{self.param}: {len(self.sources)} sources need as many segments (the layer's "
                             f"segment each one fills)")
        if self.layout is not None and (len(self.sources) != 1 or self.segments):
            raise ValueError(f"{self.param}: a row layout applies to one fused tensor (one source, no segments)")
        if len(set(self.segments)) != len(self.segments):
            raise ValueError(f"{self.param}: segment listed twice in {self.segments!r}")
        if self.fused:
            if len(self.fused) != len(self.sources) or not self.segments:
                raise ValueError(f"{self.param}: `fused` gives one entry (None or a FusedSource) per source of a "
                                 f"segmented rule")
            for seg, src, f in zip(self.segments, self.sources, self.fused):
                if f is not None and seg not in f.segments:
                    raise ValueError(f"{self.param}: source {src!r} fills segment {seg!r}, which its FusedSource "
                                     f"({'+'.join(f.segments)}) does not hold")
