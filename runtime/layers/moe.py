"""Mixture of experts: the experts as one stacked gated MLP, routed by softmax top-k (or the general routing of
ops.moe.select_experts: sigmoid scores, a selection-only bias, grouped top-k, a routed scale).

`FusedMoE(num_experts, hidden, intermediate, top_k, renormalize, activation, parallel, activation_params, bias)`
holds `gate_up_proj [E, 2 * I, H]` (per expert: gate rows | up rows) and `down_proj [E, H, I]`, with `bias` also
`gate_up_proj_bias [E, 2 * I]` and `down_proj_bias [E, H]`; `activation_params` parameterize a gated form
(swiglu_clamped: alpha, limit; glu_clamped: act, limit). Its forward takes the hidden states and the router logits
(the router, with or without a bias, is a replicated linear of the block that owns this layer).

Sharding, decided here (and only here):
  parallel="tensor": every rank holds every expert, split over the intermediate dimension: gate_up_proj is
      column-parallel along dim 1 (per segment gate / up), down_proj row-parallel along dim 2; the partial
      outputs are summed with one all-reduce. gate_up_proj_bias splits as gate_up_proj's rows; down_proj_bias is
      whole on every rank and added by rank 0 alone (once, before the all-reduce). An intermediate width that the
      TP size does not divide is padded (sharding.split_segment pad=True): zero gate / up rows and bias, zero down
      columns after each rank's real ones, so the padded intermediate values contribute nothing.
  parallel="expert": rank r holds experts [r * E / tp, (r + 1) * E / tp) whole; pairs routed to another rank's
      experts contribute nothing here, and the all-reduce sums the ranks' outputs (each rank adds its own experts'
      biases).

Loading: each stacked parameter's `tp_split` is an ExpertSplit (layers/expert_split.py), whose `load` is its
`weight_loader`, reading only this rank's experts / rows.

Quantized experts (an fp8 / int checkpoint's per-expert weights, runtime/loading/quant_load.py) are held dequantized;
the checkpoint's activation quantization is `act_quant` on the experts' input and `act_quant_down` on the
intermediate (the down projections' input), set at load: the semantics of vLLM's fp8 / int8 fused MoE.
"""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple, Optional

import torch
from torch import nn

from xllm_gen.runtime.executor import context as fwd_context
from xllm_gen.runtime.executor.distributed import all_reduce, get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import (
    ParamSplit,
    Segment,
    SegmentSlice,
    raise_or_defer,
    replicated,
    split_segment,
)
from xllm_gen.runtime.layers.activation import act, gated_act
from xllm_gen.runtime.layers.expert_norm import ExpertNorm
from xllm_gen.runtime.layers.expert_split import ExpertSplit, _attach_experts
from xllm_gen.runtime.ops import moe as moe_ops

PARALLEL_MODES = ("tensor", "expert")


_EXPERTS_ON_META = [False]


@contextlib.contextmanager
def experts_on_meta():
    """Within it, FusedMoE's stacked expert weights are built on the meta device (no memory): a checkpoint whose
    experts the loader keeps packed (float8) fills them packed, never at their compute-dtype size
    (runtime/loading/quant_load.py; one it cannot pack is materialized there)."""
    prev, _EXPERTS_ON_META[0] = _EXPERTS_ON_META[0], True
    try:
        yield
    finally:
        _EXPERTS_ON_META[0] = prev


def _expert_weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta" if _EXPERTS_ON_META[0] else None))


class RoutingView(NamedTuple):
    """FusedMoE.routing_view: [T, E] the choice scores without the selection-only bias (float32: what rounding moves;
    the bias is a parameter), [T, top_k] the experts chosen (global ids, ascending), [T] the margin of the choice
    (ops/moe.py routing_margin)."""
    unbiased: torch.Tensor
    experts: torch.Tensor
    margin: torch.Tensor


