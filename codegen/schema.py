"""The spec language: pydantic v2 models, strict, unknown keys forbidden.

This file is the reference for what a spec may contain (`xllm-gen --json-schema` exports it for editors).
Sizes, numbers and flags are literals, config symbol names, or expressions over config symbols
(codegen/expr.py: `hidden_size // num_attention_heads`; per-layer values may read `layer`). Cross-field
checks (symbols exist, dataflow references, weights vs parameters, TP divisibility, variants) live in
resolver.py, in one place. The model spec holds only the model: deployment (graph buckets, batch sizes,
chunked prefill, TP size) are engine options.
"""
from __future__ import annotations

from typing import Annotated, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Symbol = StrictStr                                   # the name of a config symbol
Dim = Union[StrictInt, StrictStr]                    # a size: an int literal, a symbol or an expression
Num = Union[StrictInt, StrictFloat, StrictStr]       # a number: a literal, a symbol or an expression
Flag = Union[StrictBool, StrictStr]                  # a bool literal, a bool symbol or an expression
Scalar = Union[StrictBool, StrictInt, StrictFloat, StrictStr, None, List[Union[StrictInt, StrictFloat, StrictStr]],
               Dict[StrictStr, Union[StrictBool, StrictInt, StrictFloat, StrictStr, None, List[StrictInt]]]]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=False)


# ---- config mapping: spec symbol <- config.json field(s) -------------------------------------------------

class ConfigField(Strict):
    """`name: {type: int, from: [dotted.path, fallback.path], default: 10}`; the first present path wins.

    Types are strict at load (no bool("false"), no int(2.7)): int, float (ints accepted), bool, str,
    int_tuple / float_tuple / str_tuple (a scalar is a 1-tuple), and rope (the rope-parameters mapping,
    transformers' `rope_parameters` or the older `rope_scaling`: its `rope_type` must be one of `values`).
    `values` restricts a str (or rope) symbol to the variants the spec models: a checkpoint with another
    value is refused at load, naming the spec and the field. `optional: true` admits null / absence (None).
    `default` is a literal; `default_expr` an expression over other symbols (`hidden_size //
    num_attention_heads`). A derived symbol reads no config.json field: `expr: "len(deepstack_visual_indexes)"`
    (rendered as a Config property, evaluated for every variant)."""
    type: Literal["int", "float", "bool", "str", "int_tuple", "float_tuple", "str_tuple", "rope"]  # strict at load
    # dotted config.json path, or a list of them: the first present wins
    from_: Optional[Union[StrictStr, List[StrictStr]]] = Field(default=None, alias="from")
    default: Optional[Scalar] = None     # a literal used when no path is present (none: the field is required)
    default_expr: Optional[StrictStr] = None  # an expression over other symbols used when no path is present
    expr: Optional[StrictStr] = None     # a derived symbol: an expression, no config.json field read
    values: Optional[List[StrictStr]] = None  # str / rope symbols: the values (rope types) the spec models
    optional: StrictBool = False         # null / absent is admitted (the symbol is None)
    min: Optional[Union[StrictInt, StrictFloat]] = None   # inclusive bounds checked at load (and for variants)
    max: Optional[Union[StrictInt, StrictFloat]] = None
    doc: StrictStr = ""                         # a free-text note about the symbol (not rendered)
    # a guard-only symbol: read (or derived) and held to its `values` / `min` / `max` at load, but used by no
    # block. Every other symbol must reach the generated model (a symbol read and never used is a compile error)
    guard: StrictBool = False


# ---- blocks ----------------------------------------------------------------------------------------------

class Projection(Strict):
    """A linear projection inside a composite block; `name` is its module (and parameter) name. `scale`: its
    output (after the bias and any tensor-parallel reduction) is multiplied by it (muP multipliers: FalconH1's
    `attention_out_multiplier`-style down / out multipliers); attention `out`, MLP `up` / `down` take it."""
    name: StrictStr
    bias: Flag = False
    scale: Optional[Num] = None


class FusedProjection(Strict):
    """A fused projection: several named output segments stacked along the output dim, in the order of the
    block's forward split (attention: q, k, v; gated MLP: gate, up). `scale: {segment: number}`: those segments of
    the output are multiplied by their number (the others by 1) right after the projection (FalconH1's
    `key_multiplier` on k, its gate multiplier on gate)."""
    name: StrictStr
    segments: List[StrictStr]
    bias: Flag = False
    scale: Optional[Dict[StrictStr, Num]] = None


class MixerProjection(Strict):
    """A recurrent mixer's projection given as a mapping instead of a bare module name: `bias` (default: the
    block's `bias`) and `scale` (in_proj: `{segment: number}` per output segment; out: a number)."""
    name: StrictStr
    bias: Optional[Flag] = None
    scale: Optional[Union[Num, Dict[StrictStr, Num]]] = None


class EmbeddingBlock(Strict):
    """Vocab-parallel embedding; `scale` multiplies the output (Gemma: hidden_size ** 0.5, in the model dtype).
    `scale_dtype: bfloat16`: the scale is first rounded to bfloat16 (RecurrentGemma's `normalizer`, a bfloat16
    buffer whatever the model dtype); `model` (default): the model dtype."""
    kind: Literal["embedding"]
    vocab: Dim
    dim: Dim
    scale: Optional[Num] = None
    scale_dtype: Literal["model", "bfloat16"] = "model"


class PositionEmbeddingBlock(Strict):
    """Absolute position embeddings added to the token embedding (after its `scale`), before the first layer:
    `learned`: a table `[positions + offset, dim]` (parameter `embed_positions.weight`, replicated) read at row
    `position + offset` (GPT-2's wpe, OPT's offset 2); `sinusoidal`: the fixed fairseq table (sin of the first
    half of the dims, cos of the second; XGLM), computed, no parameter, read at `position + offset`.
    `frequencies` (sinusoidal only): `fairseq` f_j = 10000 ** (-j / (dim/2 - 1)) (XGLM); `transformer` the original
    Transformer's f_j = 10000 ** (-2j / dim) (CTRL)."""
    kind: Literal["learned", "sinusoidal"]
    positions: Dim
    dim: Dim
    offset: StrictInt = 0
    frequencies: Optional[Literal["fairseq", "transformer"]] = None


class RMSNormBlock(Strict):
    """y = x / rms(x) * w, or * (1 + w) with `weight_offset: 1` (Gemma); `bias: true` adds a learned bias b (a bool
    config symbol: only in the checkpoints that set it); `weight: false`: no weight, y = x / rms(x) computed in float32
    (NanoChat's parameter-free RMSNorm). `enabled` (a layer block only): a flag, per layer (may read `layer`): where it
    is false the norm is absent, the identity (no parameters; ModernBERT decoder's first layer: `"layer != 0"`)."""
    kind: Literal["rmsnorm"]
    dim: Dim
    eps: Num
    weight_offset: Union[StrictInt, StrictFloat] = 0
    bias: Flag = False
    weight: StrictBool = True
    enabled: Flag = True


