"""The sparse-attention indexer part of the resolver (an `indexer:` sub-block of `mla_attention`, DeepSeek-V3.2's
DSA and GLM-MoE-DSA): its IR (`resolve_indexer`), its parameters (`indexer_params`, all replicated) and its
per-variant checks. A mixin of resolver._Resolver (through resolver_mla.MLAResolver), which provides err / dim /
num / flag / expr / symbol."""
from __future__ import annotations

from typing import List

from .ir import IndexerIR, ParamIR, Size, Value

INDEXER_MODULES = ("wq_b", "wk", "k_norm", "weights_proj")


class IndexerResolver:
    def resolve_indexer(self, path, ix, rope_dims: Size, q_lora: Value, q_lora_when, rotary_enabled) -> IndexerIR:
        p = path + ("indexer",)
        if q_lora is None:
            raise self.err(p, f"{self._where(p)}: the indexer's q is made from the query latent (q_a_layernorm's "
                              f"output): give the attention a low-rank q (`q_lora_rank`)")
        if q_lora_when is not None:
            raise self.err(path + ("q_lora_rank",),
                           f"{self._where(path)}.q_lora_rank: with an indexer the low-rank q must exist in every "
                           f"checkpoint (the indexer reads the query latent): a required int symbol, not an optional "
                           f"one")
        if rotary_enabled.literal is not True:
            raise self.err(path + ("rotary", "enabled"),
                           f"{self._where(path)}.rotary.enabled: the indexer turns its keys with the attention's "
                           f"rotary on every layer; a per-layer rotary is not modeled with an indexer")
        layout, layout_symbol = ix.rope_layout, None
        if layout not in ("neox", "interleaved"):
            f = self.symbol(p + ("rope_layout",), layout, ("str",))
            bad = [v for v in (f.values or ()) if v not in ("neox", "interleaved")]
            if not f.values or bad:
                raise self.err(p + ("rope_layout",), f"{self._where(p)}.rope_layout: config symbol '{layout}' selects "
                                                     f"the indexer's rope layout: its `values` must list layouts "
                                                     f"(neox, interleaved)" + (f", not {bad[0]!r}" if bad else ""))
            layout, layout_symbol = f.values[0], ix.rope_layout
        share = self.flag(p + ("share",), ix.share, per_layer=True)
        if share.literal is True:
            raise self.err(p + ("share",), f"{self._where(p)}.share: true on every layer leaves no layer to select "
                                           f"the keys: a per-layer expression (or false)")
        return IndexerIR(
            heads=self.dim(p + ("heads",), ix.heads), head_dim=self.dim(p + ("head_dim",), ix.head_dim),
            topk=self.dim(p + ("topk",), ix.topk),
            rope_dims=self.dim(p + ("rope_dims",), ix.rope_dims) if ix.rope_dims is not None else rope_dims,
            rope_layout=layout, rope_layout_symbol=layout_symbol,
            k_norm_eps=self.positive(p + ("k_norm_eps",), ix.k_norm_eps, below=1.0), share=share,
            rope_position=ix.rope_position)

    @staticmethod
    def indexer_params(P, ix: IndexerIR, hidden: Size, q_rank: Size) -> List[ParamIR]:
        """wq_b [heads * head_dim, q_rank], wk [head_dim, hidden], k_norm weight / bias [head_dim], weights_proj
        [heads, hidden]: replicated (every rank computes the same selection); absent on the layers that share."""
        when = None if ix.share.literal is False else (ix.share, False)
        return [P("indexer.wq_b.weight", (ix.heads * ix.head_dim, q_rank), "replicated", when=when),
                P("indexer.wk.weight", (ix.head_dim, hidden), "replicated", when=when),
                P("indexer.k_norm.weight", (ix.head_dim,), "replicated", when=when),
                P("indexer.k_norm.bias", (ix.head_dim,), "replicated", when=when),
                P("indexer.weights_proj.weight", (ix.heads, hidden), "replicated", when=when)]

    def check_indexer_variant(self, name: str, block: str, ix: IndexerIR, values, layers: int, at, vp) -> None:
        rope, hd = ix.rope_dims.eval(values), ix.head_dim.eval(values)
        if rope > hd or rope % 2:
            sym = ix.head_dim.symbol if isinstance(ix.head_dim, Size) else None
            raise self.err(at(sym) if sym else vp,
                           f"variants.{name}: {block}.indexer: {rope} rope dims in indexer heads of {hd}: the rope "
                           f"dims must be even and at most head_dim")
        if ix.share.literal is not False and layers and ix.share.eval(values, 0):
            raise self.err(vp, f"variants.{name}: {block}.indexer.share ({ix.share}) holds on layer 0: a layer "
                                   f"that shares needs an indexer layer before it")
