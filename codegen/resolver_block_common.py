"""What the resolvers of every block kind share (a mixin of resolver._Resolver through
resolver_blocks.BlockResolver): the activation tables, a block's `sub_norm` and `lora`, a projection's `scale`, and
the parameter builder (`ParamBuilder`: P / column / row) each kind's `<kind>_params` writes its parameters with."""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, List, Tuple

from .errors import did_you_mean
from .ir import (
    LoRAIR,
    ParamIR,
    SubNormIR,
    Value,
)
from .schema import (
    ActivationForm,
    Rotary,
)

# the rotary kinds the schema names (a `kind` that is none of them is a str config symbol selecting one)
ROTARY_KINDS = tuple(k for arg in typing.get_args(Rotary.model_fields["kind"].annotation)
                     if typing.get_origin(arg) is typing.Literal for k in typing.get_args(arg))

# Hugging Face activation names (config hidden_act) with a fused gated kernel (the moe block's experts admit every name
# of ACTIVATIONS: the others run the torch grouped experts)
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


class ParamBuilder:
    """A block's parameters: `P` one parameter under the block's module `prefix` (`block`: its spec path;
    `per_layer`: one per layer), `column` / `row` a column- / row-parallel projection's weight (and bias)."""

    def __init__(self, prefix: str, block: str, per_layer: bool):
        self.prefix, self.block, self.per_layer = prefix, block, per_layer

    def P(self, name, shape, shard, segments=(), when=None):
        return ParamIR(f"{self.prefix}.{name}", self.block, tuple(shape), shard, tuple(segments),
                       per_layer=self.per_layer, when=when)

    def column(self, module, in_f, segs, bias):
        P = self.P
        total = segs[0].heads * segs[0].unit
        for s in segs[1:]:
            total = total + s.heads * s.unit
        ps = [P(f"{module}weight", (total, in_f), "colwise", segs)]
        if bias:
            ps.append(P(f"{module}bias", (total,), "colwise", segs))
        return ps

    def row(self, module, in_seg, out_f, bias):
        P = self.P
        ps = [P(f"{module}weight", (out_f, in_seg.heads * in_seg.unit), "rowwise", (in_seg,))]
        if bias:
            ps.append(P(f"{module}bias", (out_f,), "replicated"))
        return ps


class BlockCommon:
    """The helpers every block kind's resolver uses: sub_norm, lora, projection scales, activations, and the
    sub_norm / lora parameters."""


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

    def gated_activation(self, path, a, allowed: Tuple[str, ...] = GATED_ACTIVATIONS,
                         what: str = "a gated activation") -> Tuple[Value, Tuple[Tuple[str, Value], ...]]:
        """A gated activation: a name / str symbol (`activation`), or a parameterized form (ActivationForm:
        swiglu_clamped {alpha, limit}, glu_clamped {act, limit}) -> (the form's name, its parameters). The limit may
        read `layer` (a limit per layer; None: no clamping)."""
        if isinstance(a, ActivationForm):
            need, refuse = ("alpha", "act") if a.kind == "swiglu_clamped" else ("act", "alpha")
            if getattr(a, need) is None:
                raise self.err(path, f"{self._where(path)}: {a.kind} needs `{need}`")
            if getattr(a, refuse) is not None:
                raise self.err(path + (refuse,), f"{self._where(path)}.{refuse}: not a parameter of {a.kind}")
            first = (("alpha", self.num(path + ("alpha",), a.alpha)) if a.kind == "swiglu_clamped" else
                     ("act", self.activation(path + ("act",), a.act, ACTIVATIONS, "an activation")))
            if a.clamp is not None and a.kind != "glu_clamped":
                raise self.err(path + ("clamp",), f"{self._where(path)}.clamp: not a parameter of {a.kind}")
            limit = ("limit", self.positive(path + ("limit",), a.limit, per_layer=True, optional=True)
                     if a.limit is not None else Value(literal=None))
            clamp = (("clamp", Value(literal=a.clamp)),) if a.clamp == "before_act" else ()
            return Value(literal=a.kind), (first, limit) + clamp
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
                if v in PARAM_ACTIVATIONS and v not in allowed:
                    raise self.err(("config", name, "values"), f"config.{name}.values: '{v}' "
                                                                + self._learned_only_mlp(v))
                if v not in allowed:
                    raise self.err(("config", name, "values"), f"config.{name}.values: '{v}' is not {what} the "
                                                                f"runtime has ({', '.join(allowed)})")
            return Value(symbol=name)
        if name in PARAM_ACTIVATIONS and name not in allowed:
            raise self.err(path, f"{self._where(path)}: '{name}' " + self._learned_only_mlp(name))
        if name not in allowed:
            raise self.err(path, f"{self._where(path)}: '{name}' is neither {what} ({', '.join(allowed)}) nor a str "
                                 f"config symbol{did_you_mean(name, list(allowed) + list(self.config))}")
        return Value(literal=name)

    @staticmethod
    def _learned_only_mlp(name: str) -> str:
        params = ", ".join(f"act_fn.{p}" for p, _ in PARAM_ACTIVATIONS[name])
        return (f"has learned parameters ({params}): only a plain `mlp` block (down(act(up))) admits it, not a "
                f"gated MLP or the experts")

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

