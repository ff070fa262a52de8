"""The resolved spec: frozen dataclasses with every derived size computed (by resolver.py).

Sizes stay symbolic (`Size`: a sum of products of ints and config symbols) so that the generated code
works for any checkpoint of the family; `VariantIR` holds the same sizes evaluated for a named variant,
per tensor-parallel size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple, Union

Factor = Union[int, str]


@dataclass(frozen=True)
class Size:
    """sum(prod(term)) over terms; a term is a tuple of ints and config symbol names."""
    terms: Tuple[Tuple[Factor, ...], ...]

    @staticmethod
    def of(*factors: Factor) -> "Size":
        return Size((tuple(factors),))

    def __add__(self, other: "Size") -> "Size":
        if not isinstance(other, Size):
            return other + self           # an expression (codegen/expr.py) absorbs a linear size
        return Size(self.terms + other.terms)

    def __mul__(self, other: "Size") -> "Size":
        if not isinstance(other, Size):
            return other * self
        return Size(tuple(a + b for a in self.terms for b in other.terms))

    def eval_layer(self, values: Mapping[str, Any], layer: Optional[int] = None) -> int:
        return self.eval(values)

    @property
    def symbol(self) -> Optional[str]:
        """The config symbol when this size is exactly one symbol, else None."""
        if len(self.terms) == 1 and len(self.terms[0]) == 1 and isinstance(self.terms[0][0], str):
            return self.terms[0][0]
        return None

    def eval(self, values: Mapping[str, Any]) -> int:
        total = 0
        for term in self.terms:
            prod = 1
            for f in term:
                prod *= values[f] if isinstance(f, str) else f
            total += prod
        return total

    @staticmethod
    def _clean(term: Tuple[Factor, ...]) -> Tuple[Factor, ...]:
        kept = tuple(f for f in term if f != 1)
        return kept or (1,)

    def py(self, config: str = "config") -> str:
        return " + ".join(" * ".join(f"{config}.{f}" if isinstance(f, str) else str(f) for f in self._clean(t))
                          for t in self.terms)

    def __str__(self) -> str:
        # merge equal terms for display: a*b + c*b + c*b -> a*b + 2*c*b
        counts: dict = {}
        for t in self.terms:
            t = self._clean(t)
            counts[t] = counts.get(t, 0) + 1
        parts = []
        for t, n in counts.items():
            s = " * ".join(str(f) for f in t)
            parts.append(s if n == 1 else f"{n} * {s}")
        return " + ".join(parts)


def size_at(size, values: Mapping[str, Any], layer: Optional[int] = None) -> Any:
    """A size's value in a variant; a per-layer size (an expression reading `layer`) in `layer` (0 when None)."""
    if getattr(size, "per_layer", False):
        return size.eval(values, 0 if layer is None else layer)
    return size.eval(values)


@dataclass(frozen=True)
class Ratio:
    """num // den, exact (the resolver checks divisibility for every variant), e.g. a vision head_dim =
    hidden / heads. Quacks like Size where a segment unit or a constructor argument is rendered."""
    num: Size
    den: Size

    @property
    def terms(self) -> tuple:
        return ()

    def eval(self, values: Mapping[str, Any]) -> int:
        return self.num.eval(values) // self.den.eval(values)

    def py(self, config: str = "config") -> str:
        return f"{self.num.py(config)} // {self.den.py(config)}"

    def __str__(self) -> str:
        return f"{self.num} / {self.den}"


@dataclass(frozen=True)
class Value:
    """A number, flag or string: a literal, a config symbol, or an expression (codegen/expr.py)."""
    literal: Any = None
    symbol: Optional[str] = None
    expr: Any = None                      # an Expr

    def py(self, config: str = "config") -> str:
        if self.expr is not None:
            return self.expr.py(config)
        return f"{config}.{self.symbol}" if self.symbol else repr(self.literal)

    def eval(self, values: Mapping[str, Any], layer: Optional[int] = None) -> Any:
        if self.expr is not None:
            return self.expr.eval(values, layer)
        return values[self.symbol] if self.symbol else self.literal

    @property
    def per_layer(self) -> bool:
        return self.expr is not None and self.expr.per_layer

    @property
    def is_none(self) -> bool:
        return self.expr is None and self.symbol is None and self.literal is None

    def __str__(self) -> str:
        if self.expr is not None:
            return str(self.expr)
        return self.symbol or repr(self.literal)


