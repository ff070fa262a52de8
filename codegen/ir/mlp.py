"""The feed-forward blocks: `GatedMLPIR`, `MLPIR`, `MoEIR`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

from .attention import LoRAIR, SubNormIR
from .blocks import NormIR
from .values import Size, Value


@dataclass(frozen=True)
class GatedMLPIR:
    kind: str
    name: str
    class_name: str
    hidden: Size
    intermediate: Size
    activation: Value             # a Hugging Face activation name, or a str config symbol (dispatch)
    gate_up_name: str
    gate_up_segments: Tuple[str, str]
    gate_up_bias: Value
    down_name: str
    down_bias: Value
    activation_params: Tuple[Tuple[str, Value], ...] = ()   # a parameterized form's (swiglu_clamped: alpha, limit)
    sub_norm: Optional[SubNormIR] = None       # a norm of act(gate) * up before the down projection
    lora: Optional[LoRAIR] = None              # per-use adapters on the gate/up projection
    # muP-style output multipliers: per segment of the fused projection ((segment, value), ...), and of the output
    # projection (None = 1)
    gate_up_scale: Tuple[Tuple[str, Value], ...] = ()
    down_scale: Optional[Value] = None


@dataclass(frozen=True)
class MLPIR:
    """Non-gated MLP: down(act(up(x))), up column-parallel, down row-parallel."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    intermediate: Size
    activation: Value             # a Hugging Face activation name, or a str config symbol (dispatch)
    up_name: str
    up_bias: Value
    down_name: str
    down_bias: Value
    learned_activation: Optional[str] = None   # an activation with parameters (xielu): they live under act_fn
    sub_norm: Optional[SubNormIR] = None       # a norm of act(up(x)) before the down projection
    up_scale: Optional[Value] = None           # output multipliers of up / down (None = 1)
    down_scale: Optional[Value] = None
    multiply: bool = False                     # act(up(x)) * this layer's slice of the decoder's per-layer input


@dataclass(frozen=True)
class MoEIR:
    """Mixture of experts: replicated router -> softmax -> top-k (renormalized when norm_topk_prob) -> stacked
    gated-MLP experts (runtime layers.moe.FusedMoE), split over TP ranks by intermediate rows or by experts; plus,
    where `shared` is set, that always-on gated MLP, its output scaled by sigmoid(`shared_gate`(x)) where a gate is
    named."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    experts: Size
    top_k: Size
    intermediate: Size
    activation: Value
    norm_topk_prob: Value
    router_name: str
    parallel: str                 # tensor | expert
    shared: Optional[Union[GatedMLPIR, MLPIR]] = None   # the shared expert: a gated (or plain) MLP (module shared.name)
    shared_gate: Optional[str] = None
    shared_scale: Optional[Value] = None     # the shared expert's output times it; None = 1
    shared_enabled: Optional[Value] = None   # a bool symbol / expression: the shared expert exists only where it holds
    router_bias: Value = Value(literal=False)
    expert_bias: Value = Value(literal=False)
    activation_params: Tuple[Tuple[str, Value], ...] = ()
    scoring: str = "softmax"                 # softmax | sigmoid (with scoring_symbol: its first value)
    scoring_symbol: Optional[str] = None     # a str config symbol selecting the scoring per checkpoint
    selection_bias: Value = Value(literal=False)   # <router>.e_score_correction_bias, for the choice only
    selection_bias_on: str = "scores"        # scores | logits: what the selection bias is added to
    groups: Optional[Tuple[Size, Size, str]] = None   # (count, top, score: top2_sum | max)
    groups_dropped: str = "excluded"      # the dropped groups' experts: excluded (-inf) | zero (choice score 0)
    routed_scale: Optional[Value] = None
    router_float32: bool = False
    renormalize_min: Optional[Value] = None   # the renormalizing sum clamped to at least it; None = no clamp
    weights_on: str = "output"               # output: sum_k w_k * expert_k(x); input: sum_k expert_k(w_k * x)
    routing: str = "topk"                     # topk | sparsemixer
    jitter_eps: Optional[Value] = None        # sparsemixer's relative margin
    out_norm: Optional[NormIR] = None         # a norm of the block's output (replicated weight [hidden])
    output_bias: Value = Value(literal=False)  # a replicated bias [hidden] added to the block's output
    renormalize_epsilon: Optional[Value] = None   # the top-k weights divided by (sum + it); None = the usual
    expert_mlp: str = "gated"                 # gated: down(act(gate) * up); plain: down(act(up))
    identity_experts: Optional[Size] = None   # zero-computation experts routed beside `experts` (weight * input)

    @property
    def router_width(self) -> Size:
        """The router's choices: the experts plus any identity experts."""
        return self.experts if self.identity_experts is None else self.experts + self.identity_experts
    # the router's own input r = N(x) * w * scale (module `router_input`): the weightless RMSNorm's eps (None: no
    # norm), a learned [hidden] weight, a constant factor (None: 1)
    router_norm_eps: Optional[Value] = None
    router_input_weight: bool = False
    router_input_scale: Optional[Value] = None
    expert_scale: bool = False                # a learned [experts] scale of the chosen experts' weights
    expert_norm: Optional[NormIR] = None      # a norm of the experts' input (not the router's)
    expert_out_norm: Optional[NormIR] = None  # an RMSNorm of each expert's output, weight [experts, hidden]
    shared_out_norm: Optional[NormIR] = None  # a norm of the shared expert's output (module <shared>.<name>)

    @property
    def router_input(self) -> bool:
        """The router reads its own transform of the block's input (module `router_input`)."""
        return self.router_norm_eps is not None or self.router_input_weight or self.router_input_scale is not None

    @property
    def plain_routing(self) -> bool:
        return (self.routing == "topk" and self.scoring == "softmax" and self.scoring_symbol is None
                and self.groups is None and self.routed_scale is None and self.weights_on == "output"
                and self.renormalize_min is None and self.renormalize_epsilon is None and self.expert_mlp == "gated"
                and self.selection_bias.literal is False and self.selection_bias.symbol is None
                and self.selection_bias.expr is None and not self.expert_scale
                and self.expert_out_norm is None)