class LayerNormBlock(Strict):
    """y = (x - mean) / std * w + b. `weight_offset: 1` scales by (1 + w) (Nemotron's LayerNorm1P); `weight:
    false` and `bias: false` make it non-parametric (OLMo 1's LayerNorm: no parameters at all); `bias` may be a bool
    config symbol (ModernBERT's `norm_bias`). `enabled`: per layer, as an RMSNorm's."""
    kind: Literal["layernorm"]
    dim: Dim
    eps: Num
    bias: Flag = True
    weight: StrictBool = True
    weight_offset: Union[StrictInt, StrictFloat] = 0
    enabled: Flag = True


class LinearBlock(Strict):
    kind: Literal["linear"]
    in_: Dim = Field(alias="in")
    out: Dim
    parallel: Literal["column", "row", "replicated"]
    bias: StrictBool = False


class FusedLinearBlock(Strict):
    """Column-parallel linear whose output is named segments, e.g. {gate: inter, up: inter}."""
    kind: Literal["fused_linear"]
    in_: Dim = Field(alias="in")
    segments: Dict[StrictStr, Dim]
    bias: StrictBool = False


class OutGate(Strict):
    """An attention output gate: `out = o_proj(attn * act(name(x)))`, x the block's input. `per: element`: one gate
    per (head, dim), `name.weight [heads * head_dim, hidden]` (Afmoe's sigmoid `gate_proj`); `per: head`: one per
    head broadcast over its dims, `[heads, hidden]` (Laguna's softplus `g_proj` per head). The activation is computed
    in float32 and cast back. Column-parallel by heads, as q."""
    name: StrictStr = "gate_proj"
    activation: Literal["sigmoid", "softplus"] = "sigmoid"
    per: Literal["element", "head"] = "element"
    # projection: the gate has a projection of its own (`name`); q: the gate rides in the q projection, each head's
    # head_dim query rows followed by its head_dim gate rows (Qwen3-Next / Qwen3.5: q_proj [heads * 2 * head_dim],
    # viewed [heads, 2 * head_dim] and chunked), so no parameter of its own (`name` unused; `per: element` only)
    source: Literal["projection", "q"] = "projection"


class QKNorm(Strict):
    """A norm of q and of k (modules `q`, `k`). `over: head` (default): per head, one [head_dim] weight shared
    by the heads (Qwen3); `over: projection`: the whole q (k) projection jointly, weight [heads * head_dim]
    ([kv_heads * head_dim]), sharded like the projection, statistics all-reduced over TP ranks (OLMo 2, OLMoE).
    `at: before_rotary` (default) or `after_rotary`. `kind` rmsnorm or layernorm; `weight_offset: 1` scales by
    (1 + w) (Gemma 3); `bias: true` adds a learned bias (the layernorm default is no bias)."""
    kind: Literal["rmsnorm", "layernorm"]
    eps: Num
    q: StrictStr = "q_norm"
    k: StrictStr = "k_norm"
    over: Literal["head", "projection"] = "head"
    # `over: head` only: `per_head` gives each head a weight of its own, [heads, head_dim] (Cohere's use_qk_norm)
    weights: Literal["shared", "per_head"] = "shared"
    at: Literal["before_rotary", "after_rotary"] = "before_rotary"
    weight_offset: Union[StrictInt, StrictFloat] = 0
    # false: no weight, x * rsqrt(mean(x^2) + eps) in float32 (rmsnorm over: head only; NanoChat, Llama 4's L2 norm)
    weight: StrictBool = True
    bias: StrictBool = False
    # a bool config symbol (or expression): the q/k norms exist only in the checkpoints where it holds (Cohere's
    # use_qk_norm, StableLM's qk_layernorm); false: no q/k norm. May read `layer` when the norm has no weight
    # (`weight: false`; Llama 4: "use_qk_norm and no_rope_layers[layer] != 0")
    enabled: Flag = True


class SubNorm(Strict):
    """A norm of a block's inner activations right before its output projection, over their whole width jointly
    (all heads of an attention output; the whole intermediate of an MLP): BitNet's `attn_sub_norm` /
    `ffn_sub_norm`. Module `name`, weight (and bias) [width], split over TP ranks like the output projection's
    input; the statistics are all-reduced, so every rank normalizes with the whole width's."""
    kind: Literal["rmsnorm", "layernorm"]
    eps: Num
    name: StrictStr
    weight_offset: Union[StrictInt, StrictFloat] = 0
    bias: StrictBool = False


class Differential(Strict):
    """Differential attention (Differential Transformer; transformers' DiffLlama): each head's softmax applied to
    the two halves of the KV heads' values, head i minus lambda times head i + heads/2, a weightless RMSNorm (`eps`)
    over the pair, times (1 - lambda_init); parameters lambda_q1, lambda_k1, lambda_q2, lambda_k2 [head_dim]."""
    eps: Num


class QueryScale(Strict):
    """A position-dependent query scale: q of the token at position p is multiplied by
    1 + beta * log(1 + floor((p + offset) / floor)) before attention (after rotary and any q/k norm): Llama 4's
    attention temperature tuning (beta attn_scale, floor floor_scale, offset 1, on NoPE layers), Ministral 3's
    llama_4_scaling_beta (floor: the rope's original_max_position_embeddings, offset 0). `enabled`: per layer
    (may read `layer`)."""
    beta: Num
    floor: Num
    offset: Num = 0
    enabled: Flag = True


class Rotary(Strict):
    """Rotary position embedding. `scaling` names a `type: rope` config symbol (or is an expression choosing
    one, which may read `layer`): rope scaling as transformers computes it (default, linear, dynamic, yarn,
    llama3, longrope / su; the symbol's `values` say which the spec models). `theta` may read `layer` too.
    `fraction` (or `dim`, not both): only the first int(head_dim * fraction) (or `dim`) dims of each head
    rotate, the rest pass through; the frequencies are computed over those dims. `layout`: neox (rotate_half:
    dim j pairs with j + d/2) or interleaved (GPT-J's rotate_every_two: dim 2j pairs with 2j + 1).
    `enabled`: a bool (literal, symbol or expression over symbols and `layer`): the layers where rotary
    applies (SmolLM3's no_rope_layers); the others use no position embedding (NoPE).
    `kind` is a rotary kind, or a `str` config symbol (read or derived) whose `values` are rotary kinds of one
    position layout (neox, or the mrope kinds): the kind the checkpoint's config selects, e.g.
    `{type: str, expr: "'mrope_interleaved' if mrope_interleaved else 'mrope_blocked'", values: [...]}`."""
    kind: Union[Literal["neox", "mrope_interleaved", "mrope_blocked"], Symbol]
    theta: Num
    max_position: Dim
    mrope_section: Optional[Union[List[StrictInt], Symbol]] = None
    scaling: Optional[StrictStr] = None
    fraction: Optional[Num] = None
    dim: Optional[Dim] = None
    # a layout, or a `str` config symbol whose `values` are layouts (the checkpoint's config selects it, e.g.
    # `{type: str, expr: "'interleaved' if rope_interleave else 'neox'", values: [neox, interleaved]}`)
    layout: Union[Literal["neox", "interleaved"], Symbol] = "neox"
    # backward: each pair turns by -theta * position (NanoChat's rotate_half(x) = [x2, -x1]); attention scores then
    # depend on the negated relative position
    direction: Literal["forward", "backward"] = "forward"
    enabled: Flag = True
    # the model's original (pretraining) context where the config keeps it outside the rope mapping (Phi-3's
    # top-level original_max_position_embeddings, which transformers writes over the mapping's key): used by the
    # scalings that read it (yarn, llama3, longrope)
    original_max_position: Optional[Dim] = None