@dataclass(frozen=True)
class ConfigFieldIR:
    name: str
    type: str                     # int | float | bool | str | int_tuple | float_tuple | str_tuple | rope
    paths: Tuple[str, ...]
    default: Any                  # None when required (has_default False)
    has_default: bool
    doc: str = ""
    expr: Any = None              # derived symbol: an Expr over other symbols (reads no config.json path)
    default_expr: Any = None      # fallback Expr when no path is present
    values: Optional[Tuple[str, ...]] = None   # str / rope: the admitted values
    optional: bool = False        # None admitted
    bounds: Tuple[Any, Any] = (None, None)     # inclusive (min, max), None = unbounded
    positive: bool = False        # used where a number must be > 0 (eps, theta, scales): checked at load
    guard: bool = False           # guard-only: read and checked (values / bounds), used by no block

    @property
    def derived(self) -> bool:
        return self.expr is not None

    @property
    def py_type(self) -> str:
        t = {"int": "int", "float": "float", "bool": "bool", "str": "str", "int_tuple": "tuple",
             "float_tuple": "tuple", "str_tuple": "tuple", "rope": "dict"}[self.type]
        return f"{t} | None" if self.optional else t


@dataclass(frozen=True)
class SegmentIR:
    name: str
    heads: Size
    unit: Size
    replicate_ok: bool = False

    def py(self) -> str:
        unit = "" if self.unit.terms == ((1,),) else f", {self.unit.py()}"
        rep = ", replicate_ok=True" if self.replicate_ok else ""
        return f'Segment("{self.name}", {self.heads.py()}{unit}{rep})'


@dataclass(frozen=True)
class ParamIR:
    name: str                     # e.g. "model.layers.{i}.self_attn.qkv_proj.weight"
    block: str                    # spec path of the block that creates it, e.g. "decoder.layers.blocks.self_attn"
    shape: Tuple[Size, ...]
    shard: str                    # the sharding its layer implies: replicated | colwise | rowwise | vocab
    segments: Tuple[SegmentIR, ...] = ()
    vocab: Optional[Size] = None
    per_layer: bool = False
    only_if_untied: Optional[str] = None   # lm_head: exists only when this bool config symbol is false
    repeat: Optional[Size] = None          # vision: one per block / deepstack level ({i}); None: once or per layer
    tp_if: Optional[Tuple[str, Size]] = None   # vision: (flag, units): sharded only when TP divides units,
                                               # else replicated (the runtime vision layers decide alike)
    experts: Optional[Size] = None         # a stacked expert parameter [experts, ...]: sources name `{e}`; the
                                           # split dim of colwise / rowwise is the one after the expert dim
    when: Optional[Tuple[Any, bool]] = None    # per-layer choice: exists in layer i iff cond(i) == the bool
    stacked: bool = False                  # a fused parameter the checkpoint stores whole under its own name

    def in_layer(self, values: Mapping[str, Any], layer: int) -> bool:
        return self.when is None or bool(self.when[0].eval(values, layer)) == self.when[1]


@dataclass(frozen=True)
class AllOf:
    """A conjunction of parameter conditions ((bool expression, value), ...): a parameter that exists only under its
    block's own condition (MLA's low-rank q where q_lora_rank is set) inside a per-layer block choice."""
    conds: Tuple[Tuple[Any, bool], ...]

    def eval(self, values: Mapping[str, Any], layer: Optional[int] = None) -> bool:
        return all(bool(c.eval(values, layer)) == v for c, v in self.conds)

    def __str__(self) -> str:
        return " and ".join(f"({c})" if v else f"not ({c})" for c, v in self.conds)


@dataclass(frozen=True)
class WeightIR:
    param: ParamIR
    sources: Tuple[str, ...]      # with "{i}" for the layer index
    layout: Optional[tuple] = None   # (per, interleave) of one fused tensor's rows; (per, interleave, groups) for per: group
    transpose: bool = False       # the tensor stores [..., in, out]
    interleave: int = 1           # n > 1: the n segments interleaved along the output dim
    squeeze: Any = False          # True: one extra leading unit dim; a tuple: unit dims at those stored positions
    # sources with `{<expression>}` placeholders: each source as a Python f-string body over `layer_idx`, `config`
    fstrings: Tuple[str, ...] = ()

    @property
    def shard(self) -> str:
        return self.param.shard


@dataclass(frozen=True)
class NormIR:
    kind: str                     # rmsnorm | layernorm
    name: str
    dim: Size
    eps: Value
    bias: bool = False
    weight_offset: float = 0.0    # y = x_normed * (weight_offset + w) (+ b)
    weight: bool = True           # layernorm: false = no weight (OLMo 1's non-parametric LayerNorm)
    # where the norm exists (per layer: may read `layer`); elsewhere the identity with no parameters
    enabled: Value = Value(literal=True)
    bias_flag: Optional[Value] = None   # a bool symbol / expression: the bias exists only where it holds (bias: True)

    @property
    def always(self) -> bool:
        """The norm exists in every layer and its bias is fixed by the spec."""
        return self.enabled.literal is True and self.bias_flag is None

    def bias_py(self) -> str:
        return self.bias_flag.py() if self.bias_flag is not None else repr(self.bias)


