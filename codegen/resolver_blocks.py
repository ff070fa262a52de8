"""The decoder-layer part of the resolver: each block kind to its IR (`resolve_block`) and its parameters with
their sharding (`block_params`). A mixin of resolver._Resolver, which provides err / dim / num / positive / flag /
ident / symbol and the spec, as resolver_vision.py is for the vision tower."""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, List, Tuple

from .errors import did_you_mean
from .ir import (
    MLAIR,
    MLPIR,
    RGLRUIR,
    AttentionExpertsIR,
    AttentionIR,
    GatedDeltaNetIR,
    GatedMLPIR,
    LinearIR,
    LoRAIR,
    Mamba2IR,
    MambaIR,
    MoEIR,
    NormIR,
    ParamIR,
    QKNormIR,
    QueryScaleIR,
    RotaryIR,
    SegmentIR,
    ShortConvIR,
    Size,
    SubNormIR,
    Value,
)
from .resolver_mla import MLAResolver
from .schema import (
    ActivationForm,
    AttentionBlock,
    FusedLinearBlock,
    GatedDeltaNetBlock,
    GatedMLPBlock,
    LayerNormBlock,
    LinearBlock,
    Mamba2Block,
    MambaBlock,
    MLAAttentionBlock,
    MLPBlock,
    MoEBlock,
    RGLRUBlock,
    RMSNormBlock,
    Rotary,
    ShortConvBlock,
)

# the rotary kinds the schema names (a `kind` that is none of them is a str config symbol selecting one)
ROTARY_KINDS = tuple(k for arg in typing.get_args(Rotary.model_fields["kind"].annotation)
                     if typing.get_origin(arg) is typing.Literal for k in typing.get_args(arg))

# Hugging Face activation names (config hidden_act) with a fused gated kernel: what a moe block's experts admit
GATED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new")
# the runtime's activation table (runtime/layers/activation.py ACTIVATION_FNS, each equal to transformers' ACT2FN of
# that name): what an mlp and a gated_mlp block admit, plain or gated (the compiler does not import torch: the
# two lists are compared in tests/test_layouts.py)
ACTIVATIONS = ("silu", "swish", "relu", "relu2", "relu6", "leaky_relu", "gelu", "gelu_python", "gelu_10",
               "gelu_pytorch_tanh", "gelu_new", "gelu_accurate", "gelu_python_tanh", "gelu_fast", "quick_gelu", "tanh",
               "sigmoid", "mish", "hardswish", "sqrtsoftplus", "laplace", "linear")

# activations with learned parameters (runtime PARAM_ACTIVATIONS), for a plain `mlp` only: their parameters live
# under the block's `act_fn` module, as transformers stores them (name -> parameter shapes)
PARAM_ACTIVATIONS = {"xielu": (("alpha_p", (1,)), ("alpha_n", (1,)), ("beta", ()), ("eps", ()))}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _maybe(flag: Value) -> bool:
    """Whether a flag may be true for some checkpoint (a literal False never is)."""
    return not (flag.expr is None and flag.symbol is None and flag.literal is False)


