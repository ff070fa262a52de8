"""The recurrent-state block kinds: `gated_delta_net`, `mamba2`, `mamba`, `short_conv`, `rg_lru`,
`lightning_attention`, the token-shift kinds `wkv`, `channel_mix`, and `mlstm`."""
from __future__ import annotations

from typing import List, Literal, Optional, Union

from pydantic import StrictBool, StrictStr

from .base import Dim, Flag, Num, Strict
from .blocks import MixerProjection, Projection


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
    # the bounded ("safe") decay of Ling's KDA (kda_safe_gate): g = decay_lower_bound * sigmoid(exp(A_log) * (a +
    # dt_bias)), in (decay_lower_bound, 0), instead of -exp(A_log) * softplus(a + dt_bias); a flag (a bool symbol
    # decides it per checkpoint)
    bounded_decay: Flag = False
    decay_lower_bound: Num = -5.0


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
    # multi-head Mamba (Zamba): the channels in `heads` heads of `head_dim` (intermediate = heads * head_dim), each
    # with its own x_proj / dt_proj and B / C; parameters stored with a head dim (x_proj.weight [heads, rank + 2
    # state, head_dim], dt_proj.weight [heads, head_dim, rank], dt_proj.bias / D [heads, head_dim], A_log [heads,
    # head_dim, state]); absent: one x_proj / dt_proj over all channels
    heads: Optional[Dim] = None
    head_dim: Optional[Dim] = None
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


class LightningAttentionBlock(Strict):
    """Lightning attention (MiniMax-Text-01 / M1's `linear_attention` layers; a per-sequence state): q, k, v =
    act(qkv(x)) (each head's rows [q | k | v] together); per head a fixed decay rate slope_h = 2 ** (-8 (h + 1) /
    heads) * (1 - layer / (layers - 1 + 1e-5) + 1e-5); the state S [head_dim, head_dim] evolves as
    S <- exp(-slope_h) S + k^T v and the output is q S; an RMSNorm over all heads (`norm`, eps `eps`), times
    sigmoid(gate(x)), `out`. A prompt runs in blocks of `block_size` tokens (transformers' block form). Parameters
    (transformers' names): `<qkv>.weight [3 heads head_dim, hidden]`, `<gate>.weight [heads head_dim, hidden]`,
    `norm.weight [heads head_dim]`, `<out>.weight [hidden, heads head_dim]`. Split over TP ranks by heads."""
    kind: Literal["lightning_attention"]
    hidden: Dim
    heads: Dim
    head_dim: Dim
    layers: Dim                          # the layer count of the decay formula (num_hidden_layers)
    block_size: Dim                      # a prompt's blocks (rounding only)
    eps: Num = 1.0e-6                    # the norm over all heads (transformers builds it with its default eps)
    activation: StrictStr = "silu"       # on q, k, v (a name or a str symbol of silu)
    qkv: StrictStr = "qkv_proj"          # module names
    gate: StrictStr = "output_gate"
    out: StrictStr = "out_proj"


class WKVBlock(Strict):
    """A WKV time mix (RWKV-4's `attention`; a per-sequence state): each token's key, value and receptance
    projections read `x * time_mix_<proj> + prev * (1 - time_mix_<proj>)` (prev: the previous token's input, the
    token shift); per channel the receptance-weighted key-value recurrence with decay `-exp(time_decay)` and
    current-token bonus `time_first`; `out(sigmoid(r) * wkv(k, v))`. Parameters (transformers' names):
    `time_decay`, `time_first [width]`, `time_mix_<key>`, `time_mix_<value>`, `time_mix_<receptance>` `[1, 1, hidden]`,
    `<key>.weight`, `<value>.weight`, `<receptance>.weight [width, hidden]`, `<out>.weight [hidden, width]` (no
    biases). Split over TP ranks by channels."""
    kind: Literal["wkv"]
    hidden: Dim
    width: Dim                           # the recurrence's channels (attention_hidden_size)
    key: StrictStr = "key"               # module names
    value: StrictStr = "value"
    receptance: StrictStr = "receptance"
    out: StrictStr = "output"


class ChannelMixBlock(Strict):
    """A token-shifted MLP (RWKV's `feed_forward`, the channel mix; a per-sequence state: the previous token's input):
    `k = act(key(lerp_k))`, `sigmoid(receptance(lerp_r)) * value(k)` with `lerp_p = x * time_mix_<p> + prev * (1 -
    time_mix_<p>)`. Parameters (transformers' names): `time_mix_<key>`, `time_mix_<receptance>` `[1, 1, hidden]`,
    `<key>.weight [intermediate, hidden]`, `<value>.weight [hidden, intermediate]`, `<receptance>.weight [hidden,
    hidden]` (no biases). TP: key column-parallel, value row-parallel, receptance replicated."""
    kind: Literal["channel_mix"]
    hidden: Dim
    intermediate: Dim
    activation: StrictStr = "relu2"      # on key's output: a name, or a str symbol (RWKV: squared ReLU)
    key: StrictStr = "key"               # module names
    value: StrictStr = "value"
    receptance: StrictStr = "receptance"


class MLSTMBlock(Strict):
    """An mLSTM mixer (xLSTM's `mlstm_layer`; a per-sequence state): q, k [qk_dim], v, the output gate [v_dim] and the
    input / forget gate pre-activations [heads] (soft-capped by `gate_soft_cap`) from the projections; per head the
    matrix-memory recurrence (exponential input gate, sigmoid forget gate, max stabilizer; state C [Dk, Dv], n [Dk],
    m); a per-head LayerNorm (`multihead_norm`, eps `norm_eps`); `out(sigmoid(ogate) * h)`. Parameters (transformers'
    names): `<q>.weight`, `<k>.weight [qk_dim, hidden]`, `<v>.weight`, `<ogate>.weight [v_dim, hidden]`,
    `<igate>.weight`, `<fgate>.weight [heads, hidden]` with biases, `multihead_norm.weight [v_dim]`, `<out>.weight
    [hidden, v_dim]`, biases where `bias` / `norm_bias` hold. Split over TP ranks by heads."""
    kind: Literal["mlstm"]
    hidden: Dim
    heads: Dim
    qk_dim: Dim                          # all heads' query / key width
    v_dim: Dim                           # all heads' value width
    eps: Num = 1.0e-6                    # the output denominator's eps
    norm_eps: Num = 1.0e-6               # the per-head LayerNorm's eps
    gate_soft_cap: Optional[Num] = None  # cap * tanh(x / cap) on the gate pre-activations; none: uncapped
    bias: Flag = False                   # biases of q, k, v, the output gate and out
    norm_bias: Flag = False              # the per-head LayerNorm's bias
    q: StrictStr = "q"                   # module names
    k: StrictStr = "k"
    v: StrictStr = "v"
    ogate: StrictStr = "ogate_preact"
    igate: StrictStr = "igate_preact"
    fgate: StrictStr = "fgate_preact"
    out: StrictStr = "out_proj"
