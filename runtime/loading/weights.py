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

Nothing here knows a model family.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Tuple, Union

from xllm_gen.runtime.executor.sharding import Segment

SHARD_KINDS = ("replicated", "colwise", "rowwise", "vocab")   # legacy `shard=` values (ignored)


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

    def __init__(self, param: str, sources, *args, segments=(), shard: str = "", vocab_size: int = 0,
                 layout: Any = None):
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
