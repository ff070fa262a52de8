"""The vision tower part of the resolver: its blocks, its parameters and its per-variant checks (a mixin of
resolver._Resolver, which provides err / dim / positive / ... and the spec)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .errors import did_you_mean
from .ir import (
    NormIR,
    ParamIR,
    PatchEmbedIR,
    PatchMergerIR,
    PosEmbedIR,
    Ratio,
    SegmentIR,
    Size,
    Value,
    VisionAttentionIR,
    VisionIR,
    VisionMLPIR,
    VisionStepIR,
)
from .schema import (
    VisionAttentionBlock,
    VisionMLPBlock,
)


class VisionResolver:
    def resolve_vision(self, levels: Optional[Size]) -> VisionIR:
        v = self.spec.vision
        base = ("vision",)
        prefix = self.spec.class_prefix
        merge = self.dim(base + ("merge",), v.merge)
        pe = v.patch_embed
        pp = base + ("patch_embed",)
        patch = PatchEmbedIR("patch_embed", self.dim(pp + ("in_channels",), pe.in_channels),
                             self.dim(pp + ("temporal_patch",), pe.temporal_patch), self.dim(pp + ("patch",), pe.patch),
                             self.dim(pp + ("dim",), pe.dim))
        pos = PosEmbedIR("pos_embed", self.dim(base + ("pos_embed", "positions"), v.pos_embed.positions),
                         self.dim(base + ("pos_embed", "dim"), v.pos_embed.dim))
        width = patch.dim
        if pos.dim != width:
            raise self.err(base + ("pos_embed", "dim"), f"vision.pos_embed.dim: is {pos.dim}, but the patch embedding "
                                                        f"has width {width} (vision.patch_embed.dim)")
        lp = base + ("blocks",)
        count = self.dim(lp + ("count",), v.blocks.count)
        blocks: Dict[str, Any] = {}
        attn = None
        for name, b in v.blocks.blocks.items():
            bp = lp + ("blocks", name)
            self.ident(bp, name, "block name", at_key=True)
            if isinstance(b, VisionAttentionBlock):
                if attn is not None:
                    raise self.err(bp, f"vision.blocks.blocks.{name}: a vision block has one vision_attention "
                                       f"(its 2-D rotary is shared by the tower); '{attn.name}' is the other",
                                   at_key=True)
                hidden, heads = self.dim(bp + ("hidden",), b.hidden), self.dim(bp + ("heads",), b.heads)
                attn = blocks[name] = VisionAttentionIR("vision_attention", name, hidden, heads, Ratio(hidden, heads),
                                                        self.positive(bp + ("rotary", "theta"), b.rotary.theta))
            elif isinstance(b, VisionMLPBlock):
                blocks[name] = VisionMLPIR("vision_mlp", name, self.dim(bp + ("hidden",), b.hidden),
                                           self.dim(bp + ("intermediate",), b.intermediate), b.activation)
            else:
                blocks[name] = self.resolve_norm(bp, name, b, context="vision")
            dims = [(bp + ("dim",), blocks[name].dim)] if isinstance(blocks[name], NormIR) else \
                [(bp + ("hidden",), blocks[name].hidden)]
            for path, size in dims:
                if size != width:
                    raise self.err(path, f"{self._where(path)}: is {size}, but the vision tower's width is {width} "
                                         f"(vision.patch_embed.dim)")
        if attn is None:
            raise self.err(lp + ("blocks",), "vision.blocks.blocks: a vision block needs a vision_attention block",
                           at_key=True)
        steps, used = [], {}
        for i, st in enumerate(v.blocks.dataflow):
            sp = lp + ("dataflow", i)
            for role, ref, kinds in (("norm", st.norm, ("layernorm", "rmsnorm")),
                                     ("block", st.block, ("vision_attention", "vision_mlp"))):
                if ref not in blocks:
                    raise self.err(sp + (role,), f"vision.blocks.dataflow[{i}].{role}: no block '{ref}' in "
                                                 f"vision.blocks.blocks{did_you_mean(ref, blocks)}")
                if blocks[ref].kind not in kinds:
                    raise self.err(sp + (role,), f"vision.blocks.dataflow[{i}].{role}: block '{ref}' is "
                                                 f"{blocks[ref].kind}, expected {' or '.join(kinds)}")
                if ref in used:
                    raise self.err(sp + (role,), f"vision.blocks.dataflow[{i}].{role}: block '{ref}' is already "
                                                 f"used by dataflow[{used[ref]}]; each block is used once")
                used[ref] = i
            steps.append(VisionStepIR(st.norm, st.block, isinstance(blocks[st.block], VisionAttentionIR)))
        if not steps:
            raise self.err(lp + ("dataflow",), "vision.blocks.dataflow: list at least one residual step")
        for name in blocks:
            if name not in used:
                raise self.err(lp + ("blocks", name), f"vision.blocks.blocks.{name}: block is never used by "
                                                      f"vision.blocks.dataflow", at_key=True)

        def merger(path, name, m) -> PatchMergerIR:
            d = self.dim(path + ("dim",), m.dim)
            if d != width:
                raise self.err(path + ("dim",), f"{self._where(path)}.dim: is {d}, but the vision tower's width is "
                                                f"{width} (vision.patch_embed.dim)")
            return PatchMergerIR(name, d, self.dim(path + ("out",), m.out), d * merge * merge, m.norm,
                                 self.positive(path + ("eps",), m.eps, below=1.0))

        main = merger(base + ("merger",), "merger", v.merger)
        taps = count_ds = ds_merger = None
        if v.deepstack:
            dp = base + ("deepstack",)
            if isinstance(v.deepstack.taps, str):
                self.symbol(dp + ("taps",), v.deepstack.taps, ("int_tuple",))
                taps = Value(symbol=v.deepstack.taps)
                derived = [f.name for f in self.config.values()
                           if f.derived and f.expr.source == f"len({v.deepstack.taps})"]
                count_ds = Size.of(derived[0]) if derived else None
            else:
                taps = Value(literal=tuple(v.deepstack.taps))
                count_ds = Size.of(len(v.deepstack.taps)) if v.deepstack.taps else None
            if count_ds is None:
                raise self.err(dp + ("taps",), f"vision.deepstack.taps: declare the number of levels as a derived "
                                               f"symbol, e.g. `deepstack_levels: {{type: int, expr: \"len("
                                               f"{v.deepstack.taps})\"}}`, so the mergers and the decoder can use it")
            ds_merger = merger(dp + ("merger",), "deepstack_merger_list", v.deepstack.merger)
            if levels is None:
                raise self.err(dp, "vision.deepstack: the decoder has no `decoder.deepstack` to inject the levels "
                                   "into", at_key=True)
            if levels != count_ds:
                raise self.err(("decoder", "deepstack", "levels"),
                               f"decoder.deepstack.levels: is {levels}, but vision.deepstack has {count_ds} levels "
                               f"(one per tap of {taps})")
        elif levels is not None:
            raise self.err(("decoder", "deepstack"), "decoder.deepstack: the vision tower has no `vision.deepstack` "
                                                     "mergers that produce the levels", at_key=True)
        return VisionIR(v.prefix, f"{prefix}VisionModel", f"{prefix}VisionBlock", merge, patch, pos, attn, count,
                        tuple(blocks.values()), tuple(steps), main, taps, count_ds, ds_merger)

    def vision_params(self, v: VisionIR) -> Tuple[ParamIR, ...]:
        p, one = v.prefix, Size.of(1)
        out: List[ParamIR] = []

        def P(name, block, shape, shard="replicated", segments=(), repeat=None, tp_if=None):
            out.append(ParamIR(f"{p}.{name}", block, tuple(shape), shard, tuple(segments), repeat=repeat, tp_if=tp_if))

        pe = v.patch_embed
        P("patch_embed.proj.weight", "vision.patch_embed", (pe.dim, pe.in_channels, pe.temporal_patch, pe.patch, pe.patch))
        P("patch_embed.proj.bias", "vision.patch_embed", (pe.dim,))
        P("pos_embed.weight", "vision.pos_embed", (v.pos_embed.positions, v.pos_embed.dim))
        for b in v.blocks:
            blk = f"vision.blocks.blocks.{b.name}"
            pre = f"blocks.{{i}}.{b.name}"
            if isinstance(b, NormIR):
                P(f"{pre}.weight", blk, (b.dim,), repeat=v.count)
                if b.bias:
                    P(f"{pre}.bias", blk, (b.dim,), repeat=v.count)
            elif isinstance(b, VisionAttentionIR):
                flag = (f"{b.name}_tp", b.heads)
                segs = [SegmentIR(n, b.heads, b.head_dim) for n in ("q", "k", "v")]
                three = Size.of(3) * b.hidden
                P(f"{pre}.qkv.weight", blk, (three, b.hidden), "colwise", segs, v.count, flag)
                P(f"{pre}.qkv.bias", blk, (three,), "colwise", segs, v.count, flag)
                P(f"{pre}.proj.weight", blk, (b.hidden, b.hidden), "rowwise", [SegmentIR("proj", b.heads, b.head_dim)],
                  v.count, flag)
                P(f"{pre}.proj.bias", blk, (b.hidden,), repeat=v.count)
            else:
                flag = (f"{b.name}_tp", b.intermediate)
                seg = [SegmentIR("linear_fc1", b.intermediate, one)]
                P(f"{pre}.linear_fc1.weight", blk, (b.intermediate, b.hidden), "colwise", seg, v.count, flag)
                P(f"{pre}.linear_fc1.bias", blk, (b.intermediate,), "colwise", seg, v.count, flag)
                P(f"{pre}.linear_fc2.weight", blk, (b.hidden, b.intermediate), "rowwise", seg, v.count, flag)
                P(f"{pre}.linear_fc2.bias", blk, (b.hidden,), repeat=v.count)
        for m, block, repeat in ((v.merger, "vision.merger", None),
                                 (v.deepstack_merger, "vision.deepstack.merger", v.deepstack_count)):
            if m is None:
                continue
            pre = m.name + (".{i}" if repeat else "")
            nd = m.dim if m.norm == "before_merge" else m.merged
            P(f"{pre}.norm.weight", block, (nd,), repeat=repeat)
            P(f"{pre}.norm.bias", block, (nd,), repeat=repeat)
            P(f"{pre}.linear_fc1.weight", block, (m.merged, m.merged), repeat=repeat)
            P(f"{pre}.linear_fc1.bias", block, (m.merged,), repeat=repeat)
            P(f"{pre}.linear_fc2.weight", block, (m.out, m.merged), repeat=repeat)
            P(f"{pre}.linear_fc2.bias", block, (m.out,), repeat=repeat)
        return tuple(out)

    def check_vision_variant(self, name, values, v: VisionIR, embed, at, vp) -> None:
        a = v.attention
        hidden, heads = a.hidden.eval(values), a.heads.eval(values)
        sym = a.heads.symbol if isinstance(a.heads, Size) else None
        if hidden % heads or (hidden // heads) % 4:
            raise self.err(at(sym), f"variants.{name}: vision {a.name}.hidden ({hidden}) must be a multiple of "
                                    f"4 * {a.name}.heads ({heads}): head_dim = hidden / heads, split in 2-D rotary halves")
        side = int(round(v.pos_embed.positions.eval(values) ** 0.5))
        if side * side != v.pos_embed.positions.eval(values):
            f = v.pos_embed.positions.symbol if isinstance(v.pos_embed.positions, Size) else None
            raise self.err(at(f),
                           f"variants.{name}: vision.pos_embed.positions ({v.pos_embed.positions.eval(values)}) "
                           f"must be a square (side x side table)")
        text = embed.dim.eval(values)
        for m, path in ((v.merger, ("vision", "merger", "out")), (v.deepstack_merger, ("vision", "deepstack", "merger", "out"))):
            if m is not None and m.out.eval(values) != text:
                f = m.out.symbol if isinstance(m.out, Size) else 0
                raise self.err(at(f if isinstance(f, str) else None) if isinstance(f, str) and at(f) != vp else path,
                               f"variants.{name}: {'.'.join(path)} is {m.out.eval(values)}, but the text width "
                               f"(decoder.embed_tokens.dim) is {text}")
        if v.deepstack_taps is not None:
            taps = list(v.deepstack_taps.eval(values))
            depth = v.count.eval(values)
            where = at(v.deepstack_taps.symbol) if v.deepstack_taps.symbol else ("vision", "deepstack", "taps")
            if where == vp:
                where = ("vision", "deepstack", "taps")
            bad = [t for t in taps if not 0 <= t < depth]
            if bad or len(set(taps)) != len(taps):
                raise self.err(where, f"variants.{name}: vision.deepstack.taps {taps} must be unique vision block "
                                      f"indices in 0..{depth - 1} ({depth} blocks)")
