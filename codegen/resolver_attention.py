"""The `attention` block kind's part of the resolver: its IR (`resolve_attention`: the fused qkv projection, rotary,
qk_norm, windows, gates, sinks, differential heads, LoRA, value heads of their own width; `experts`, a mixture of
attention heads), its rotary (`resolve_attention_rotary`) and its parameters with their sharding
(`attention_params`). A mixin of resolver._Resolver through resolver_blocks.BlockResolver."""
from __future__ import annotations

import dataclasses
import math
from typing import List

from .errors import did_you_mean
from .ir import (
    AttentionExpertsIR,
    AttentionIR,
    KeyBiasIR,
    ParamIR,
    QKNormIR,
    QueryScaleIR,
    RotaryIR,
    SegmentIR,
    Size,
    Value,
)
from .resolver_block_common import (
    ROTARY_KINDS,
    BlockCommon,
    ParamBuilder,
    _is_int,
    _maybe,
)


class AttentionResolver:

    def resolve_attention_experts(self, path, b, module) -> AttentionExpertsIR:
        """attention.experts (a mixture of attention heads): only with rotary (neox), a window, a scale and a soft-cap."""
        ep = path + ("experts",)
        for key, on in (("qk_norm", b.qk_norm is not None), ("out_gate", b.out_gate is not None),
                        ("sub_norm", b.sub_norm is not None), ("differential", b.differential is not None),
                        ("query_scale", b.query_scale is not None), ("clip_qkv", b.clip_qkv is not None),
                        ("sinks", b.sinks), ("alibi", b.alibi), ("chunk_size", b.chunk_size is not None),
                        ("key_bias", b.key_bias is not None), ("kv_nvfp4", b.kv_nvfp4 is not False)):
            if on:
                raise self.err(path + (key,), f"{self._where(path)}.{key}: not supported with `experts` (a mixture "
                                              f"of attention heads)", at_key=True)
        if b.rotary is not None and b.rotary.kind != "neox":
            raise self.err(path + ("rotary", "kind"), f"{self._where(path)}.rotary.kind: a mixture of attention heads "
                                                      f"takes neox rotary only")
        e = b.experts
        return AttentionExpertsIR(self.dim(ep + ("count",), e.count), self.dim(ep + ("top_k",), e.top_k),
                                  module(ep + ("router",), e.router), module(ep + ("q",), e.q))

    def resolve_attention(self, path, name: str, b, class_name: str):
        """An `attention` block (either form: one fused qkv projection, or `experts`, a mixture of attention heads)."""
        modules = {}
        def module(mpath, mname):
            self.ident(mpath, mname, "module name")
            if mname in modules or mname in ("rotary_emb", "attn"):
                raise self.err(mpath, f"{self._where(mpath)}: module name '{mname}' is already used in this block")
            modules[mname] = mpath
            return mname
        qkv_segs = b.qkv.segments
        experts = self.resolve_attention_experts(path, b, module) if b.experts is not None else None
        if experts is not None and list(qkv_segs) != ["k", "v"]:
            raise self.err(path + ("qkv", "segments"), f"{self._where(path)}.qkv.segments: with `experts` the "
                                                      f"queries come from the routed q projection; the fused "
                                                      f"projection is [k, v], got {list(qkv_segs)}")
        if experts is None and list(qkv_segs) != ["q", "k", "v"]:
            # the segments are stacked in the order the forward pass splits them: q | k | v
            raise self.err(path + ("qkv", "segments"), f"{self._where(path)}.qkv.segments: the forward pass "
                                                      f"splits the fused projection as [q, k, v]; got "
                                                      f"{list(qkv_segs)}")
        rotary = self.resolve_attention_rotary(path, b.rotary) if b.rotary is not None else None
        qk = None
        qk_on = self.rotary_enabled(path + ("qk_norm", "enabled"), b.qk_norm.enabled) if b.qk_norm else None
        if b.qk_norm and qk_on.literal is not False:
            qp = path + ("qk_norm",)
            n = b.qk_norm
            if not math.isfinite(n.weight_offset):
                raise self.err(qp + ("weight_offset",), f"{self._where(qp)}.weight_offset: must be finite")
            if n.weights == "per_head" and n.over != "head":
                raise self.err(qp + ("weights",), f"{self._where(qp)}.weights: per-head weights are for `over: "
                                                  f"head`; a projection-wide norm's weight already has a value "
                                                  f"per column")
            if not n.weight and (n.kind != "rmsnorm" or n.over != "head" or n.weights != "shared"
                                 or n.weight_offset or n.bias):
                raise self.err(qp + ("weight",), f"{self._where(qp)}.weight: a weightless q/k norm is an rmsnorm "
                                                 f"over each head, without weight_offset, bias or per-head weights")
            if qk_on.per_layer and n.weight:
                raise self.err(qp + ("enabled",), f"{self._where(qp)}.enabled: a per-layer q/k norm (reading "
                                                  f"`layer`) must have no weight (`weight: false`)")
            qk = QKNormIR(module(qp + ("q",), n.q), module(qp + ("k",), n.k),
                          self.positive(qp + ("eps",), n.eps, below=1.0), n.kind, n.over, n.at,
                          float(n.weight_offset), n.bias, n.weights == "per_head",
                          None if qk_on.literal is True else qk_on, n.weight)
        if (qk is not None and qk.at == "after_rotary" and rotary is not None and qk.weight
                and (rotary.direction != "forward" or rotary.layout != "neox" or rotary.layout_symbol)):
            raise self.err(path + ("qk_norm", "at"), f"{self._where(path)}.qk_norm.at: a q/k norm with a weight "
                                                     f"after an interleaved or backward rotary is not supported "
                                                     f"(the rotary keeps q and k in a permuted order)")
        clip = None
        if b.clip_qkv is not None:
            clip = self.positive(path + ("clip_qkv",), b.clip_qkv, optional=True)
        window = softcap = None
        if b.sliding_window is not None:
            window = self.num(path + ("sliding_window",), b.sliding_window, per_layer=True, optional=True)
            if window.symbol is None and window.expr is None and (not _is_int(window.literal) or window.literal < 1):
                raise self.err(path + ("sliding_window",), f"{self._where(path)}.sliding_window: a window is an "
                                                          f"int >= 1 (or None), got {window.literal!r}")
        if b.softcap is not None:
            softcap = self.positive(path + ("softcap",), b.softcap, optional=True)
        chunk = None
        if b.chunk_size is not None:
            chunk = self.num(path + ("chunk_size",), b.chunk_size, per_layer=True, optional=True)
            if chunk.symbol is None and chunk.expr is None and (not _is_int(chunk.literal) or chunk.literal < 1):
                raise self.err(path + ("chunk_size",), f"{self._where(path)}.chunk_size: a chunk is an int >= 1 "
                                                      f"(or None), got {chunk.literal!r}")
        qscale = None
        if b.query_scale is not None:
            sp = path + ("query_scale",)
            if rotary is not None and rotary.kind != "neox":
                raise self.err(sp, f"{self._where(sp)}: a position-dependent query scale reads one position per "
                                   f"token; rotary kind {rotary.kind} has several")
            qs = b.query_scale
            qscale = QueryScaleIR(self.num(sp + ("beta",), qs.beta), self.positive(sp + ("floor",), qs.floor),
                                  self.num(sp + ("offset",), qs.offset),
                                  self.rotary_enabled(sp + ("enabled",), qs.enabled), qs.form)
        out_name = module(path + ("out", "name"), b.out.name)
        # the output projection's bias may exist on some layers only (an expression reading `layer`)
        out_bias = self.flag(path + ("out", "bias"), b.out.bias, per_layer=True)
        if experts is not None and out_bias.per_layer:
            raise self.err(path + ("out", "bias"), f"{self._where(path)}.out.bias: a routed output projection's "
                                                   f"bias is the same on every layer")
        gate_name = (module(path + ("out_gate", "name"), b.out_gate.name)
                     if b.out_gate is not None and b.out_gate.source == "projection" else None)
        sub = self.resolve_sub_norm(path, b.sub_norm, ())
        if sub is not None:
            module(path + ("sub_norm", "name"), sub.name)
        sinks = self.flag(path + ("sinks",), b.sinks, per_layer=True)
        has_sinks = sinks.literal is not False
        v_dim = self.dim(path + ("v_head_dim",), b.v_head_dim, per_layer=True) if b.v_head_dim is not None else None
        if v_dim is not None:
            for key, on in (("differential", b.differential is not None),
                            ("out_gate", b.out_gate is not None and b.out_gate.source == "q")):
                if on:
                    raise self.err(path + ("v_head_dim",), f"{self._where(path)}.v_head_dim: value heads of their "
                                                           f"own width with `{key}` are not supported")
        vscale = self.num(path + ("value_scale",), b.value_scale, per_layer=True, optional=True) \
            if b.value_scale is not None else None
        vnorm = None
        if b.v_norm is not None:
            module(path + ("v_norm",), "v_norm")
            vnorm = self.positive(path + ("v_norm", "eps"), b.v_norm.eps, below=1.0)
        vfk = self.flag(path + ("values_from_keys",), b.values_from_keys, per_layer=True)
        vfk = None if vfk.literal is False else vfk
        if vfk is not None:
            vp = path + ("values_from_keys",)
            for key, on in (("v_head_dim", b.v_head_dim is not None), ("differential", b.differential is not None),
                            ("lora", b.lora is not None), ("experts", b.experts is not None),
                            ("clip_qkv", b.clip_qkv is not None), ("qkv.scale", bool(b.qkv.scale))):
                if on:
                    raise self.err(vp, f"{self._where(path)}.values_from_keys: values taken from the keys with "
                                       f"`{key}` are not supported")
        kvsrc = None
        if b.kv_source is not None:
            kp = path + ("kv_source",)
            kvsrc = self.num(kp, b.kv_source, per_layer=True)
            n = b.qk_norm
            for key, on in (("experts", b.experts is not None), ("differential", b.differential is not None),
                            ("lora", b.lora is not None), ("clip_qkv", b.clip_qkv is not None),
                            ("qkv.scale", bool(b.qkv.scale)), ("out_gate", b.out_gate is not None),
                            ("sub_norm", b.sub_norm is not None), ("query_scale", b.query_scale is not None),
                            ("a q/k norm over the projection or after rotary",
                             n is not None and (n.over != "head" or n.at != "before_rotary"))):
                if on:
                    raise self.err(kp, f"{self._where(path)}.kv_source: KV sharing across layers with {key} is "
                                       f"not supported")
            module(kp, "kv_source")
            module(kp, "reads_kv")
        diff = None
        if b.differential is not None:
            dp = path + ("differential",)
            for key, on in (("sinks", has_sinks), ("out_gate", b.out_gate is not None), ("alibi", b.alibi),
                            ("sub_norm", b.sub_norm is not None), ("query_scale", b.query_scale is not None)):
                if on:
                    raise self.err(dp, f"{self._where(dp)}: differential attention with `{key}` is not supported")
            for m in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "diff"):
                module(dp, m)
            diff = self.positive(dp + ("eps",), b.differential.eps, below=1.0)
        kbias = self.resolve_key_bias(path, b, vfk, module)
        alibi, alibi_when, alibi_scale = self.resolve_alibi(path, b)
        nvfp4 = self.flag(path + ("kv_nvfp4",), b.kv_nvfp4, per_layer=True)
        nvfp4 = None if nvfp4.literal is False else nvfp4
        if nvfp4 is not None:
            module(path + ("kv_nvfp4",), "kv_nvfp4")
            if b.differential is not None:
                raise self.err(path + ("kv_nvfp4",), f"{self._where(path)}.kv_nvfp4: with `differential` is not "
                                                     f"supported")
        return AttentionIR(
            kind="attention", name=name, class_name=class_name,
            hidden=self.dim(path + ("hidden",), b.hidden),
            heads=self.dim(path + ("heads",), b.heads, per_layer=True),
            kv_heads=self.dim(path + ("kv_heads",), b.kv_heads, per_layer=True),
            head_dim=self.dim(path + ("head_dim",), b.head_dim, per_layer=True),
            qkv_name=module(path + ("qkv", "name"), b.qkv.name), qkv_segments=tuple(qkv_segs),
            qkv_bias=self.flag(path + ("qkv", "bias"), b.qkv.bias),
            out_name=out_name,
            out_bias=out_bias,
            rotary=rotary,
            qk_norm=qk, scale=self.positive(path + ("scale",), b.scale, per_layer=True) if b.scale is not None else None,
            sliding_window=window, softcap=softcap, chunk_size=chunk, query_scale=qscale, clip_qkv=clip, sinks=has_sinks,
            out_gate=(gate_name, b.out_gate.activation, b.out_gate.per) if gate_name is not None else None,
            out_gate_bias=self._gate_bias(path, b, gate_name),
            out_gate_proj_bias=self._gate_proj_bias(path, b, gate_name),
            q_gate=self.q_gate(path + ("out_gate",), b.out_gate),
            alibi=alibi, alibi_when=alibi_when, alibi_scale=alibi_scale, alibi_bf16=b.alibi_bf16, sub_norm=sub,
            differential=diff, v_head_dim=v_dim, value_scale=vscale, v_norm=vnorm, values_from_keys=vfk, kv_source=kvsrc,
            sinks_when=sinks if has_sinks and sinks.literal is not True else None,
            input_width=self.dim(path + ("input_width",), b.input_width) if b.input_width is not None else None,
            lora=self.resolve_lora(path, b.lora, b.qkv.name, module),
            qkv_scale=self.segment_scales(path + ("qkv",), b.qkv.scale, ("q", "k", "v")),
            out_scale=self.output_scale(path + ("out",), b.out.scale),
            experts=experts, key_bias=kbias, kv_nvfp4=nvfp4)

    def resolve_alibi(self, path, b):
        """attention.alibi (a literal, or a per-checkpoint flag), its bias_max and an optional factor on the slopes:
        (bias_max or None when off, the flag where not literally true, the factor)."""
        flag = self.flag(path + ("alibi",), b.alibi)
        if flag.literal is False:
            for key, on in (("alibi_scale", b.alibi_scale is not None), ("alibi_bf16", b.alibi_bf16)):
                if on:
                    raise self.err(path + (key,), f"{self._where(path)}.{key}: without `alibi`", at_key=True)
            return None, None, None
        bias_max = self.positive(path + ("alibi_bias_max",), b.alibi_bias_max)
        scale = self.positive(path + ("alibi_scale",), b.alibi_scale) if b.alibi_scale is not None else None
        return bias_max, (None if flag.literal is True else flag), scale

    def resolve_key_bias(self, path, b, vfk, module):
        """attention.key_bias (a per-key score bias from the values): its modules, flag and `keep`."""
        if b.key_bias is None:
            return None
        kp = path + ("key_bias",)
        for key, on in (("differential", b.differential is not None), ("kv_source", b.kv_source is not None),
                        ("v_head_dim", b.v_head_dim is not None), ("values_from_keys", vfk is not None),
                        ("chunk_size", b.chunk_size is not None)):
            if on:
                raise self.err(kp, f"{self._where(path)}.key_bias: a per-key score bias with `{key}` is not "
                                   f"supported")
        kb = b.key_bias
        self.ident(kp + ("gain",), kb.gain, "parameter name")
        keep = None
        if kb.keep is not None:
            keep = self.num(kp + ("keep",), kb.keep, optional=True)
            if keep.symbol is None and keep.expr is None and (not _is_int(keep.literal) or keep.literal < 1):
                raise self.err(kp + ("keep",), f"{self._where(kp)}.keep: an int >= 1 (or None), got "
                                               f"{keep.literal!r}")
        return KeyBiasIR(module(kp + ("proj",), kb.proj), module(kp + ("gain",), kb.gain),
                         self.flag(kp + ("bias",), kb.bias), keep)

    def resolve_attention_rotary(self, path, rot) -> RotaryIR:
        """An attention block's `rotary` (kind, or the str symbol selecting it; mrope sections; scaling; axes)."""
        rp = path + ("rotary",)
        kind_symbol = None
        if rot.kind not in ROTARY_KINDS:        # a str symbol selects the kind from the checkpoint's config
            if rot.kind not in self.config:
                raise self.err(rp + ("kind",), f"{self._where(rp)}.kind: '{rot.kind}' (str) is not allowed"
                                               f"{did_you_mean(rot.kind, list(ROTARY_KINDS) + list(self.config))}: "
                                               f"give a rotary kind ({', '.join(ROTARY_KINDS)}) or a str config "
                                               f"symbol whose values are rotary kinds")
            f = self.symbol(rp + ("kind",), rot.kind, ("str",))
            bad = [v for v in (f.values or ()) if v not in ROTARY_KINDS]
            if not f.values or bad:
                raise self.err(rp + ("kind",), f"{self._where(rp)}.kind: config symbol '{rot.kind}' selects the "
                                               f"rotary kind: its `values` must list rotary kinds "
                                               f"({', '.join(ROTARY_KINDS)})" + (f", not {bad[0]!r}" if bad else ""))
            if len({v.startswith("mrope") for v in f.values}) > 1:
                raise self.err(rp + ("kind",), f"{self._where(rp)}.kind: config symbol '{rot.kind}' admits "
                                               f"{', '.join(f.values)}: neox and the mrope kinds take different "
                                               f"positions ([N] vs [3, N]); one spec selects among kinds of one")
            kind_symbol = rot.kind
            rot = rot.model_copy(update={"kind": f.values[0]})
        mrope = None
        if rot.kind.startswith("mrope"):
            if rot.mrope_section is None:
                raise self.err(rp, f"{self._where(rp)}: rotary kind '{rot.kind}' needs mrope_section")
            if isinstance(rot.mrope_section, str):
                self.symbol(rp + ("mrope_section",), rot.mrope_section, ("int_tuple",))
                mrope = Value(symbol=rot.mrope_section)
            else:
                sec = list(rot.mrope_section)
                if len(sec) != 3 or any(x < 0 for x in sec):
                    raise self.err(rp + ("mrope_section",), f"{self._where(rp)}.mrope_section: three sections "
                                                            f"(t, h, w), each >= 0; got {sec}")
                mrope = Value(literal=tuple(sec))
        elif rot.mrope_section is not None:
            raise self.err(rp + ("mrope_section",), f"{self._where(rp)}.mrope_section: only for mrope rotary kinds")
        scaling = None
        if rot.scaling is not None:
            scaling = self.rope_scaling(rp + ("scaling",), rot.scaling)
            if rot.kind != "neox":
                raise self.err(rp + ("scaling",), f"{self._where(rp)}.scaling: rope scaling applies to the neox "
                                                  f"rotary only")
        fraction, rdim, layout, enabled, layout_symbol = self.rotary_axes(rp, rot)
        if rot.direction != "forward" and rot.kind != "neox":
            raise self.err(rp + ("direction",), f"{self._where(rp)}.direction: backward rotary is for kind neox only")
        original = None
        if rot.original_max_position is not None:
            if scaling is None:
                raise self.err(rp + ("original_max_position",), f"{self._where(rp)}.original_max_position: only "
                                                                f"with a rope `scaling` (it is a scaling parameter)")
            original = self.dim(rp + ("original_max_position",), rot.original_max_position)
        for key, on in (("longrope_factors", rot.longrope_factors != "by_context"),
                        ("longrope_mscale", rot.longrope_mscale)):
            if on and scaling is None:
                raise self.err(rp + (key,), f"{self._where(rp)}.{key}: only with a rope `scaling` (a longrope "
                                            f"parameter)")
        return RotaryIR(rot.kind, self.positive(rp + ("theta",), rot.theta, per_layer=True),
                        self.dim(rp + ("max_position",), rot.max_position), mrope, scaling,
                        fraction, rdim, layout, enabled, kind_symbol, layout_symbol, original, rot.direction,
                        rot.longrope_factors, rot.longrope_mscale)

    def _gate_proj_bias(self, path, b, gate_name):
        """The output gate projection's bias flag (`out_gate.bias`), None where it has none."""
        if b.out_gate is None or b.out_gate.bias is False:
            return None
        if gate_name is None:
            raise self.err(path + ("out_gate", "bias"), f"{self._where(path)}.out_gate.bias: a gate with a projection "
                                                        f"of its own only (not source: q)")
        return self.flag(path + ("out_gate", "bias"), b.out_gate.bias)

    def _gate_bias(self, path, b, gate_name):
        """The output gate's per-head logit bias (`out_gate.head_bias`): a parameter name of the block, with a gate
        projection of its own."""
        name = b.out_gate.head_bias if b.out_gate is not None else None
        if name is None:
            return None
        gp = path + ("out_gate", "head_bias")
        self.ident(gp, name, "parameter name")
        if gate_name is None:
            raise self.err(gp, f"{self._where(path)}.out_gate.head_bias: a gate with a projection of its own "
                               f"(source: projection)")
        if name in (gate_name, b.out.name, "sinks", getattr(b.qkv, "name", None)):
            raise self.err(gp, f"{self._where(path)}.out_gate.head_bias: '{name}' is already a module of the block")
        return name

    def q_gate(self, path, g):
        """The activation of an output gate that rides in the q projection (`out_gate.source: q`), else None."""
        if g is None or g.source != "q":
            return None
        if g.per != "element":
            raise self.err(path + ("per",), f"{self._where(path)}.per: a gate in the q projection has a value per "
                                            f"(head, dim) (`per: element`)")
        return g.activation

    @staticmethod
    def attention_params(pb: ParamBuilder, b) -> List[ParamIR]:
        """An attention block's parameters (a mixture of attention heads: `attention_experts_params`)."""
        if b.experts is not None:                   # a mixture of attention heads
            return AttentionResolver.attention_experts_params(pb, b)
        P, column, row = pb.P, pb.column, pb.row
        one = Size.of(1)
        q, k, v = b.qkv_segments
        segs = [SegmentIR(q, b.heads, b.head_dim if not b.q_gate else Size.of(2) * b.head_dim),
                SegmentIR(k, b.kv_heads, b.head_dim, True),
                SegmentIR(v, b.kv_heads, b.v_dim, True)]
        ps = column(f"{b.qkv_name}.", b.in_width, segs, _maybe(b.qkv_bias))
        ps += BlockCommon.lora_params(P, b.lora, b.in_width, segs)
        ps += row(f"{b.out_name}.", SegmentIR(b.out_name, b.heads, b.v_dim), b.hidden, _maybe(b.out_bias))
        if b.out_bias.per_layer:      # the bias exists on the layers where the expression holds
            ps[-1] = dataclasses.replace(ps[-1], when=(b.out_bias, True))
        if b.qk_norm:
            n = b.qk_norm
            first = len(ps)
            for module, seg in ((n.q, segs[0]), (n.k, segs[1])):
                if n.weightless:                                # no parameters
                    continue
                if n.over == "head" and n.per_head_weights:    # [heads, head_dim], split by heads
                    names = ("weight", "bias") if n.bias else ("weight",)
                    ps += [P(f"{module}.{w}", (seg.heads, b.head_dim), "colwise",
                             (SegmentIR(module, seg.heads, Size.of(1), seg.replicate_ok),)) for w in names]
                elif n.over == "head":    # one [head_dim] weight shared by the heads
                    names = ("weight", "bias") if n.bias else ("weight",)
                    ps += [P(f"{module}.{w}", (b.head_dim,), "replicated") for w in names]
                else:                     # the whole projection's [heads * head_dim], sharded like it
                    rows = seg.heads * seg.unit
                    names = ("weight", "bias") if n.bias else ("weight",)
                    ps += [P(f"{module}.{w}", (rows,), "colwise", (dataclasses.replace(seg, name=module),))
                           for w in names]
            if n.enabled is not None:     # only in the checkpoints where the flag holds
                ps[first:] = [dataclasses.replace(p, when=(n.enabled, True)) for p in ps[first:]]
        if b.out_gate:                # a gate per (head, dim) or per head, split by heads as q is
            gname, _, per = b.out_gate
            ps += column(f"{gname}.", b.hidden, [SegmentIR(gname, b.heads, b.v_dim if per == "element" else one)],
                         _maybe(b.out_gate_proj_bias) if b.out_gate_proj_bias is not None else False)
        if b.out_gate_bias:           # the gate logits' bias per head, split by heads as q is
            ps.append(P(b.out_gate_bias, (b.heads,), "colwise", (SegmentIR(b.out_gate_bias, b.heads, one),)))
        if b.sinks:                   # one logit per query head, split by heads as q is
            ps.append(P("sinks", (b.heads,), "colwise", (SegmentIR("sinks", b.heads, one),)))
            if b.sinks_when is not None:      # only on the layers where the flag holds
                ps[-1] = dataclasses.replace(ps[-1], when=(b.sinks_when, True))
        ps += BlockCommon.sub_norm_params(P, b.sub_norm, SegmentIR(b.out_name, b.heads, b.v_dim))
        if b.differential is not None:    # the lambda re-parameterization vectors, replicated
            ps += [P(n, (b.head_dim,), "replicated") for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")]
        if b.key_bias is not None:        # over every KV head's values (gathered): replicated, the gain as well
            kb = b.key_bias
            ps.append(P(f"{kb.proj}.weight", (b.kv_heads, b.kv_heads * b.head_dim), "replicated"))
            if _maybe(kb.bias):
                ps.append(P(f"{kb.proj}.bias", (b.kv_heads,), "replicated"))
            ps.append(P(kb.gain, (b.kv_heads,), "replicated"))
        return ps

    @staticmethod
    def attention_experts_params(pb: ParamBuilder, b) -> List[ParamIR]:
        """A mixture of attention heads: the routed q and output projections stacked per expert."""
        P, column, prefix, block, per_layer = pb.P, pb.column, pb.prefix, pb.block, pb.per_layer
        ex = b.experts
        kv = [SegmentIR("k", b.kv_heads, b.head_dim), SegmentIR("v", b.kv_heads, b.head_dim)]
        ps = column(f"{b.qkv_name}.", b.hidden, kv, _maybe(b.qkv_bias))
        ps.append(P(f"{ex.router}.weight", (ex.count, b.hidden), "replicated"))
        # the routed q [experts, kv_heads * head_dim, hidden] split by KV heads per expert; the routed output
        # projection [experts, hidden, kv_heads * head_dim] by its input columns alike
        ps.append(ParamIR(f"{prefix}.{ex.q}.weight", block, (ex.count, b.kv_heads * b.head_dim, b.hidden),
                          "colwise", (SegmentIR(ex.q, b.kv_heads, b.head_dim),), per_layer=per_layer,
                          experts=ex.count))
        ps.append(ParamIR(f"{prefix}.{b.out_name}.weight", block, (ex.count, b.hidden, b.kv_heads * b.head_dim),
                          "rowwise", (SegmentIR(b.out_name, b.kv_heads, b.head_dim),), per_layer=per_layer,
                          experts=ex.count))
        if _maybe(b.out_bias):
            ps.append(P(f"{b.out_name}.bias", (b.hidden,), "replicated"))
        return ps

