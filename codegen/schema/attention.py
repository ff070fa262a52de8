"""The attention block kinds: `attention` (`AttentionBlock` and its parts: out_gate, qk_norm, sub_norm,
differential, query_scale, rotary, LoRA, experts) and `mla_attention` (`MLAAttentionBlock`)."""
from __future__ import annotations

from typing import List, Literal, Optional, Union

from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr

from .base import Dim, Flag, Num, Strict, Symbol
from .blocks import FusedProjection, Projection


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
    # a learned bias per head added to the gate's logits before the activation (Beam's `gate_bias [heads]`): the
    # parameter's name on the attention block, split by heads as q is
    head_bias: Optional[StrictStr] = None
    # a bias on the gate projection's output rows (`name.bias`, split by heads as q is): a flag (a bool symbol: only in
    # the checkpoints that set it; HRM-Text's `attention_bias`); a gate with a projection of its own only
    bias: Flag = False


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
    # log (default): 1 + beta * log(1 + floor((p + offset) / floor)); power: (1 + (p + offset) / floor) ** beta, no
    # rounding (Beam's NoPE layers: beta 0.1, floor 2048, offset 1)
    form: Literal["log", "power"] = "log"


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
    # longrope: which factor list the frequencies take. by_context (default): short_factor while the engine's context
    # (max_model_len) is within the original one, long_factor beyond (vLLM; transformers' Phi-3 for a sequence past
    # the original context). short: short_factor at every context, only the attention factor (short_mscale /
    # long_mscale) follows the regime (transformers' PhiMoE computes its frequencies with short_factor at any length)
    longrope_factors: Literal["by_context", "short"] = "by_context"
    # longrope: the mapping's short_mscale / long_mscale replace the attention factor per regime (transformers'
    # PhiMoE rotary). Off (default): they are ignored, as transformers' generic longrope (Phi-3) ignores them
    longrope_mscale: StrictBool = False


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


class KeyBias(Strict):
    """A learned per-key score bias from the values (Doge's dynamic mask): b[s, h] = exp(gain[h] *
    softplus(proj(v[s]))[h]) added to every score against key s of KV head h's query heads, `proj` a linear
    [kv_heads, kv_heads * head_dim] over the key's values (all KV heads); with `keep` K, a query that sees more than K
    keys keeps only its K of highest bias."""
    proj: StrictStr = "dt_proj"          # module name of the linear over the values
    gain: StrictStr = "A"                # parameter name of the per-KV-head gain [kv_heads]
    bias: Flag = False                   # proj's bias
    keep: Optional[Num] = None           # an int, or an optional int symbol (None: every key kept)


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
    # ALiBi (Bloom, MPT, Falcon-RW): a per-head linear bias slope_h * (key_pos - query_pos) added to the scaled
    # scores; the slopes are the geometric series of the ALiBi paper over the heads (`alibi_bias_max`: its base, 8).
    # A bool literal, or a bool symbol / expression over config symbols (per checkpoint: Falcon's `alibi`)
    alibi: Flag = False
    alibi_bias_max: Num = 8
    # a factor on the slopes (Falcon: transformers scales the ALiBi bias with the scores, by 1 / sqrt(head_dim));
    # absent: 1
    alibi_scale: Optional[Num] = None
    # the bias built as transformers' Falcon builds it: in bfloat16 at the absolute key positions,
    # bf16(bf16(slope) * key_pos) * alibi_scale (its rounding depends on the position: not the relative form)
    alibi_bf16: StrictBool = False
    # a learned per-key score bias computed from the values, with an optional top-`keep` of keys per query (Doge's
    # dynamic mask attention, above); absent: none
    key_bias: Optional[KeyBias] = None
    # a flag, per-layer (may read `layer`): where it holds, k and v are rounded to NVFP4 and back (E2M1 values, one
    # E4M3 scale per 16 of head_dim) before the cache (Kolibri 1.1's indexed-attention layers)
    kv_nvfp4: Flag = False
    # the width of the block's input, read by the q/k/v projection (default `hidden`, also the output width):
    # Zamba's shared attention reads the concatenation of the residual stream and the embeddings (2 * hidden)
    input_width: Optional[Dim] = None
    lora: Optional[LoRA] = None          # per-use low-rank adapters on the q/k/v projection (above)
    # a mixture of attention heads (JetMoE): q and the output projection routed per token among expert stacks
    experts: Optional[AttentionExperts] = None

