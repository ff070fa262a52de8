"""The feed-forward block kinds: `gated_mlp`, `mlp` and `moe` (router, grouped routing, shared expert), and
the parameterized gated activation form (`ActivationForm`)."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import StrictBool, StrictStr

from .attention import LoRA, SubNorm
from .base import Dim, Flag, Num, Strict, Symbol
from .blocks import FusedProjection, Projection


class ActivationForm(Strict):
    """A parameterized gated activation over the gate | up halves. `{kind: swiglu_clamped, alpha: 1.702, limit:
    swiglu_limit}`: gate = min(gate, limit), up = clamp(up, -limit, limit), out = (up + 1) * gate *
    sigmoid(alpha * gate) (GPT-OSS's experts). `{kind: glu_clamped, act: silu, limit: L}`: out = min(act(gate),
    limit) * clamp(up, -limit, limit), the clamp after the activation (Ling / Bailing); with `clamp: before_act`,
    out = act(min(gate, limit)) * clamp(up, -limit, limit) (HY-V4's experts). `limit` may be an optional symbol or a
    per-layer expression (it may read `layer`; None: no clamping)."""
    kind: Literal["swiglu_clamped", "glu_clamped"]
    alpha: Optional[Num] = None             # swiglu_clamped only (required there)
    act: Optional[StrictStr] = None         # glu_clamped only (required there): an activation name or str symbol
    limit: Optional[Num] = None
    clamp: Optional[Literal["after_act", "before_act"]] = None   # glu_clamped only: where the gate is clamped


class GatedMLPBlock(Strict):
    """down(act(gate(x)) * up(x)) with gate/up fused into one projection (segments gate, up). `activation` is a
    Hugging Face activation name (silu, gelu, gelu_pytorch_tanh, gelu_new, ...) or a str config symbol
    (`hidden_act`) whose `values` are such names: dispatched when the model is built."""
    kind: Literal["gated_mlp"]
    hidden: Dim
    intermediate: Dim
    activation: Union[StrictStr, ActivationForm]
    gate_up: FusedProjection
    down: Projection
    sub_norm: Optional[SubNorm] = None      # a norm of act(gate) * up before `down`
    lora: Optional[LoRA] = None             # per-use low-rank adapters on the gate/up projection


class MLPBlock(Strict):
    """down(act(up(x))): the non-gated MLP (GPT-2, StarCoder2). `activation` is a Hugging Face activation name
    (silu, relu, gelu, gelu_pytorch_tanh, gelu_new) or a str config symbol whose `values` are such names; `up` is
    column-parallel, `down` row-parallel."""
    kind: Literal["mlp"]
    hidden: Dim
    intermediate: Dim
    activation: StrictStr
    up: Projection
    down: Projection
    sub_norm: Optional[SubNorm] = None      # a norm of act(up(x)) before `down`
    # `per_layer_input`: act(up(x)) is multiplied elementwise by this layer's slice of the decoder's per-layer input
    # (decoder.per_layer_input, Gemma 4's per-layer embeddings): down(act(up(x)) * per_layer_input[layer])
    multiply: Optional[Literal["per_layer_input"]] = None


class RouterNorm(Strict):
    """The router's input norm: a weightless RMSNorm, y = x / rms(x) in float32, cast back."""
    eps: Num


class Router(Strict):
    """The router of a mixture-of-experts block: a replicated linear hidden -> experts, with a bias when `bias`.
    `float32`: the logits are computed in float32 from the float32-cast input and weight (DeepSeek, GLM-4-MoE keep
    their router in float32), whatever the model dtype."""
    name: StrictStr = "gate"
    bias: Flag = False
    float32: StrictBool = False
    # the router's own input transform, r = N(x) * w * input_scale, before its linear (Gemma 4's router reads the
    # un-normed residual stream): `input_norm: {eps}` a weightless RMSNorm (float32, cast back); `input_weight` a
    # learned per-channel scale (module `router_input`, parameter `router_input.weight [hidden]`, replicated);
    # `input_scale` a constant factor. The experts read the block's input (or `expert_norm`'s output), not r
    input_norm: Optional[RouterNorm] = None
    input_weight: StrictBool = False
    input_scale: Optional[Num] = None
    # a learned per-expert scale of the routing weights, `expert_scale [experts]` (replicated): each chosen expert's
    # weight (after any renormalization and routed_scale) times its entry (Gemma 4's per_expert_scale)
    expert_scale: StrictBool = False


class RoutingGroups(Strict):
    """Grouped top-k routing: the experts form `count` equal groups; each token keeps the `top` groups with the
    highest group score (`score: top2_sum`, the sum of the group's two highest choice scores, DeepSeek-V3 /
    GLM-4-MoE; `max`, its highest, DeepSeek-V2's group_limited_greedy) and picks its top-k experts among them.
    count 1 (or top == count) is plain top-k."""
    count: Dim
    top: Dim
    score: Literal["top2_sum", "max"] = "top2_sum"
    # the experts of the groups not kept: `excluded` (their choice score -inf: DeepSeek-V3), or `zero` (their choice
    # score 0, so that they still beat negative scores: A.X-K2's router, as its reference implementation)
    dropped: Literal["excluded", "zero"] = "excluded"


class SharedExpert(Strict):
    """An always-on gated MLP beside the routed experts (Qwen2-MoE's `shared_expert`): module `name`, with the
    block's activation, parameters `gate_up_proj [2 * intermediate, hidden]` (segments gate | up, column-parallel)
    and `down_proj [hidden, intermediate]` (row-parallel), as a dense MLP's. `gate` names a replicated linear
    hidden -> 1 whose sigmoid scales the shared expert's output (Qwen2-MoE's `shared_expert_gate`); without it the
    output is added unscaled."""
    name: StrictStr = "shared_expert"
    intermediate: Dim
    gate: Optional[StrictStr] = None
    # its output is multiplied by it (Cohere 2 MoE's `average`: 0.5, with `routed_scale` 0.5); None = 1
    scale: Optional[Num] = None
    # a bool symbol / expression: the shared expert (and its parameters) exists only in the checkpoints where it
    # holds (Cohere 2 MoE's `num_shared_experts > 0`), decided when the model is built
    enabled: Flag = True
    # biases on its gate_up_proj and down_proj (a bool symbol: only in the checkpoints that set it; Hy3's shared MLP
    # follows `mlp_bias`)
    bias: Flag = False
    # its own gated activation (default: the block's): Ling / Bailing clamp the shared experts by their own limits
    activation: Optional[Union[StrictStr, ActivationForm]] = None
    # a norm of its output before it joins the routed experts' (Ergo's `shared_experts.norm`): module
    # `<name>.<out_norm.name>`, a replicated weight [hidden], after the shared expert's all-reduce
    out_norm: Optional[SubNorm] = None


class MoEBlock(Strict):
    """Mixture of experts: a replicated router (`router.name`: linear hidden -> experts), softmax over the experts,
    the `top_k` largest probabilities (renormalized to sum 1 when `norm_topk_prob`), and the experts as one stacked
    gated MLP (module `experts`, parameters `gate_up_proj [experts, 2 * intermediate, hidden]` with segments
    gate | up, and `down_proj [experts, hidden, intermediate]`); the output is the routing-weighted sum of the
    chosen experts, plus a `shared_expert`'s where one is declared. `activation` as a gated MLP's.
    `parallel: tensor` splits every expert over the intermediate dimension (column / row, one all-reduce);
    `parallel: expert` gives each rank whole experts."""
    kind: Literal["moe"]
    hidden: Dim
    experts: Dim
    top_k: Dim
    intermediate: Dim
    activation: Union[StrictStr, ActivationForm]
    norm_topk_prob: Flag = False
    # per-expert biases: experts.gate_up_proj_bias [experts, 2 * intermediate], experts.down_proj_bias
    # [experts, hidden] (GPT-OSS)
    expert_bias: Flag = False
    router: Router = Router()
    parallel: Literal["tensor", "expert"] = "tensor"
    shared_expert: Optional[SharedExpert] = None
    # routing: scores = softmax (default) or sigmoid of the router logits (in float32)
    # softmax | sigmoid, or a `str` config symbol whose `values` are among them (the checkpoint selects it, e.g.
    # Cohere 2 MoE's `expert_selection_fn`)
    scoring: Union[Literal["softmax", "sigmoid"], Symbol] = "softmax"
    # a selection-only bias: `<router>.e_score_correction_bias [experts]` added to the scores for the choice of
    # experts, not to the weights (DeepSeek-V3's noaux_tc)
    selection_bias: Flag = False
    # what the selection bias is added to: `scores` (DeepSeek-V3: sigmoid(logits) + bias) or the raw router
    # `logits` (Kolibri 1: top-k of logits + bias; the weights are still the chosen experts' scores)
    selection_bias_on: Literal["scores", "logits"] = "scores"
    groups: Optional[RoutingGroups] = None
    routed_scale: Optional[Num] = None   # the routing weights are multiplied by it (routed_scaling_factor); None = 1
    # with norm_topk_prob: the sum the top-k weights are divided by is clamped to at least it (ERNIE 4.5's
    # moe_norm_min); None = no clamp (the plain sum)
    renormalize_min: Optional[Num] = None
    # where the routing weights apply: `output` (default) sum_k w_k * expert_k(x); `input` sum_k expert_k(w_k * x)
    # (Llama 4: the router's sigmoid scores scale each chosen expert's input)
    weights_on: Literal["output", "input"] = "output"
    # a norm of the block's output (the routed experts' plus any shared expert's), module `out_norm.name` with a
    # replicated weight [hidden] (A.X-K1's post_mlp_layernorm)
    out_norm: Optional[SubNorm] = None
    # a norm of the experts' input (and any shared expert's), not the router's: the router reads the block's input x
    # (through its own `input_norm` / scales), the experts N(x) (Gemma 4's pre_feedforward_layernorm_2); module
    # `expert_norm.name`, a replicated weight [hidden]
    expert_norm: Optional[SubNorm] = None
    # a bias [hidden] added to the block's output (routed experts plus any shared expert, before any out_norm), once,
    # after the experts' all-reduce (JetMoE's MoE `bias`): parameter `bias` of the block, replicated
    output_bias: Flag = False
    # how the experts are chosen from the router logits: `topk` (the scores' top_k, above) or `sparsemixer`
    # (PhiMoE's eval-mode SparseMixer: two experts, each weighted by a softmax over the logits within a relative
    # `jitter_eps` margin of it; top_k must be 2; no scoring / groups / bias / renormalization options)
    routing: Literal["topk", "sparsemixer"] = "topk"
    jitter_eps: Optional[Num] = None     # sparsemixer: the relative margin (router_jitter_noise); required there
    # with norm_topk_prob: the top-k weights are divided by (sum + it) (LFM2-MoE: 1e-6); None = transformers' usual
    # (the plain sum; + 1e-20 for sigmoid scores)
    renormalize_epsilon: Optional[Num] = None
    # the experts' MLP form: `gated` (down(act(gate) * up), experts.gate_up_proj [experts, 2 * intermediate, hidden])
    # or `plain` (down(act(up)), experts.up_proj [experts, intermediate, hidden]; NemotronH's relu2 experts); a shared
    # expert has the same form (plain: up_proj / down_proj)
    expert_mlp: Literal["gated", "plain"] = "gated"
    # zero-computation (identity) experts among the routed ones (LongCat-Flash's zero_expert_num): the router scores
    # `experts + identity_experts` choices (its weight [experts + identity_experts, hidden], a selection bias as wide);
    # a chosen identity expert adds its routing weight times the block's input, the others are the stacked experts
    identity_experts: Optional[Dim] = None
    # an RMSNorm of each routed expert's output, with that expert's own weight, before the routing weights (Ergo's
    # `experts.post_expert_norm`): parameter `experts.<name>.weight [experts, hidden]`; needs `parallel: expert` (each
    # rank normalizes whole experts' outputs); runs the torch grouped experts
    expert_out_norm: Optional[SubNorm] = None
