"""The spec resolver's ends of the decoder (a mixin of resolver._Resolver): the projections in / out of the
residual stream (`resolve_projection`, `projection_params`), the head transform (`resolve_head_transform`,
`head_transform_params`), the LM head (`resolve_lm_head`), the residual stream's widths (`check_widths`) and
the `when` of a parameter inside a block that exists only where a flag holds (`both`)."""
from __future__ import annotations

from typing import Optional, Tuple

from .expr import is_symbol
from .ir import (
    MLAIR,
    MLPIR,
    MLSTMIR,
    RGLRUIR,
    WKVIR,
    AttentionIR,
    ChannelMixIR,
    EmbeddingIR,
    GatedDeltaNetIR,
    GatedMLPIR,
    HeadTransformIR,
    LayerIR,
    LightningIR,
    LinearIR,
    LMHeadIR,
    Mamba2IR,
    MambaIR,
    MoEIR,
    NormIR,
    ParamIR,
    ProjectionIR,
    ResidualGateIR,
    ShortConvIR,
    Value,
)
from .resolver_blocks import ACTIVATIONS, _maybe


class HeadResolver:
    def resolve_projection(self, name: str, b) -> ProjectionIR:
        p = ("decoder", name)
        return ProjectionIR(name, self.dim(p + ("in",), b.in_), self.dim(p + ("out",), b.out),
                            self.flag(p + ("bias",), b.bias), self.flag(p + ("enabled",), b.enabled))

    def projection_params(self, proj: ProjectionIR) -> Tuple[ParamIR, ...]:
        """`<prefix>.<name>.weight [out, in]` (and `.bias [out]`), replicated; where `enabled` is not literally true
        they exist only in the checkpoints where it holds."""
        when = None if proj.enabled.literal is True else (proj.enabled, True)
        out = [ParamIR(f"{self.prefix}.{proj.name}.weight", f"decoder.{proj.name}", (proj.out, proj.in_),
                       "replicated", when=when)]
        if _maybe(proj.bias):
            out.append(ParamIR(f"{self.prefix}.{proj.name}.bias", f"decoder.{proj.name}", (proj.out,), "replicated",
                               when=when))
        return tuple(out)

    def both(self, when, inner):
        """The `when` of a parameter that exists where `when` holds and, inside its block, where `inner` holds."""
        if inner is None:
            return when
        (a, av), (b, bv) = when, inner
        text = f"({'' if av else 'not '}({a})) and ({'' if bv else 'not '}({b}))"
        return (Value(expr=self.expr(("decoder", "layers"), text, per_layer=True)), True)
    def resolve_head_transform(self, b, width, lm_head: LMHeadIR) -> HeadTransformIR:
        """decoder.head_transform: `in` is the width it reads (the residual stream's, or project_out's output), `out`
        the LM head's `dim`, its norm `out` wide."""
        p = ("decoder", "head_transform")
        ht = HeadTransformIR(self.dim(p + ("in",), b.in_), self.dim(p + ("out",), b.out), self.flag(p + ("bias",), b.bias),
                             self.activation(p + ("activation",), b.activation, ACTIVATIONS, "an activation"),
                             self.resolve_norm(p + ("norm",), "norm", b.norm) if b.norm is not None else None)
        if str(ht.in_) != str(width):
            raise self.err(p + ("in",), f"decoder.head_transform.in: is {ht.in_}, but it reads the width {width} (the "
                                        f"residual stream's, or decoder.project_out.out)")
        if str(ht.out) != str(lm_head.dim):
            raise self.err(p + ("out",), f"decoder.head_transform.out: is {ht.out}, but the LM head reads {lm_head.dim} "
                                         f"(lm_head.dim)")
        if ht.norm is not None and str(ht.norm.dim) != str(ht.out):
            raise self.err(p + ("norm", "dim"), f"decoder.head_transform.norm.dim: is {ht.norm.dim}, but the transform's "
                                                f"output is {ht.out} wide (decoder.head_transform.out)")
        return ht

    def head_transform_params(self, ht: HeadTransformIR) -> Tuple[ParamIR, ...]:
        """`<prefix>.head_transform.dense.weight [out, in]` (and `.bias`), its norm's weight / bias: replicated."""
        pre, blk = f"{self.prefix}.head_transform", "decoder.head_transform"
        out = [ParamIR(f"{pre}.dense.weight", blk, (ht.out, ht.in_), "replicated")]
        if _maybe(ht.bias):
            out.append(ParamIR(f"{pre}.dense.bias", blk, (ht.out,), "replicated"))
        if ht.norm is not None:
            out += self.block_params(f"{pre}.norm", blk + ".norm", ht.norm, False)
        return tuple(out)

    def check_widths(self, embed: EmbeddingIR, layer: LayerIR, norm: Optional[NormIR]) -> None:
        """Everything on the residual stream has its width (the embedding's, or decoder.project_in's output)."""
        checks = [(("decoder", "norm", "dim"), "decoder.norm.dim", norm.dim)] if norm is not None else []
        off_stream = {n for s in layer.all_steps if getattr(s, "value", None) is not None
                      for op in s.branches for n in (op.norm, op.block) if n}
        for b in layer.blocks:
            if b.name in off_stream:      # a branch's blocks: their widths are the branch's business
                continue
            bp = ("decoder", "layers", "blocks", b.name)
            if isinstance(b, NormIR):
                checks.append((bp + ("dim",), f"decoder.layers.blocks.{b.name}.dim", b.dim))
            elif isinstance(b, (AttentionIR, GatedMLPIR, MLPIR, MoEIR, MLAIR, GatedDeltaNetIR, Mamba2IR, MambaIR,
                                ShortConvIR, RGLRUIR, LightningIR, WKVIR, ChannelMixIR, MLSTMIR, ResidualGateIR)):
                checks.append((bp + ("hidden",), f"decoder.layers.blocks.{b.name}.hidden", b.hidden))
            elif isinstance(b, LinearIR) and b.on_stream:   # a residual step's linear: stream width in and out
                checks.append((bp + ("in",), f"decoder.layers.blocks.{b.name}.in", b.in_features))
                checks.append((bp + ("out",), f"decoder.layers.blocks.{b.name}.out", b.out_sizes[0][1]))
        for path, where, size in checks:
            if str(size) != str(embed.dim):
                raise self.err(path, f"{where}: is {size}, but the residual stream has the embedding's width "
                                     f"{embed.dim} (decoder.embed_tokens.dim)")

    def resolve_lm_head(self, embed: EmbeddingIR) -> LMHeadIR:
        h = self.spec.lm_head
        p = ("lm_head",)
        if isinstance(h.tie, str) and not is_symbol(h.tie):
            # the tied head's parameter exists per checkpoint by one symbol; an expression here was rendered as no tie
            raise self.err(p + ("tie",), f"lm_head.tie: '{h.tie}' is an expression; tie takes true, false or a bool "
                                         f"symbol: derive one (`tied: {{type: bool, expr: \"{h.tie}\"}}`) and name it")
        head = LMHeadIR("lm_head", self.dim(p + ("vocab",), h.vocab), self.dim(p + ("dim",), h.dim),
                        self.flag(p + ("tie",), h.tie),
                        self.positive(p + ("softcap",), h.softcap, optional=True) if h.softcap is not None else None,
                        self.positive(p + ("logit_scale",), h.logit_scale) if h.logit_scale is not None else None,
                        self.flag(p + ("bias",), h.bias), self.flag(p + ("normalize",), h.normalize))
        if head.normalize.literal is not False and head.tie.literal is not False:
            # normalizing the rows of a tied head would normalize the embedding it shares
            raise self.err(p + ("normalize",), "lm_head.normalize: the head's rows are normalized in place at load, "
                                               "so the head must be untied (tie: false); a tied head would normalize "
                                               "the embedding too")
        if head.tie.literal is not False and (str(head.vocab) != str(embed.vocab) or str(head.dim) != str(embed.dim)):
            # a tie decided per checkpoint may go with a head of another width (a pruned head): the generated model
            # refuses a tied checkpoint whose widths differ, and each variant that ties is checked here
            if head.tie.literal is True or str(head.dim) != str(embed.dim):
                raise self.err(p, f"lm_head: a tied head must have the embedding's shape: vocab {head.vocab} vs "
                                  f"{embed.vocab}, dim {head.dim} vs {embed.dim}", at_key=True)
        return head