class LoRA(Strict):
    """A per-use low-rank adapter on a block's fused input projection : the
    projection's output gets `up(down(x))` added, down `[rank, in]` (replicated), up `[out, rank]` (split over TP
    ranks as the projection's segments are). `per: segment`: one adapter per output segment (attention: q, k, v, each
    `<name>.<segment>.down` / `.up`); `per: projection`: one over the whole fused output (`<name>.down` / `.up`, up
    stored whole). The adapter belongs to the layer, not to a shared block: a block several layers share
    (`layers.shared`) keeps one adapter per layer. `enabled`: a flag (bool symbol): the adapter exists only in the
    checkpoints where it holds. `name`: the module name (default `<projection>_lora`)."""
    rank: Dim
    per: Literal["segment", "projection"] = "segment"
    enabled: Flag = True
    name: Optional[StrictStr] = None


class AttentionExperts(Strict):
    """A mixture of attention heads (JetMoE's MoA): a replicated `router` (linear hidden -> `count`, no bias) picks
    each token's `top_k` attention experts (the softmax of the top-k logits, in float32); each chosen expert's routed q
    projection `q` (stacked `[count, kv_heads * head_dim, hidden]`) gives the token `kv_heads` query heads, slot s's
    head h attending KV head h of the shared K / V (the block's `qkv`, segments [k, v]); each slot's output goes
    through the same expert's routed output projection (the block's `out`, stacked `[count, hidden, kv_heads *
    head_dim]`, with `out.bias` added once), weighted by its routing weight and summed. `heads` is `top_k *
    kv_heads`."""
    count: Dim
    top_k: Dim
    router: StrictStr = "router"
    q: StrictStr = "q_experts"


class VNorm(Strict):
    """A weightless RMSNorm of each value head: `v * rsqrt(mean(v ** 2) + eps)` in float32, cast back."""
    eps: Num


class AttentionBlock(Strict):
    """Self-attention with GQA: fused q/k/v projection (segments q, k, v), optional per-head q/k norm,
    rotary embedding, paged attention, output projection."""
    kind: Literal["attention"]
    hidden: Dim
    heads: Dim          # the sizes heads / kv_heads / head_dim / v_head_dim are per-layer values (may read `layer`)
    kv_heads: Dim
    head_dim: Dim
    v_head_dim: Optional[Dim] = None     # value heads' width; absent: head_dim (MiMo-V2-Flash: v_head_dim 128, q/k 192)
    qkv: FusedProjection
    out: Projection
    rotary: Optional[Rotary] = None     # absent: no rotary (absolute positions in the embedding, or ALiBi)
    qk_norm: Optional[QKNorm] = None
    out_gate: Optional[OutGate] = None      # a gate on the attention output before the output projection
    sub_norm: Optional[SubNorm] = None      # a norm of the attention output (after any out_gate) before `out`
    differential: Optional[Differential] = None   # differential attention (above)
    scale: Optional[Num] = None          # default head_dim ** -0.5 (Gemma 2: query_pre_attn_scalar ** -0.5)
    sliding_window: Optional[Num] = None  # per-layer value (may read `layer`); None / absent = full attention
    # chunked local attention (Llama 4): query i sees key j iff j <= i and j // C == i // C; per-layer value (may
    # read `layer`); None / absent = off
    chunk_size: Optional[Num] = None
    query_scale: Optional[QueryScale] = None   # a position-dependent query scale (above)
    softcap: Optional[Num] = None        # attention logit soft-capping: cap * tanh(scores / cap); None = off
    clip_qkv: Optional[Num] = None       # q, k, v clamped to [-c, c] after the projection (and a projection-wide
                                         # qk_norm); an optional symbol that is None turns it off (OLMo, DBRX)
    # attention sinks (GPT-OSS): a learned logit per query head in the softmax denominator, parameter
    # `sinks [heads]` of this block (split by heads under TP)
    sinks: Flag = False                 # a flag, per-layer (may read `layer`): the layers that have sinks
    # a constant factor on the values before the cache (MiMo-V2-Flash's attention_value_scale); absent: none
    value_scale: Optional[Num] = None
    # a weightless RMSNorm of each value head (over its width) before the cache, `v / rms(v)` in float32 (Gemma 4's
    # `v_norm`); absent: none
    v_norm: Optional[VNorm] = None
    # a flag, per-layer (may read `layer`): in the layers where it holds the fused projection has no `v` segment and
    # the values are the keys as projected (before any q/k norm and rotary), Gemma 4's `attention_k_eq_v`
    values_from_keys: Flag = False
    # KV sharing across layers: an int per layer (may read `layer`), the layer whose keys and values (its KV cache)
    # this layer attends over; where it is another (earlier) layer, this layer has q alone (no k / v segments, no k
    # norm) and writes no cache (Gemma 4's num_kv_shared_layers); absent or `layer`: its own
    kv_source: Optional[Dim] = None
    # ALiBi (Bloom, MPT): a per-head linear bias slope_h * (key_pos - query_pos) added to the scaled scores; the
    # slopes are the geometric series of the ALiBi paper over the heads (`alibi_bias_max`: its base, 8)
    alibi: StrictBool = False
    alibi_bias_max: Num = 8
    # the width of the block's input, read by the q/k/v projection (default `hidden`, also the output width):
    # Zamba's shared attention reads the concatenation of the residual stream and the embeddings (2 * hidden)
    input_width: Optional[Dim] = None
    lora: Optional[LoRA] = None          # per-use low-rank adapters on the q/k/v projection (above)
    # a mixture of attention heads (JetMoE): q and the output projection routed per token among expert stacks
    experts: Optional[AttentionExperts] = None


class LowRankInput(Strict):
    """The low-rank factor in front of a projection: module `name` (hidden -> `rank`, no bias, replicated over TP
    ranks); the projection then maps `rank` -> its segments (Kimi Delta Attention's f_a_proj / g_a_proj)."""
    name: StrictStr
    rank: Dim


