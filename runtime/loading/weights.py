"""The weight plan: how each model parameter is built from checkpoint tensors and sharded.

Generated model modules export `weight_plan(config) -> list[WeightRule]`, rendered from the spec's
`weights` section; runtime.loader executes it. Nothing here knows a model family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from xllm_gen.runtime.executor.sharding import Segment

SHARD_KINDS = ("replicated", "colwise", "rowwise", "vocab")


@dataclass(frozen=True)
class WeightRule:
    param: str                        # parameter name in the model (model.named_parameters())
    sources: Tuple[str, ...]          # checkpoint tensor names; several are concatenated along dim 0
    shard: str = "replicated"         # replicated | colwise (dim 0) | rowwise (dim 1) | vocab (dim 0, padded)
    segments: Tuple[Segment, ...] = ()  # colwise/rowwise: the split unit of the sharded dim, in order
    vocab_size: int = 0               # vocab: the unpadded number of rows

    def __post_init__(self):
        if self.shard not in SHARD_KINDS:
            raise ValueError(f"{self.param}: unknown shard kind {self.shard!r}")
        if len(self.sources) > 1 and len(self.sources) != len(self.segments):
            raise ValueError(f"{self.param}: {len(self.sources)} sources need as many segments")