@dataclass(frozen=True)
class EmbeddingIR:
    name: str
    vocab: Size
    dim: Size
    scale: Optional[Value] = None     # output multiplier (Gemma: hidden_size ** 0.5)
    scale_dtype: str = "model"        # "bfloat16": the scale rounded to bfloat16 first (RecurrentGemma)


@dataclass(frozen=True)
class PositionEmbeddingIR:
    """Absolute position embeddings added to the token embedding: `learned` (a replicated table
    [positions + offset, dim], parameter embed_positions.weight) or `sinusoidal` (computed, no parameter)."""
    kind: str                     # learned | sinusoidal
    positions: Size
    dim: Size
    offset: int = 0
    frequencies: str = "fairseq"  # sinusoidal: fairseq (10000 ** (-j / (d/2 - 1))) | transformer (10000 ** (-2j / d))


@dataclass(frozen=True)
class LinearIR:
    kind: str                     # linear | fused_linear
    name: str
    in_features: Size
    out_sizes: Tuple[Tuple[str, Size], ...]   # (segment name, size); one segment for a plain linear
    parallel: str                 # column | row | replicated
    bias: bool


@dataclass(frozen=True)
class RotaryIR:
    kind: str
    theta: Value
    max_position: Size
    mrope_section: Optional[Value] = None     # literal tuple or an int_tuple symbol
    scaling: Optional[Value] = None           # a `type: rope` config symbol, or an expression (may read layer)
    fraction: Optional[Value] = None          # rotary dims = int(head_dim * fraction)
    dim: Optional[Value] = None               # rotary dims, explicit (fraction and dim: at most one)
    layout: str = "neox"                      # neox | interleaved
    enabled: Value = Value(literal=True)      # per layer: rotary on (a bool literal, symbol or expression)
    kind_symbol: Optional[str] = None         # a str config symbol selecting the kind (`kind`: its first value)
    layout_symbol: Optional[str] = None       # a str config symbol selecting the layout (`layout`: its first value)
    original_max_position: Optional[Size] = None   # overrides the rope mapping's original_max_position_embeddings
    direction: str = "forward"                # forward | backward (pairs turn by -theta * position)


@dataclass(frozen=True)
class QKNormIR:
    """The q / k norms of an attention block: per head (a [head_dim] weight shared by the heads) or over the
    whole projection (weight [heads * head_dim], sharded like it), before or after rotary."""
    q: str                        # module names
    k: str
    eps: Value
    kind: str = "rmsnorm"         # rmsnorm | layernorm
    over: str = "head"            # head | projection
    at: str = "before_rotary"     # before_rotary | after_rotary
    weight_offset: float = 0.0
    bias: bool = False
    per_head_weights: bool = False   # over head: weight [heads, head_dim] instead of one shared [head_dim]
    enabled: Optional[Value] = None  # a bool symbol / expression: the norms exist only where it holds; None: always
    weight: bool = True              # false: no weight, x * rsqrt(mean(x^2) + eps) (a parameter-free rmsnorm per head)

    @property
    def weightless(self) -> bool:
        return not self.weight

    @property
    def fusable(self) -> bool:
        """The per-head RMSNorm + rotary that ops.qk_norm_rope fuses (one kernel on CUDA)."""
        return (self.kind == "rmsnorm" and self.over == "head" and self.at == "before_rotary"
                and not self.weight_offset and not self.bias and not self.per_head_weights and not self.weightless
                and (self.enabled is None or not self.enabled.per_layer))


@dataclass(frozen=True)
class SubNormIR:
    """A norm of a block's inner activations before its output projection, over their whole width (weight [width],
    split over TP ranks like the projection's input; statistics all-reduced: runtime L.ProjectionNorm)."""
    name: str
    kind: str                     # rmsnorm | layernorm
    eps: Value
    weight_offset: float = 0.0
    bias: bool = False


@dataclass(frozen=True)
class QueryScaleIR:
    """q *= 1 + beta * log(1 + floor((position + offset) / floor)), on the layers where `enabled` holds."""
    beta: Value
    floor: Value
    offset: Value
    enabled: Value = Value(literal=True)


@dataclass(frozen=True)
class LoRAIR:
    """Per-use low-rank adapters on a block's fused input projection (runtime L.LoRA / L.SegmentLoRA)."""
    name: str                     # module name
    rank: "Size"
    per: str                      # segment (one adapter per output segment) | projection (one over the whole)
    enabled: "Value"              # literal True, or a bool symbol: the adapters exist where it holds


@dataclass(frozen=True)
class AttentionExpertsIR:
    """A mixture of attention heads: the router picks top_k of `count` experts per token; each has a routed q
    projection (module `q`) and a routed output projection (the attention's `out`)."""
    count: Size
    top_k: Size
    router: str
    q: str


