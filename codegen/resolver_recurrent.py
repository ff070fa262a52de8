"""The recurrent-state block kinds' part of the resolver (`short_conv`, `rg_lru`, `mamba2`, `mamba`,
`gated_delta_net`): each one's IR (`resolve_<kind>`) and its parameters with their sharding (`<kind>_params`). A mixin
of resolver._Resolver through resolver_blocks.BlockResolver; the runtime side is runtime/layers/recurrent/."""
from __future__ import annotations

import dataclasses
from typing import List

from .ir import (
    RGLRUIR,
    GatedDeltaNetIR,
    Mamba2IR,
    MambaIR,
    ParamIR,
    SegmentIR,
    ShortConvIR,
    Size,
)
from .resolver_block_common import (
    ACTIVATIONS,
    ParamBuilder,
    _maybe,
)
from .schema import (
    GatedDeltaNetBlock,
)


class RecurrentResolver:

    def resolve_short_conv(self, path, name: str, b, class_name: str):
        """A `short_conv` block (LFM2's gated short convolution)."""
        names = [self.ident(path + (k,), v, "module name") for k, v in (("in_proj", b.in_proj), ("out", b.out))]
        if names[1] in (names[0], "conv") or names[0] == "conv":
            raise self.err(path + ("out",), f"{self._where(path)}: module names in_proj / out must differ from "
                                            f"each other and from `conv`")
        return ShortConvIR("short_conv", name, class_name,
                           self.dim(path + ("hidden",), b.hidden), self.dim(path + ("conv_kernel",), b.conv_kernel),
                           self.flag(path + ("bias",), b.bias), names[0], names[1])

    def resolve_rg_lru(self, path, name: str, b, class_name: str):
        """An `rg_lru` block (Griffin's recurrent block)."""
        keys = (("x_proj", b.x_proj), ("y_proj", b.y_proj), ("out", b.out))
        names = [self.ident(path + (k,), v, "module name") for k, v in keys]
        for i, (k, v) in enumerate(zip(("x_proj", "y_proj", "out"), names)):
            if v in ("conv_1d", "rg_lru", "act_fn") or v in names[:i]:
                raise self.err(path + (k,), f"{self._where(path)}.{k}: module name '{v}' is already used in "
                                            f"this block")
        width, heads = self.dim(path + ("width",), b.width), self.dim(path + ("heads",), b.heads)

        def src(size):
            return f"({size.source})" if not isinstance(size, Size) else f"({size})"
        return RGLRUIR(
            kind="rg_lru", name=name, class_name=class_name,
            hidden=self.dim(path + ("hidden",), b.hidden), width=width, heads=heads,
            block_width=self.expr(path + ("width",), f"{src(width)} // {src(heads)}"),
            conv_kernel=self.dim(path + ("conv_kernel",), b.conv_kernel),
            activation=self.activation(path + ("activation",), b.activation, ACTIVATIONS, "an activation"),
            decay_scale=self.positive(path + ("decay_scale",), b.decay_scale),
            bias=self.flag(path + ("bias",), b.bias), conv_bias=self.flag(path + ("conv_bias",), b.conv_bias),
            x_proj=names[0], y_proj=names[1], out_name=names[2])

    def resolve_mamba2(self, path, name: str, b, class_name: str):
        """A `mamba2` block (the SSD mixer)."""
        refs = {k: (v, None, None) if isinstance(v, str) else (v.name, v.bias, v.scale)
                for k, v in (("in_proj", b.in_proj), ("out", b.out))}
        names = [self.ident(path + (k,) + (() if isinstance(getattr(b, k), str) else ("name",)), refs[k][0],
                            "module name") for k in ("in_proj", "out")]
        for k, v in zip(("in_proj", "out"), names):
            if v in ("conv1d", "norm", "A_log", "D", "dt_bias") or names[0] == names[1] and k == "out":
                raise self.err(path + (k,), f"{self._where(path)}.{k}: module name '{v}' is already used in "
                                            f"this block")
        bias = self.flag(path + ("bias",), b.bias)
        in_bias = self.flag(path + ("in_proj", "bias"), refs["in_proj"][1]) if refs["in_proj"][1] is not None \
            else bias
        out_bias = self.flag(path + ("out", "bias"), refs["out"][1]) if refs["out"][1] is not None else None
        in_scale = refs["in_proj"][2]
        if in_scale is not None and not isinstance(in_scale, dict):
            raise self.err(path + ("in_proj", "scale"), f"{self._where(path)}.in_proj.scale: per segment, "
                                                        f"{{z: .., x: .., B: .., C: .., dt: ..}} (any of them)")
        if refs["out"][2] is not None and isinstance(refs["out"][2], dict):
            raise self.err(path + ("out", "scale"), f"{self._where(path)}.out.scale: a number (the projection "
                                                    f"has one output)")
        return Mamba2IR(
            kind="mamba2", name=name, class_name=class_name,
            hidden=self.dim(path + ("hidden",), b.hidden), heads=self.dim(path + ("heads",), b.heads),
            head_dim=self.dim(path + ("head_dim",), b.head_dim), groups=self.dim(path + ("groups",), b.groups),
            state_size=self.dim(path + ("state_size",), b.state_size),
            conv_kernel=self.dim(path + ("conv_kernel",), b.conv_kernel),
            chunk_size=self.dim(path + ("chunk_size",), b.chunk_size),
            eps=self.positive(path + ("eps",), b.eps, below=1.0),
            activation=self.activation(path + ("activation",), b.activation, ("silu", "swish"),
                                       "a conv activation"),
            bias=in_bias, conv_bias=self.flag(path + ("conv_bias",), b.conv_bias),
            in_proj=names[0], out_name=names[1], time_step_min=self.num(path + ("time_step_min",), b.time_step_min),
            time_step_max=self.positive(path + ("time_step_max",), b.time_step_max)
            if b.time_step_max is not None else None,
            out_bias=out_bias,
            in_scale=self.segment_scales(path + ("in_proj",), in_scale, ("z", "x", "B", "C", "dt")),
            out_scale=self.output_scale(path + ("out",), refs["out"][2]),
            gated_norm=self.flag(path + ("gated_norm",), b.gated_norm),
            norm_before_gate=self.flag(path + ("norm_before_gate",), b.norm_before_gate))

    def resolve_mamba(self, path, name: str, b, class_name: str):
        """A `mamba` block (Mamba-1's selective scan)."""
        names = [self.ident(path + (k,), v, "module name") for k, v in (("in_proj", b.in_proj), ("out", b.out))]
        taken = ("conv1d", "x_proj", "dt_proj", "A_log", "D", "dt_layernorm", "b_layernorm", "c_layernorm")
        for k, v in zip(("in_proj", "out"), names):
            if v in taken or names[0] == names[1] and k == "out":
                raise self.err(path + (k,), f"{self._where(path)}.{k}: module name '{v}' is already used in "
                                            f"this block")
        n = b.inner_norm
        return MambaIR(
            kind="mamba", name=name, class_name=class_name,
            hidden=self.dim(path + ("hidden",), b.hidden),
            intermediate=self.dim(path + ("intermediate",), b.intermediate),
            state_size=self.dim(path + ("state_size",), b.state_size),
            time_step_rank=self.dim(path + ("time_step_rank",), b.time_step_rank),
            conv_kernel=self.dim(path + ("conv_kernel",), b.conv_kernel),
            activation=self.activation(path + ("activation",), b.activation, ("silu", "swish"), "an activation"),
            bias=self.flag(path + ("bias",), b.bias), conv_bias=self.flag(path + ("conv_bias",), b.conv_bias),
            inner_norm=None if n is None else ("weight" if n.weight else "weightless"),
            inner_eps=None if n is None else self.positive(path + ("inner_norm", "eps"), n.eps, below=1.0),
            in_proj=names[0], out_name=names[1])

    def resolve_gated_delta_net(self, path, name: str, b: GatedDeltaNetBlock, class_name: str) -> GatedDeltaNetIR:
        self.no_scale(path + ("out",), b.out)
        seen: dict = {}
        projections, low_rank = [], []
        names = {"conv1d", "norm", "A_log", "dt_bias"}
        for i, pr in enumerate(b.projections):
            pp = path + ("projections", i)
            mname = self.ident(pp + ("name",), pr.name, "module name")
            if mname in names:
                raise self.err(pp + ("name",), f"{self._where(pp)}.name: module name '{mname}' is already used in "
                                               f"this block")
            names.add(mname)
            if not pr.segments:
                raise self.err(pp + ("segments",), f"{self._where(pp)}.segments: at least one segment")
            for sname in pr.segments:
                if sname in seen:
                    raise self.err(pp + ("segments",), f"{self._where(pp)}.segments: segment '{sname}' is already "
                                                       f"produced by projection '{seen[sname]}'")
                seen[sname] = mname
            projections.append((mname, tuple(pr.segments)))
            if pr.low_rank is not None:
                lp = pp + ("low_rank",)
                lname = self.ident(lp + ("name",), pr.low_rank.name, "module name")
                if lname in names:
                    raise self.err(lp + ("name",), f"{self._where(lp)}.name: module name '{lname}' is already used in "
                                                   f"this block")
                names.add(lname)
                low_rank.append((mname, lname, self.dim(lp + ("rank",), pr.low_rank.rank)))
        missing = [x for x in ("q", "k", "v", "z", "b", "a") if x not in seen]
        if missing:
            raise self.err(path + ("projections",), f"{self._where(path)}.projections: no projection produces "
                                                    f"{', '.join(missing)} (q, k, v, z, b, a each once)")
        out = self.ident(path + ("out", "name"), b.out.name, "module name")
        if out in names:
            raise self.err(path + ("out", "name"), f"{self._where(path)}.out.name: module name '{out}' is already used")
        if b.out.bias is not False:
            raise self.err(path + ("out", "bias"), f"{self._where(path)}.out.bias: the gated DeltaNet's output "
                                                   f"projection has no bias")
        kh = self.dim(path + ("key_heads",), b.key_heads)
        vh = self.dim(path + ("value_heads",), b.value_heads)

        def src(size):
            return f"({size.source})" if not isinstance(size, Size) else f"({size})"
        rep = self.expr(path + ("value_heads",), f"{src(vh)} // {src(kh)}")
        return GatedDeltaNetIR(
            kind="gated_delta_net", name=name, class_name=class_name,
            hidden=self.dim(path + ("hidden",), b.hidden), key_heads=kh, value_heads=vh,
            key_head_dim=self.dim(path + ("key_head_dim",), b.key_head_dim),
            value_head_dim=self.dim(path + ("value_head_dim",), b.value_head_dim),
            conv_kernel=self.dim(path + ("conv_kernel",), b.conv_kernel),
            eps=self.positive(path + ("eps",), b.eps, below=1.0),
            activation=self.activation(path + ("activation",), b.activation, ("silu", "swish"),
                                       "a conv activation"),
            projections=tuple(projections), out_name=out, conv_bias=b.conv_bias, rep=rep,
            decay=b.decay, gate_activation=b.gate_activation, low_rank=tuple(low_rank),
            beta_scale=self.positive(path + ("beta_scale",), b.beta_scale))

    @staticmethod
    def short_conv_params(pb: ParamBuilder, b) -> List[ParamIR]:
        """short_conv: the fused in_proj [B | C | x], the conv, out (split by channels)."""
        P, column, row = pb.P, pb.column, pb.row
        one = Size.of(1)
        segs = [SegmentIR(n, b.hidden, one) for n in ("B", "C", "x")]
        ps = [dataclasses.replace(p, stacked=True) for p in column(f"{b.in_proj}.", b.hidden, segs, _maybe(b.bias))]
        ps.append(P("conv.weight", (b.hidden, one, b.conv_kernel), "colwise", (SegmentIR("x", b.hidden, one),)))
        if _maybe(b.bias):
            ps.append(P("conv.bias", (b.hidden,), "colwise", (SegmentIR("x", b.hidden, one),)))
        ps += row(f"{b.out_name}.", SegmentIR(b.out_name, b.hidden, one), b.hidden, _maybe(b.bias))
        return ps

    @staticmethod
    def rg_lru_params(pb: ParamBuilder, b) -> List[ParamIR]:
        """rg_lru: split by heads (x, y, the conv, the gates, out's input)."""
        P = pb.P
        one = Size.of(1)
        # split by heads: each rank its heads' channels of x, y, the conv, the gates, and out's input
        per = SegmentIR("heads", b.heads, one)
        ch = SegmentIR("channels", b.heads, b.block_width)
        ps = []
        for m in (b.x_proj, b.y_proj):        # [width, hidden], a head's block_width rows per unit
            ps.append(P(f"{m}.weight", (b.width, b.hidden), "colwise", (ch,)))
            if _maybe(b.bias):
                ps.append(P(f"{m}.bias", (b.width,), "colwise", (ch,)))
        ps.append(P("conv_1d.weight", (b.width, one, b.conv_kernel), "colwise", (ch,)))
        if _maybe(b.conv_bias):
            ps.append(P("conv_1d.bias", (b.width,), "colwise", (ch,)))
        ps.append(P("rg_lru.recurrent_param", (b.width,), "colwise", (ch,)))
        for g in ("input", "recurrent"):
            ps.append(P(f"rg_lru.{g}_gate_weight", (b.heads, b.block_width, b.block_width), "colwise", (per,)))
            ps.append(P(f"rg_lru.{g}_gate_bias", (b.heads, b.block_width), "colwise", (per,)))
        ps.append(P(f"{b.out_name}.weight", (b.hidden, b.width), "rowwise", (ch,)))
        if _maybe(b.bias):
            ps.append(P(f"{b.out_name}.bias", (b.hidden,), "replicated"))
        return ps

    @staticmethod
    def mamba2_params(pb: ParamBuilder, b) -> List[ParamIR]:
        """mamba2: in_proj [z | x | B | C | dt], the conv over x | B | C, per-head A_log / D / dt_bias, norm, out."""
        P, column, row = pb.P, pb.column, pb.row
        one = Size.of(1)
        x = SegmentIR("x", b.heads, b.head_dim)
        bc = [SegmentIR("B", b.groups, b.state_size, True), SegmentIR("C", b.groups, b.state_size, True)]
        segs = [SegmentIR("z", b.heads, b.head_dim), x] + bc + [SegmentIR("dt", b.heads, one)]
        ps = [dataclasses.replace(p, stacked=True) for p in column(f"{b.in_proj}.", b.hidden, segs, _maybe(b.bias))]
        conv = [x] + bc
        total = b.heads * b.head_dim + Size.of(2) * b.groups * b.state_size
        ps.append(dataclasses.replace(P("conv1d.weight", (total, one, b.conv_kernel), "colwise", conv), stacked=True))
        if _maybe(b.conv_bias):
            ps.append(dataclasses.replace(P("conv1d.bias", (total,), "colwise", conv), stacked=True))
        heads = SegmentIR("heads", b.heads, one)
        ps += [P(n, (b.heads,), "colwise", (heads,)) for n in ("A_log", "D", "dt_bias")]
        if _maybe(b.gated_norm):
            ps.append(P("norm.weight", (b.heads * b.head_dim,), "colwise", (SegmentIR("heads", b.heads, b.head_dim),)))
            if b.gated_norm.literal is not True:      # the norm exists where the flag holds
                ps[-1] = dataclasses.replace(ps[-1], when=(b.gated_norm, True))
        out_bias = b.bias if b.out_bias is None else b.out_bias
        ps += row(f"{b.out_name}.", SegmentIR(b.out_name, b.heads, b.head_dim), b.hidden, _maybe(out_bias))
        return ps

    @staticmethod
    def mamba_params(pb: ParamBuilder, b) -> List[ParamIR]:
        """mamba: in_proj [x | z], the conv, x_proj, dt_proj, A_log, D (split by channels), out."""
        P, column, row = pb.P, pb.column, pb.row
        one = Size.of(1)
        ch = SegmentIR("channels", b.intermediate, one)
        segs = [SegmentIR("x", b.intermediate, one), SegmentIR("z", b.intermediate, one)]
        ps = [dataclasses.replace(p, stacked=True) for p in column(f"{b.in_proj}.", b.hidden, segs, _maybe(b.bias))]
        ps.append(P("conv1d.weight", (b.intermediate, one, b.conv_kernel), "colwise", (ch,)))
        if _maybe(b.conv_bias):
            ps.append(P("conv1d.bias", (b.intermediate,), "colwise", (ch,)))
        # x_proj: a rank's channels in, dt | B | C out (summed over the ranks)
        ps += row("x_proj.", ch, b.time_step_rank + Size.of(2) * b.state_size, False)
        ps += column("dt_proj.", b.time_step_rank, [ch], True)
        ps += [P("A_log", (b.intermediate, b.state_size), "colwise", (ch,)), P("D", (b.intermediate,), "colwise", (ch,))]
        if b.inner_norm == "weight":
            ps += [P("dt_layernorm.weight", (b.time_step_rank,), "replicated"),
                   P("b_layernorm.weight", (b.state_size,), "replicated"),
                   P("c_layernorm.weight", (b.state_size,), "replicated")]
        ps += row(f"{b.out_name}.", SegmentIR(b.out_name, b.intermediate, one), b.hidden, _maybe(b.bias))
        return ps

    @staticmethod
    def gated_delta_net_params(pb: ParamBuilder, b) -> List[ParamIR]:
        """gated_delta_net: its projections, the conv over q | k | v, A_log, dt_bias, norm, out."""
        P, column, row = pb.P, pb.column, pb.row
        one = Size.of(1)
        ps = []
        for mname, segs in b.projections:   # each stored whole under its own name (a `layout` may reorder it)
            lr = b.low_rank_of(mname)
            if lr is not None:                   # a replicated low-rank factor in front of it
                ps.append(P(f"{lr[0]}.weight", (lr[1], b.hidden), "replicated"))
            ps += [dataclasses.replace(p, stacked=True)
                   for p in column(f"{mname}.", lr[1] if lr else b.hidden, [b.segment(x) for x in segs], False)]
        conv = [b.segment(x) for x in ("q", "k", "v")]
        total = conv[0].heads * conv[0].unit + conv[1].heads * conv[1].unit + conv[2].heads * conv[2].unit
        # the conv's channels are q | k | v, stored whole (nn.Conv1d's weight [channels, 1, kernel])
        ps.append(dataclasses.replace(P("conv1d.weight", (total, one, b.conv_kernel), "colwise", conv), stacked=True))
        if b.conv_bias:
            ps.append(dataclasses.replace(P("conv1d.bias", (total,), "colwise", conv), stacked=True))
        heads = SegmentIR("heads", b.key_heads, b.rep)
        ps.append(P("A_log", (b.value_heads,), "colwise", (heads,)))
        if b.decay == "channel":              # one per value head and key channel
            ps.append(P("dt_bias", (b.value_heads * b.key_head_dim,), "colwise",
                        (SegmentIR("heads", b.key_heads, b.rep * b.key_head_dim),)))
        else:
            ps.append(P("dt_bias", (b.value_heads,), "colwise", (heads,)))
        ps.append(P("norm.weight", (b.value_head_dim,), "replicated"))
        ps += row(f"{b.out_name}.", SegmentIR(b.out_name, b.key_heads, b.rep * b.value_head_dim), b.hidden, False)
        return ps