class FusedMoE(nn.Module):
    """Experts as one stacked gated MLP: out[t] = sum_k w[t, k] * down_e(act(gate_e(x)) * up_e(x)),
    e = ids[t, k], from softmax top-k routing of the router logits (renormalized when `renormalize`).

    `activation_params`: the parameters of a parameterized gated form (activation "swiglu_clamped": alpha,
    limit; "glu_clamped": act, limit, the plain `act` experts where limit is None). `bias`: per-expert biases
    `gate_up_proj_bias [E, 2 * I]` (split as gate_up_proj's rows) and
    `down_proj_bias [E, H]` (whole on every rank; with parallel="tensor" rank 0 adds it, once)."""

    # a quantized checkpoint's activation quantization (runtime.layers.quant.ActQuant), set at load: of the experts'
    # input (the gate / up projections') and of the intermediate (the down projections' input)
    act_quant = None
    act_quant_down = None
    # a quantized checkpoint's experts kept packed (runtime/loading/quant_load.py), set at load: stacked parameter
    # name -> (float8 codes [E, rows, K], scales [E, rows, ceil(K / bk)], bk), or for 4-bit codes (two to a byte
    # [E, rows, K / 2], scales [E, rows, K / group], group, zeros uint8 [E, rows, K / group]) (ops/moe.py
    # dequantize_experts); the parameter itself is then empty
    packed = None

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int, renormalize: bool,
                 activation: str, parallel: str = "tensor", activation_params: Optional[dict] = None,
                 bias: bool = False, scoring: str = "softmax", n_group: int = 1, topk_group: int = 1,
                 group_score: str = "top2_sum", routed_scale: float = 1.0, renormalize_min: float = 0.0,
                 weights_on: str = "output", selection_bias_on: str = "scores",
                 routing: str = "topk", jitter_eps: float = 0.0, renormalize_epsilon: Optional[float] = None,
                 gated: bool = True, group_dropped: str = "excluded", identity_experts: int = 0,
                 out_norm: Optional[str] = None, out_norm_eps: float = 1e-6):
        super().__init__()
        # zero-computation experts: the router's choices num_experts .. num_experts + identity_experts - 1 add their
        # routing weight times the input; the stacked experts never see them
        if not (isinstance(identity_experts, int) and identity_experts >= 0):
            raise ValueError(f"FusedMoE: identity_experts must be an int >= 0, got {identity_experts!r}")
        self.identity_experts = identity_experts
        if identity_experts and (routing != "topk" or n_group > 1 or weights_on != "output"):
            raise ValueError("FusedMoE: identity experts are chosen by top-k routing without groups and weight the "
                             "output (weights_on='output')")
        # gated: down(act(gate) * up), gate_up_proj [E, 2I, H]; plain (gated=False): down(act(up)), up_proj [E, I, H]
        self.gated = bool(gated)
        if not self.gated and (bias or weights_on != "output" or activation_params):
            raise ValueError("FusedMoE: plain (non-gated) experts take no expert biases, no activation parameters and "
                             "weights_on='output' only")
        if renormalize_epsilon is not None and not (renormalize_epsilon > 0.0 and math.isfinite(renormalize_epsilon)):
            raise ValueError(f"FusedMoE: renormalize_epsilon must be a finite number > 0, got {renormalize_epsilon}")
        self.renormalize_epsilon = None if renormalize_epsilon is None else float(renormalize_epsilon)
        if weights_on not in ("output", "input"):
            raise ValueError(f"FusedMoE: weights_on must be 'output' or 'input', not {weights_on!r}")
        # "input": each chosen expert sees w * x and the outputs are summed unweighted
        self.weights_on = weights_on
        if routing not in moe_ops.ROUTINGS:
            raise ValueError(f"FusedMoE: routing must be one of {moe_ops.ROUTINGS}, not {routing!r}")
        if routing == "sparsemixer" and (top_k != 2 or num_experts < 2):
            raise ValueError(f"FusedMoE: routing 'sparsemixer' chooses two experts of at least two: top_k {top_k}, "
                             f"{num_experts} experts (num_experts_per_tok must be 2)")
        if routing == "sparsemixer" and not (jitter_eps >= 0.0 and math.isfinite(jitter_eps)):
            raise ValueError(f"FusedMoE: sparsemixer's jitter_eps must be a finite number >= 0, got {jitter_eps}")
        self.routing, self.jitter_eps = routing, float(jitter_eps)
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"FusedMoE parallel must be one of {PARALLEL_MODES}, not {parallel!r}")
        if not 1 <= top_k <= num_experts + identity_experts:
            raise ValueError(f"FusedMoE: top_k {top_k} must be in 1..{num_experts + identity_experts} (the number of "
                             f"experts)")
        if scoring not in moe_ops.SCORINGS or group_score not in moe_ops.GROUP_SCORES:
            raise ValueError(f"FusedMoE: scoring must be one of {moe_ops.SCORINGS} (got {scoring!r}), group_score one "
                             f"of {moe_ops.GROUP_SCORES} (got {group_score!r})")
        grouped = n_group > 1 and topk_group < n_group
        if n_group < 1 or not 1 <= topk_group <= n_group or num_experts % n_group:
            raise ValueError(f"FusedMoE: grouped routing needs n_group >= 1 dividing the {num_experts} experts and "
                             f"1 <= topk_group <= n_group; got n_group={n_group}, topk_group={topk_group}")
        if grouped and group_score == "top2_sum" and num_experts // n_group < 2:
            raise ValueError(f"FusedMoE: group score top2_sum needs at least 2 experts per group; {num_experts} "
                             f"experts in {n_group} groups have {num_experts // n_group}")
        if group_dropped not in ("excluded", "zero"):
            raise ValueError(f"FusedMoE: group_dropped must be 'excluded' or 'zero', not {group_dropped!r}")
        # zero: the dropped groups' experts keep a choice score of 0 (A.X-K2), so they may fill the top-k
        self.group_dropped = group_dropped
        if grouped and group_dropped == "excluded" and top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"FusedMoE: top_k {top_k} exceeds the experts of the topk_group={topk_group} chosen "
                             f"groups ({topk_group * (num_experts // n_group)})")
        self.scoring, self.group_score, self.routed_scale = scoring, group_score, float(routed_scale)
        if selection_bias_on not in moe_ops.BIAS_ON:
            raise ValueError(f"FusedMoE: selection_bias_on must be one of {moe_ops.BIAS_ON}, got {selection_bias_on!r}")
        self.selection_bias_on = selection_bias_on    # what a selection-only bias is added to: scores | logits
        self.n_group, self.topk_group = (n_group, topk_group) if grouped else (1, 1)
        # softmax top-k without groups, scale or a selection bias: the fused routing kernel's case
        if not renormalize_min >= 0.0:
            raise ValueError(f"FusedMoE: renormalize_min must be >= 0, got {renormalize_min}")
        self.renormalize_min = float(renormalize_min)   # the renormalizing sum clamped to at least it (0: not)
        self.plain_routing = (routing == "topk" and scoring == "softmax" and not grouped and self.routed_scale == 1.0
                              and self.renormalize_min == 0.0 and self.renormalize_epsilon is None
                              and not identity_experts)
        tp, rank = get_tp_size(), get_tp_rank()
        self.tp_size, self.tp_rank, self.parallel = tp, rank, parallel
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, bool(renormalize)
        activation_params = dict(activation_params or {})
        if activation == "glu_clamped" and activation_params.get("limit") is None and "act" in activation_params:
            activation, activation_params = activation_params["act"], {}   # no clamp here: the plain gated experts
        self.activation = activation
        self.activation_params = activation_params
        self.act_fn = gated_act(activation, **self.activation_params) if self.gated else act(activation)
        problems: list = []
        owner = type(self).__name__
        if parallel == "tensor":
            # an intermediate width the TP size does not divide is padded with zero rows / columns (exact)
            gate = split_segment(Segment("gate", intermediate), tp, rank, problems, pad=True)
            up = split_segment(Segment("up", intermediate), tp, rank, [], pad=True)
            down = split_segment(Segment("down_proj", intermediate), tp, rank, [], pad=True)
            e0, e1 = 0, num_experts
        else:
            ex = split_segment(Segment("experts", num_experts), tp, rank, problems)
            e0, e1 = ex.start, ex.stop
            gate, up, down = (SegmentSlice(n, intermediate, 0, intermediate) for n in ("gate", "up", "down_proj"))
        self.intermediate = gate.rows                                    # per rank
        self.expert_start, self.num_local_experts = e0, e1 - e0
        raise_or_defer(self, problems)
        # per expert: gate_up_proj column-parallel (rows of each segment), down_proj row-parallel (columns);
        # with parallel="expert" the segments are whole (every row), the experts are what is split
        if self.gated:
            self.gate_up_proj = _expert_weight(e1 - e0, 2 * gate.rows, hidden)
            _attach_experts(self.gate_up_proj, ExpertSplit(
                ParamSplit("column", 0, (gate, up), (2 * gate.rows, hidden), tp, rank, owner),
                num_experts, e0, e1, parallel, owner))
        else:
            self.up_proj = _expert_weight(e1 - e0, up.rows, hidden)
            _attach_experts(self.up_proj, ExpertSplit(
                ParamSplit("column", 0, (up,), (up.rows, hidden), tp, rank, owner), num_experts, e0, e1, parallel,
                owner))
        self.down_proj = _expert_weight(e1 - e0, hidden, down.rows)
        _attach_experts(self.down_proj, ExpertSplit(
            ParamSplit("row", 1, (down,), (hidden, down.rows), tp, rank, owner), num_experts, e0, e1, parallel, owner))
        self.out_norm = out_norm      # the module name of a per-expert output norm (ExpertNorm), or None
        if out_norm is not None:
            if parallel != "expert" and tp > 1:
                raise ValueError("FusedMoE: a per-expert output norm needs whole experts per rank (parallel='expert')")
            norm = ExpertNorm(e1 - e0, hidden, out_norm_eps)
            _attach_experts(norm.weight, ExpertSplit(
                ParamSplit("replicated", None, (), (hidden,), tp, rank, owner), num_experts, e0, e1, parallel, owner))
            setattr(self, out_norm, norm)
        self.has_bias = bool(bias)
        if self.has_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e1 - e0, 2 * gate.rows))
            self.down_proj_bias = nn.Parameter(torch.empty(e1 - e0, hidden))
            _attach_experts(self.gate_up_proj_bias, ExpertSplit(
                ParamSplit("column", 0, (gate, up), (2 * gate.rows,), tp, rank, owner), num_experts, e0, e1, parallel,
                owner))
            _attach_experts(self.down_proj_bias, ExpertSplit(
                ParamSplit("replicated", None, (), (hidden,), tp, rank, owner), num_experts, e0, e1, parallel, owner))

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                score_bias: Optional[torch.Tensor] = None, expert_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`score_bias` [E]: a selection-only bias (added to the scores for the choice of experts, not to the
        weights; transformers' e_score_correction_bias, a parameter of the router: `routing_bias`). `expert_scale`
        [E]: each chosen expert's weight times its entry (after renormalization and the routed scale)."""
        # pairs routed to another rank's experts (parallel="expert") or from a decode batch's padding rows: nowhere
        if self.plain_routing and score_bias is None and expert_scale is None:
            weights, ids = moe_ops.route(router_logits, self.top_k, self.renormalize, self.expert_start,
                                         self.num_local_experts, _decode_slots(hidden_states.shape[0]))
        elif self.routing == "sparsemixer":
            weights, ids = moe_ops.sparsemixer(router_logits, self.jitter_eps)
            weights, ids = moe_ops.localize(weights.to(hidden_states.dtype), ids, self.num_experts, self.expert_start,
                                            self.num_local_experts, _decode_slots(hidden_states.shape[0]))
        else:                             # torch, static shapes (graph-capturable), on every device
            weights, ids = moe_ops.select_experts(router_logits, self.top_k, self.renormalize, self.scoring,
                                                  self.n_group, self.topk_group, self.group_score, score_bias,
                                                  self.routed_scale, self.renormalize_min, self.selection_bias_on,
                                                  self.renormalize_epsilon, self.group_dropped)
            if self.identity_experts:     # the identity experts' summed weight; localize routes them nowhere
                identity = weights.masked_fill(ids < self.num_experts, 0.0).sum(dim=-1, keepdim=True)
            if expert_scale is not None:  # a learned per-expert scale of the chosen experts' weights
                weights = weights * expert_scale[ids.clamp(max=self.num_experts - 1)].to(weights.dtype)
            weights, ids = moe_ops.localize(weights.to(hidden_states.dtype), ids, self.num_experts, self.expert_start,
                                            self.num_local_experts, _decode_slots(hidden_states.shape[0]))
        out = self._experts(hidden_states, weights, ids)
        out = all_reduce(out) if self.tp_size > 1 else out
        if self.identity_experts:         # after the all-reduce: once, on every rank
            out = out + (hidden_states * identity).to(out.dtype)
        return out

    def routing_view(self, router_logits: torch.Tensor, score_bias: Optional[torch.Tensor] = None) -> RoutingView:
        """How this layer routes each token (torch; for parity tests that tell bf16 near-ties from routing errors):
        the scores it chooses by, the experts chosen and how near the choice is to a tie (ops/moe.py)."""
        if self.routing == "sparsemixer":
            logits = moe_ops.choice_scores(router_logits, None)
            return RoutingView(logits, moe_ops.sparsemixer(router_logits, self.jitter_eps)[1].sort(-1).values,
                               moe_ops.routing_margin(logits, 2))
        unbiased = moe_ops.choice_scores(router_logits, self.scoring, None, self.selection_bias_on)
        choice = unbiased if score_bias is None else unbiased + score_bias.float()
        experts = moe_ops.select_experts(router_logits, self.top_k, self.renormalize, self.scoring, self.n_group,
                                         self.topk_group, self.group_score, score_bias, self.routed_scale,
                                         self.renormalize_min, self.selection_bias_on, self.renormalize_epsilon,
                                         self.group_dropped)[1]
        return RoutingView(unbiased, experts.sort(-1).values,
                           moe_ops.routing_margin(choice, self.top_k, self.n_group, self.topk_group, self.group_score,
                                                  self.group_dropped))

    def _experts(self, hidden_states: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's part of the chosen experts' weighted sum (before the all-reduce)."""
        norm = getattr(self, self.out_norm) if self.out_norm is not None else None
        x, act_fn, mid = hidden_states, self.act_fn, self.act_quant_down
        w_in, w2 = self.gate_up_proj if self.gated else self.up_proj, self.down_proj
        p_in = p2 = None
        if self.packed is not None:
            p_in, p2 = self.packed.get("gate_up_proj" if self.gated else "up_proj"), self.packed.get("down_proj")
        if self.act_quant is not None:    # per token (and group): the same rows every chosen expert reads
            x = self.act_quant(hidden_states)
        if mid is not None:               # the intermediate quantized as the down projections read it
            act_fn = lambda h, f=self.act_fn: mid(f(h))                                     # noqa: E731
        if (p_in is not None and p2 is not None and self.gated and norm is None and not self.has_bias
                and self.weights_on == "output"):       # the float8 experts as they are (dequantized off the kernels)
            return moe_ops.fused_moe(x, p_in[0], p2[0], weights, ids, self.activation, act_fn, mid=mid,
                                     scales13=p_in[1:], scales2=p2[1:])
        if p_in is not None:
            w_in = moe_ops.dequantize_packed(p_in, x.dtype)
        if p2 is not None:
            w2 = moe_ops.dequantize_packed(p2, x.dtype)
        if not self.gated:                # down(act(up)): the torch grouped reference on every device
            return moe_ops.fused_moe_reference(x, w_in, w2, weights, ids, act_fn,
                                               out_norm=norm)
        if norm is not None:              # each expert's output normalized: the torch grouped reference
            return moe_ops.fused_moe_reference(x, w_in, w2, weights, ids,
                                               act_fn, b13=self.gate_up_proj_bias if self.has_bias else None,
                                               b2=self.down_proj_bias if self.has_bias else None,
                                               weights_on_input=self.weights_on == "input", out_norm=norm)
        if self.has_bias and self.weights_on == "input":
            raise NotImplementedError("FusedMoE: routing weights on the expert input with expert biases")
        if self.has_bias:                 # with parallel="tensor" every rank computes part of each expert: the
            b2 = self.down_proj_bias if self.parallel == "expert" or self.tp_rank == 0 else None   # bias once
            return moe_ops.fused_moe(x, w_in, w2, weights, ids, self.activation,
                                     act_fn, self.gate_up_proj_bias, b2, mid=mid)
        if self.weights_on == "input":
            return moe_ops.fused_moe_reference(x, w_in, w2, weights, ids,
                                               act_fn, weights_on_input=True)
        return moe_ops.fused_moe(x, w_in, w2, weights, ids, self.activation, act_fn,
                                 mid=mid)

    def extra_repr(self) -> str:
        routing = ("weights_on='input', " if self.weights_on == "input" else "") + (
            "gated=False, " if not self.gated else "") + (
            f"renormalize_epsilon={self.renormalize_epsilon}, " if self.renormalize_epsilon is not None else "") + (
            f"routing='sparsemixer', jitter_eps={self.jitter_eps}, " if self.routing == "sparsemixer" else
            "" if self.plain_routing else (
            f"scoring={self.scoring!r}, groups={self.topk_group} of {self.n_group} by {self.group_score}, "
            f"routed_scale={self.routed_scale}, renormalize_min={self.renormalize_min}, "))
        routing += f"identity_experts={self.identity_experts}, " if self.identity_experts else ""
        routing += f"out_norm={self.out_norm!r}, " if self.out_norm else ""
        if self.packed:
            kinds = {"float8" if v[0].dtype == torch.float8_e4m3fn else "int4" for v in self.packed.values()}
            routing += f"packed {'/'.join(sorted(kinds))} {sorted(self.packed)}, "
        if self.act_quant is not None or self.act_quant_down is not None:
            routing += f"act_quant={self.act_quant!r}, act_quant_down={self.act_quant_down!r}, "
        return routing + (f"experts={self.num_experts} (this rank: {self.expert_start}..{self.expert_start + self.num_local_experts - 1}), "
                f"top_k={self.top_k}, renormalize={self.renormalize}, intermediate={self.intermediate} (per rank), "
                f"activation={self.activation!r}{self.activation_params or ''}, bias={self.has_bias}, parallel={self.parallel!r}, tp={self.tp_size}")


def linear_float32(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A router's logits in float32: layer's weight (and bias) and the input cast to float32 (a router kept in float32
    whatever the model dtype, as the spec's router.float32 says). A quantized checkpoint's layer: its input quantized
    as its own forward would (act_quant), its packed weight dequantized."""
    if getattr(layer, "act_quant", None) is not None:
        x = layer.act_quant(x)
    packed = getattr(layer, "packed", None)
    weight = packed.dequantized(torch.float32) if packed is not None else layer.weight.float()
    bias = None if getattr(layer, "bias", None) is None else layer.bias.float()
    return torch.nn.functional.linear(x.float(), weight, bias)


def routing_bias(num_experts: int) -> nn.Parameter:
    """A selection-only routing bias [num_experts] (transformers' `e_score_correction_bias`), replicated: set it
    on the router module and pass it to FusedMoE.forward(..., score_bias=)."""
    return replicated(nn.Parameter(torch.zeros(num_experts, dtype=torch.float32)), "routing_bias")   # kept float32


def _decode_slots(rows: int) -> Optional[torch.Tensor]:
    """[rows] the KV slots of a decode step (-1: a padding row of a captured batch, which the experts skip); None
    outside a decode step. Read on the device only: fine inside a captured graph."""
    ctx = fwd_context._CONTEXT
    if ctx is None or ctx.is_prefill or ctx.slot_mapping is None or ctx.slot_mapping.shape[0] != rows:
        return None
    return ctx.slot_mapping