@dataclass(frozen=True)
class AttentionIR:
    kind: str
    name: str
    class_name: str
    hidden: Size
    heads: Size
    kv_heads: Size
    head_dim: Size
    qkv_name: str
    qkv_segments: Tuple[str, str, str]
    qkv_bias: Value
    out_name: str
    out_bias: Value
    rotary: Optional[RotaryIR]                 # None: no rotary
    qk_norm: Optional[QKNormIR]
    scale: Optional[Value]
    sliding_window: Optional[Value] = None     # per-layer value (may read the layer index); None = full
    softcap: Optional[Value] = None
    chunk_size: Optional[Value] = None         # chunked local attention, per-layer value; None = off
    query_scale: Optional["QueryScaleIR"] = None
    clip_qkv: Optional[Value] = None           # q, k, v clamped to [-c, c]; None (or a None symbol) = off
    sinks: bool = False                        # attention sinks (on some layer): parameter `sinks [heads]`
    out_gate: Optional[Tuple[str, str, str]] = None   # (module, activation, per): attn * act(module(x)) before out
    alibi: Optional[Value] = None              # ALiBi: the slopes' bias_max (8); None = off
    q_gate: Optional[str] = None               # an output gate riding in q's rows (activation), per (head, dim)
    sub_norm: Optional[SubNormIR] = None       # a norm of the attention output before the output projection
    differential: Optional[Value] = None       # differential attention: the eps of its weightless RMSNorm
    v_head_dim: Optional[Size] = None          # value heads' width (None: head_dim); a per-layer size may read `layer`
    value_scale: Optional[Value] = None        # a constant factor on v before the cache (None: none)
    v_norm: Optional[Value] = None             # a weightless RMSNorm of each value head: its eps (None: none)
    values_from_keys: Optional[Value] = None   # flag, per-layer: v is k as projected, no v segment (None: never)
    kv_source: Optional[Value] = None          # per-layer int: the layer whose KV cache this one reads (None: own)
    sinks_when: Optional[Value] = None         # sinks only on the layers where this flag holds (None: every layer)
    input_width: Optional[Size] = None         # the q/k/v projection's input width (None: hidden)
    lora: Optional[LoRAIR] = None              # per-use adapters on the q/k/v projection

    @property
    def in_width(self) -> Size:
        return self.input_width if self.input_width is not None else self.hidden
    # muP-style output multipliers: per segment of the fused projection ((segment, value), ...), and of the output
    # projection (None = 1)
    qkv_scale: Tuple[Tuple[str, Value], ...] = ()
    out_scale: Optional[Value] = None
    experts: Optional["AttentionExpertsIR"] = None   # a mixture of attention heads: q and out routed per token

    @property
    def q_size(self) -> Size:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> Size:
        return self.kv_heads * self.head_dim

    @property
    def v_dim(self) -> Size:
        """The value heads' width (head_dim unless `v_head_dim` is given)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def per_layer_shape(self) -> bool:
        """Some of heads / kv_heads / head_dim / v_head_dim reads the layer index."""
        return any(getattr(s, "per_layer", False) for s in (self.heads, self.kv_heads, self.head_dim, self.v_head_dim))


@dataclass(frozen=True)
class MLAIR:
    """Multi-head latent attention (runtime: the generated class over L.Attention with v heads of their own width):
    q direct (`q_lora_rank` None) or low-rank, a compressed KV latent + one shared rope key; cached as the latent
    (kv_b_proj absorbed, runtime layers/mla.py) or expanded per head by kv_b_proj (v at its own width)."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    heads: Size
    q_lora_rank: Optional[Value]       # None: always q_proj; a literal size: always low-rank; a symbol: per checkpoint
    kv_lora_rank: Size
    qk_nope_head_dim: Size
    qk_rope_head_dim: Size
    v_head_dim: Size
    latent_eps: Value
    bias: Value
    out_name: str
    out_bias: Value
    rotary: RotaryIR
    scale: Optional[Value]
    scale_mscale: bool = False
    q_lora_when: Optional[Value] = None   # the bool expression "q_lora_rank is not None" (a symbol q_lora_rank)
    kv_cache: str = "latent"              # latent (absorbed kv_b_proj, one cached head) | expanded (per-head K/V)


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

    @property
    def plain_routing(self) -> bool:
        return (self.routing == "topk" and self.scoring == "softmax" and self.scoring_symbol is None
                and self.groups is None and self.routed_scale is None and self.weights_on == "output"
                and self.renormalize_min is None and self.renormalize_epsilon is None and self.expert_mlp == "gated"
                and self.selection_bias.literal is False and self.selection_bias.symbol is None
                and self.selection_bias.expr is None)