class GatedDeltaNetProjection(Strict):
    """One fused input projection of a gated DeltaNet: module `name`, its output the `segments` stacked in order
    (each of q, k, v, z, b, a appears in exactly one projection of the block). `low_rank`: the projection reads a
    low-rank factor of the input (`{name: f_a_proj, rank: head_dim}`: segments = name(low_rank(x)))."""
    name: StrictStr
    segments: List[Literal["q", "k", "v", "z", "b", "a"]]
    low_rank: Optional[LowRankInput] = None


class GatedDeltaNetBlock(Strict):
    """A gated DeltaNet token mixer (linear attention with a per-sequence recurrent state, Qwen3-Next / Qwen3.5's
    `linear_attn`): input projections give q, k [key_heads * key_head_dim], v, z [value_heads * value_head_dim],
    b, a [value_heads]; q | k | v go through a depthwise causal conv1d (`conv1d`, kernel `conv_kernel`) and the
    activation; q, k are L2-normalized; decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); the
    gated delta rule over the state [value_heads, key_head_dim, value_head_dim]; an RMSNorm per value head (`norm`,
    eps) times silu(z); the output projection. Parameters (transformers' names): each projection's `weight`,
    `conv1d.weight [conv channels, 1, conv_kernel]`, `A_log`, `dt_bias [value_heads]`, `norm.weight
    [value_head_dim]`, `<out>.weight`. Split over TP ranks by key heads (each with its value heads)."""
    kind: Literal["gated_delta_net"]
    hidden: Dim
    key_heads: Dim
    value_heads: Dim
    key_head_dim: Dim
    value_head_dim: Dim
    conv_kernel: Dim
    eps: Num
    activation: StrictStr = "silu"       # the conv's activation (silu), or a str symbol whose values are silu
    projections: List[GatedDeltaNetProjection]
    out: Projection = Projection(name="out_proj")
    conv_bias: StrictBool = False
    # head: the decay g is a scalar per value head (a, dt_bias [value_heads]); channel: one per value head and key
    # channel (Kimi Delta Attention's fine-grained decay: a, dt_bias [value_heads * key_head_dim], A_log
    # [value_heads]), the state decaying per key row
    decay: Literal["head", "channel"] = "head"
    # the gated output norm's activation of z: silu (Gated DeltaNet), sigmoid (Kimi Delta Attention's o_norm)
    gate_activation: Literal["silu", "sigmoid"] = "silu"
    # beta = beta_scale * sigmoid(b): 2 lets the delta rule's step reach [0, 2] (negative eigenvalues of the state
    # transition; OLMo-Hybrid's linear_allow_neg_eigval); a number, symbol or expression over config symbols
    beta_scale: Num = 1.0


class Mamba2Block(Strict):
    """A Mamba-2 token mixer (selective state space, SSD, with a per-sequence state: Mamba2ForCausalLM's `mixer`):
    `in_proj` gives z [heads * head_dim] (the gate), x [heads * head_dim], B, C [groups * state_size] and dt [heads];
    x | B | C go through a depthwise causal conv1d (`conv1d`, kernel `conv_kernel`) and the activation; dt =
    softplus(dt + dt_bias); the SSD scan with A = -exp(A_log) over the state [heads, head_dim, state_size] (each B / C
    group serves heads / groups heads) plus D x; then the gated RMSNorm `norm` (x * silu(z), normalized per group of
    heads * head_dim / groups channels) and the output projection. Parameters (transformers' names):
    `<in_proj>.weight`, `conv1d.weight`, `A_log`, `D`, `dt_bias [heads]`, `norm.weight [heads * head_dim]`,
    `<out>.weight`, and biases where `bias` / `conv_bias` hold. Split over TP ranks by heads and groups."""
    kind: Literal["mamba2"]
    hidden: Dim
    heads: Dim
    head_dim: Dim
    groups: Dim
    state_size: Dim
    conv_kernel: Dim
    chunk_size: Dim                      # the scan's chunk length (transformers' chunk_size; rounding only)
    eps: Num
    activation: StrictStr = "silu"       # the conv's activation (silu), or a str symbol whose values are silu
    bias: Flag = False                   # biases of in_proj and out_proj (transformers' use_bias)
    conv_bias: Flag = True               # the conv's bias (use_conv_bias)
    # module names, or {name, bias, scale} (a bias of its own; in_proj: per-segment output multipliers over z, x,
    # B, C, dt; out: an output multiplier)
    in_proj: Union[StrictStr, MixerProjection] = "in_proj"
    out: Union[StrictStr, MixerProjection] = "out_proj"
    # the gated RMSNorm `norm` exists (false: the output is y * silu(z), no norm: FalconH1's mamba_rms_norm)
    gated_norm: Flag = True
    # the norm runs before the gate, w * rmsnorm(y) * silu(z) (FalconH1's mamba_norm_before_gate), instead of
    # Mamba-2's w * rmsnorm(y * silu(z))
    norm_before_gate: Flag = False
    # dt's clamp in a prompt chunk (transformers' chunked scan, `dt_limit`; its decode step does not clamp): at least
    # time_step_min, at most time_step_max (None: no upper bound). NemotronH clamps at (time_step_min, inf)
    time_step_min: Num = 0.0
    time_step_max: Optional[Num] = None


class MambaInnerNorm(Strict):
    """RMSNorms of a Mamba-1 mixer's dt, B and C after x_proj (before dt_proj and the scan): modules `dt_layernorm`
    [time_step_rank], `b_layernorm`, `c_layernorm` [state_size]. `weight: false` (FalconMamba's `mixer_rms_eps`):
    weightless, x / rms(x); `weight: true` (Jamba): `weight * x / rms(x)`, replicated weights."""
    eps: Num
    weight: StrictBool = False


class MambaBlock(Strict):
    """A Mamba-1 token mixer (the selective scan over a per-sequence state: MambaForCausalLM's `mixer`): `in_proj`
    gives x and the gate z [intermediate each]; x goes through a depthwise causal conv1d (`conv1d`, kernel
    `conv_kernel`) and the activation; `x_proj` (no bias) gives dt [time_step_rank], B, C [state_size]; optional
    RMSNorms of dt, B, C (`inner_norm`); dt = softplus(dt_proj(dt)) (with dt_proj's bias); the selective scan with
    A = -exp(A_log) [intermediate, state_size] over the state [intermediate, state_size] plus D x; times act(z); the
    output projection. Parameters (transformers' names): `<in_proj>.weight [2 intermediate, hidden]`,
    `conv1d.weight [intermediate, 1, conv_kernel]`, `x_proj.weight`, `dt_proj.weight`, `dt_proj.bias`, `A_log`, `D`,
    `<out>.weight`, biases where `bias` / `conv_bias` hold, and the inner norms' weights. Split over TP ranks by
    channels (x_proj's output all-reduced)."""
    kind: Literal["mamba"]
    hidden: Dim
    intermediate: Dim
    state_size: Dim
    time_step_rank: Dim
    conv_kernel: Dim
    activation: StrictStr = "silu"       # the conv's and the gate's activation (silu), or a str symbol of silu
    bias: Flag = False                   # biases of in_proj and out_proj (transformers' use_bias)
    conv_bias: Flag = True               # the conv's bias (use_conv_bias)
    inner_norm: Optional[MambaInnerNorm] = None   # RMSNorms of dt, B, C (FalconMamba, Jamba); absent: none
    in_proj: StrictStr = "in_proj"       # module names
    out: StrictStr = "out_proj"


