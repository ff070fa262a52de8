"""The attention blocks: `AttentionIR` and its parts (rotary, qk_norm, sub_norm, query scale, LoRA, experts), and
`MLAIR` (multi-head latent attention)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .values import Size, Value


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
    longrope_factors: str = "by_context"      # by_context | short (longrope's factor list at every context)
    longrope_mscale: bool = False             # longrope's short_mscale / long_mscale keys are read


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
    form: str = "log"             # log | power: (1 + (position + offset) / floor) ** beta


@dataclass(frozen=True)
class LoRAIR:
    """Per-use low-rank adapters on a block's fused input projection (runtime L.LoRA / L.SegmentLoRA)."""
    name: str                     # module name
    rank: "Size"
    per: str                      # segment (one adapter per output segment) | projection (one over the whole)
    enabled: "Value"              # literal True, or a bool symbol: the adapters exist where it holds


@dataclass(frozen=True)
class KeyBiasIR:
    """A per-key score bias from the values, exp(gain * softplus(proj(v))) per KV head (runtime L.ValueKeyBias), with
    an optional top-`keep` of keys per query."""
    proj: str                     # module name (a row-parallel linear kv_heads * head_dim -> kv_heads)
    gain: str                     # parameter name [kv_heads], split by KV heads
    bias: Value                   # proj's bias
    keep: Optional[Value] = None  # None: no top-k (an optional symbol that is None: none either)


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
    out_gate_proj_bias: Optional[Value] = None          # the gate projection's bias flag (None: no bias)
    out_gate_bias: Optional[str] = None   # a learned [heads] bias on the gate logits (parameter of the block)
    alibi: Optional[Value] = None              # ALiBi: the slopes' bias_max (8); None = off
    alibi_when: Optional[Value] = None         # ALiBi on the checkpoints where this flag holds; None = always
    alibi_scale: Optional[Value] = None        # a factor on the slopes; None = 1
    alibi_bf16: bool = False                   # the bias in bfloat16 at absolute key positions, then scaled
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
    key_bias: Optional[KeyBiasIR] = None       # a per-key score bias from the values (Doge's dynamic mask)
    kv_nvfp4: Optional[Value] = None           # flag, per-layer: k, v rounded to NVFP4 before the cache (None: never)

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
class IndexerIR:
    """A sparse-attention indexer (runtime layers/indexer.py SparseIndexer): heads x head_dim indexer q over the query
    latent, one LayerNorm-ed key, rope on the first rope_dims dims in `rope_layout` (or the str symbol), the top
    `topk` causal keys per query; `share` (per-layer bool): the layer reuses the previous indexer layer's selection."""
    heads: Size
    head_dim: Size
    topk: Size
    rope_dims: Size
    rope_layout: str
    rope_layout_symbol: Optional[str]
    k_norm_eps: Value
    share: Value
    rope_position: str = "first"          # the rotating dims: the first rope_dims (first) or the last (last)


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
    out_gate: Optional[Tuple[str, str, str]] = None   # (module, activation, per): out * act(module(x)) before out
    indexer: Optional[IndexerIR] = None   # a sparse-attention indexer (DeepSeek-V3.2's DSA)
    q_gate: Optional[str] = None          # a fused q + output-gate projection over [normed, raw] query latent
    q_scale: Optional[Value] = None       # the normalized query latent (or a direct q) times it; None = 1
    latent_scale: Optional[Value] = None  # the normalized KV latent times it (mla_scale_kv_lora); None = 1
    rope_key_norm: Optional[str] = None   # an RMSNorm module of the shared rope key before rotary
    sliding_window: Optional[Value] = None   # a sliding window (may read `layer`; an optional symbol)
    sinks: bool = False                   # attention sinks: parameter `sinks [heads]`, split by heads