@dataclass(frozen=True)
class GatedDeltaNetIR:
    """A gated DeltaNet mixer (runtime: the generated class over L.GatedDeltaNet, a recurrent-state mixer)."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    key_heads: Size
    value_heads: Size
    key_head_dim: Size
    value_head_dim: Size
    conv_kernel: Size
    eps: Value
    activation: Value
    projections: Tuple[Tuple[str, Tuple[str, ...]], ...]   # (module, segments) in order
    out_name: str
    conv_bias: bool
    rep: Any                      # value heads per key head (an expression)
    decay: str = "head"           # head (g per value head) | channel (g per value head and key channel)
    gate_activation: str = "silu"  # the gated norm's activation of z: silu | sigmoid
    low_rank: Tuple[Tuple[str, str, Any], ...] = ()   # (projection, its low-rank input module, rank)
    beta_scale: Value = Value(literal=1.0)   # beta = beta_scale * sigmoid(b)

    def segment(self, name: str) -> "SegmentIR":
        """A projection segment, split by key heads (each with its value heads)."""
        a = self.rep * self.key_head_dim if self.decay == "channel" else self.rep
        unit = {"q": self.key_head_dim, "k": self.key_head_dim, "v": self.rep * self.value_head_dim,
                "z": self.rep * self.value_head_dim, "b": self.rep, "a": a}[name]
        return SegmentIR(name, self.key_heads, unit)

    def low_rank_of(self, projection: str):
        """(module, rank) of a projection's low-rank input, else None."""
        return next(((m, r) for p, m, r in self.low_rank if p == projection), None)


@dataclass(frozen=True)
class Mamba2IR:
    """A Mamba-2 mixer (runtime: the generated class over L.Mamba2, a recurrent-state mixer)."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    heads: Size
    head_dim: Size
    groups: Size
    state_size: Size
    conv_kernel: Size
    chunk_size: Size
    eps: Value
    activation: Value
    bias: Value
    conv_bias: Value
    in_proj: str
    out_name: str
    time_step_min: Value = Value(literal=0.0)    # dt's clamp in a prompt chunk
    time_step_max: Optional[Value] = None        # None: no upper bound
    out_bias: Optional[Value] = None             # the output projection's bias (None: as `bias`)
    in_scale: Tuple[Tuple[str, Value], ...] = ()  # per-segment output multipliers of in_proj (z, x, B, C, dt)
    out_scale: Optional[Value] = None            # the output projection's output multiplier
    gated_norm: Value = Value(literal=True)      # the gated RMSNorm exists (else y * silu(z))
    norm_before_gate: Value = Value(literal=False)   # w * rmsnorm(y) * silu(z) instead of w * rmsnorm(y * silu(z))


@dataclass(frozen=True)
class MambaIR:
    """A Mamba-1 mixer, the selective scan (runtime: the generated class over L.Mamba, a recurrent-state mixer)."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    intermediate: Size
    state_size: Size
    time_step_rank: Size
    conv_kernel: Size
    activation: Value
    bias: Value
    conv_bias: Value
    inner_norm: Optional[str]             # None | "weightless" | "weight"
    inner_eps: Optional[Value]
    in_proj: str
    out_name: str

    def intermediate_fields(self, ir) -> str:
        """The config.json field (or the expression over symbols) giving the channels, for refusals."""
        sym = getattr(self.intermediate, "symbol", None)
        return ir.config_source(sym) if sym else str(getattr(self.intermediate, "source", self.intermediate))


@dataclass(frozen=True)
class ShortConvIR:
    """A gated short-convolution mixer (runtime: the generated class over L.ShortConv, a recurrent-state mixer)."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    conv_kernel: Size
    bias: Value
    in_proj: str
    out_name: str


@dataclass(frozen=True)
class RGLRUIR:
    """A Griffin recurrent block, conv1d + RG-LRU (runtime: the generated class over L.RGLRU, a recurrent-state mixer)."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    width: Size
    heads: Size
    block_width: Any              # width // heads (an expression): the gates' block, a head's channels
    conv_kernel: Size
    activation: Value
    decay_scale: Value
    bias: Value
    conv_bias: Value
    x_proj: str
    y_proj: str
    out_name: str

    def fields(self, ir) -> dict:
        """The config.json field (or the expression over symbols) of the width and the heads, for refusals."""
        out = {}
        for k, size in (("width", self.width), ("heads", self.heads)):
            sym = getattr(size, "symbol", None)
            out[k] = ir.config_source(sym) if sym else str(getattr(size, "source", size))
        return out


RECURRENT_KINDS = ("gated_delta_net", "mamba2", "mamba", "short_conv", "rg_lru")

BlockIR = Union[NormIR, LinearIR, AttentionIR, GatedMLPIR, MLPIR, MoEIR, MLAIR, GatedDeltaNetIR, Mamba2IR, MambaIR,
                ShortConvIR, RGLRUIR]


