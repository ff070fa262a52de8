"""The multi-head latent attention part of the resolver (block kind `mla_attention`, DeepSeek-V2 / V3): its IR
(`resolve_mla`), its parameters with their sharding (`mla_params`) and its per-variant checks. A mixin of
resolver._Resolver (through resolver_blocks.BlockResolver), which provides err / dim / num / flag / expr / ident."""
from __future__ import annotations

from typing import List

from .ir import MLAIR, ParamIR, RotaryIR, SegmentIR, Size, Value
from .resolver_indexer import IndexerResolver
from .resolver_rotary import RotaryResolver
from .schema import MLAAttentionBlock

# transformers' module names (the parameters are `<module>.weight` / `.bias`)
MLA_MODULES = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
               "kv_b_proj", "rotary_emb", "attn")


class MLAResolver(RotaryResolver, IndexerResolver):
    def resolve_mla(self, path, name: str, b: MLAAttentionBlock, class_name: str) -> MLAIR:
        rp = path + ("rotary",)
        rot = b.rotary
        if rot.kind != "neox":
            raise self.err(rp + ("kind",), f"{self._where(rp)}.kind: multi-head latent attention rotates its rope "
                                           f"dims with the neox kind (one position axis), not {rot.kind}")
        if rot.fraction is not None or rot.dim is not None:
            key = "fraction" if rot.fraction is not None else "dim"
            raise self.err(rp + (key,), f"{self._where(rp)}.{key}: the rotating dims of multi-head latent attention "
                                        f"are qk_rope_head_dim (the rope part of each q head and the shared key)")
        scaling = self.rope_scaling(rp + ("scaling",), rot.scaling) if rot.scaling is not None else None
        _, _, layout, enabled, layout_symbol = self.rotary_axes(rp, rot)
        self.no_scale(path + ("out",), b.out)
        out = self.ident(path + ("out", "name"), b.out.name, "module name")
        if out in MLA_MODULES or (b.indexer is not None and out == "indexer"):
            raise self.err(path + ("out", "name"), f"{self._where(path)}.out.name: '{out}' is a module of the "
                                                   f"latent attention ({', '.join(MLA_MODULES)})")
        qp = path + ("q_lora_rank",)
        q_lora = when = None
        if b.q_lora_rank is not None:
            q_lora = self.num(qp, b.q_lora_rank, optional=True)
            if q_lora.expr is not None:
                raise self.err(qp, f"{self._where(qp)}: a size (int) or an optional int config symbol (None: a "
                                   f"direct q_proj), not an expression")
            if q_lora.symbol is not None:
                self.symbol(qp, q_lora.symbol, ("int",))
                if self.config[q_lora.symbol].optional:      # low-rank q only in the checkpoints that set it
                    when = Value(expr=self.expr(qp, f"{q_lora.symbol} is not None"))
            elif not isinstance(q_lora.literal, int) or isinstance(q_lora.literal, bool) or q_lora.literal < 1:
                raise self.err(qp, f"{self._where(qp)}: a rank is an int >= 1 (or null: a direct q_proj), got "
                                   f"{q_lora.literal!r}")
        scale = None
        if b.scale is not None:
            scale = self.positive(path + ("scale",), b.scale)
        if b.scale_mscale and scaling is None:
            raise self.err(path + ("scale_mscale",), f"{self._where(path)}.scale_mscale: the mscale comes from the "
                                                     f"rope parameters: give `rotary.scaling` (a rope symbol)")
        gate = None
        if b.out_gate is not None:
            gp = path + ("out_gate",)
            if b.out_gate.source != "projection":
                raise self.err(gp + ("source",), f"{self._where(gp)}.source: multi-head latent attention's output gate "
                                                 f"has a projection of its own (source: projection)")
            if b.out_gate.head_bias is not None:
                raise self.err(gp + ("head_bias",), f"{self._where(gp)}.head_bias: not supported on multi-head latent "
                                                    f"attention")
            g = self.ident(gp + ("name",), b.out_gate.name, "module name")
            if g in MLA_MODULES or g == out:
                raise self.err(gp + ("name",), f"{self._where(gp)}.name: '{g}' is already a module of the latent "
                                               f"attention")
            gate = (g, b.out_gate.activation, b.out_gate.per)
        q_gate = None
        if b.q_gate is not None:
            gp = path + ("q_gate",)
            q_gate = self.ident(gp, b.q_gate, "module name")
            if q_lora is None or when is not None:
                raise self.err(gp, f"{self._where(gp)}: the fused q + gate projection reads the query latent: give "
                                   f"the attention a low-rank q (`q_lora_rank`, a size or a required int symbol)")
            if (q_gate in MLA_MODULES and q_gate != "q_b_proj") or q_gate in (out, "indexer"):
                raise self.err(gp, f"{self._where(gp)}: '{q_gate}' is another module of the latent attention")
        window = None
        if b.sliding_window is not None:
            window = self.num(path + ("sliding_window",), b.sliding_window, per_layer=True, optional=True)
            if window.symbol is None and window.expr is None and (
                    not isinstance(window.literal, int) or isinstance(window.literal, bool) or window.literal < 1):
                raise self.err(path + ("sliding_window",), f"{self._where(path)}.sliding_window: a window is an "
                                                          f"int >= 1 (or None), got {window.literal!r}")
        knorm = None
        if b.rope_key_norm is not None:
            knorm = self.ident(path + ("rope_key_norm",), b.rope_key_norm, "module name")
            if knorm in MLA_MODULES or knorm in (out, "indexer", q_gate, gate[0] if gate else None):
                raise self.err(path + ("rope_key_norm",), f"{self._where(path)}.rope_key_norm: '{knorm}' is another "
                                                          f"module of the latent attention")
        rope_dims = self.dim(path + ("qk_rope_head_dim",), b.qk_rope_head_dim)
        indexer = (self.resolve_indexer(path, b.indexer, rope_dims, q_lora, when, enabled)
                   if b.indexer is not None else None)
        for key, on in (("longrope_factors", rot.longrope_factors != "by_context"),
                        ("longrope_mscale", rot.longrope_mscale)):
            if on:
                raise self.err(rp + (key,), f"{self._where(rp)}.{key}: not for mla_attention's rotary (attention's "
                                            f"only)")
        return MLAIR(
            kind="mla_attention", name=name, class_name=class_name,
            hidden=self.dim(path + ("hidden",), b.hidden), heads=self.dim(path + ("heads",), b.heads),
            q_lora_rank=q_lora, kv_lora_rank=self.dim(path + ("kv_lora_rank",), b.kv_lora_rank),
            qk_nope_head_dim=self.dim(path + ("qk_nope_head_dim",), b.qk_nope_head_dim),
            qk_rope_head_dim=rope_dims,
            v_head_dim=self.dim(path + ("v_head_dim",), b.v_head_dim),
            latent_eps=self.positive(path + ("latent_eps",), b.latent_eps, below=1.0),
            bias=self.flag(path + ("bias",), b.bias), out_name=out,
            out_bias=self.flag(path + ("out", "bias"), b.out.bias),
            rotary=RotaryIR("neox", self.positive(rp + ("theta",), rot.theta, per_layer=True),
                            self.dim(rp + ("max_position",), rot.max_position), None, scaling, None, None, layout,
                            enabled, None, layout_symbol,
                            self.dim(rp + ("original_max_position",), rot.original_max_position)
                            if rot.original_max_position is not None and scaling is not None else None),
            scale=scale, scale_mscale=b.scale_mscale, q_lora_when=when, kv_cache=b.kv_cache, out_gate=gate,
            indexer=indexer, q_gate=q_gate,
            q_scale=self.positive(path + ("q_scale",), b.q_scale) if b.q_scale is not None else None,
            latent_scale=self.positive(path + ("latent_scale",), b.latent_scale) if b.latent_scale is not None else None,
            rope_key_norm=knorm, sliding_window=window, sinks=b.sinks)

    @staticmethod
    def mla_params(prefix: str, block: str, b: MLAIR, per_layer: bool, maybe) -> List[ParamIR]:
        """q_proj / q_b_proj and kv_b_proj column-parallel by heads, o_proj row-parallel by heads; the latent
        projections and their norms replicated."""
        def P(name, shape, shard, segments=(), when=None):
            return ParamIR(f"{prefix}.{name}", block, tuple(shape), shard, tuple(segments), per_layer=per_layer,
                           when=when)

        qk = b.qk_nope_head_dim + b.qk_rope_head_dim
        q_seg = (SegmentIR("q", b.heads, qk),)
        ps: List[ParamIR] = []
        lora = b.q_lora_rank
        if lora is None or b.q_lora_when is not None:     # a direct q_proj (always, or where the rank is None)
            ps.append(P("q_proj.weight", (b.heads * qk, b.hidden), "colwise", q_seg,
                        None if b.q_lora_when is None else (b.q_lora_when, False)))
        if lora is not None:
            r = Size.of(lora.symbol) if lora.symbol else Size.of(lora.literal)
            w = None if b.q_lora_when is None else (b.q_lora_when, True)
            ps.append(P("q_a_proj.weight", (r, b.hidden), "replicated", when=w))
            if maybe(b.bias):
                ps.append(P("q_a_proj.bias", (r,), "replicated", when=w))
            ps.append(P("q_a_layernorm.weight", (r,), "replicated", when=w))
            if b.q_gate is not None:    # q and the output gate, per head [q | gate], from [normed, raw] latent
                ps.append(P(f"{b.q_gate}.weight", (b.heads * (qk + b.v_head_dim), r + r), "colwise",
                            (SegmentIR(b.q_gate, b.heads, qk + b.v_head_dim),), w))
            else:
                ps.append(P("q_b_proj.weight", (b.heads * qk, r), "colwise", q_seg, w))
        ps.append(P("kv_a_proj_with_mqa.weight", (b.kv_lora_rank + b.qk_rope_head_dim, b.hidden), "replicated"))
        if maybe(b.bias):
            ps.append(P("kv_a_proj_with_mqa.bias", (b.kv_lora_rank + b.qk_rope_head_dim,), "replicated"))
        ps.append(P("kv_a_layernorm.weight", (b.kv_lora_rank,), "replicated"))
        if b.rope_key_norm is not None:
            ps.append(P(f"{b.rope_key_norm}.weight", (b.qk_rope_head_dim,), "replicated"))
        ps.append(P("kv_b_proj.weight", (b.heads * (b.qk_nope_head_dim + b.v_head_dim), b.kv_lora_rank), "colwise",
                    (SegmentIR("kv", b.heads, b.qk_nope_head_dim + b.v_head_dim),)))
        if b.out_gate is not None:           # one gate per head (or per head and value dim), split by heads as q
            gname, _, per = b.out_gate
            if per == "head":
                ps.append(P(f"{gname}.weight", (b.heads, b.hidden), "colwise", (SegmentIR(gname, b.heads, Size.of(1)),)))
            else:
                ps.append(P(f"{gname}.weight", (b.heads * b.v_head_dim, b.hidden), "colwise",
                            (SegmentIR(gname, b.heads, b.v_head_dim),)))
        ps.append(P(f"{b.out_name}.weight", (b.hidden, b.heads * b.v_head_dim), "rowwise",
                    (SegmentIR(b.out_name, b.heads, b.v_head_dim),)))
        if maybe(b.out_bias):
            ps.append(P(f"{b.out_name}.bias", (b.hidden,), "replicated"))
        if b.sinks:                    # one logit per query head, split by heads as q is
            ps.append(P("sinks", (b.heads,), "colwise", (SegmentIR("sinks", b.heads, Size.of(1)),)))
        if b.indexer is not None:      # (the resolver requires a low-rank q: a literal or a required symbol)
            ps += IndexerResolver.indexer_params(P, b.indexer, b.hidden,
                                                 Size.of(lora.symbol) if lora.symbol else Size.of(lora.literal))
        return ps

    def check_mla_variant(self, name: str, b: MLAIR, values, at, vp, layers: int = 0) -> None:
        if b.indexer is not None:
            self.check_indexer_variant(name, b.name, b.indexer, values, layers, at, vp)
        rope = b.qk_rope_head_dim.eval(values)
        if rope % 2:
            raise self.err(at(b.qk_rope_head_dim.symbol) if b.qk_rope_head_dim.symbol else vp,
                           f"variants.{name}: {b.name}.qk_rope_head_dim is {rope}; rotary needs an even number of "
                           f"dims")
        if b.q_lora_rank is not None and b.q_lora_rank.symbol:
            r = values[b.q_lora_rank.symbol]
            if r is not None and (not isinstance(r, int) or r < 1):
                raise self.err(at(b.q_lora_rank.symbol), f"variants.{name}: {b.name}.q_lora_rank is {r!r}; a rank "
                                                         f"is an int >= 1 or None")
