"""The feed-forward block kinds' part of the resolver (`gated_mlp`, `mlp`, `moe`): each one's IR (`resolve_<kind>`),
grouped routing's per-variant check (`check_groups_variant`) and the parameters with their sharding
(`<kind>_params`). A mixin of resolver._Resolver through resolver_blocks.BlockResolver."""
from __future__ import annotations

import dataclasses
import math
from typing import List

from .ir import (
    MLPIR,
    GatedMLPIR,
    MoEIR,
    NormIR,
    ParamIR,
    SegmentIR,
    Size,
)
from .resolver_block_common import (
    ACTIVATIONS,
    PARAM_ACTIVATIONS,
    BlockCommon,
    ParamBuilder,
    _maybe,
)
from .schema import (
    ActivationForm,
)


class FeedForwardResolver:

    def resolve_gated_mlp(self, path, name: str, b, class_name: str):
        """A `gated_mlp` block: down(act(gate) * up)."""
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
        return GatedMLPIR("gated_mlp", name, class_name,
                          self.dim(path + ("hidden",), b.hidden), self.dim(path + ("intermediate",), b.intermediate, per_layer=True),
                          act, g, tuple(segs), self.flag(path + ("gate_up", "bias"), b.gate_up.bias), dn,
                          self.flag(path + ("down", "bias"), b.down.bias), act_params,
                          self.resolve_sub_norm(path, b.sub_norm, (g, dn, "act_fn")),
                          self.resolve_lora(path, b.lora, g, None, taken=(g, dn, "act_fn")),
                          gate_up_scale=self.segment_scales(path + ("gate_up",), b.gate_up.scale, ("gate", "up")),
                          down_scale=self.output_scale(path + ("down",), b.down.scale))

    def resolve_mlp(self, path, name: str, b, class_name: str):
        """An `mlp` block: down(act(up))."""
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
        return MLPIR("mlp", name, class_name,
                     self.dim(path + ("hidden",), b.hidden), self.dim(path + ("intermediate",), b.intermediate),
                     act, up, self.flag(path + ("up", "bias"), b.up.bias), dn, self.flag(path + ("down", "bias"), b.down.bias),
                     learned[0] if learned else None, self.resolve_sub_norm(path, b.sub_norm, (up, dn, "act_fn")),
                     self.output_scale(path + ("up",), b.up.scale), self.output_scale(path + ("down",), b.down.scale),
                     multiply=b.multiply is not None)

    def resolve_moe(self, path, name: str, b, class_name: str):
        """A `moe` block: the router, the stacked experts, an optional shared expert and out_norm."""
        router = self.ident(path + ("router", "name"), b.router.name, "module name")
        if router == "experts":
            raise self.err(path + ("router", "name"), f"{self._where(path)}.router.name: 'experts' is the "
                                                      f"stacked experts' module")
        cls = class_name
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
            if b.expert_mlp == "plain" and b.shared_expert.activation is not None:
                raise self.err(sp + ("activation",), f"{self._where(sp)}.activation: plain experts' shared expert "
                                                     f"takes the block's activation")
            if b.expert_mlp == "plain":
                sact, sparams = self.activation(path + ("activation",), b.activation, ACTIVATIONS,
                                                "an activation"), ()
            elif b.shared_expert.activation is not None:       # its own gated activation
                sact, sparams = self.gated_activation(sp + ("activation",), b.shared_expert.activation, ACTIVATIONS,
                                                      "an activation")
            else:
                sact, sparams = self.gated_activation(path + ("activation",), b.activation, ACTIVATIONS,
                                                      "an activation")
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
        else:   # any name of the table: one without a fused gated kernel runs the torch grouped experts
            act, act_params = self.gated_activation(path + ("activation",), b.activation, ACTIVATIONS,
                                                    "an activation")
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
                       groups=groups, groups_dropped=b.groups.dropped if b.groups is not None else "excluded",
                       router_float32=b.router.float32, routed_scale=self.positive(path + ("routed_scale",), b.routed_scale)
                       if b.routed_scale is not None else None,
                       renormalize_min=self.positive(path + ("renormalize_min",), b.renormalize_min)
                       if b.renormalize_min is not None else None, weights_on=b.weights_on, routing=b.routing,
                       renormalize_epsilon=self.positive(path + ("renormalize_epsilon",), b.renormalize_epsilon)
                       if b.renormalize_epsilon is not None else None, expert_mlp=b.expert_mlp)
        if b.renormalize_epsilon is not None and b.renormalize_min is not None:
            raise self.err(path + ("renormalize_epsilon",), f"{self._where(path)}.renormalize_epsilon: not with "
                                                            f"renormalize_min (one renormalizing sum)")
        if b.identity_experts is not None:
            ip = path + ("identity_experts",)
            routing["identity_experts"] = self.dim(ip, b.identity_experts)
            for key, bad in (("routing", b.routing != "topk"), ("groups", b.groups is not None),
                             ("weights_on", b.weights_on != "output")):
                if bad:
                    raise self.err(path + (key,), f"{self._where(path)}.{key}: not with identity_experts (they are "
                                                  f"chosen by plain top-k and weight the block's output)")
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
        taken = {"experts", router, "shared_expert" if b.shared_expert is None else b.shared_expert.name,
                 "router_input", "expert_scale", "bias"}
        if b.shared_expert is not None and b.shared_expert.gate:
            taken.add(b.shared_expert.gate)
        norms = {}
        for key in ("out_norm", "expert_norm"):     # a norm of the block's output / of the experts' input
            n = getattr(b, key)
            if n is None:
                continue
            op = path + (key,)
            self.ident(op + ("name",), n.name, "module name")
            if n.name in taken:
                raise self.err(op + ("name",), f"{self._where(op)}.name: module name '{n.name}' is already used "
                                               f"in this block")
            taken.add(n.name)
            if not math.isfinite(n.weight_offset):
                raise self.err(op + ("weight_offset",), f"{self._where(op)}.weight_offset: must be finite")
            norms[key] = NormIR(n.kind, n.name, self.dim(path + ("hidden",), b.hidden),
                                self.positive(op + ("eps",), n.eps, below=1.0), n.bias, float(n.weight_offset))
        r, rp = b.router, path + ("router",)
        if r.expert_scale and b.routing != "topk":
            raise self.err(rp + ("expert_scale",), f"{self._where(rp)}.expert_scale: only with routing: topk")
        routing.update(
            router_norm_eps=self.positive(rp + ("input_norm", "eps"), r.input_norm.eps, below=1.0)
            if r.input_norm is not None else None, router_input_weight=r.input_weight,
            router_input_scale=self.positive(rp + ("input_scale",), r.input_scale) if r.input_scale is not None else None,
            expert_scale=r.expert_scale, expert_norm=norms.get("expert_norm"))
        routing.update(self._output_norms(path, b))
        return MoEIR("moe", name, cls,
                     self.dim(path + ("hidden",), b.hidden), self.dim(path + ("experts",), b.experts),
                     self.dim(path + ("top_k",), b.top_k), self.dim(path + ("intermediate",), b.intermediate),
                     act, self.flag(path + ("norm_topk_prob",), b.norm_topk_prob), router, b.parallel, **shared,
                     router_bias=self.flag(path + ("router", "bias"), b.router.bias),
                     expert_bias=self.flag(path + ("expert_bias",), b.expert_bias), activation_params=act_params,
                     out_norm=norms.get("out_norm"), output_bias=self.flag(path + ("output_bias",), b.output_bias), **routing)

    def _output_norms(self, path, b) -> dict:
        """`expert_out_norm` (an RMSNorm of each routed expert's output, a weight per expert; whole experts per rank)
        and `shared_expert.out_norm` (a norm of the shared expert's output)."""
        out = {}
        n = b.expert_out_norm
        if n is not None:
            op = path + ("expert_out_norm",)
            self.ident(op + ("name",), n.name, "module name")
            if n.kind != "rmsnorm" or n.bias or n.weight_offset:
                raise self.err(op, f"{self._where(op)}: a plain RMSNorm (kind: rmsnorm, no bias / weight_offset)",
                               at_key=True)
            if b.parallel != "expert":
                raise self.err(op, f"{self._where(op)}: each expert's output is normalized whole, so the experts must "
                                   f"be split whole over the ranks (parallel: expert)", at_key=True)
            if n.name in ("up_proj", "down_proj", "gate_up_proj", "gate_up_proj_bias", "down_proj_bias"):
                raise self.err(op + ("name",), f"{self._where(op)}.name: '{n.name}' is a parameter of the experts")
            out["expert_out_norm"] = NormIR("rmsnorm", n.name, self.dim(path + ("hidden",), b.hidden),
                                            self.positive(op + ("eps",), n.eps, below=1.0))
        n = b.shared_expert.out_norm if b.shared_expert is not None else None
        if n is not None:
            op = path + ("shared_expert", "out_norm")
            self.ident(op + ("name",), n.name, "module name")
            if n.name in ("up_proj", "down_proj", "gate_up_proj", "act_fn"):
                raise self.err(op + ("name",), f"{self._where(op)}.name: '{n.name}' is a module of the shared expert")
            if not math.isfinite(n.weight_offset):
                raise self.err(op + ("weight_offset",), f"{self._where(op)}.weight_offset: must be finite")
            out["shared_out_norm"] = NormIR(n.kind, n.name, self.dim(path + ("hidden",), b.hidden),
                                            self.positive(op + ("eps",), n.eps, below=1.0), n.bias,
                                            float(n.weight_offset))
        return out

    def check_groups_variant(self, name: str, b: MoEIR, values, at, vp) -> None:
        """Grouped routing: the groups divide the experts, top <= count, and the chosen groups hold top_k experts."""
        count, top, score = b.groups
        n, t, E, k = count.eval(values), top.eval(values), b.experts.eval(values), b.top_k.eval(values)
        gp = ("decoder", "layers", "blocks", b.name, "groups")
        if E % n or not 1 <= t <= n:
            raise self.err(gp, f"variants.{name}: {b.name}.groups: {n} groups must divide the {E} experts and "
                               f"1 <= top ({t}) <= count ({n})")
        if t < n and ((k > t * (E // n) and b.groups_dropped == "excluded") or (score == "top2_sum" and E // n < 2)):
            raise self.err(gp, f"variants.{name}: {b.name}.groups: the top {t} of {n} groups hold {t * (E // n)} "
                               f"experts (top_k {k}; top2_sum needs 2 per group)")

    @staticmethod
    def moe_params(pb: ParamBuilder, b) -> List[ParamIR]:
        """moe: the router, the stacked experts (split by rows under tensor, by experts under expert parallelism), the shared expert, out_norm, the output bias."""
        P, prefix, block, per_layer = pb.P, pb.prefix, pb.block, pb.per_layer
        one = Size.of(1)
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
        R = b.router_width            # the router scores the experts and any identity experts
        ps = [P(f"{b.router_name}.weight", (R, b.hidden), "replicated")]
        if _maybe(b.router_bias):
            ps.append(P(f"{b.router_name}.bias", (R,), "replicated"))
        if _maybe(b.selection_bias):
            ps.append(P(f"{b.router_name}.e_score_correction_bias", (R,), "replicated"))
        ps += [up, down]
        if _maybe(b.expert_bias):     # gate_up's bias split as its rows (tensor) or by experts; down's whole
            ps.append(dataclasses.replace(up, name=f"{prefix}.experts.gate_up_proj_bias",
                                          shape=(E, Size.of(2) * b.intermediate)))
            ps.append(ParamIR(f"{prefix}.experts.down_proj_bias", block, (E, b.hidden),
                              "expert" if b.parallel == "expert" else "replicated", (), per_layer=per_layer,
                              experts=E))
        if b.shared:                  # a dense gated MLP's parameters, under the shared expert's module
            first = len(ps)
            from . import resolver_blocks  # the shared expert: a dense block's parameters
            ps += resolver_blocks.BlockResolver.block_params(f"{prefix}.{b.shared.name}", block, b.shared, per_layer)
            if b.shared_gate:
                ps.append(P(f"{b.shared_gate}.weight", (one, b.hidden), "replicated"))
            n = b.shared_out_norm
            if n is not None:         # the shared expert's output norm, replicated
                ps += [P(f"{b.shared.name}.{n.name}.{w}", (b.hidden,), "replicated")
                       for w in (("weight", "bias") if n.bias else ("weight",))]
            if b.shared_enabled is not None:     # only in the checkpoints where the flag holds
                ps[first:] = [dataclasses.replace(p, when=(b.shared_enabled, True)) for p in ps[first:]]
        for n in (b.out_norm, b.expert_norm):   # a replicated [hidden] weight (and bias)
            if n is not None:
                ps += [P(f"{n.name}.{w}", (b.hidden,), "replicated") for w in (("weight", "bias") if n.bias else ("weight",))]
        if b.expert_out_norm is not None:   # each expert's output norm weight, whole experts per rank
            ps.append(ParamIR(f"{prefix}.experts.{b.expert_out_norm.name}.weight", block, (E, b.hidden), "expert", (),
                              per_layer=per_layer, experts=E))
        if b.router_input_weight:     # the router's learned input scale [hidden]
            ps.append(P("router_input.weight", (b.hidden,), "replicated"))
        if b.expert_scale:            # the learned per-expert scale of the routing weights
            ps.append(P("expert_scale", (E,), "replicated"))
        if _maybe(b.output_bias):     # the block's output bias, replicated
            ps.append(P("bias", (b.hidden,), "replicated"))
        return ps

    @staticmethod
    def mlp_params(pb: ParamBuilder, b) -> List[ParamIR]:
        """mlp: up (column), down (row), a learned activation's parameters, a sub_norm."""
        P, column, row = pb.P, pb.column, pb.row
        one = Size.of(1)
        ps = column(f"{b.up_name}.", b.hidden, [SegmentIR(b.up_name, b.intermediate, one)], _maybe(b.up_bias))
        ps += row(f"{b.down_name}.", SegmentIR(b.down_name, b.intermediate, one), b.hidden, _maybe(b.down_bias))
        for pname, shape in PARAM_ACTIVATIONS.get(b.learned_activation, ()):
            ps.append(P(f"act_fn.{pname}", tuple(Size.of(n) for n in shape), "replicated"))
        ps += BlockCommon.sub_norm_params(P, b.sub_norm, SegmentIR(b.down_name, b.intermediate, one))
        return ps

    @staticmethod
    def gated_mlp_params(pb: ParamBuilder, b) -> List[ParamIR]:
        """gated_mlp: gate_up (column, two segments), its LoRA, down (row), a sub_norm."""
        P, column, row = pb.P, pb.column, pb.row
        one = Size.of(1)
        g, u = b.gate_up_segments
        ps = column(f"{b.gate_up_name}.", b.hidden, [SegmentIR(g, b.intermediate, one),
                                                     SegmentIR(u, b.intermediate, one)], _maybe(b.gate_up_bias))
        ps += BlockCommon.lora_params(P, b.lora, b.hidden, [SegmentIR(g, b.intermediate, one),
                                                             SegmentIR(u, b.intermediate, one)])
        ps += row(f"{b.down_name}.", SegmentIR(b.down_name, b.intermediate, one), b.hidden, _maybe(b.down_bias))
        ps += BlockCommon.sub_norm_params(P, b.sub_norm, SegmentIR(b.down_name, b.intermediate, one))
        return ps

