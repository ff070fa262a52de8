"""The embedding step besides the token embedding: absolute position embeddings (`decoder.embed_positions`: a
learned table or the fixed sinusoidal one, added to the token embedding before the first layer: GPT-2, OPT, XGLM)
and a norm of the embedding output (`decoder.embed_norm`: Bloom's word_embeddings_layernorm). A mixin of resolver._Resolver (which provides
err / dim and the spec), as resolver_blocks.py is for the block kinds."""
from __future__ import annotations

from .expr import is_symbol
from .ir import EmbeddingIR, NormIR, ParamIR, PositionEmbeddingIR, Size

# the largest position offset a spec may declare (OPT: 2, XGLM: 2)
MAX_OFFSET = 1024


class PositionsResolver:
    def resolve_embed_positions(self, embed: EmbeddingIR) -> PositionEmbeddingIR:
        p = ("decoder", "embed_positions")
        b = self.spec.decoder.embed_positions
        dim = self.dim(p + ("dim",), b.dim)
        if str(dim) != str(embed.dim):
            raise self.err(p + ("dim",), f"decoder.embed_positions.dim: is {dim}, but the residual stream has the "
                                         f"embedding's width {embed.dim} (decoder.embed_tokens.dim)")
        if not 0 <= b.offset <= MAX_OFFSET:
            raise self.err(p + ("offset",), f"decoder.embed_positions.offset: must be in 0..{MAX_OFFSET}, got "
                                            f"{b.offset}")
        if b.frequencies is not None and b.kind != "sinusoidal":
            raise self.err(p + ("frequencies",), f"decoder.embed_positions.frequencies: only a sinusoidal table has "
                                                 f"frequencies (kind is {b.kind})")
        zero_row = None
        if b.zero_row is not None:
            if b.kind != "sinusoidal":
                raise self.err(p + ("zero_row",), f"decoder.embed_positions.zero_row: only a sinusoidal table has a "
                                                  f"zeroed row (kind is {b.kind}; a learned table's rows are weights)")
            if isinstance(b.zero_row, str) and is_symbol(b.zero_row):
                self.symbol(p + ("zero_row",), b.zero_row, ("int",))
            zero_row = self.num(p + ("zero_row",), b.zero_row, optional=True)
        scale = self.positive(p + ("scale",), b.scale) if b.scale is not None else None
        return PositionEmbeddingIR(b.kind, self.dim(p + ("positions",), b.positions), dim, b.offset,
                                   b.frequencies or "fairseq", zero_row, scale, self.flag(p + ("enabled",), b.enabled))

    def position_param(self, pe: PositionEmbeddingIR) -> ParamIR:
        """A learned table: `<prefix>.embed_positions.weight [positions + offset, dim]`, replicated; where `enabled`
        is not literally true it exists only in the checkpoints where it holds."""
        rows = pe.positions + Size.of(pe.offset) if pe.offset else pe.positions
        when = None if pe.enabled.literal is True else (pe.enabled, True)
        return ParamIR(f"{self.prefix}.embed_positions.weight", "decoder.embed_positions", (rows, pe.dim), "replicated",
                       when=when)

    def resolve_embed_norm(self, embed: EmbeddingIR) -> NormIR:
        p = ("decoder", "embed_norm")
        norm = self.resolve_norm(p, "embed_norm", self.spec.decoder.embed_norm)
        if str(norm.dim) != str(embed.dim):
            raise self.err(p + ("dim",), f"decoder.embed_norm.dim: is {norm.dim}, but the residual stream has the "
                                         f"embedding's width {embed.dim} (decoder.embed_tokens.dim)")
        return norm