@dataclass(frozen=True)
class ChoiceIR:
    """A per-layer choice of block, one module per layer. `if` form: layer i builds `then` where cond(i) holds,
    else `else_`. `select` form (`cases` given): layer i builds the block of the case whose value equals cond(i)
    (the selector); a value with no case is refused."""
    cond: Value                   # `if`: a bool expression over config symbols and `layer`; `select`: the selector
    then: str = ""
    else_: str = ""
    cases: Tuple[Tuple[str, str, Any], ...] = ()   # select: (value, block, the bool expression `selector == value`)

    @property
    def alternatives(self) -> Tuple[str, ...]:
        return tuple(b for _, b, _ in self.cases) if self.cases else (self.then, self.else_)

    @property
    def anchor(self) -> str:
        """The alternative at whose place among the blocks the generated layer builds the module."""
        return self.cases[0][1] if self.cases else self.then

    def when(self, block: str) -> Tuple[Any, bool]:
        """(bool expression, value): the block exists in layer i iff the expression gives the value for i."""
        if self.cases:
            return next((Value(expr=c), True) for _, b, c in self.cases if b == block)
        return self.cond, block == self.then

    def describe(self) -> str:
        if self.cases:
            return f"select {self.cond}: " + ", ".join(f"{v!r} -> {b}" for v, b, _ in self.cases)
        return f"{self.then} if {self.cond} else {self.else_}"


@dataclass(frozen=True)
class StepIR:
    """A residual step: residual += hidden; hidden = post_norm(block(norm(residual))); without a norm the block
    reads the residual stream itself."""
    norm: Optional[str]
    block: str                    # the module (for a choice: the module both alternatives become)
    takes_positions: bool         # attention blocks get (positions, hidden), the others (hidden)
    post_norm: Optional[str] = None
    choice: Optional[ChoiceIR] = None
    scale: Optional[Value] = None  # the block's output is multiplied by it before joining the residual
    after_norm: Optional[str] = None  # post-LN: the residual stream is normalized after the add
    # a choice whose alternatives take different inputs (attention / recurrent mixer vs MLP / MoE): the layer
    # passes the positions where its module takes them (a per-layer flag `self.<block>_takes_positions`)
    mixed_input: bool = False
    add: Optional[str] = None     # a branch value added to the block's input (not to the residual)
    input_scale: Optional[Value] = None  # the block's input (the normed residual) is multiplied by it


@dataclass(frozen=True)
class BranchStepIR:
    """A side computation: value = ops(concat(inputs)), each op `h = block(norm(h))`, no residual; `branches` holds
    the ops (StepIR, as a parallel step's branches: code that walks the steps' blocks reads them alike)."""
    value: str                    # the value's name
    inputs: Tuple[str, ...]       # residual | embeddings | an earlier branch's value, concatenated on the last dim
    branches: Tuple[StepIR, ...]  # the ops, in order
    when: Optional[Value] = None  # per-layer: the branch runs (and its blocks exist) only where it holds


@dataclass(frozen=True)
class ParallelStepIR:
    """Parallel residual: every branch reads the same residual; their outputs are summed."""
    branches: Tuple[StepIR, ...]


@dataclass(frozen=True)
class LayerIR:
    class_name: str
    count: Size
    blocks: Tuple[BlockIR, ...]
    steps: Tuple[StepIR, ...]
    # `dataflow: {if: cond, then: A, else: B}`: `steps` is B (class_name), alt_steps A (alt_class_name, a subclass
    # overriding forward), chosen per checkpoint; only_in: (block, in A) for the blocks one dataflow uses
    alt_cond: Optional[Value] = None
    alt_steps: Tuple[StepIR, ...] = ()
    alt_class_name: Optional[str] = None
    only_in: Tuple[Tuple[str, bool], ...] = ()
    # `layers.shared`: (block, instance expression over `layer`): layers with equal values share its parameters
    shared: Tuple[Tuple[str, Value], ...] = ()
    output_scale: Optional[str] = None     # a learned scalar [1] that multiplies the stream after the layer

    @property
    def uses_per_layer_input(self) -> bool:
        """Some MLP reads the decoder's per-layer input: the layers take their slice as an input."""
        return any(getattr(b, "multiply", False) for b in self.blocks)

    @property
    def uses_embeddings(self) -> bool:
        """Some branch reads the decoder's embeddings: the layers take them as an input."""
        return any("embeddings" in getattr(s, "inputs", ()) for s in self.all_steps)

    def branch_when(self, block: str) -> Optional[Value]:
        """The `when` of the branch that uses `block` (it exists only where that holds); None: every layer."""
        for s in self.all_steps:
            if getattr(s, "value", None) is not None and any(op.block == block or op.norm == block
                                                              for op in s.branches):
                return s.when
        return None

    @property
    def all_steps(self) -> Tuple[StepIR, ...]:
        return self.steps + self.alt_steps

    def only_in_then(self, block: str) -> Optional[bool]:
        """True / False: the block exists only with the `then` / `else` dataflow; None: with both."""
        return dict(self.only_in).get(block)


@dataclass(frozen=True)
class LMHeadIR:
    name: str
    vocab: Size
    dim: Size
    tie: Value                    # literal bool or a bool config symbol
    softcap: Optional[Value] = None   # final logit soft-capping
    logit_scale: Optional[Value] = None   # logits multiplied by it (before the soft-cap)
    bias: Value = Value(literal=False)    # a [vocab] bias, vocab-parallel like the weight