class ShortConvBlock(Strict):
    """A gated short-convolution token mixer (LFM2's `conv`, a per-sequence conv state): `in_proj` gives B, C, x
    [hidden each]; `out(C * conv(B * x))` with a depthwise causal conv1d (kernel `conv_kernel`, no activation).
    Parameters (transformers' names): `<in_proj>.weight [3 hidden, hidden]`, `conv.weight [hidden, 1, conv_kernel]`,
    `<out>.weight`, and their biases where `bias` holds. Channels split over TP ranks."""
    kind: Literal["short_conv"]
    hidden: Dim
    conv_kernel: Dim
    bias: Flag = False                   # biases of in_proj, the conv and out (LFM2's conv_bias)
    in_proj: StrictStr = "in_proj"
    out: StrictStr = "out_proj"


class RGLRUBlock(Strict):
    """A Griffin recurrent block (RecurrentGemma's `temporal_block` on its recurrent layers, a per-sequence state):
    `y = act(y_proj(x))`; `x_proj(x)` goes through a depthwise causal conv1d (`conv_1d`, kernel `conv_kernel`, bias
    `conv_bias`, no activation) and the RG-LRU (`rg_lru`: input and recurrence gates from block-diagonal linears, one
    [width / heads]^2 block per head, a learned log-decay `recurrent_param`, a = exp(-decay_scale * r *
    softplus(recurrent_param)), h = a h + sqrt(1 - a^2) (i * x), reset at position 0); `out(h * y)`. Parameters
    (transformers' names): `<x_proj>.weight`, `<y_proj>.weight [width, hidden]`, `conv_1d.weight [width, 1,
    conv_kernel]`, `rg_lru.recurrent_param [width]`, `rg_lru.input_gate_weight`, `rg_lru.recurrent_gate_weight
    [heads, width / heads, width / heads]`, `rg_lru.input_gate_bias`, `rg_lru.recurrent_gate_bias [heads, width /
    heads]`, `<out>.weight [hidden, width]`, biases where `bias` / `conv_bias` hold. Split over TP ranks by heads."""
    kind: Literal["rg_lru"]
    hidden: Dim
    width: Dim                           # the recurrence's channels (lru_width)
    heads: Dim                           # the gates' diagonal blocks (num_attention_heads); width a multiple of it
    conv_kernel: Dim                     # conv1d_width
    activation: StrictStr                # the y branch's activation: a name, or a str symbol (hidden_activation)
    decay_scale: Num = 8.0               # c in log a = -c * r * softplus(recurrent_param) (Griffin: 8)
    bias: Flag = True                    # biases of x_proj, y_proj and out
    conv_bias: Flag = True               # the conv's bias
    x_proj: StrictStr = "linear_x"       # module names
    y_proj: StrictStr = "linear_y"
    out: StrictStr = "linear_out"


class MLAAttentionBlock(Strict):
    """Multi-head latent attention (DeepSeek-V2 / V3): q from `q_proj` (hidden -> heads * (nope + rope)), or, when
    `q_lora_rank` is a size, low-rank: q_a_proj (hidden -> q_lora_rank) -> q_a_layernorm (RMSNorm) -> q_b_proj;
    kv_a_proj_with_mqa (hidden -> kv_lora_rank + rope) split into the latent (-> kv_a_layernorm -> kv_b_proj ->
    per head k_nope | v) and one rope key shared by all heads; rotary on the rope dims of q and k only; softmax
    scale (nope + rope) ** -0.5 (times yarn's mscale(factor, mscale_all_dim) ** 2 with `scale_mscale`); o_proj.
    Module names are transformers' (q_proj, q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj, o_proj)."""
    kind: Literal["mla_attention"]
    hidden: Dim
    heads: Dim
    q_lora_rank: Optional[Num] = None    # a size: low-rank q; an optional int symbol that is None, or absent: q_proj
    kv_lora_rank: Dim
    qk_nope_head_dim: Dim
    qk_rope_head_dim: Dim
    v_head_dim: Dim
    latent_eps: Num = 1.0e-6             # eps of q_a_layernorm and kv_a_layernorm
    bias: Flag = False                   # biases of q_a_proj and kv_a_proj_with_mqa (transformers' attention_bias)
    out: Projection = Projection(name="o_proj")
    rotary: Rotary
    scale: Optional[Num] = None          # default (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
    # multiply the scale by mscale(factor, mscale_all_dim) ** 2 of `rotary.scaling` (rope type not default and
    # mscale_all_dim set: transformers' yarn_apply_mscale of DeepSeek-V2 / V3)
    scale_mscale: StrictBool = False
    # latent: cache the KV latent + the shared rope key per token (kv_b_proj absorbed into q and the output:
    # multi-query attention over kv_lora_rank + rope dims); expanded: cache per-head K / V (v zero-padded)
    kv_cache: Literal["latent", "expanded"] = "latent"


class ActivationForm(Strict):
    """A parameterized gated activation, `{kind: swiglu_clamped, alpha: 1.702, limit: swiglu_limit}`: over the
    gate | up halves, gate = min(gate, limit), up = clamp(up, -limit, limit), out = (up + 1) * gate *
    sigmoid(alpha * gate) (GPT-OSS's experts). `limit` may be an optional symbol (None: no clamping)."""
    kind: Literal["swiglu_clamped"]
    alpha: Num
    limit: Optional[Num] = None


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


class Router(Strict):
    """The router of a mixture-of-experts block: a replicated linear hidden -> experts, with a bias when `bias`.
    `float32`: the logits are computed in float32 from the float32-cast input and weight (DeepSeek, GLM-4-MoE keep
    their router in float32), whatever the model dtype."""
    name: StrictStr = "gate"
    bias: Flag = False
    float32: StrictBool = False


class RoutingGroups(Strict):
    """Grouped top-k routing: the experts form `count` equal groups; each token keeps the `top` groups with the
    highest group score (`score: top2_sum`, the sum of the group's two highest choice scores, DeepSeek-V3 /
    GLM-4-MoE; `max`, its highest, DeepSeek-V2's group_limited_greedy) and picks its top-k experts among them.
    count 1 (or top == count) is plain top-k."""
    count: Dim
    top: Dim
    score: Literal["top2_sum", "max"] = "top2_sum"


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


