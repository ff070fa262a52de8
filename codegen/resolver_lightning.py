"""The lightning attention part of the resolver (block kind `lightning_attention`, MiniMax-Text-01 / M1's
`linear_attention` layers: a recurrent linear attention with a fixed decay per head and layer): its IR
(`resolve_lightning`) and its parameters with their sharding (`lightning_params`). A mixin of resolver._Resolver
(through resolver_blocks.BlockResolver), which provides err / dim / num / ident / activation."""
from __future__ import annotations

from typing import List

from .ir import LightningIR, ParamIR, SegmentIR, Size
from .schema import LightningAttentionBlock


class LightningResolver:
    def resolve_lightning(self, path, name: str, b: LightningAttentionBlock, class_name: str) -> LightningIR:
        names = [self.ident(path + (k,), v, "module name") for k, v in (("qkv", b.qkv), ("gate", b.gate),
                                                                      ("out", b.out))]
        for i, (k, v) in enumerate(zip(("qkv", "gate", "out"), names)):
            if v == "norm" or v in names[:i]:
                raise self.err(path + (k,), f"{self._where(path)}.{k}: module name '{v}' is already used in this block")
        return LightningIR(
            kind="lightning_attention", name=name, class_name=class_name,
            hidden=self.dim(path + ("hidden",), b.hidden), heads=self.dim(path + ("heads",), b.heads),
            head_dim=self.dim(path + ("head_dim",), b.head_dim), layers=self.dim(path + ("layers",), b.layers),
            block_size=self.dim(path + ("block_size",), b.block_size),
            eps=self.positive(path + ("eps",), b.eps, below=1.0),
            activation=self.activation(path + ("activation",), b.activation, ("silu", "swish"), "an activation"),
            qkv=names[0], gate=names[1], out_name=names[2])

    @staticmethod
    def lightning_params(prefix: str, block: str, b: LightningIR, per_layer: bool) -> List[ParamIR]:
        """qkv (each head's q | k | v rows together) and the output gate column-parallel by heads, the norm's weight
        by heads, the output projection row-parallel by heads."""
        def P(name, shape, shard, segments=()):
            return ParamIR(f"{prefix}.{name}", block, tuple(shape), shard, tuple(segments), per_layer=per_layer)
        width = b.heads * b.head_dim
        return [P(f"{b.qkv}.weight", (Size.of(3) * width, b.hidden), "colwise",
                  (SegmentIR(b.qkv, b.heads, Size.of(3) * b.head_dim),)),
                P(f"{b.gate}.weight", (width, b.hidden), "colwise", (SegmentIR(b.gate, b.heads, b.head_dim),)),
                P("norm.weight", (width,), "colwise", (SegmentIR("norm", b.heads, b.head_dim),)),
                P(f"{b.out_name}.weight", (b.hidden, width), "rowwise", (SegmentIR(b.out_name, b.heads, b.head_dim),))]