@dataclass(frozen=True)
class RunnerIR:
    """What the generated runner specializes (derived from the model; deployment is engine options)."""
    position_kind: str            # rope | mrope
    multimodal: bool = False
    deepstack_levels_field: Optional[str] = None   # the Config field with the number of deepstack levels


@dataclass(frozen=True)
class RankTableIR:
    """Per-rank view of one variant at one tensor-parallel size."""
    tp: int
    heads_per_rank: Tuple[Tuple[str, int, int], ...]     # (attention block, q heads, kv heads) per rank
    params: Tuple[Tuple[str, Tuple[int, ...], int], ...]  # (param, per-rank shape, numel), layer params once
    layer_numel: int
    total_numel: int


@dataclass(frozen=True)
class VariantIR:
    name: str
    values: Tuple[Tuple[str, Any], ...]                   # every config symbol, defaults filled in
    tied: bool
    layers: int


@dataclass(frozen=True)
class PatchEmbedIR:
    name: str
    in_channels: Size
    temporal_patch: Size
    patch: Size
    dim: Size


@dataclass(frozen=True)
class PosEmbedIR:
    name: str
    positions: Size
    dim: Size


@dataclass(frozen=True)
class VisionAttentionIR:
    kind: str
    name: str
    hidden: Size
    heads: Size
    head_dim: Ratio
    theta: Value


@dataclass(frozen=True)
class VisionMLPIR:
    kind: str
    name: str
    hidden: Size
    intermediate: Size
    activation: str               # gelu_tanh | gelu

    @property
    def approximate(self) -> str:
        return "tanh" if self.activation == "gelu_tanh" else "none"


@dataclass(frozen=True)
class PatchMergerIR:
    name: str
    dim: Size
    out: Size
    merged: Size                  # dim * merge * merge
    norm: str                     # before_merge | after_merge
    eps: Value


@dataclass(frozen=True)
class VisionStepIR:
    norm: str
    block: str
    takes_rotary: bool            # attention gets (x, cu_seqlens, rotary); the MLP (x)


@dataclass(frozen=True)
class VisionIR:
    prefix: str                   # e.g. model.visual
    class_name: str
    block_class: str
    merge: Size
    patch_embed: PatchEmbedIR
    pos_embed: PosEmbedIR
    attention: VisionAttentionIR  # the blocks' attention: its head_dim and theta make the shared rotary
    count: Size
    blocks: Tuple[Any, ...]       # NormIR | VisionAttentionIR | VisionMLPIR
    steps: Tuple[VisionStepIR, ...]
    merger: PatchMergerIR
    deepstack_taps: Optional[Value]        # int_tuple symbol or literal tuple
    deepstack_count: Optional[Size]        # number of deepstack mergers (= levels)
    deepstack_merger: Optional[PatchMergerIR]
    weights: Tuple["WeightIR", ...] = ()

    @property
    def attr(self) -> str:
        return self.prefix.rsplit(".", 1)[-1]

    @property
    def tp_flags(self) -> Tuple[Tuple[str, Size], ...]:
        seen: dict = {}
        for w in self.weights:
            if w.param.tp_if and w.param.tp_if[0] not in seen:
                seen[w.param.tp_if[0]] = w.param.tp_if[1]
        return tuple(seen.items())


@dataclass(frozen=True)
class ProjectionIR:
    """decoder.project_in / project_out: a replicated linear between the embedding's and the residual's widths."""
    name: str                     # project_in | project_out
    in_: Size
    out: Size
    bias: Value
    enabled: Value                # where it exists (a literal true: always)


@dataclass(frozen=True)
class PerLayerInputIR:
    """decoder.per_layer_input: (norm(proj(h0) * project_scale) + embed_per_layer(ids) * embed_scale) * combine_scale,
    [tokens, layers * dim]; layer i reads columns [i * dim, (i + 1) * dim)."""
    vocab: Size
    dim: Size
    layers: Size
    hidden: Size
    embed_scale: Value
    project_scale: Value
    combine_scale: Value
    norm: "NormIR"
    enabled: Value


@dataclass(frozen=True)
class HeadTransformIR:
    """decoder.head_transform: norm(act(dense(x))) before the LM head (a replicated linear, an activation, a norm)."""
    in_: Size
    out: Size
    bias: Value
    activation: Value
    norm: Optional[NormIR] = None