class LMHeadBlock(Strict):
    kind: Literal["lm_head"]
    vocab: Dim
    dim: Dim
    tie: Flag                            # true, false, or a bool config symbol (decided by the checkpoint)
    softcap: Optional[Num] = None        # final logit soft-capping (Gemma 2); None = off
    logit_scale: Optional[Num] = None    # logits are multiplied by it, before any soft-cap (Granite:
                                         # "1 / logits_scaling"); None = 1
    bias: Flag = False                   # a [vocab] bias (Phi, GPT-J), split over ranks as the weight is


LayerBlock = Annotated[
    Union[RMSNormBlock, LayerNormBlock, LinearBlock, FusedLinearBlock, AttentionBlock, GatedMLPBlock, MLPBlock,
          MoEBlock, MLAAttentionBlock, GatedDeltaNetBlock, Mamba2Block, MambaBlock,
          ShortConvBlock, RGLRUBlock],
    Field(discriminator="kind"),
]
NormBlock = Annotated[Union[RMSNormBlock, LayerNormBlock], Field(discriminator="kind")]


class Choice(Strict):
    """A per-layer choice of block: `{if: <bool expression over config symbols and `layer`>, then: A, else: B}`.
    Layer i builds A where the expression is true for i, else B; both become the same module, named `name`
    (default: the name of B). A and B may take different inputs (an attention or recurrent mixer gets the
    positions, an MLP not): the layer then passes them where its module takes them."""
    if_: StrictStr = Field(alias="if")
    then: StrictStr
    else_: StrictStr = Field(alias="else")
    name: Optional[StrictStr] = None


class Select(Strict):
    """A per-layer choice among several blocks: `{select: <expression over config symbols and `layer`>, cases:
    {value: block, ...}, name: M}`. Layer i builds the block of the case equal to the expression's value for i
    (NemotronH's `layers_block_type[layer]`: a Mamba-2 mixer, attention, an MLP or a MoE); every alternative becomes
    the same module `name` (default: the first case's block). A value with no case is refused when the model is
    built (and for every variant), naming the value. The alternatives may take different inputs (attention and
    recurrent mixers get the positions, MLPs and MoEs not)."""
    select: StrictStr
    cases: Dict[StrictStr, StrictStr]
    name: Optional[StrictStr] = None


class ResidualStep(Strict):
    """`{norm: N, block: B}`: residual += h; h = B(N(residual)) (the norm fuses the residual add). Without
    `norm` the block reads the residual stream itself (h = B(residual); OLMo 2's post-norm-only steps).
    `post_norm: P` normalizes the block's output before it joins the residual (sandwich norms, Gemma 2);
    `scale: S` multiplies it (after the post-norm) before it joins the residual (Granite); `input_scale: S` multiplies
    the block's input, the normed residual (FalconH1's attention_in_multiplier).
    `block` may be a per-layer choice `{if: expr, then: A, else: B}` (e.g. a MoE on some layers, a dense MLP on
    the others)."""
    norm: Optional[StrictStr] = None
    block: Union[StrictStr, Choice, Select]
    post_norm: Optional[StrictStr] = None
    scale: Optional[Num] = None          # the block's output is multiplied by it before it joins the residual
                                         # (Granite's residual_multiplier); None = 1
    # the block's input (the normed residual) is multiplied by it (FalconH1's attention_in_multiplier); None = 1
    input_scale: Optional[Num] = None
    # classic post-LN (OPT-350m, the original Transformer): the residual stream itself is normalized after the
    # add, x = after_norm(x + h); the block reads x (no `norm` then)
    after_norm: Optional[StrictStr] = None
    # a branch value (`branch.name`) added to the block's input, not to the residual: residual += h;
    # h = B(N(residual + value)) (Zamba: the shared transformer's output joins the Mamba layer's input). In a layer
    # where the branch does not run (its `when` is false) nothing is added
    add: Optional[StrictStr] = None


class BranchOp(Strict):
    """One operation of a branch: `h = block(norm(h))` (no residual); `norm` optional."""
    norm: Optional[StrictStr] = None
    block: StrictStr


class Branch(Strict):
    """A side computation of the layer whose result is a named value, not a residual update: its input is the
    concatenation (last dim) of `input` values: `residual` (the residual stream as this step sees it),
    `embeddings` (the decoder's input to the first layer), or an earlier branch's name; then each op in order,
    `h = block(norm(h))`; the result is the value `name`, which a later step reads through `add` (or a later
    branch through `input`). `when`: a bool expression over config symbols and `layer`: the branch (and the
    blocks only it uses) exists only in the layers where it holds (Zamba's hybrid layers)."""
    name: StrictStr
    input: List[StrictStr]
    steps: List[BranchOp]
    when: Optional[StrictStr] = None


class BranchStep(Strict):
    branch: Branch


class ParallelStep(Strict):
    """`{parallel: [{norm: N1, block: B1}, {norm: N2, block: B2}]}`: both blocks read the same residual and
    their outputs are summed into it (GPT-J / NeoX style parallel residual). N1 and N2 may be one norm. A branch may
    be any block a step takes, a recurrent mixer too (FalconH1: Mamba-2 beside attention)."""
    parallel: List[ResidualStep]


class DataflowChoice(Strict):
    """`{if: <bool expression over config symbols>, then: [steps], else: [steps]}`: the layer's dataflow chosen
    per checkpoint (StableLM's and GPT-NeoX's `use_parallel_residual`), or per layer where the expression reads
    `layer` (OLMo-Hybrid: post-norm attention layers, pre-norm DeltaNet layers). Each is a list of residual / parallel
    steps; a block used by one of them only exists in that one's checkpoints. Rendered as two layer classes (the
    `then` one named `<class_prefix><name>DecoderLayer`; `name` defaults to the flag in CamelCase), picked when
    the model is built."""
    if_: StrictStr = Field(alias="if")
    then: List[Union[ResidualStep, ParallelStep]]
    else_: List[Union[ResidualStep, ParallelStep]] = Field(alias="else")
    name: Optional[StrictStr] = None


class Layers(Strict):
    count: Dim
    blocks: Dict[StrictStr, LayerBlock]
    dataflow: Union[List[Union[ResidualStep, ParallelStep, BranchStep]], DataflowChoice]
    # blocks whose weights several layers reuse: block name -> an expression over config symbols and `layer`, the
    # instance the layer uses; layers with equal values share the block's parameters (the first such layer holds
    # them, under its name). Each layer keeps its own module state (KV cache, recurrent state) and LoRA adapters
    shared: Dict[StrictStr, StrictStr] = {}
    # a learned scalar parameter of each layer (its name, e.g. `layer_scalar`: `model.layers.{i}.layer_scalar [1]`) that
    # multiplies the whole residual stream after the layer's last step (Gemma 4)
    output_scale: Optional[StrictStr] = None