class Indexer(Strict):
    """The sparse-attention indexer of an attention block (DeepSeek-V3.2's DSA "lightning indexer"; GLM-MoE-DSA):
    per token an indexer q of `heads` heads of `head_dim` (wq_b over the query latent: the attention's
    q_a_layernorm output), one key (wk over the input, then a LayerNorm with weight and bias, eps `k_norm_eps`), the
    first `rope_dims` dims of both turned by the attention's rotary frequencies in `rope_layout`, per-head weights
    (weights_proj over the input, float32, times heads ** -0.5); score(t, s) = sum_h w[t, h] relu(head_dim ** -0.5
    q[t, h] . k[s]) over the causal keys, and query t attends only to its min(topk, length) best keys. The keys are
    cached per sequence beside the KV cache. `share` (a per-layer flag, may read `layer`): the layers that run no
    indexer of their own and reuse the selection of the previous indexer layer (GLM-MoE-DSA's `indexer_types`
    'shared'). Module names are transformers' (indexer.wq_b, indexer.wk, indexer.k_norm, indexer.weights_proj)."""
    heads: Dim
    head_dim: Dim
    topk: Dim
    rope_dims: Optional[Dim] = None       # default: the attention's rope dims (qk_rope_head_dim)
    # neox halves or interleaved pairs, or a `str` config symbol whose `values` are layouts
    rope_layout: Union[Literal["neox", "interleaved"], Symbol] = "neox"
    # which dims of each indexer head turn: the first `rope_dims` (DeepSeek-V3.2, GLM-MoE-DSA) or the last (HY-V4)
    rope_position: Literal["first", "last"] = "first"
    k_norm_eps: Num = 1.0e-6
    share: Flag = False


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
    # a gate on the attention output before `out` (as attention's `out_gate`: `per: head`, Ling's sigmoid `g_proj`
    # [heads, hidden]; `per: element` [heads * v_head_dim, hidden]); its own projection only (no `source: q`)
    out_gate: Optional[OutGate] = None
    # a sparse-attention indexer (needs the low-rank q: it reads the query latent)
    indexer: Optional[Indexer] = None
    # the module name of a fused q + output-gate projection replacing q_b_proj (A.X-K2's q_gate_proj): over the query
    # latent normalized and raw, concatenated ([q_a_layernorm(q_a), q_a], 2 * q_lora_rank), per head [q | gate] with
    # the gate v_head_dim wide; each head's attention output times sigmoid(gate) before the output projection
    q_gate: Optional[StrictStr] = None
    # the normalized query latent (q_a_layernorm's output: what q_b_proj and an indexer read) is multiplied by it,
    # or, with a direct q_proj, the query (LongCat-Flash's mla_scale_q_lora, Dots 3's q_lora_scale:
    # sqrt(hidden / q_lora_rank)); None = 1
    q_scale: Optional[Num] = None
    # the normalized KV latent (kv_a_layernorm's output, before kv_b_proj and the cache; not the rope key) is
    # multiplied by it (LongCat-Flash's mla_scale_kv_lora: sqrt(hidden / kv_lora_rank)); None = 1
    latent_scale: Optional[Num] = None
    # the module name of an RMSNorm (eps `latent_eps`, weight [qk_rope_head_dim], replicated) of the shared rope key,
    # before rotary (Dots 3's k_rope_only_layernorm)
    rope_key_norm: Optional[StrictStr] = None
    # a sliding window (as attention's: the query attends to the last `sliding_window` keys, itself included); an
    # optional symbol (None: no window) or an expression over `layer`
    sliding_window: Optional[Num] = None
    # attention sinks (as attention's: a learned logit per query head joins each softmax denominator; parameter
    # `sinks [heads]`, split by heads as q): HY-V4
    sinks: StrictBool = False
