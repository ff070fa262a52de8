"""Resolving Gemma 4's per-layer side inputs: `decoder.per_layer_input` (a second embedding table plus a projection of
the embedding output, sliced per layer and read by an `mlp` with `multiply: per_layer_input`) and
`decoder.layers.output_scale` (a learned scalar on the whole residual stream after each layer)."""
from __future__ import annotations

from typing import List, Optional

from .ir import LayerIR, ParamIR, PerLayerInputIR, Size


class PerLayerInputResolver:
    def resolve_per_layer_input(self, stream, layer: LayerIR) -> Optional[PerLayerInputIR]:
        d = self.spec.decoder
        p = ("decoder", "per_layer_input")
        readers = [b.name for b in layer.blocks if getattr(b, "multiply", False)]
        if d.per_layer_input is None:
            if readers:
                raise self.err(("decoder", "layers", "blocks", readers[0], "multiply"),
                               f"decoder.layers.blocks.{readers[0]}.multiply: there is no decoder.per_layer_input")
            return None
        if not readers:
            raise self.err(p, "decoder.per_layer_input: no block reads it (an `mlp` with `multiply: per_layer_input`)",
                           at_key=True)
        if d.deepstack is not None:
            raise self.err(p, "decoder.per_layer_input: not with deepstack", at_key=True)
        b = d.per_layer_input
        norm = self.resolve_norm(p + ("norm",), "per_layer_projection_norm", b.norm)
        dim = self.dim(p + ("dim",), b.dim)
        if str(norm.dim) != str(dim):
            raise self.err(p + ("norm", "dim"), f"decoder.per_layer_input.norm.dim: is {norm.dim}, but each layer's "
                                                f"slice is {dim} wide (decoder.per_layer_input.dim)")
        for r in readers:
            blk = next(x for x in layer.blocks if x.name == r)
            if str(blk.intermediate) != str(dim):
                raise self.err(("decoder", "layers", "blocks", r, "intermediate"),
                               f"decoder.layers.blocks.{r}.intermediate: is {blk.intermediate}, but it multiplies the "
                               f"per-layer input of width {dim} (decoder.per_layer_input.dim)")
        return PerLayerInputIR(self.dim(p + ("vocab",), b.vocab), dim, layer.count, stream.dim,
                               self.positive(p + ("embed_scale",), b.embed_scale),
                               self.positive(p + ("project_scale",), b.project_scale),
                               self.positive(p + ("combine_scale",), b.combine_scale), norm,
                               self.flag(p + ("enabled",), b.enabled))

    def per_layer_input_params(self, ple: PerLayerInputIR) -> tuple:
        pre, blk = self.prefix, "decoder.per_layer_input"
        width = ple.layers * ple.dim
        ps: List[ParamIR] = [
            ParamIR(f"{pre}.embed_tokens_per_layer.weight", blk, (ple.vocab, width), "vocab", vocab=ple.vocab),
            ParamIR(f"{pre}.per_layer_model_projection.weight", blk, (width, ple.hidden), "replicated"),
            ParamIR(f"{pre}.per_layer_projection_norm.weight", blk, (ple.dim,), "replicated")]
        if ple.enabled.literal is not True:
            ps = [ParamIR(p.name, p.block, p.shape, p.shard, vocab=p.vocab, when=(ple.enabled, True)) for p in ps]
        return tuple(ps)

    def output_scale_params(self, layer: LayerIR) -> tuple:
        if layer.output_scale is None:
            return ()
        return (ParamIR(f"{self.prefix}.layers.{{i}}.{layer.output_scale}", "decoder.layers.output_scale", (Size.of(1),),
                        "replicated", per_layer=True),)