class BlockResolver(MLAResolver):
    def resolve_attention_experts(self, path, b, module) -> AttentionExpertsIR:
        """attention.experts (a mixture of attention heads): only with rotary (neox), a window, a scale and a soft-cap."""
        ep = path + ("experts",)
        for key, on in (("qk_norm", b.qk_norm is not None), ("out_gate", b.out_gate is not None),
                        ("sub_norm", b.sub_norm is not None), ("differential", b.differential is not None),
                        ("query_scale", b.query_scale is not None), ("clip_qkv", b.clip_qkv is not None),
                        ("sinks", b.sinks), ("alibi", b.alibi), ("chunk_size", b.chunk_size is not None)):
            if on:
                raise self.err(path + (key,), f"{self._where(path)}.{key}: not supported with `experts` (a mixture "
                                              f"of attention heads)", at_key=True)
        if b.rotary is not None and b.rotary.kind != "neox":
            raise self.err(path + ("rotary", "kind"), f"{self._where(path)}.rotary.kind: a mixture of attention heads "
                                                      f"takes neox rotary only")
        e = b.experts
        return AttentionExpertsIR(self.dim(ep + ("count",), e.count), self.dim(ep + ("top_k",), e.top_k),
                                  module(ep + ("router",), e.router), module(ep + ("q",), e.q))

    def resolve_sub_norm(self, path, n, taken) -> SubNormIR | None:
        """A block's `sub_norm` (None: absent); `taken`: the block's other module names."""
        if n is None:
            return None
        sp = path + ("sub_norm",)
        self.ident(sp + ("name",), n.name, "module name")
        if n.name in taken:
            raise self.err(sp + ("name",), f"{self._where(sp)}.name: module name '{n.name}' is already used in this "
                                           f"block")
        if not math.isfinite(n.weight_offset):
            raise self.err(sp + ("weight_offset",), f"{self._where(sp)}.weight_offset: must be finite")
        return SubNormIR(n.name, n.kind, self.positive(sp + ("eps",), n.eps, below=1.0), float(n.weight_offset), n.bias)

    def resolve_lora(self, path, lo, proj: str, module=None, taken=()) -> LoRAIR | None:
        """A block's `lora`: per-use low-rank adapters on its fused input projection `proj`."""
        if lo is None:
            return None
        lp = path + ("lora",)
        name = lo.name or f"{proj}_lora"
        if module is not None:
            module(lp + ("name",), name)
        else:
            self.ident(lp + ("name",), name, "module name")
            if name in taken:
                raise self.err(lp + ("name",), f"{self._where(lp)}.name: module name '{name}' is already used in this "
                                               f"block")
        enabled = self.flag(lp + ("enabled",), lo.enabled)
        if enabled.literal is False:
            return None
        return LoRAIR(name, self.dim(lp + ("rank",), lo.rank), lo.per, enabled)

    def resolve_block(self, path, name, b, unique_kind: bool):
        prefix = self.spec.class_prefix
        camel = "".join(p.capitalize() for p in name.split("_"))
        if isinstance(b, (RMSNormBlock, LayerNormBlock)):
            return self.resolve_norm(path, name, b, context="layer")
        if isinstance(b, LinearBlock):
            return LinearIR("linear", name, self.dim(path + ("in",), b.in_), (((name, self.dim(path + ("out",), b.out)),)),
                            b.parallel, b.bias)
        if isinstance(b, FusedLinearBlock):
            if len(b.segments) < 2:
                raise self.err(path + ("segments",), f"{self._where(path)}.segments: a fused linear has 2 or more segments")
            segs = tuple((self.ident(path + ("segments", k), k, "segment name", at_key=True),
                          self.dim(path + ("segments", k), v)) for k, v in b.segments.items())
            return LinearIR("fused_linear", name, self.dim(path + ("in",), b.in_), segs, "column", b.bias)
        if isinstance(b, AttentionBlock):
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
                                      self.rotary_enabled(sp + ("enabled",), qs.enabled))
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
            return AttentionIR(
                kind="attention", name=name, class_name=f"{prefix}Attention" if unique_kind else f"{prefix}{camel}",
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
                q_gate=self.q_gate(path + ("out_gate",), b.out_gate),
                alibi=self.positive(path + ("alibi_bias_max",), b.alibi_bias_max) if b.alibi else None, sub_norm=sub,
                differential=diff, v_head_dim=v_dim, value_scale=vscale, v_norm=vnorm, values_from_keys=vfk, kv_source=kvsrc,
                sinks_when=sinks if has_sinks and sinks.literal is not True else None,
                input_width=self.dim(path + ("input_width",), b.input_width) if b.input_width is not None else None,
                lora=self.resolve_lora(path, b.lora, b.qkv.name, module),
                qkv_scale=self.segment_scales(path + ("qkv",), b.qkv.scale, ("q", "k", "v")),
                out_scale=self.output_scale(path + ("out",), b.out.scale),
                experts=experts)
        if isinstance(b, ShortConvBlock):
            names = [self.ident(path + (k,), v, "module name") for k, v in (("in_proj", b.in_proj), ("out", b.out))]
            if names[1] in (names[0], "conv") or names[0] == "conv":
                raise self.err(path + ("out",), f"{self._where(path)}: module names in_proj / out must differ from "
                                                f"each other and from `conv`")
            return ShortConvIR("short_conv", name, f"{prefix}ShortConv" if unique_kind else f"{prefix}{camel}",
                               self.dim(path + ("hidden",), b.hidden), self.dim(path + ("conv_kernel",), b.conv_kernel),
                               self.flag(path + ("bias",), b.bias), names[0], names[1])
        if isinstance(b, RGLRUBlock):
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
                kind="rg_lru", name=name, class_name=f"{prefix}RGLRU" if unique_kind else f"{prefix}{camel}",
                hidden=self.dim(path + ("hidden",), b.hidden), width=width, heads=heads,
                block_width=self.expr(path + ("width",), f"{src(width)} // {src(heads)}"),
                conv_kernel=self.dim(path + ("conv_kernel",), b.conv_kernel),
                activation=self.activation(path + ("activation",), b.activation, ACTIVATIONS, "an activation"),
                decay_scale=self.positive(path + ("decay_scale",), b.decay_scale),
                bias=self.flag(path + ("bias",), b.bias), conv_bias=self.flag(path + ("conv_bias",), b.conv_bias),
                x_proj=names[0], y_proj=names[1], out_name=names[2])
        if isinstance(b, Mamba2Block):
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
                kind="mamba2", name=name, class_name=f"{prefix}Mamba2" if unique_kind else f"{prefix}{camel}",
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
        if isinstance(b, MambaBlock):
            names = [self.ident(path + (k,), v, "module name") for k, v in (("in_proj", b.in_proj), ("out", b.out))]
            taken = ("conv1d", "x_proj", "dt_proj", "A_log", "D", "dt_layernorm", "b_layernorm", "c_layernorm")
            for k, v in zip(("in_proj", "out"), names):
                if v in taken or names[0] == names[1] and k == "out":
                    raise self.err(path + (k,), f"{self._where(path)}.{k}: module name '{v}' is already used in "
                                                f"this block")
            n = b.inner_norm
            return MambaIR(
                kind="mamba", name=name, class_name=f"{prefix}Mamba" if unique_kind else f"{prefix}{camel}",
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
        if isinstance(b, GatedDeltaNetBlock):
            return self.resolve_gated_delta_net(path, name, b, f"{prefix}GatedDeltaNet" if unique_kind
                                                else f"{prefix}{camel}")
        if isinstance(b, MLAAttentionBlock):
            return self.resolve_mla(path, name, b, f"{prefix}Attention" if unique_kind else f"{prefix}{camel}")
        if isinstance(b, GatedMLPBlock):
            segs = b.gate_up.segments
            if list(segs) != ["gate", "up"]:
                # act(gate) * up: the forward pass splits the fused projection as [gate, up]
                raise self.err(path + ("gate_up", "segments"), f"{self._where(path)}.gate_up.segments: the forward "
                                                              f"pass splits the fused projection as [gate, up]; got "
                                                              f"{list(segs)}")
            act, act_params = self.gated_activation(path + ("activation",), b.activation, ACTIVATIONS, "an activation")
            g = self.ident(path + ("gate_up", "name"), b.gate_up.name, "module name")
            dn = self.ident(path + ("down", "name"), b.down.name, "module name")
            if g == dn:
                raise self.err(path + ("down", "name"), f"{self._where(path)}.down.name: module name '{dn}' is already used")
            return GatedMLPIR("gated_mlp", name, f"{prefix}MLP" if unique_kind else f"{prefix}{camel}",
                              self.dim(path + ("hidden",), b.hidden), self.dim(path + ("intermediate",), b.intermediate, per_layer=True),
                              act, g, tuple(segs), self.flag(path + ("gate_up", "bias"), b.gate_up.bias), dn,
                              self.flag(path + ("down", "bias"), b.down.bias), act_params,
                              self.resolve_sub_norm(path, b.sub_norm, (g, dn, "act_fn")),
                              self.resolve_lora(path, b.lora, g, None, taken=(g, dn, "act_fn")),
                              gate_up_scale=self.segment_scales(path + ("gate_up",), b.gate_up.scale, ("gate", "up")),
                              down_scale=self.output_scale(path + ("down",), b.down.scale))
        if isinstance(b, MLPBlock):
            act = self.activation(path + ("activation",), b.activation, ACTIVATIONS + tuple(PARAM_ACTIVATIONS),
                                  "an activation")
            vals = self.config[act.symbol].values if act.symbol is not None else (act.literal,)
            learned = [v for v in vals if v in PARAM_ACTIVATIONS]
            if learned and len(vals) > 1:
                raise self.err(("config", act.symbol, "values"), f"config.{act.symbol}.values: '{learned[0]}' "
                                                                 f"has learned parameters (act_fn.*): a symbol "
                                                                 f"selecting it must admit it alone")
            up = self.ident(path + ("up", "name"), b.up.name, "module name")
            dn = self.ident(path + ("down", "name"), b.down.name, "module name")
            if up == dn:
                raise self.err(path + ("down", "name"), f"{self._where(path)}.down.name: module name '{dn}' is already used")
            return MLPIR("mlp", name, f"{prefix}MLP" if unique_kind else f"{prefix}{camel}",
                         self.dim(path + ("hidden",), b.hidden), self.dim(path + ("intermediate",), b.intermediate),
                         act, up, self.flag(path + ("up", "bias"), b.up.bias), dn, self.flag(path + ("down", "bias"), b.down.bias),
                         learned[0] if learned else None, self.resolve_sub_norm(path, b.sub_norm, (up, dn, "act_fn")),
                         self.output_scale(path + ("up",), b.up.scale), self.output_scale(path + ("down",), b.down.scale),
                         multiply=b.multiply is not None)
        if isinstance(b, MoEBlock):
            router = self.ident(path + ("router", "name"), b.router.name, "module name")
            if router == "experts":
                raise self.err(path + ("router", "name"), f"{self._where(path)}.router.name: 'experts' is the "
                                                          f"stacked experts' module")
            cls = f"{prefix}SparseMoeBlock" if unique_kind else f"{prefix}{camel}"
            shared = {}
            if b.shared_expert is not None:
                sp = path + ("shared_expert",)
                taken = {"experts": "the stacked experts' module", router: "the router"}
                for key, module in (("name", b.shared_expert.name), ("gate", b.shared_expert.gate)):
                    if module is None:
                        continue
                    self.ident(sp + (key,), module, "module name")
                    if module in taken:
                        raise self.err(sp + (key,), f"{self._where(sp + (key,))}: '{module}' is {taken[module]}")
                    taken[module] = f"the shared expert's {'module' if key == 'name' else 'gate'}"
                sbias = self.flag(sp + ("bias",), b.shared_expert.bias)
                if b.expert_mlp == "plain":
                    sact, sparams = self.activation(path + ("activation",), b.activation, ACTIVATIONS,
                                                    "an activation"), ()
                else:
                    sact, sparams = self.gated_activation(path + ("activation",), b.activation)
                on = self.flag(sp + ("enabled",), b.shared_expert.enabled)
                if on.literal is False:
                    raise self.err(sp + ("enabled",), f"{self._where(sp)}.enabled: false: delete the shared expert "
                                                      f"instead")
                shared = dict(shared_gate=b.shared_expert.gate, shared_enabled=None if on.literal is True else on,
                              shared_scale=self.positive(sp + ("scale",), b.shared_expert.scale)
                              if b.shared_expert.scale is not None else None,
                              shared=MLPIR(
                    "mlp", b.shared_expert.name, f"{cls}SharedExpert", self.dim(path + ("hidden",), b.hidden),
                    self.dim(sp + ("intermediate",), b.shared_expert.intermediate),
                    sact, "up_proj", sbias, "down_proj", sbias) if b.expert_mlp == "plain" else GatedMLPIR(
                    "gated_mlp", b.shared_expert.name, f"{cls}SharedExpert", self.dim(path + ("hidden",), b.hidden),
                    self.dim(sp + ("intermediate",), b.shared_expert.intermediate),
                    sact, "gate_up_proj", ("gate", "up"), sbias, "down_proj", sbias, sparams))
            if b.expert_mlp == "plain":     # down(act(up)): any activation of the table, run by the torch experts
                if isinstance(b.activation, ActivationForm):
                    raise self.err(path + ("activation",), f"{self._where(path)}.activation: a gated activation form "
                                                           f"with expert_mlp: plain (down(act(up)) has no gate)")
                if _maybe(self.flag(path + ("expert_bias",), b.expert_bias)) or b.weights_on != "output":
                    raise self.err(path + ("expert_mlp",), f"{self._where(path)}.expert_mlp: plain experts take no "
                                                           f"expert_bias and weights_on: output only")
                act, act_params = self.activation(path + ("activation",), b.activation, ACTIVATIONS,
                                                  "an activation"), ()
            else:
                act, act_params = self.gated_activation(path + ("activation",), b.activation)
            groups = None
            if b.groups is not None:
                gp = path + ("groups",)
                groups = (self.dim(gp + ("count",), b.groups.count), self.dim(gp + ("top",), b.groups.top),
                          b.groups.score)
            scoring, scoring_symbol = b.scoring, None
            if scoring not in ("softmax", "sigmoid"):   # a str symbol selects the scoring from the checkpoint's config
                f = self.symbol(path + ("scoring",), scoring, ("str",))
                if not f.values or any(v not in ("softmax", "sigmoid") for v in f.values):
                    raise self.err(path + ("scoring",), f"{self._where(path)}.scoring: config symbol '{scoring}' "
                                                        f"selects the expert scoring: its `values` must list scorings "
                                                        f"(softmax, sigmoid)")
                scoring, scoring_symbol = f.values[0], b.scoring
            if b.selection_bias_on != "scores" and b.selection_bias is False:
                raise self.err(path + ("selection_bias_on",), f"{self._where(path)}.selection_bias_on: "
                                                              f"'{b.selection_bias_on}' needs a `selection_bias`")
            routing = dict(scoring=scoring, scoring_symbol=scoring_symbol, selection_bias_on=b.selection_bias_on,
                           selection_bias=self.flag(path + ("selection_bias",), b.selection_bias),
                           groups=groups, router_float32=b.router.float32, routed_scale=self.positive(path + ("routed_scale",), b.routed_scale)
                           if b.routed_scale is not None else None,
                           renormalize_min=self.positive(path + ("renormalize_min",), b.renormalize_min)
                           if b.renormalize_min is not None else None, weights_on=b.weights_on, routing=b.routing,
                           renormalize_epsilon=self.positive(path + ("renormalize_epsilon",), b.renormalize_epsilon)
                           if b.renormalize_epsilon is not None else None, expert_mlp=b.expert_mlp)
            if b.renormalize_epsilon is not None and b.renormalize_min is not None:
                raise self.err(path + ("renormalize_epsilon",), f"{self._where(path)}.renormalize_epsilon: not with "
                                                                f"renormalize_min (one renormalizing sum)")
            if b.routing == "sparsemixer":
                rp = path + ("routing",)
                for key, bad in (("scoring", b.scoring != "softmax"), ("groups", b.groups is not None),
                                 ("selection_bias", b.selection_bias is not False),
                                 ("norm_topk_prob", b.norm_topk_prob is not False),
                                 ("routed_scale", b.routed_scale is not None),
                                 ("renormalize_min", b.renormalize_min is not None),
                                 ("renormalize_epsilon", b.renormalize_epsilon is not None),
                                 ("expert_mlp", b.expert_mlp != "gated")):
                    if bad:
                        raise self.err(path + (key,), f"{self._where(path)}.{key}: not with routing: sparsemixer "
                                                      f"(it chooses and weights the two experts itself)")
                if b.jitter_eps is None:
                    raise self.err(rp, f"{self._where(path)}: routing: sparsemixer needs `jitter_eps` (its relative "
                                       f"margin, transformers' router_jitter_noise)")
                routing["jitter_eps"] = self.num(path + ("jitter_eps",), b.jitter_eps)
            elif b.jitter_eps is not None:
                raise self.err(path + ("jitter_eps",), f"{self._where(path)}.jitter_eps: only with routing: "
                                                       f"sparsemixer")
            out_norm = None
            if b.out_norm is not None:
                op = path + ("out_norm",)
                n = b.out_norm
                self.ident(op + ("name",), n.name, "module name")
                taken = {"experts", router, "shared_expert" if b.shared_expert is None else b.shared_expert.name}
                if b.shared_expert is not None and b.shared_expert.gate:
                    taken.add(b.shared_expert.gate)
                if n.name in taken:
                    raise self.err(op + ("name",), f"{self._where(op)}.name: module name '{n.name}' is already used "
                                                   f"in this block")
                if not math.isfinite(n.weight_offset):
                    raise self.err(op + ("weight_offset",), f"{self._where(op)}.weight_offset: must be finite")
                out_norm = NormIR(n.kind, n.name, self.dim(path + ("hidden",), b.hidden),
                                  self.positive(op + ("eps",), n.eps, below=1.0), n.bias, float(n.weight_offset))
            return MoEIR("moe", name, cls,
                         self.dim(path + ("hidden",), b.hidden), self.dim(path + ("experts",), b.experts),
                         self.dim(path + ("top_k",), b.top_k), self.dim(path + ("intermediate",), b.intermediate),
                         act, self.flag(path + ("norm_topk_prob",), b.norm_topk_prob), router, b.parallel, **shared,
                         router_bias=self.flag(path + ("router", "bias"), b.router.bias),
                         expert_bias=self.flag(path + ("expert_bias",), b.expert_bias), activation_params=act_params,
                         out_norm=out_norm, output_bias=self.flag(path + ("output_bias",), b.output_bias), **routing)
        raise AssertionError(type(b))  # pragma: no cover - the schema admits no other kind

    def segment_scales(self, path, scale, segments) -> tuple:
        """A fused projection's `scale: {segment: number}`: ((segment, Value), ...) in the segments' order."""
        if not scale:
            return ()
        for seg in scale:
            if seg not in segments:
                raise self.err(path + ("scale", seg), f"{self._where(path)}.scale.{seg}: no segment '{seg}' (the "
                                                      f"projection's segments: {', '.join(segments)})", at_key=True)
        return tuple((seg, self.num(path + ("scale", seg), scale[seg])) for seg in segments if seg in scale)

    def output_scale(self, path, scale):
        """A projection's `scale`: its output multiplier (None = 1)."""
        return None if scale is None else self.num(path + ("scale",), scale)

    def no_scale(self, path, proj) -> None:
        """A projection of a block kind whose template does not apply a `scale` (yet): refused, not ignored."""
        if getattr(proj, "scale", None) is not None:
            raise self.err(path + ("scale",), f"{self._where(path)}.scale: output multipliers are not supported on "
                                              f"this block kind's projections (attention, gated_mlp, mlp, mamba2 "
                                              f"take them)")

    def check_groups_variant(self, name: str, b: MoEIR, values, at, vp) -> None:
        """Grouped routing: the groups divide the experts, top <= count, and the chosen groups hold top_k experts."""
        count, top, score = b.groups
        n, t, E, k = count.eval(values), top.eval(values), b.experts.eval(values), b.top_k.eval(values)
        gp = ("decoder", "layers", "blocks", b.name, "groups")
        if E % n or not 1 <= t <= n:
            raise self.err(gp, f"variants.{name}: {b.name}.groups: {n} groups must divide the {E} experts and "
                               f"1 <= top ({t}) <= count ({n})")
        if t < n and (k > t * (E // n) or (score == "top2_sum" and E // n < 2)):
            raise self.err(gp, f"variants.{name}: {b.name}.groups: the top {t} of {n} groups hold {t * (E // n)} "
                               f"experts (top_k {k}; top2_sum needs 2 per group)")

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
        return RotaryIR(rot.kind, self.positive(rp + ("theta",), rot.theta, per_layer=True),
                        self.dim(rp + ("max_position",), rot.max_position), mrope, scaling,
                        fraction, rdim, layout, enabled, kind_symbol, layout_symbol, original, rot.direction)

    def q_gate(self, path, g):
        """The activation of an output gate that rides in the q projection (`out_gate.source: q`), else None."""
        if g is None or g.source != "q":
            return None
        if g.per != "element":
            raise self.err(path + ("per",), f"{self._where(path)}.per: a gate in the q projection has a value per "
                                            f"(head, dim) (`per: element`)")
        return g.activation

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

    def gated_activation(self, path, a, allowed: Tuple[str, ...] = GATED_ACTIVATIONS,
                         what: str = "a gated activation") -> Tuple[Value, Tuple[Tuple[str, Value], ...]]:
        """A gated activation: a name / str symbol (`activation`), or a parameterized form (ActivationForm:
        swiglu_clamped {alpha, limit}) -> (the form's name, its parameters)."""
        if isinstance(a, ActivationForm):
            return Value(literal=a.kind), (("alpha", self.num(path + ("alpha",), a.alpha)),
                                           ("limit", self.positive(path + ("limit",), a.limit, optional=True)
                                            if a.limit is not None else Value(literal=None)))
        return self.activation(path, a, allowed, what), ()

    def activation(self, path, name: str, allowed: Tuple[str, ...] = GATED_ACTIVATIONS,
                   what: str = "a gated activation") -> Value:
        """An activation the runtime has (`allowed`): a Hugging Face activation name, or a str config symbol whose
        values all are."""
        if name in self.config:
            f = self.symbol(path, name, ("str",))
            if not f.values:
                raise self.err(path, f"{self._where(path)}: config symbol '{name}' selects the activation: list the "
                                     f"activations the spec models in its `values`")
            for v in f.values:
                if v not in allowed:
                    raise self.err(("config", name, "values"), f"config.{name}.values: '{v}' is not {what} the "
                                                                f"runtime has ({', '.join(allowed)})")
            return Value(symbol=name)
        if name not in allowed:
            raise self.err(path, f"{self._where(path)}: '{name}' is neither {what} ({', '.join(allowed)}) nor a str "
                                 f"config symbol{did_you_mean(name, list(allowed) + list(self.config))}")
        return Value(literal=name)

    # ---- vision tower -----------------------------------------------------------------------------
    @staticmethod
    def sub_norm_params(P, n, seg) -> List[ParamIR]:
        """A sub_norm's weight (and bias) [width]: split over TP ranks as the output projection's input `seg`."""
        if n is None:
            return []
        rows = seg.heads * seg.unit
        seg = dataclasses.replace(seg, name=n.name)
        return [P(f"{n.name}.{w}", (rows,), "colwise", (seg,)) for w in (("weight", "bias") if n.bias else ("weight",))]

    @staticmethod
    def lora_params(P, lo, in_f, segs) -> List[ParamIR]:
        """A LoRA's down `[rank, in]` (replicated) and up `[rows, rank]` (split as the projection's segments): one
        pair per segment (`per: segment`) or one over the whole projection, its up stored whole."""
        if lo is None:
            return []
        ps = []
        groups = [(f"{lo.name}.{s.name}.", [s]) for s in segs] if lo.per == "segment" else [(f"{lo.name}.", list(segs))]
        for mod, ss in groups:
            rows = ss[0].heads * ss[0].unit
            for s in ss[1:]:
                rows = rows + s.heads * s.unit
            ps.append(P(f"{mod}down.weight", (lo.rank, in_f), "replicated"))
            ps.append(dataclasses.replace(P(f"{mod}up.weight", (rows, lo.rank), "colwise", ss), stacked=True))
        if lo.enabled.literal is not True:     # only in the checkpoints where the flag holds
            ps = [dataclasses.replace(p, when=(lo.enabled, True)) for p in ps]
        return ps

    @staticmethod
    def block_params(prefix: str, block: str, b, per_layer: bool) -> List[ParamIR]:
        one = Size.of(1)

        def P(name, shape, shard, segments=()):
            return ParamIR(f"{prefix}.{name}", block, tuple(shape), shard, tuple(segments), per_layer=per_layer)

        def column(module, in_f, segs, bias):
            total = segs[0].heads * segs[0].unit
            for s in segs[1:]:
                total = total + s.heads * s.unit
            ps = [P(f"{module}weight", (total, in_f), "colwise", segs)]
            if bias:
                ps.append(P(f"{module}bias", (total,), "colwise", segs))
            return ps

        def row(module, in_seg, out_f, bias):
            ps = [P(f"{module}weight", (out_f, in_seg.heads * in_seg.unit), "rowwise", (in_seg,))]
            if bias:
                ps.append(P(f"{module}bias", (out_f,), "replicated"))
            return ps

        if isinstance(b, NormIR):
            return ([P("weight", (b.dim,), "replicated")] if b.weight else []) + \
                ([P("bias", (b.dim,), "replicated")] if b.bias else [])
        if isinstance(b, LinearIR):
            out_total = b.out_sizes[0][1]
            for _, s in b.out_sizes[1:]:
                out_total = out_total + s
            if b.parallel == "column":
                return column("", b.in_features, [SegmentIR(n, s, one) for n, s in b.out_sizes], b.bias)
            if b.parallel == "row":
                return row("", SegmentIR(b.name, b.in_features, one), out_total, b.bias)
            return [P("weight", (out_total, b.in_features), "replicated")] + \
                ([P("bias", (out_total,), "replicated")] if b.bias else [])
        if isinstance(b, ShortConvIR):
            segs = [SegmentIR(n, b.hidden, one) for n in ("B", "C", "x")]
            ps = [dataclasses.replace(p, stacked=True) for p in column(f"{b.in_proj}.", b.hidden, segs, _maybe(b.bias))]
            ps.append(P("conv.weight", (b.hidden, one, b.conv_kernel), "colwise", (SegmentIR("x", b.hidden, one),)))
            if _maybe(b.bias):
                ps.append(P("conv.bias", (b.hidden,), "colwise", (SegmentIR("x", b.hidden, one),)))
            ps += row(f"{b.out_name}.", SegmentIR(b.out_name, b.hidden, one), b.hidden, _maybe(b.bias))
            return ps
        if isinstance(b, RGLRUIR):
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
        if isinstance(b, Mamba2IR):
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
        if isinstance(b, MambaIR):
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
        if isinstance(b, GatedDeltaNetIR):
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
        if isinstance(b, AttentionIR) and b.experts is not None:   # a mixture of attention heads
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
        if isinstance(b, AttentionIR):
            q, k, v = b.qkv_segments
            segs = [SegmentIR(q, b.heads, b.head_dim if not b.q_gate else Size.of(2) * b.head_dim),
                    SegmentIR(k, b.kv_heads, b.head_dim, True),
                    SegmentIR(v, b.kv_heads, b.v_dim, True)]
            ps = column(f"{b.qkv_name}.", b.in_width, segs, _maybe(b.qkv_bias))
            ps += BlockResolver.lora_params(P, b.lora, b.in_width, segs)
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
                             False)
            if b.sinks:                   # one logit per query head, split by heads as q is
                ps.append(P("sinks", (b.heads,), "colwise", (SegmentIR("sinks", b.heads, one),)))
                if b.sinks_when is not None:      # only on the layers where the flag holds
                    ps[-1] = dataclasses.replace(ps[-1], when=(b.sinks_when, True))
            ps += BlockResolver.sub_norm_params(P, b.sub_norm, SegmentIR(b.out_name, b.heads, b.v_dim))
            if b.differential is not None:    # the lambda re-parameterization vectors, replicated
                ps += [P(n, (b.head_dim,), "replicated") for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")]
            return ps
        if isinstance(b, MoEIR):
            E = b.experts
            if b.expert_mlp == "plain":   # experts.up_proj [E, I, H] (one segment), down_proj as the gated form's
                shard = "colwise" if b.parallel == "tensor" else "expert"
                up = ParamIR(f"{prefix}.experts.up_proj", block, (E, b.intermediate, b.hidden), shard,
                             (SegmentIR("up", b.intermediate, one),), per_layer=per_layer, experts=E)
                down = ParamIR(f"{prefix}.experts.down_proj", block, (E, b.hidden, b.intermediate),
                               "rowwise" if b.parallel == "tensor" else "expert",
                               (SegmentIR("down_proj", b.intermediate, one),), per_layer=per_layer, experts=E)
            elif b.parallel == "tensor":
                up = ParamIR(f"{prefix}.experts.gate_up_proj", block, (E, Size.of(2) * b.intermediate, b.hidden),
                             "colwise", (SegmentIR("gate", b.intermediate, one), SegmentIR("up", b.intermediate, one)),
                             per_layer=per_layer, experts=E)
                down = ParamIR(f"{prefix}.experts.down_proj", block, (E, b.hidden, b.intermediate), "rowwise",
                               (SegmentIR("down_proj", b.intermediate, one),), per_layer=per_layer, experts=E)
            else:                         # expert parallel: whole experts per rank (dim 0), segments as loaded
                up = ParamIR(f"{prefix}.experts.gate_up_proj", block, (E, Size.of(2) * b.intermediate, b.hidden),
                             "expert", (SegmentIR("gate", b.intermediate, one), SegmentIR("up", b.intermediate, one)),
                             per_layer=per_layer, experts=E)
                down = ParamIR(f"{prefix}.experts.down_proj", block, (E, b.hidden, b.intermediate), "expert",
                               (SegmentIR("down_proj", b.intermediate, one),), per_layer=per_layer, experts=E)
            ps = [P(f"{b.router_name}.weight", (E, b.hidden), "replicated")]
            if _maybe(b.router_bias):
                ps.append(P(f"{b.router_name}.bias", (E,), "replicated"))
            if _maybe(b.selection_bias):
                ps.append(P(f"{b.router_name}.e_score_correction_bias", (E,), "replicated"))
            ps += [up, down]
            if _maybe(b.expert_bias):     # gate_up's bias split as its rows (tensor) or by experts; down's whole
                ps.append(dataclasses.replace(up, name=f"{prefix}.experts.gate_up_proj_bias",
                                              shape=(E, Size.of(2) * b.intermediate)))
                ps.append(ParamIR(f"{prefix}.experts.down_proj_bias", block, (E, b.hidden),
                                  "expert" if b.parallel == "expert" else "replicated", (), per_layer=per_layer,
                                  experts=E))
            if b.shared:                  # a dense gated MLP's parameters, under the shared expert's module
                first = len(ps)
                ps += BlockResolver.block_params(f"{prefix}.{b.shared.name}", block, b.shared, per_layer)
                if b.shared_gate:
                    ps.append(P(f"{b.shared_gate}.weight", (one, b.hidden), "replicated"))
                if b.shared_enabled is not None:     # only in the checkpoints where the flag holds
                    ps[first:] = [dataclasses.replace(p, when=(b.shared_enabled, True)) for p in ps[first:]]
            if b.out_norm is not None:    # a replicated [hidden] weight (and bias)
                n = b.out_norm
                ps += [P(f"{n.name}.{w}", (b.hidden,), "replicated") for w in (("weight", "bias") if n.bias else ("weight",))]
            if _maybe(b.output_bias):     # the block's output bias, replicated
                ps.append(P("bias", (b.hidden,), "replicated"))
            return ps
        if isinstance(b, MLAIR):
            return MLAResolver.mla_params(prefix, block, b, per_layer, _maybe)
        if isinstance(b, MLPIR):
            ps = column(f"{b.up_name}.", b.hidden, [SegmentIR(b.up_name, b.intermediate, one)], _maybe(b.up_bias))
            ps += row(f"{b.down_name}.", SegmentIR(b.down_name, b.intermediate, one), b.hidden, _maybe(b.down_bias))
            for pname, shape in PARAM_ACTIVATIONS.get(b.learned_activation, ()):
                ps.append(P(f"act_fn.{pname}", tuple(Size.of(n) for n in shape), "replicated"))
            ps += BlockResolver.sub_norm_params(P, b.sub_norm, SegmentIR(b.down_name, b.intermediate, one))
            return ps
        if isinstance(b, GatedMLPIR):
            g, u = b.gate_up_segments
            ps = column(f"{b.gate_up_name}.", b.hidden, [SegmentIR(g, b.intermediate, one),
                                                         SegmentIR(u, b.intermediate, one)], _maybe(b.gate_up_bias))
            ps += BlockResolver.lora_params(P, b.lora, b.hidden, [SegmentIR(g, b.intermediate, one),
                                                                 SegmentIR(u, b.intermediate, one)])
            ps += row(f"{b.down_name}.", SegmentIR(b.down_name, b.intermediate, one), b.hidden, _maybe(b.down_bias))
            ps += BlockResolver.sub_norm_params(P, b.sub_norm, SegmentIR(b.down_name, b.intermediate, one))
            return ps
        raise AssertionError(type(b))  # pragma: no cover
