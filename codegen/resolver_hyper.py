"""The hyper-connections part of the resolver (block kind `hyper_connection`, the `{hyper: HC, ...}` steps and
`decoder.hyper_head`): the block's IR (`resolve_hyper_connection`), its parameters (`hyper_params`, replicated: each
rank holds the whole streams) and the dataflow checks (`check_hyper`). A mixin of resolver._Resolver (through
resolver_blocks.BlockResolver), which provides err / dim / num / positive / flag."""
from __future__ import annotations

from typing import List, Optional

from .ir import HyperIR, ParamIR, Size, Value
from .schema import HyperConnectionBlock


class HyperResolver:
    def resolve_hyper_connection(self, path, name: str, b: HyperConnectionBlock, class_name: str = "",
                                 head: bool = False) -> HyperIR:
        where = self._where(path)
        if b.form == "low_rank":
            if b.rank is None:
                raise self.err(path + ("form",), f"{where}.form: low_rank needs the input mixer's `rank`")
            if b.mix is not None:
                raise self.err(path + ("mix",), f"{where}.mix: the low_rank form has no residual mix (the identity)")
            if b.pre.eps != 0:
                raise self.err(path + ("pre", "eps"), f"{where}.pre.eps: the low_rank form's input gates take no eps")
        elif b.rank is not None:
            raise self.err(path + ("rank",), f"{where}.rank: only the low_rank form has a rank")
        if head and (b.post is not None or b.mix is not None):
            key = "post" if b.post is not None else "mix"
            raise self.err(path + (key,), f"{where}.{key}: the decoder's final collapse has only the pre-mix")
        if not head and b.post is None:
            raise self.err(path, f"{where}: a layer's hyper_connection needs its `post` (how the block's output joins "
                                 f"the streams)", at_key=True)
        if b.mix is not None and b.post is None:
            raise self.err(path + ("mix",), f"{where}.mix: a residual mix goes with a `post`")
        num = lambda key, v: self.num(path + key, v)   # noqa: E731
        return HyperIR(
            kind="hyper_connection", name=name, streams=self.dim(path + ("streams",), b.streams),
            dim=self.dim(path + ("dim",), b.dim), form=b.form,
            norm_eps=self.positive(path + ("norm", "eps"), b.norm.eps, below=1.0),
            per_stream=b.norm.per_stream, norm_weight=b.norm.weight, norm_offset=float(b.norm.weight_offset),
            rank=self.dim(path + ("rank",), b.rank) if b.rank is not None else None,
            pre_eps=num(("pre", "eps"), b.pre.eps), post=b.post is not None,
            magnitude=num(("post", "magnitude"), b.post.magnitude) if b.post else Value(literal=1),
            post_eps=num(("post", "eps"), b.post.eps) if b.post else Value(literal=0),
            mix=b.mix is not None,
            sinkhorn_iters=self.dim(path + ("mix", "sinkhorn_iters"), b.mix.sinkhorn_iters) if b.mix else None,
            mix_eps=num(("mix", "eps"), b.mix.eps) if b.mix else Value(literal=0))

    @staticmethod
    def hyper_params(pb, b: HyperIR) -> List[ParamIR]:
        """Replicated, kept in float32 (the runtime creates them so): the norm's weight, then by form `fn` / `base` /
        `scale` (fused) or the input mixer's `down` / `up` and the output's `block_inject_weight` (low_rank)."""
        P, n = pb.P, b.streams
        flat = n * b.dim
        ps = [P("hc_norm.weight", (flat,), "replicated")] if b.norm_weight else []
        if b.form == "fused":
            m = n * Size.of(2) if b.post else n
            if b.mix:
                m = m + n * n
            groups = Size.of(1 + int(b.post) + int(b.mix))
            return ps + [P("fn", (m, flat), "replicated"), P("base", (m,), "replicated"),
                         P("scale", (groups,), "replicated")]
        ps += [P("input_mix_weight_down.weight", (b.rank, flat), "replicated"),
               P("input_mix_weight_up.weight", (flat, b.rank), "replicated")]
        if b.post:
            ps.append(P("block_inject_weight.weight", (n, flat), "replicated"))
        return ps

    def resolve_hyper_head(self) -> Optional[HyperIR]:
        h = self.spec.decoder.hyper_head
        if h is None:
            return None
        return self.resolve_hyper_connection(("decoder", "hyper_head"), "hyper_head", h, head=True)

    def check_hyper(self, layer, head: Optional[HyperIR], stream_dim) -> None:
        """With `decoder.hyper_head` every step is a plain `{hyper, norm?, block, post_norm?, scale?}` step (the
        streams replace the residual); without it no step names a hyper_connection. Every hyper_connection has the
        head's streams and the residual stream's width."""
        base = ("decoder", "layers", "dataflow")
        flows = [(layer.steps, "")] + ([(layer.alt_steps, "then")] if layer.alt_steps else [])
        for steps, sub in flows:
            for i, s in enumerate(steps):
                sp = base + ((sub,) if sub else ()) + (i,)
                where = "decoder.layers.dataflow" + (f".{sub}" if sub else "") + f"[{i}]"
                hyper = getattr(s, "hyper", None)
                if head is None:
                    if hyper is not None:
                        raise self.err(sp + ("hyper",), f"{where}.hyper: the residual streams need decoder.hyper_head "
                                                        f"(their final collapse)")
                    continue
                if hyper is None or getattr(s, "branches", None) is not None:
                    raise self.err(sp, f"{where}: with decoder.hyper_head every step is a `{{hyper: HC, norm: N, "
                                       f"block: B}}` step (the residual stream is several streams)", at_key=True)
                bad = [k for k, v in (("after_norm", s.after_norm), ("add", s.add), ("input_scale", s.input_scale),
                                      ("residual", s.residual_normed or None)) if v]
                if bad:
                    raise self.err(sp + (bad[0],), f"{where}.{bad[0]}: not with `hyper` (the streams replace the "
                                                   f"residual)")
        if head is None:
            return
        for b in layer.blocks:
            if isinstance(b, HyperIR):
                bp = ("decoder", "layers", "blocks", b.name)
                if str(b.streams) != str(head.streams):
                    raise self.err(bp + ("streams",), f"decoder.layers.blocks.{b.name}.streams: is {b.streams}, but "
                                                      f"decoder.hyper_head.streams is {head.streams}")
        for b, where in [(head, ("decoder", "hyper_head"))] + [
                (b, ("decoder", "layers", "blocks", b.name)) for b in layer.blocks if isinstance(b, HyperIR)]:
            if str(b.dim) != str(stream_dim):
                raise self.err(where + ("dim",), f"{'.'.join(where)}.dim: is {b.dim}, but the residual stream has the "
                                                 f"width {stream_dim}")