class PerLayerInput(Strict):
    """A second input of every layer computed once from the token ids and the embedding output (Gemma 4's per-layer
    embeddings): `e = embed_tokens_per_layer(ids) * embed_scale` and `p = per_layer_projection_norm(
    per_layer_model_projection(h0) * project_scale)`, both `[tokens, layers, dim]` (h0 the scaled embedding output),
    combined `(p + e) * combine_scale`; layer i reads slice i (an `mlp` with `multiply: per_layer_input`)."""
    vocab: Dim                 # rows of embed_tokens_per_layer
    dim: Dim                   # each layer's width
    embed_scale: Num
    project_scale: Num
    combine_scale: Num
    norm: NormBlock            # per_layer_projection_norm, over `dim`
    enabled: Flag = True       # where the per-layer input exists (its parameters too)


class Deepstack(Strict):
    """Qwen3-VL: deepstack level k is added at visual-token rows after a decoder layer. Give one of:
    `after_layers: [0, 1, 2]` (level k after layer after_layers[k], fixed by the spec) or
    `levels: n` (after layers 0..n-1; n a literal or an int config symbol known from the checkpoint,
    rendered as a loop bound)."""
    after_layers: Optional[List[StrictInt]] = None
    levels: Optional[Dim] = None


class EmbedProjection(Strict):
    """A linear projection between the embedding's width and the residual stream's (OPT's `project_in`, embedding ->
    residual, and `project_out`, residual -> LM head), replicated on every rank; it exists where `enabled` holds (a
    flag: literal, bool symbol or expression over symbols, e.g. `"word_embed_proj_dim != hidden_size"`)."""
    in_: Dim = Field(alias="in")
    out: Dim
    bias: Flag = False
    enabled: Flag = True


class HeadTransform(Strict):
    """The LM head's input transform, BERT's prediction head: `norm(act(dense(x)))` after the final norm (and any
    `project_out`), before the LM head projection (ModernBERT decoder's `lm_head`: dense -> GELU -> LayerNorm). Module
    `head_transform` of the decoder: `dense` a replicated linear `[out, in]` (+ bias), `norm` a norm of width `out`."""
    in_: Dim = Field(alias="in")
    out: Dim
    bias: Flag = False
    activation: StrictStr
    norm: Optional[NormBlock] = None


class Decoder(Strict):
    # module path of the decoder in the model and in the checkpoint. `weights` keys and `from` names of
    # decoder tensors are written `model.<rest>`; with another prefix they mean `<prefix>.<rest>` (so a spec
    # that moves the decoder, e.g. Qwen3-VL's model.language_model, reuses its base's `weights` as they are)
    prefix: StrictStr = "model"
    embed_tokens: EmbeddingBlock
    embed_positions: Optional[PositionEmbeddingBlock] = None   # absolute positions added to the embedding
    embed_norm: Optional[NormBlock] = None   # a norm of the embedding output, before the first layer (Bloom)
    layers: Layers
    norm: Optional[NormBlock] = None     # the final norm (it also adds the last residual); absent: the plain add
    # the final norm exists where this flag holds (OPT: only in its pre-LN form); elsewhere the last residual is
    # added without a norm
    norm_enabled: Flag = True
    # the residual stream kept in float32 (transformers' residual_in_fp32: Mamba, Mamba-2): each layer's step norm reads
    # it cast to the model dtype, the final norm in float32. A flag (a bool symbol: decided by the checkpoint); only
    # with plain `{norm, block}` steps of RMSNorms and a final RMSNorm
    residual_float32: Flag = False
    # embedding width -> residual width, after the embedding (and its scale), before position embeddings are added
    project_in: Optional[EmbedProjection] = None
    # residual width -> the LM head's width, after the final norm
    project_out: Optional[EmbedProjection] = None
    # dense -> act -> norm between the final norm (and project_out) and the LM head (BERT's prediction head)
    head_transform: Optional[HeadTransform] = None
    deepstack: Optional[Deepstack] = None
    # a per-layer second input of the layers (Gemma 4's per-layer embeddings), above
    per_layer_input: Optional[PerLayerInput] = None


class RowLayout(Strict):
    """How the rows of one fused checkpoint tensor are laid out (undone at load, before TP sharding).
    `interleave`: the parameter's segments in the order the checkpoint stores them within a group; `per`:
    `tensor` (one group: the segments blocked in that order, "split by sizes"), `head` (one group per head, every
    segment with as many heads: GPT-NeoX `query_key_value` [h0: q k v, h1: q k v, ...]), `kv_group` (one group per
    head of the segment with the fewest heads, each holding heads / groups heads of every segment: Falcon's
    [g0: q * (heads / kv_heads), k, v, g1: ...]; with one KV head the multi-query [q * heads, k, v]), `group`
    (`groups` groups, each holding heads / groups heads of every segment: CodeGen's qkv_proj, 4 groups of [q v k])."""
    interleave: List[StrictStr]
    per: Literal["tensor", "head", "kv_group", "group"]
    groups: Optional[StrictInt] = None   # per: group only: the number of groups


class WeightEntry(Strict):
    """Where one parameter comes from in the checkpoint (names only: the layer kind implies the sharding).

    A parameter without an entry loads the tensor of its own name. `from` renames it; a mapping
    {segment: tensor} stacks several checkpoint tensors into a fused parameter, in the block's segment order
    (which is the order of its forward split). `{i}` stands for the layer index, `{e}` for the expert index of a
    stacked expert parameter (the per-expert tensors are stacked at load; each rank reads only its slices).
    `transpose: true`: the tensor stores each matrix as [in, out] (the last two dims swapped). `segments_interleaved:
    true`: a single tensor holds the fused parameter's segments interleaved element by element along the output
    dim (gate = [..., 0::2], up = [..., 1::2]) instead of stacked. Without `from`, the tensor of the parameter's
    own name is read in that layout."""
    from_: Optional[Union[StrictStr, Dict[StrictStr, StrictStr]]] = Field(default=None, alias="from")
    transpose: StrictBool = False
    segments_interleaved: StrictBool = False
    # `squeeze: true`: the tensor stores the parameter under one extra leading dim of size 1 (ERNIE 4.5's routing
    # bias moe_statics.e_score_correction_bias [1, experts] for the [experts] parameter); dropped at load. A list of
    # dims: the stored shape has unit dims at those positions (Kimi's A_log [1, 1, heads, 1]: [0, 1, 3])
    squeeze: Union[StrictBool, List[StrictInt]] = False
    # the row layout of a single fused tensor (`from` one name) stored per head / per KV group / reordered
    layout: Optional[RowLayout] = None


# ---- vision tower ----------------------------------------------------------------------------------------