@dataclass(frozen=True)
class ModelIR:
    name: str
    spec_path: str                # relative to the repository (or cwd)
    spec_files: Tuple[str, ...]   # the spec and those it extends
    description: str
    class_prefix: str
    architectures: Tuple[str, ...]
    config: Tuple[ConfigFieldIR, ...]
    embed: EmbeddingIR
    layer: LayerIR
    norm: Optional[NormIR]        # None: the last residual is added without a norm
    lm_head: LMHeadIR
    deepstack_after: Tuple[int, ...]
    params: Tuple[ParamIR, ...]
    weights: Tuple[WeightIR, ...]  # in parameter order
    ignored: Tuple[str, ...]
    runner: RunnerIR
    tp_sizes: Tuple[int, ...]
    variants: Tuple[VariantIR, ...]
    decoder_prefix: str = "model"
    deepstack_levels: Optional[Size] = None    # deepstack after layers 0..levels-1 (a loop bound)
    vision: Optional[VisionIR] = None
    spec_file: str = ""                                # absolute path of the spec (where its project is)
    checkpoint_renames: Tuple[Tuple[str, str], ...] = ()   # (regex, replacement) over checkpoint tensor names
    config_assume: Tuple[Tuple[str, Any], ...] = ()   # config.json path -> the value the spec assumes
    config_ignore: Tuple[str, ...] = ()                # config.json paths (patterns) that do not change the math
    config_defaults: Tuple[Tuple[str, Any], ...] = ()  # assumed path -> transformers' default when it is absent
    embed_positions: Optional[PositionEmbeddingIR] = None   # absolute positions added to the embedding
    embed_norm: Optional[NormIR] = None                     # a norm of the embedding output (Bloom)
    norm_enabled: Value = Value(literal=True)               # where the final norm exists
    residual_float32: Value = Value(literal=False)          # the residual stream in float32
    project_in: Optional[ProjectionIR] = None               # embedding width -> residual width
    project_out: Optional[ProjectionIR] = None              # residual width -> LM head width
    head_transform: Optional[HeadTransformIR] = None        # dense -> act -> norm before the LM head
    per_layer_input: Optional[PerLayerInputIR] = None      # a per-layer second input of the layers (Gemma 4)

    @property
    def model_class(self) -> str:
        return f"{self.class_prefix}ForConditionalGeneration" if self.vision else f"{self.class_prefix}ForCausalLM"

    @property
    def text_model_class(self) -> str:
        return f"{self.class_prefix}Model" if self.decoder_prefix == "model" else f"{self.class_prefix}TextModel"

    @property
    def decoder_attr(self) -> str:
        """The decoder's attribute in the container `model` ('' when the decoder is `model` itself)."""
        return "" if self.decoder_prefix == "model" else self.decoder_prefix.split(".", 1)[1]

    @property
    def decoder_path(self) -> str:
        """The decoder module as an expression on the top-level model (self.model, self.model.language_model)."""
        return "self." + self.decoder_prefix

    @property
    def derived_config(self) -> Tuple[ConfigFieldIR, ...]:
        return tuple(f for f in self.config if f.derived)

    @property
    def read_config(self) -> Tuple[ConfigFieldIR, ...]:
        return tuple(f for f in self.config if not f.derived)

    @property
    def weights_before_layers(self) -> Tuple[WeightIR, ...]:
        first = next((i for i, w in enumerate(self.weights) if w.param.per_layer), len(self.weights))
        return tuple(w for w in self.weights[:first] if not w.param.only_if_untied)

    @property
    def weights_after_layers(self) -> Tuple[WeightIR, ...]:
        first = next((i for i, w in enumerate(self.weights) if w.param.per_layer), len(self.weights))
        return tuple(w for w in self.weights[first:] if not w.param.per_layer and not w.param.only_if_untied)

    @property
    def deepstack_is_prefix(self) -> bool:
        """Deepstack after layers 0, 1, ..., k-1 (Qwen3-VL): rendered as one enumerate loop."""
        return self.deepstack_after == tuple(range(len(self.deepstack_after)))

    @property
    def choices(self) -> Tuple[ChoiceIR, ...]:
        out = []
        for s in self.layer.all_steps:
            for st in getattr(s, "branches", (s,)):
                if st.choice is not None:
                    out.append(st.choice)
        return tuple(out)

    def config_source(self, symbol: str) -> str:
        """The config.json path a symbol reads first (its name for a derived symbol), for messages."""
        for f in self.config:
            if f.name == symbol:
                return f.paths[0] if f.paths else symbol
        return symbol

    def choice_of(self, block: str) -> Optional[Tuple[ChoiceIR, str]]:
        """(the choice, its module name) when `block` is an alternative of a per-layer choice."""
        for s in self.layer.all_steps:
            for st in getattr(s, "branches", (s,)):
                if st.choice is not None and block in st.choice.alternatives:
                    return st.choice, st.block
        return None

    def choice_mixed(self, module: str) -> bool:
        """The per-layer choice that builds `module` has alternatives of different inputs (positions or not)."""
        return any(st.mixed_input for s in self.layer.all_steps for st in getattr(s, "branches", (s,))
                   if st.choice is not None and st.block == module)

    @property
    def attention_blocks(self) -> Tuple[AttentionIR, ...]:
        return tuple(b for b in self.layer.blocks if isinstance(b, AttentionIR))