class PatchEmbedBlock(Strict):
    """Conv3d patch embedding with kernel = stride = (temporal_patch, patch, patch) over `in_channels`, run
    as one linear over the processor's flattened patch rows. Params proj.weight [dim, C, tp, p, p], proj.bias."""
    kind: Literal["conv3d_patch_embed"]
    in_channels: Dim
    temporal_patch: Dim
    patch: Dim
    dim: Dim


class PosEmbedBlock(Strict):
    """Learned square position table `weight [positions, dim]`, bilinearly interpolated (align corners) to
    each image / frame patch grid."""
    kind: Literal["interpolated_pos_embed"]
    positions: Dim
    dim: Dim


class VisionRotary(Strict):
    """Axial 2-D rotary (patch row | patch column) over the attention's head_dim = hidden / heads."""
    kind: Literal["rotary_2d"]
    theta: Num


class VisionAttentionBlock(Strict):
    """Bidirectional attention within each image / video frame: fused `qkv` (bias; segments q, k, v of
    `heads` heads each, stored fused in the checkpoint), 2-D rotary on q/k, `proj` (bias). Heads are split
    over TP ranks when divisible, else the block is replicated (runtime VisionAttention)."""
    kind: Literal["vision_attention"]
    hidden: Dim
    heads: Dim
    rotary: VisionRotary


class VisionMLPBlock(Strict):
    """linear_fc1 (bias) -> GELU -> linear_fc2 (bias); split over TP ranks when `intermediate` is divisible,
    else replicated (runtime VisionMLP)."""
    kind: Literal["vision_mlp"]
    hidden: Dim
    intermediate: Dim
    activation: Literal["gelu_tanh", "gelu"]


class PatchMergerBlock(Strict):
    """merge x merge spatial merge (the merge^2 consecutive patch rows concatenated) then
    linear_fc1 -> GELU (exact) -> linear_fc2 to `out`. `norm: before_merge` is a LayerNorm over `dim` per
    patch (the main merger); `after_merge` over the merged width dim * merge^2 (deepstack mergers)."""
    kind: Literal["patch_merger"]
    dim: Dim
    out: Dim
    norm: Literal["before_merge", "after_merge"]
    eps: Num = 1.0e-6


VisionLayerBlock = Annotated[
    Union[LayerNormBlock, RMSNormBlock, VisionAttentionBlock, VisionMLPBlock], Field(discriminator="kind")]


class VisionLayers(Strict):
    """`count` blocks (module list `blocks`); each residual step of the dataflow is x = x + block(norm(x))."""
    count: Dim
    blocks: Dict[StrictStr, VisionLayerBlock]
    dataflow: List[ResidualStep]


class VisionDeepstack(Strict):
    """Deepstack mergers (module list `deepstack_merger_list`): level k merges the output of vision block
    taps[k]; `taps` is an int_tuple config symbol (deepstack_visual_indexes) or a literal list."""
    taps: Union[List[StrictInt], StrictStr]
    merger: PatchMergerBlock


class Vision(Strict):
    """The vision tower: patch_embed -> + pos_embed -> blocks (rotary_pos_emb shared) -> merger, with the
    deepstack mergers fed from the tapped blocks. Patch rows arrive in merge order (merge x merge blocks)."""
    prefix: StrictStr                    # module path in the model and in the checkpoint, e.g. model.visual
    merge: Dim                           # spatial merge size
    patch_embed: PatchEmbedBlock
    pos_embed: PosEmbedBlock
    blocks: VisionLayers
    merger: PatchMergerBlock
    deepstack: Optional[VisionDeepstack] = None
    weights: Dict[StrictStr, WeightEntry] = {}  # full tensor names; {i} is the block (or deepstack level) index


# ---- weights, runner, tensor parallel -------------------------------------------------------------------

class TensorParallel(Strict):
    """The TP sizes the spec's shapes must allow, checked statically for every variant (the TP size a model
    is served with is an engine option)."""
    sizes: List[StrictInt]


class Spec(Strict):
    spec_version: Literal[2]                           # the language version: 2
    name: StrictStr                      # output package generated/<name>/ (a Python identifier)
    description: StrictStr = ""          # the generated model's docstring
    class_prefix: StrictStr              # generated class names: <prefix>Config, <prefix>Attention, <prefix>ForCausalLM
    architectures: List[StrictStr]       # config.json `architectures` this spec serves (one spec per architecture)
    config: Dict[StrictStr, ConfigField]  # config symbols: spec name -> how it is read from config.json
    # config.json fields that change the math but that the spec does not read, with the value it assumes
    # (a checkpoint with another value is refused); dotted paths
    config_assume: Dict[StrictStr, Scalar] = {}
    # transformers' default of an assumed field (the value its config class fills in when config.json omits it,
    # e.g. partial_rotary_factor: 0.5): the guard compares the effective value with config_assume, so a checkpoint
    # without the field is refused where the family's default differs from what the spec assumes
    config_defaults: Dict[StrictStr, Scalar] = {}
    # config.json fields that do not change the math (fnmatch patterns over dotted paths); a checkpoint field
    # that is neither read, assumed, ignored nor a generic transformers field is refused at load
    config_ignore: List[StrictStr] = []
    decoder: Decoder                     # embedding, decoder layers (blocks + dataflow), final norm
    lm_head: LMHeadBlock                 # the output projection (tied or not)
    vision: Optional[Vision] = None      # a vision tower (multimodal models)
    # parameter name -> checkpoint tensor(s), only where they differ ({i} = layer index)
    weights: Dict[StrictStr, WeightEntry] = {}
    # parameter-name prefix -> checkpoint-name prefix, for every parameter without a `weights` entry (the longest
    # matching prefix wins): `{model.layers.: transformer.h., lm_head.: embed_out.}`
    checkpoint_prefixes: Dict[StrictStr, StrictStr] = {}
    ignore_checkpoint_tensors: List[StrictStr] = []  # regexes of checkpoint tensors that are not parameters
    # regex -> replacement: checkpoint tensor names rewritten at load by the first pattern that matches (re.sub,
    # once), before `weights` / `ignore_checkpoint_tensors` see them (transformers' conversion-mapping renames of an
    # original release: Kimi Linear's `{'\.block_sparse_moe\.': '.mlp.'}`)
    checkpoint_renames: Dict[StrictStr, StrictStr] = {}
    tensor_parallel: TensorParallel      # TP sizes every variant's shapes must allow (a static check)
    # named config.json value sets (symbol -> value; others take their defaults) for static checks and --explain
    variants: Dict[StrictStr, Dict[StrictStr, Scalar]] = {}


BLOCK_KINDS = ("embedding", "rmsnorm", "layernorm", "linear", "fused_linear", "attention", "gated_mlp", "mlp", "moe", "lm_head",
               "mla_attention", "gated_delta_net", "mamba2", "mamba", "short_conv", "rg_lru",
               "conv3d_patch_embed", "interpolated_pos_embed", "rotary_2d", "vision_attention", "vision_mlp",
               "patch_merger")
