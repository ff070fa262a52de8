"""Recurrent-state token mixers: layers that keep a per-sequence state instead of (or beside) a KV cache.

A `RecurrentMixer` declares its state tensors (`state_shapes()`: name -> (per-sequence shape, dtype), this rank's
shapes). The runner allocates each as `[num_slots, *shape]` (a state pool beside the paged KV cache, one slot per
running sequence, runtime/executor/model_runner.py) and attaches them as `self.states[name]`; the block manager hands
a sequence its slot at admission and takes it back when it finishes, is aborted or preempted. A step's forward
context says, per sequence, which slot it owns (`ctx.state_slots`) and whether the slot continues a state
(`ctx.state_continue_cpu`: False at a sequence's first prefill chunk, whose state starts at zero; so a sequence
preempted and recomputed from its tokens starts over). The mixer reads its rows of the pool, computes, and writes them
back: a prefill step per sequence (`step_sequences`, host values), a decode step batched from the slot tensor alone
(`decode_slots`, `gather_states` / `scatter_states`: index_select / index_copy_, no host value, no data-dependent
shape), which the decode CUDA graphs capture with the slots as a static input (padding rows on the pool's scratch
slot, runtime/executor/cuda_graph.py).

Math (torch reference, float32 state; the GPU runs the same torch code):
- `causal_conv1d`: a depthwise causal conv1d over time, its state the last kernel - 1 inputs of each channel;
- `gated_delta_rule`: the gated delta rule (Gated DeltaNet): per value head, S <- exp(g) S, then
  S <- S + k (beta (v - S^T k))^T, output S^T q (q and k L2-normalized, q scaled by dk ** -0.5); a prompt chunk runs
  the chunked (UT-transform) form of transformers' torch_chunk_gated_delta_rule, a decode step the recurrent form of
  torch_recurrent_gated_delta_rule, both from the slot's state;
  the decay g is a scalar per value head ([T, Hv], Gated DeltaNet) or a vector per value head over the key channels
  ([T, Hv, Dk], Kimi Delta Attention's fine-grained decay: S <- diag(exp(g)) S), one core for both;
- `GatedRMSNorm`: RMSNorm of the mixer output per value head, times silu(z) (or sigmoid(z)).
- `RGLRU`: the real-gated linear recurrent unit (Griffin's RG-LRU): h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t),
  a reset (a_t := 0, no normalisation) at position 0; a prompt chunk runs the recurrence in chunks of 64 tokens
  (`rg_lru_scan_chunked`, log-space decays within a chunk), a decode step as one batched update.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.executor.context import get_context
from xllm_gen.runtime.executor.distributed import all_reduce, get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, Segment, attach, raise_or_defer, replicated, split_segment


class RecurrentMixer(nn.Module):
    """Base of a token mixer with per-sequence state. Subclasses set `self.state_spec` {name: (shape, dtype)}
    (this rank's per-sequence shapes); the runner fills `self.states` {name: [num_slots, *shape]}."""

    state_spec: dict = {}

    def state_shapes(self) -> dict:
        return dict(self.state_spec)

    def init_states(self, num_slots: int, device, dtype) -> None:
        self.states = {name: torch.zeros((num_slots,) + tuple(shape), dtype=dt or dtype, device=device)
                       for name, (shape, dt) in self.state_shapes().items()}

    def state_bytes(self, dtype) -> int:
        """Bytes of one sequence's state."""
        n = 0
        for shape, dt in self.state_shapes().values():
            numel = 1
            for s in shape:
                numel *= int(s)
            n += numel * torch.tensor([], dtype=dt or dtype).element_size()
        return n


def decode_slots(ctx) -> Optional[torch.Tensor]:
    """The state slot of each row [B] int64 (device) when the step is a decode step, else None (a prefill step runs
    per sequence, `step_sequences`). A decode step has one token per sequence and every sequence continues its
    state, so its mixer path reads only this tensor: no host value, which makes it graph-safe (a decode CUDA graph
    binds a static slot buffer here; its padding rows hold the pool's scratch slot, runtime/executor/cuda_graph.py)."""
    if ctx.is_prefill:
        return None
    if ctx.state_slots is None:
        raise RuntimeError("a recurrent mixer ran a decode step without state slots in the forward context (the "
                           "runner allocates them for models with recurrent layers)")
    if ctx.query_lens_cpu is not None and any(q != 1 for q in ctx.query_lens_cpu):
        return None
    return ctx.state_slots


def gather_states(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows `slots` [B] of a state pool [num_slots, ...] (a copy; graph-safe, no host sync)."""
    return pool.index_select(0, slots)


def scatter_states(pool: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Writes `new` [B, ...] into the rows `slots` of the pool, in place (graph-safe, no host sync). Slots are
    distinct but for a decode graph's padding rows, which all share the scratch slot (any of them may win)."""
    pool.index_copy_(0, slots, new.to(pool.dtype))


def slot_state(pool: torch.Tensor, slot: int, continues: bool) -> torch.Tensor:
    """A prompt chunk's starting state: its sequence's row of the pool when it continues an earlier chunk, else
    zeros (a new sequence, or one recomputed after preemption)."""
    return pool[slot] if continues else torch.zeros_like(pool[slot])


def step_sequences(ctx):
    """[(row_start, row_end, slot, continues)] of the step's sequences (host values; no device sync)."""
    if ctx.state_slots_cpu is None:
        raise RuntimeError("a recurrent mixer ran without state slots in the forward context (the runner allocates "
                           "them for models with recurrent layers)")
    out, start = [], 0
    for qlen, slot, cont in zip(ctx.query_lens_cpu, ctx.state_slots_cpu, ctx.state_continue_cpu):
        out.append((start, start + qlen, slot, cont))
        start += qlen
    return out


def _fields_named(fields: Optional[dict]):
    """A refusal's ' (config.json <field>)' for a size, where the generated block named its field."""
    return lambda size: f" (config.json {fields[size]})" if fields and size in fields else ""


# ------------------------------------------------------------------------------------------------ conv1d
class CausalConv1d(nn.Module):
    """Depthwise causal conv1d over time of `channels` channels (kernel `kernel`, optional bias), parameter
    `weight [channels, 1, kernel]` as nn.Conv1d stores it. `segments`: the channel segments (name, heads, unit) in
    order, split over TP ranks by heads (each rank holds its heads' channels of every segment)."""

    def __init__(self, segments, kernel: int, bias: bool = False):
        # segments: (name, heads, unit) or (name, heads, unit, replicate_ok): a segment of fewer heads than ranks
        # may be replicated (rank r serves head r // (tp / heads)), as KV heads are
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        problems: list = []
        segs = tuple(split_segment(Segment(*seg), tp, rank, problems) for seg in segments)
        self.channels = sum(s.rows for s in segs)
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(self.channels, 1, kernel))
        attach(self.weight, ParamSplit("column", 0, segs, tuple(self.weight.shape), tp, rank, "CausalConv1d"))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.channels))
            attach(self.bias, ParamSplit("column", 0, segs, tuple(self.bias.shape), tp, rank, "CausalConv1d"))
        raise_or_defer(self, problems)

    def extra_repr(self) -> str:
        return f"channels={self.channels} (per rank), kernel={self.kernel}, bias={self.bias is not None}"


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], state: torch.Tensor,
                  activation: Optional[str] = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [T, C] (this chunk), weight [C, 1, K], state [C, K - 1] (the previous inputs; zeros at the
    start). Returns (act(conv(x)) [T, C], new state [C, K - 1])."""
    C = x.shape[1]
    K = weight.shape[-1]
    ext = torch.cat([state.to(weight.dtype), x.t().to(weight.dtype)], dim=-1)          # [C, K - 1 + T]
    out = F.conv1d(ext.unsqueeze(0), weight, bias, groups=C)[0]                        # [C, T]
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: activation {activation!r} (silu or None)")
    return out.t().to(x.dtype), ext[:, ext.shape[-1] - (K - 1):]


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], state: torch.Tensor,
                       activation: Optional[str] = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step of B sequences: x [B, C], state [B, C, K - 1]. Returns (out [B, C], new state)."""
    ext = torch.cat([state.to(weight.dtype), x.unsqueeze(-1).to(weight.dtype)], dim=-1)   # [B, C, K]
    out = (ext.float() * weight[:, 0].float().unsqueeze(0)).sum(-1)       # accumulated in float32, as conv1d does
    if bias is not None:
        out = out + bias.float()
    out = out.to(weight.dtype)
    if activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype), ext[:, :, 1:]


# ---------------------------------------------------------------------------------------- gated delta rule
def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size: int = 64):
    """One sequence, the chunked form: q, k [T, Hv, Dk] (already repeated to the value heads), v [T, Hv, Dv],
    g [T, Hv] (a decay per head) or [T, Hv, Dk] (per key channel), beta [T, Hv], state [Hv, Dk, Dv] (float32).
    Returns (out [T, Hv, Dv] float32, new state)."""
    if g.dim() == 3:
        return _delta_rule_chunked_per_channel(q, k, v, g, beta, state, chunk_size)
    T = q.shape[0]
    q, k, v, beta, g = (x.transpose(0, 1).float().contiguous() for x in (q, k, v, beta, g))   # [H, T, ...]
    q = _l2norm(q)
    k = _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (chunk_size - T % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    H, n = q.shape[0], (T + pad) // chunk_size
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(H, n, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(H, n, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    S = state.float()
    out = torch.zeros_like(new_v)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(n):
        v_new = new_v[:, i] - k_cum[:, i] @ S
        out[:, i] = q[:, i] @ S + intra[:, i] @ v_new
        S = S * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(H, -1, out.shape[-1])[:, :T]
    return out.transpose(0, 1), S


def _delta_rule_chunked_per_channel(q, k, v, g, beta, state, chunk_size: int = 64):
    """gated_delta_rule_chunked with a decay per key channel, g [T, Hv, Dk] (Kimi Delta Attention; transformers'
    chunk_kimi_delta_attention): within a chunk the pairwise decays exp(G_r - G_c) (G the in-chunk cumulative log
    decay) are per channel, so the UT matrix and the intra-chunk scores sum k_r * k_c * exp(G_r - G_c) over the
    channels; computed chunk by chunk ([H, C, C, Dk] at a time, every exponent <= 0)."""
    T = q.shape[0]
    q, k, v, g = (x.transpose(0, 1).float().contiguous() for x in (q, k, v, g))       # [H, T, D]
    beta = beta.transpose(0, 1).float()
    q = _l2norm(q)
    k = _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (chunk_size - T % chunk_size) % chunk_size
    q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    H, n, C = q.shape[0], (T + pad) // chunk_size, chunk_size
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, g, k_beta, v_beta = (x.reshape(H, n, C, x.shape[-1]) for x in (q, k, g, k_beta, v_beta))
    cum = g.cumsum(dim=-2)                                                              # [H, n, C, Dk]
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    S = state.float()
    out = torch.empty(H, n, C, v.shape[-1], dtype=torch.float32, device=q.device)
    for i in range(n):
        c = cum[:, i]                                                                   # [H, C, Dk]
        pair = (c.unsqueeze(-2) - c.unsqueeze(-3)).masked_fill(upper[..., None], float("-inf")).exp()  # [H, C, C, Dk]
        ut = (k_beta[:, i].unsqueeze(-2) * k[:, i].unsqueeze(-3) * pair).sum(-1)
        intra = (q[:, i].unsqueeze(-2) * k[:, i].unsqueeze(-3) * pair).sum(-1)
        new_v = torch.linalg.solve_triangular(ut, v_beta[:, i], upper=False, unitriangular=True)
        k_cum = torch.linalg.solve_triangular(ut, k_beta[:, i] * c.exp(), upper=False, unitriangular=True)
        v_new = new_v - k_cum @ S
        out[:, i] = (q[:, i] * c.exp()) @ S + intra @ v_new
        last = c[:, -1:]                                                                # [H, 1, Dk]
        S = S * last.exp().transpose(-1, -2) + (k[:, i] * (last - c).exp()).transpose(-1, -2) @ v_new
    out = out.reshape(H, -1, out.shape[-1])[:, :T]
    return out.transpose(0, 1), S


def gated_delta_rule_step(q, k, v, g, beta, state):
    """A decode step of B sequences, the recurrent form: q, k [B, Hv, Dk], v [B, Hv, Dv], g [B, Hv] (per head) or
    [B, Hv, Dk] (per key channel), beta [B, Hv], state [B, Hv, Dk, Dv]. Returns (out [B, Hv, Dv] float32, new
    state)."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = _l2norm(q)
    k = _l2norm(k)
    q = q / (q.shape[-1] ** 0.5)
    decay = g.exp()[..., None] if g.dim() == 3 else g.exp()[..., None, None]
    S = state.float() * decay
    kv_mem = (S * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    S = S + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (S * q.unsqueeze(-1)).sum(dim=-2), S


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output times silu(gate): `w * norm(x).to(dtype) * silu(z.float())`, cast back
    (transformers' RMSNormGated / FLA's FusedRMSNormGated); weight [dim] replicated. `activation="sigmoid"`: times
    sigmoid(z) (Kimi Delta Attention's o_norm)."""

    def __init__(self, dim: int, eps: float, activation: str = "silu"):
        super().__init__()
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"GatedRMSNorm: the gate activation must be silu or sigmoid, got {activation!r}")
        self.eps = eps
        self.activation = activation
        self.weight = replicated(nn.Parameter(torch.empty(dim)), "GatedRMSNorm")

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        gate = torch.sigmoid(z.float()) if self.activation == "sigmoid" else F.silu(z.float())
        return (h * gate).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (f", {self.activation}" if self.activation != "silu" else "")


class GatedDeltaNet(RecurrentMixer):
    """The state and math of a gated DeltaNet mixer (the generated block subclasses it and adds its projections):
    `conv1d` (depthwise causal conv over q | k | v channels, then SiLU), `A_log` and `dt_bias` [value_heads]
    (decay g = -exp(A_log) * softplus(a + dt_bias)), beta = beta_scale * sigmoid(b), `norm` (GatedRMSNorm over
    value_head_dim). Heads are split over
    TP ranks by key-head groups: rank r holds key heads [r Hk / tp, ...) and their value heads (value heads
    Hv / Hk per key head, consecutive), so `key_heads` must be divisible by the TP size.

    States per sequence: `conv` [conv channels, kernel - 1] and `recurrent` [value heads, key_head_dim,
    value_head_dim] (float32)."""

    def __init__(self, key_heads: int, value_heads: int, key_head_dim: int, value_head_dim: int, conv_kernel: int,
                 eps: float, conv_bias: bool = False, activation: str = "silu", fields: Optional[dict] = None,
                 decay: str = "head", gate_activation: str = "silu", beta_scale: float = 1.0,
                 bounded_decay: bool = False, decay_lower_bound: float = -5.0):
        # fields: the config fields of the sizes ({"key_heads": "linear_num_key_heads"}), named in refusals
        # decay: "head" (g a scalar per value head: `a` and `dt_bias` [value_heads]) or "channel" (Kimi Delta
        # Attention's fine-grained decay, one per value head and key channel: `a` and `dt_bias` [value_heads *
        # key_head_dim], A_log still [value_heads]); gate_activation: the gated norm's (silu, or sigmoid)
        # beta_scale: beta = beta_scale * sigmoid(b) (2: OLMo-Hybrid's linear_allow_neg_eigval, a step in [0, 2])
        super().__init__()
        if activation not in ("silu", "swish"):
            raise ValueError(f"gated_delta_net: the conv activation must be silu, got {activation!r}")
        if decay not in ("head", "channel"):
            raise ValueError(f"gated_delta_net: decay must be 'head' or 'channel', got {decay!r}")
        self.decay = decay
        self.beta_scale = float(beta_scale)
        # bounded_decay (Ling's kda_safe_gate): g = decay_lower_bound * sigmoid(exp(A_log) * (a + dt_bias))
        self.bounded_decay, self.decay_lower_bound = bool(bounded_decay), float(decay_lower_bound)
        named = _fields_named(fields)
        if value_heads % key_heads:
            raise ValueError(f"gated_delta_net: value heads ({value_heads}) must be a multiple of key heads "
                             f"({key_heads})")
        tp = get_tp_size()
        problems: list = []
        if key_heads % tp:
            problems.append(f"gated_delta_net: {key_heads} key heads{named('key_heads')} (and their value heads) cannot "
                            f"be split over tensor parallel size {tp}")
        raise_or_defer(self, problems)
        self.rep = value_heads // key_heads                 # value heads per key head
        self.key_heads = max(1, key_heads // tp)            # per rank
        self.value_heads = self.key_heads * self.rep
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.key_dim = self.key_heads * key_head_dim
        self.value_dim = self.value_heads * value_head_dim
        self.conv_kernel = conv_kernel
        self.conv1d = CausalConv1d((("q", key_heads, key_head_dim), ("k", key_heads, key_head_dim),
                                    ("v", key_heads, self.rep * value_head_dim)), conv_kernel, conv_bias)
        heads = Segment("heads", key_heads, self.rep)
        rank = get_tp_rank()
        for name in ("A_log", "dt_bias"):
            if name == "dt_bias" and decay == "channel":       # one per value head and key channel
                seg = split_segment(Segment("heads", key_heads, self.rep * key_head_dim), tp, rank, [])
                p = nn.Parameter(torch.empty(self.value_heads * key_head_dim))
            else:
                seg = split_segment(heads, tp, rank, [])
                p = nn.Parameter(torch.empty(self.value_heads))
            setattr(self, name, attach(p, ParamSplit("column", 0, (seg,), tuple(p.shape), tp, rank, "GatedDeltaNet")))
        self.norm = GatedRMSNorm(value_head_dim, eps, gate_activation)
        self.state_spec = {"conv": ((self.conv1d.channels, conv_kernel - 1), None),
                           "recurrent": ((self.value_heads, key_head_dim, value_head_dim), torch.float32)}

    def sizes(self, *segments: str) -> list:
        """This rank's widths of projection segments (q, k: key_dim; v, z: value_dim; b: value heads; a: value heads,
        times key_head_dim with a per-channel decay)."""
        size = {"q": self.key_dim, "k": self.key_dim, "v": self.value_dim, "z": self.value_dim,
                "b": self.value_heads,
                "a": self.value_heads * (self.key_head_dim if self.decay == "channel" else 1)}
        return [size[s] for s in segments]

    def mix(self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """qkv [N, 2 key_dim + value_dim] (q | k | v, before the conv), z [N, value_dim], b [N, value_heads], a
        [N, value_heads] (or [N, value_heads * key_head_dim], a per-channel decay) -> the gated-normed mixer output
        [N, value_dim] (before the output projection), states updated."""
        ctx = get_context()
        N = qkv.shape[0]
        Hv, Dv = self.value_heads, self.value_head_dim
        conv_state, rec_state = self.states["conv"], self.states["recurrent"]
        w, cb = self.conv1d.weight, self.conv1d.bias
        beta = b.sigmoid()
        if self.beta_scale != 1.0:                               # as transformers: in the projection's dtype
            beta = beta * self.beta_scale
        if self.bounded_decay:                  # g in (lower_bound, 0): lower_bound * sigmoid(exp(A_log) (a + dt_bias))
            x = (a.float() + self.dt_bias.float()).view(N, Hv, -1)
            g = self.decay_lower_bound * torch.sigmoid(self.A_log.float().exp()[:, None] * x)
            g = (g if self.decay == "channel" else g[..., 0]).to(a.dtype).float()   # cast as transformers does
        elif self.decay == "channel":           # g [N, Hv, Dk]: -exp(A_log[h]) * softplus(a + dt_bias) per channel
            sp = F.softplus(a.float() + self.dt_bias.float()).view(N, Hv, self.key_head_dim)
            g = -self.A_log.float().exp()[:, None] * sp
        else:
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        slots = decode_slots(ctx)
        if slots is not None:                                   # decode: one token each, batched, graph-safe
            x, new_conv = causal_conv1d_step(qkv, w, cb, gather_states(conv_state, slots))
            scatter_states(conv_state, slots, new_conv)
            q, k, v = self._split(x)
            out, S = gated_delta_rule_step(q, k, v, g, beta, gather_states(rec_state, slots))
            scatter_states(rec_state, slots, S)
        else:
            out = torch.empty(N, Hv, Dv, dtype=torch.float32, device=qkv.device)
            for s, e, slot, cont in step_sequences(ctx):
                cs = slot_state(conv_state, slot, cont)
                x, new_conv = causal_conv1d(qkv[s:e], w, cb, cs)
                conv_state[slot] = new_conv.to(conv_state.dtype)
                q, k, v = self._split(x)
                rs = slot_state(rec_state, slot, cont)
                o, S = gated_delta_rule_chunked(q, k, v, g[s:e], beta[s:e], rs)
                rec_state[slot] = S
                out[s:e] = o
        out = self.norm(out.to(qkv.dtype).reshape(-1, Dv), z.reshape(-1, Dv))
        return out.view(N, Hv * Dv)

    def _split(self, x: torch.Tensor):
        Hk, Dk, Dv = self.key_heads, self.key_head_dim, self.value_head_dim
        q, k, v = x.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(-1, Hk, Dk).repeat_interleave(self.rep, dim=1)
        k = k.reshape(-1, Hk, Dk).repeat_interleave(self.rep, dim=1)
        return q, k, v.reshape(-1, self.value_heads, Dv)

    def extra_repr(self) -> str:
        return (f"key_heads={self.key_heads}, value_heads={self.value_heads} (per rank), key_head_dim="
                f"{self.key_head_dim}, value_head_dim={self.value_head_dim}, conv_kernel={self.conv_kernel}"
                + (f", decay={self.decay}" if self.decay != "head" else ""))


# ------------------------------------------------------------------------------------------------- mamba2
def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: out[..., i, j] = sum(x[..., j + 1 : i + 1]) for j <= i, -inf above (transformers'
    segment_sum)."""
    T = x.size(-1)
    x = x[..., None].expand(*x.size(), T)
    x = x.masked_fill(~torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool), diagonal=-1), 0)
    s = torch.cumsum(x, dim=-2)
    return s.masked_fill(~torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool), diagonal=0), -torch.inf)


def ssd_chunk_scan(x, dt, A, B, C, D, state, chunk_size: int):
    """One sequence, Mamba-2's SSD in chunks (transformers' mamba2_chunk_scan): x [T, H, P], dt [T, H] (after bias,
    softplus and clamp), A [H] (negative), B, C [T, H, N] (already repeated to the heads), D [H], state [H, P, N]
    (float32). Returns (y [T, H, P] float32, new state)."""
    T = x.shape[0]
    x = x.float()
    pad = (chunk_size - T % chunk_size) % chunk_size
    D_res = D.float()[:, None] * F.pad(x, (0, 0, 0, 0, 0, pad))
    x = x * dt[..., None].float()
    A = A.float() * dt.float()                                                      # [T, H]

    def chunks(t):
        t = F.pad(t, [0, 0] * (t.dim() - 1) + [0, pad])
        return t.reshape(-1, chunk_size, *t.shape[1:])
    x, A, B, C = (chunks(t) for t in (x, A, B.float(), C.float()))                 # [c, l, ...]
    A = A.permute(2, 0, 1)                                                          # [H, c, l]
    A_cum = torch.cumsum(A, dim=-1)
    L = torch.exp(_segment_sum(A))                                                  # [H, c, l, s]
    G = torch.einsum("clhn,cshn->clsh", C, B)
    M = G * L.permute(1, 2, 3, 0)
    y_diag = torch.einsum("clsh,cshp->clhp", M, x)
    decay_states = torch.exp(A_cum[:, :, -1:] - A_cum)                              # [H, c, l]
    B_decay = B * decay_states.permute(1, 2, 0)[..., None]
    states = torch.einsum("clhn,clhp->chpn", B_decay, x)
    states = torch.cat([state.float()[None], states], dim=0)                       # [c + 1, H, P, N]
    decay_chunk = torch.exp(_segment_sum(F.pad(A_cum[:, :, -1], (1, 0)))).transpose(0, 2)   # [c+1 (z), c+1, H]
    new_states = torch.einsum("zch,zhpn->chpn", decay_chunk, states)
    states, final = new_states[:-1], new_states[-1]
    C_states = torch.einsum("clhn,chpn->clhp", C, states)
    y_off = C_states * torch.exp(A_cum).permute(1, 2, 0)[..., None]
    y = (y_diag + y_off).reshape(-1, *y_diag.shape[2:]) + D_res
    return y[:T], final


def ssd_step(x, dt, A, B, C, D, state):
    """A decode step of B sequences (transformers' mamba2_selective_state_update): x [B, H, P], dt [B, H] (after bias
    and softplus), A [H], B, C [B, H, N] (repeated to the heads), D [H], state [B, H, P, N]. Returns (y [B, H, P] in
    x's dtype, new state float32)."""
    dt = dt[..., None]                                                              # [B, H, 1]
    dA = torch.exp(dt.float()[..., None] * A.float()[None, :, None, None])           # [B, H, 1, 1]
    dBx = (dt * B)[:, :, None, :] * x[..., None]                                    # [B, H, P, N]
    S = state.float() * dA + dBx
    y = (S.to(C.dtype).float() * C[:, :, None, :].float()).sum(-1).to(C.dtype)   # a bmm in C's dtype
    y = (y + x * D[None, :, None]).to(y.dtype)
    return y.to(x.dtype), S


class GroupedGatedRMSNorm(nn.Module):
    """Mamba-2's gated norm (transformers' MambaRMSNormGated): `w * rmsnorm_per_group(x * silu(z))`, in float32
    before the weight; `groups` groups of equal width. Weight [channels] split over TP ranks as the heads are: with
    at least as many groups as ranks each rank normalizes its own groups; with fewer, a group spans tp / groups
    ranks and its mean square is summed over them (one all-reduce of [N, groups])."""

    def __init__(self, segment: Segment, groups: int, eps: float, norm_before_gate: bool = False):
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        seg = split_segment(segment, tp, rank, [])
        self.eps, self.groups = eps, groups
        # True: w * rmsnorm(x) * silu(z) (FalconH1's mamba_norm_before_gate), in float32, then cast
        self.norm_before_gate = norm_before_gate
        self.group_size = segment.size // groups                   # channels of one group (global)
        self.spanning = groups < tp                                # a group spans several ranks
        self.my_group = rank // max(1, tp // groups)
        self.weight = attach(nn.Parameter(torch.empty(seg.rows)),
                             ParamSplit("column", 0, (seg,), (seg.rows,), tp, rank, "GroupedGatedRMSNorm"))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() if self.norm_before_gate else x.float() * F.silu(z.float())
        if self.spanning:
            sums = torch.zeros(h.shape[0], self.groups, dtype=torch.float32, device=h.device)
            sums[:, self.my_group] = h.pow(2).sum(-1)
            var = all_reduce(sums)[:, self.my_group:self.my_group + 1] / self.group_size
            h = h * torch.rsqrt(var + self.eps)
        else:
            g = h.view(*h.shape[:-1], -1, self.group_size)
            h = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).view_as(h)
        if self.norm_before_gate:           # transformers' FalconH1RMSNormGated: the weight in float32, then the gate
            return (self.weight.float() * h * F.silu(z.float())).to(dtype)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]} (per rank), group_size={self.group_size}, eps={self.eps}"


class Mamba2(RecurrentMixer):
    """The state and math of a Mamba-2 mixer (the generated block subclasses it and adds its projections): `conv1d`
    (depthwise causal conv over x | B | C, then SiLU), `A_log`, `D`, `dt_bias` [heads], `norm` (the grouped gated
    RMSNorm over heads * head_dim). SSD with `groups` B / C groups (heads / groups heads each), dt = softplus(dt +
    dt_bias) clamped to `time_step_limit` in a prompt chunk (transformers' chunk scan; its decode step does not
    clamp), y = SSD(x) + D x. TP splits heads and groups (both divisible by the TP size).

    States per sequence: `conv` [conv channels, kernel - 1] and `ssm` [heads, head_dim, state_size] (float32)."""

    def __init__(self, heads: int, head_dim: int, groups: int, state_size: int, conv_kernel: int, chunk_size: int,
                 eps: float, conv_bias: bool = True, activation: str = "silu", time_step_limit=(0.0, float("inf")),
                 fields: Optional[dict] = None, gated_norm: bool = True, norm_before_gate: bool = False):
        # gated_norm False: no norm, the output is y * silu(z) (FalconH1's mamba_rms_norm false); norm_before_gate:
        # w * rmsnorm(y) * silu(z) instead of w * rmsnorm(y * silu(z))
        # fields: the config fields of the sizes ({"heads": "num_heads", "groups": "n_groups"}), named in refusals
        super().__init__()
        named = _fields_named(fields)
        if activation not in ("silu", "swish"):
            raise ValueError(f"mamba2: the conv activation must be silu, got {activation!r}")
        if heads % groups:
            raise ValueError(f"mamba2: heads ({heads}) must be a multiple of groups ({groups})")
        tp, rank = get_tp_size(), get_tp_rank()
        problems = [f"mamba2: {heads} heads{named('heads')} cannot be split over tensor parallel size {tp}"] \
            if heads % tp else []
        if groups % tp and tp % groups:
            problems.append(f"mamba2: {groups} B/C groups{named('groups')} cannot be split over (nor replicated "
                            f"across) tensor parallel size {tp}")
        raise_or_defer(self, problems)
        # per rank; with fewer groups than ranks each rank holds (a copy of) the one group of its heads
        self.heads, self.groups = max(1, heads // tp), max(1, groups // tp)
        self.head_dim, self.state_size, self.chunk_size = head_dim, state_size, chunk_size
        self.conv_kernel = conv_kernel
        self.time_step_limit = tuple(float(v) for v in time_step_limit)
        self.conv1d = CausalConv1d((("x", heads, head_dim), ("B", groups, state_size, True),
                                    ("C", groups, state_size, True)), conv_kernel, conv_bias)
        heads_seg = split_segment(Segment("heads", heads), tp, rank, [])
        for name in ("A_log", "D", "dt_bias"):
            p = nn.Parameter(torch.empty(self.heads))
            setattr(self, name, attach(p, ParamSplit("column", 0, (heads_seg,), tuple(p.shape), tp, rank, "Mamba2")))
        self.norm = (GroupedGatedRMSNorm(Segment("heads", heads, head_dim), groups, eps, norm_before_gate)
                     if gated_norm else None)
        self.state_spec = {"conv": ((self.conv1d.channels, conv_kernel - 1), None),
                           "ssm": ((self.heads, head_dim, state_size), torch.float32)}

    def sizes(self, *segments: str) -> list:
        """This rank's widths of in_proj segments (z, x: heads * head_dim; B, C: groups * state_size; dt: heads)."""
        inner, bc = self.heads * self.head_dim, self.groups * self.state_size
        size = {"z": inner, "x": inner, "B": bc, "C": bc, "dt": self.heads}
        return [size[s] for s in segments]

    def mix(self, z: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """z [N, heads * head_dim] (the gate), xbc [N, x | B | C] (before the conv), dt [N, heads] -> the gated-normed
        SSD output [N, heads * head_dim] (before the output projection), states updated."""
        ctx = get_context()
        N = xbc.shape[0]
        H, P = self.heads, self.head_dim
        conv_state, ssm_state = self.states["conv"], self.states["ssm"]
        w, cb = self.conv1d.weight, self.conv1d.bias
        A = -torch.exp(self.A_log.float())
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype))
        slots = decode_slots(ctx)
        if slots is not None:                                   # decode: one token each, batched, graph-safe
            h, new_conv = causal_conv1d_step(xbc, w, cb, gather_states(conv_state, slots))
            scatter_states(conv_state, slots, new_conv)
            x, B, C = self._split(h)
            y, st = ssd_step(x, dt, A, B, C, self.D, gather_states(ssm_state, slots))
            scatter_states(ssm_state, slots, st)
        else:
            y = torch.empty(N, H, P, dtype=torch.float32, device=xbc.device)
            lo, hi = self.time_step_limit
            dtc = torch.clamp(dt, min=lo, max=hi)
            for s, e, slot, cont in step_sequences(ctx):
                cs = slot_state(conv_state, slot, cont)
                h, new_conv = causal_conv1d(xbc[s:e], w, cb, cs)
                conv_state[slot] = new_conv.to(conv_state.dtype)
                x, B, C = self._split(h)
                st = slot_state(ssm_state, slot, cont)
                y[s:e], ssm_state[slot] = ssd_chunk_scan(x, dtc[s:e], A, B, C, self.D, st, self.chunk_size)
        y = y.reshape(N, H * P)
        if self.norm is None:               # no norm: the gate alone (transformers: y * silu(z) in y's dtype)
            return (y * F.silu(z.to(y.dtype))).to(z.dtype)
        return self.norm(y, z).to(z.dtype)

    def _split(self, h: torch.Tensor):
        H, P, G, S = self.heads, self.head_dim, self.groups, self.state_size
        x, B, C = h.split([H * P, G * S, G * S], dim=-1)
        B = B.reshape(-1, G, S).repeat_interleave(H // G, dim=1)
        C = C.reshape(-1, G, S).repeat_interleave(H // G, dim=1)
        return x.reshape(-1, H, P), B, C

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, groups={self.groups} (per rank), head_dim={self.head_dim}, state_size="
                f"{self.state_size}, conv_kernel={self.conv_kernel}, chunk_size={self.chunk_size}")


# ------------------------------------------------------------------------------------------------- mamba (1)
def selective_scan(x, dt, A, B, C, D, state):
    """One sequence, Mamba-1's selective scan in its sequential form (transformers' mamba_selective_scan, recurrent
    iteration): x [T, I] (the conv output), dt [T, I] (after dt_proj, its bias and softplus, float32), A [I, N]
    (negative, float32), B, C [T, N] (or [T, H, N]: a B and C per head of I / H consecutive channels, Zamba's
    multi-head Mamba), D [I], state [I, N] (float32). Returns (y [T, I] float32 = S_t C_t + D x_t, new state);
    S_t = exp(dt_t A) S_{t-1} + dt_t B_t x_t."""
    T, I = x.shape
    N = A.shape[-1]
    H = B.shape[1] if B.dim() == 3 else 0
    dA = torch.exp(A[None] * dt[:, :, None])                                        # [T, I, N]
    Bc = B.float().repeat_interleave(I // H, dim=1) if H else B.float()[:, None, :]  # [T, I or 1, N]
    dBx = dt[:, :, None] * Bc * x.float()[:, :, None]                               # [T, I, N]
    S = state.float()
    ys = []
    for t in range(T):
        S = dA[t] * S + dBx[t]
        if H:                                                                        # a matmul per head
            ys.append(torch.matmul(S.view(H, I // H, N).to(x.dtype), C[t].unsqueeze(-1)).reshape(I))
        else:
            ys.append(torch.matmul(S.to(x.dtype), C[t].unsqueeze(-1))[:, 0])       # a matmul in x's dtype
    y = torch.stack(ys).float() if T else x.new_zeros(0, x.shape[1], dtype=torch.float32)
    return y + x * D.float()[None], S


def selective_state_step(x, dt, A, B, C, D, state):
    """A decode step of B sequences (transformers' mamba_selective_state_update): x [B, I], dt [B, I] (after bias and
    softplus), A [I, N], B, C [B, N] (or [B, H, N], per head), D [I], state [B, I, N]. Returns (y [B, I] = S C + D x,
    new state float32)."""
    Bt, I = x.shape
    N = A.shape[-1]
    H = B.shape[1] if B.dim() == 3 else 0
    dA = torch.exp(dt.float()[..., None] * A[None])
    Bc = B.float().repeat_interleave(I // H, dim=1) if H else B.float()[:, None, :]
    dBx = dt.float()[..., None] * Bc * x.float()[..., None]
    S = state.float() * dA + dBx
    if H:
        y = torch.matmul(S.view(Bt, H, I // H, N).to(C.dtype), C.unsqueeze(-1)).reshape(Bt, I)
    else:
        y = torch.matmul(S.to(C.dtype), C.unsqueeze(-1))[..., 0]
    return y + x * D.to(x.dtype)[None], S


class HeadwiseLinear(nn.Module):
    """A block-diagonal linear, one [out, in] matrix per head (Zamba's per-head `x_proj_weight [heads, out, in]`,
    `dt_proj_weight` / `dt_proj_bias [heads, out]`): x [N, heads, in] -> [N, heads, out]. Split over TP ranks by
    heads (`head_seg`: this rank's heads)."""

    def __init__(self, head_seg, in_features: int, out_features: int, bias: bool, tp: int, rank: int):
        super().__init__()
        H = head_seg.rows

        def param(shape):
            return attach(nn.Parameter(torch.empty(shape)),
                          ParamSplit("column", 0, (head_seg,), tuple(shape), tp, rank, "Mamba"))
        self.weight = param((H, out_features, in_features))
        self.bias = param((H, out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.einsum("nhi,hoi->nho", x, self.weight.to(x.dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        H, o, i = self.weight.shape
        return f"heads={H} (per rank), in={i}, out={o}, bias={self.bias is not None}"


class Mamba(RecurrentMixer):
    """The state and math of a Mamba-1 mixer (the `mamba` block kind; the generated block subclasses it and adds its
    input / output projections): `conv1d` (depthwise causal conv over the `intermediate` channels of x, then the
    activation), `x_proj` (intermediate -> time_step_rank + 2 state_size: dt | B | C, no bias), optional RMSNorms of
    dt, B, C (`dt_layernorm`, `b_layernorm`, `c_layernorm`; `inner_norm`: None, "weightless" (FalconMamba) or "weight"
    (Jamba), eps `inner_eps`), `dt_proj` (time_step_rank -> intermediate, with bias) and softplus, the selective scan
    with A = -exp(A_log) [intermediate, state_size] and the D skip, y * act(z). TP splits the channels (intermediate):
    in_proj's x and z, the conv, dt_proj's output, A_log, D and the output projection's input; x_proj's input is a
    rank's channels, so its output (dt | B | C, replicated) is summed over the ranks (one all-reduce, a row-parallel
    linear).

    States per sequence: `conv` [intermediate, kernel - 1] and `ssm` [intermediate, state_size] (float32)."""

    def __init__(self, intermediate: int, state_size: int, time_step_rank: int, conv_kernel: int,
                 conv_bias: bool = True, activation: str = "silu", inner_norm: Optional[str] = None,
                 inner_eps: float = 1e-6, fields: Optional[dict] = None, heads: Optional[int] = None,
                 head_dim: Optional[int] = None):
        # fields: the config fields of the sizes ({"intermediate": "intermediate_size"}), named in refusals
        # heads: Zamba's multi-head Mamba: the channels in `heads` heads of intermediate / heads, each with its own
        # x_proj / dt_proj (HeadwiseLinear) and its own B and C in the scan; A_log [heads, head_dim, state_size],
        # D and dt_proj's bias [heads, head_dim]; TP splits the heads (no all-reduce of x_proj)
        super().__init__()
        from xllm_gen.runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
        from xllm_gen.runtime.layers.norm import RMSNorm
        named = _fields_named(fields)
        if activation not in ("silu", "swish"):
            raise ValueError(f"mamba: the activation must be silu, got {activation!r}")
        if inner_norm not in (None, "weightless", "weight"):
            raise ValueError(f"mamba: inner_norm must be None, 'weightless' or 'weight', got {inner_norm!r}")
        if heads is not None and (heads < 1 or heads * (head_dim or 0) != intermediate):
            raise ValueError(f"mamba: {intermediate} channels{named('intermediate')} are not {heads} heads"
                             f"{named('heads')} of {head_dim}")
        tp, rank = get_tp_size(), get_tp_rank()
        units = heads if heads is not None else intermediate
        what = f"{heads} heads{named('heads')}" if heads is not None else f"{intermediate} channels{named('intermediate')}"
        problems = [f"mamba: {what} cannot be split over tensor parallel size {tp}"] if units % tp else []
        raise_or_defer(self, problems)
        self.intermediate = max(1, intermediate // tp)                 # per rank
        self.state_size, self.time_step_rank, self.conv_kernel = state_size, time_step_rank, conv_kernel
        self.heads = None if heads is None else max(1, heads // tp)     # per rank
        if heads is None:
            self.conv1d = CausalConv1d((("x", intermediate, 1),), conv_kernel, conv_bias)
            self.x_proj = RowParallelLinear(intermediate, time_step_rank + 2 * state_size, bias=False)
            self.dt_proj = ColumnParallelLinear(time_step_rank, intermediate, bias=True)
            seg = split_segment(Segment("channels", intermediate), tp, rank, [])
            a_shape, d_shape = (self.intermediate, state_size), (self.intermediate,)
        else:
            hd = intermediate // heads
            self.intermediate = self.heads * hd
            self.conv1d = CausalConv1d((("x", heads, hd),), conv_kernel, conv_bias)
            seg = split_segment(Segment("heads", heads), tp, rank, [])
            self.x_proj = HeadwiseLinear(seg, hd, time_step_rank + 2 * state_size, False, tp, rank)
            self.dt_proj = HeadwiseLinear(seg, time_step_rank, hd, True, tp, rank)
            a_shape, d_shape = (self.heads, hd, state_size), (self.heads, hd)
        self.A_log = attach(nn.Parameter(torch.empty(a_shape)),
                            ParamSplit("column", 0, (seg,), a_shape, tp, rank, "Mamba"))
        self.D = attach(nn.Parameter(torch.empty(d_shape)), ParamSplit("column", 0, (seg,), d_shape, tp, rank, "Mamba"))
        self.inner_norm = inner_norm
        if inner_norm is not None:     # RMSNorms of dt, B, C over their own widths (replicated weights, or none)
            w = inner_norm == "weight"
            self.dt_layernorm = RMSNorm(time_step_rank, inner_eps, weight=w)
            self.b_layernorm = RMSNorm(state_size, inner_eps, weight=w)
            self.c_layernorm = RMSNorm(state_size, inner_eps, weight=w)
        self.state_spec = {"conv": ((self.intermediate, conv_kernel - 1), None),
                           "ssm": ((self.intermediate, state_size), torch.float32)}

    def mix(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z [N, intermediate] (in_proj's halves, this rank's channels) -> the gated scan output [N, intermediate]
        (before the output projection), states updated."""
        ctx = get_context()
        N = x.shape[0]
        conv_state, ssm_state = self.states["conv"], self.states["ssm"]
        w, cb = self.conv1d.weight, self.conv1d.bias
        A = -torch.exp(self.A_log.float()).reshape(self.intermediate, self.state_size)
        D = self.D.reshape(self.intermediate)
        slots = decode_slots(ctx)
        decode = slots is not None
        if decode:                                     # one token each, batched, graph-safe (slots: a device tensor)
            h, new_conv = causal_conv1d_step(x, w, cb, gather_states(conv_state, slots))
            scatter_states(conv_state, slots, new_conv)
        else:
            seqs = step_sequences(ctx)
            h = torch.empty_like(x)
            for s, e, slot, cont in seqs:
                cs = slot_state(conv_state, slot, cont)
                h[s:e], new_conv = causal_conv1d(x[s:e], w, cb, cs)
                conv_state[slot] = new_conv.to(conv_state.dtype)
        if self.heads is None:
            dt, B, C = self.x_proj(h).split([self.time_step_rank, self.state_size, self.state_size], dim=-1)
        else:                                          # per head: dt, B, C [N, heads, ...]
            dt, B, C = self.x_proj(h.view(N, self.heads, -1)).split(
                [self.time_step_rank, self.state_size, self.state_size], dim=-1)
        if self.inner_norm is not None:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        # dt_proj's product, then its bias and softplus (transformers adds the bias inside the scan: in float32 over
        # a prompt, in the model dtype at a decode step)
        if self.heads is None:
            dt, dt_bias = F.linear(dt, self.dt_proj.weight), self.dt_proj.bias
        else:
            dt = torch.einsum("nhr,hdr->nhd", dt, self.dt_proj.weight.to(dt.dtype)).reshape(N, self.intermediate)
            dt_bias = self.dt_proj.bias.reshape(self.intermediate)
        if decode:
            dt = F.softplus(dt + dt_bias.to(dt.dtype))
            y, st = selective_state_step(h, dt, A, B, C, D, gather_states(ssm_state, slots))
            scatter_states(ssm_state, slots, st)
        else:
            dt = F.softplus(dt.float() + dt_bias.float())
            y = torch.empty(N, self.intermediate, dtype=torch.float32, device=x.device)
            for s, e, slot, cont in seqs:
                st = slot_state(ssm_state, slot, cont)
                y[s:e], ssm_state[slot] = selective_scan(h[s:e], dt[s:e], A, B[s:e], C[s:e], D, st)
        return (y * F.silu(z)).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"intermediate={self.intermediate} (per rank), heads={self.heads}, state_size={self.state_size}, time_step_rank="
                f"{self.time_step_rank}, conv_kernel={self.conv_kernel}, inner_norm={self.inner_norm}")


# ----------------------------------------------------------------------------------------------- short conv
class ShortConv(RecurrentMixer):
    """The state and math of a gated short-convolution mixer (the `short_conv` block kind; the generated block subclasses it and
    adds its projections): `y = C * conv(B * x)` with a depthwise causal conv1d over `channels` channels (no
    activation), parameter `conv.weight [channels, 1, kernel]`. Channels split over TP ranks.

    State per sequence: `conv` [channels, kernel - 1]."""

    def __init__(self, channels: int, conv_kernel: int, bias: bool = False):
        super().__init__()
        self.conv = CausalConv1d((("x", channels, 1),), conv_kernel, bias)
        self.channels, self.conv_kernel = self.conv.channels, conv_kernel
        self.state_spec = {"conv": ((self.conv.channels, conv_kernel - 1), None)}

    def mix(self, b: torch.Tensor, c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """b, c, x [N, channels] -> c * conv(b * x) [N, channels], the conv state updated."""
        ctx = get_context()
        conv_state = self.states["conv"]
        w, cb = self.conv.weight, self.conv.bias
        bx = b * x
        slots = decode_slots(ctx)
        if slots is not None:                                   # decode: one token each, batched, graph-safe
            h, new = causal_conv1d_step(bx, w, cb, gather_states(conv_state, slots), activation=None)
            scatter_states(conv_state, slots, new)
        else:
            h = torch.empty_like(bx)
            for s, e, slot, cont in step_sequences(ctx):
                cs = slot_state(conv_state, slot, cont)
                h[s:e], new = causal_conv1d(bx[s:e], w, cb, cs, activation=None)
                conv_state[slot] = new.to(conv_state.dtype)
        return c * h

    def extra_repr(self) -> str:
        return f"channels={self.channels} (per rank), conv_kernel={self.conv_kernel}"


# ---------------------------------------------------------------------------------------------- RG-LRU
def rg_lru_scan(x: torch.Tensor, a: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, the linear recurrence h_t = a_t h_{t-1} + x_t in float32 (transformers' _rnn_scan, linear mode,
    step by step): x, a [T, C] (x already gated and normalized, a already zero at a reset), state [C] (float32).
    Returns (h [T, C] in x's dtype, the last h float32). The reference of `rg_lru_scan_chunked`."""
    h = state.float()
    out = torch.empty_like(x)
    af, xf = a.float(), x.float()
    for t in range(x.shape[0]):
        h = af[t] * h + xf[t]
        out[t] = h.to(x.dtype)
    return out, h


def rg_lru_scan_chunked(x: torch.Tensor, log_a: torch.Tensor, state: torch.Tensor,
                        chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence over chunks of `chunk` tokens (a few batched ops per chunk instead of a step per token):
    within a chunk, h_t = sum_{s <= t} exp(sum_{s < r <= t} log a_r) x_s + exp(sum_{r <= t} log a_r) h_0. The
    segment sums are summed as such (masked cumulative sums, as Mamba-2's SSD segsum), not as differences of running
    sums, which would lose the small ones to cancellation when the decays are strong. x, log_a [T, C] (log a finite:
    a reset may only be the first token of a zero state, where a multiplies nothing), state [C] float32. Returns
    (h [T, C] in x's dtype, the last h float32)."""
    T = x.shape[0]
    h = state.float()
    out = torch.empty_like(x)
    for s0 in range(0, T, chunk):
        xs, la = x[s0:s0 + chunk].float(), log_a[s0:s0 + chunk].float()
        n = xs.shape[0]
        ones = torch.ones(n, n, dtype=torch.bool, device=x.device)
        # seg[t, s] = sum_{s < r <= t} log a_r: la_r kept where r > s, summed over r <= t
        seg = la[:, None, :].expand(n, n, -1).masked_fill(~ones.tril(-1)[:, :, None], 0.0).cumsum(0)
        decay = seg.masked_fill(~ones.tril()[:, :, None], float("-inf")).exp()          # [t, s, C]
        hs = (decay * xs[None, :, :]).sum(1) + la.cumsum(0).exp() * h[None, :]
        out[s0:s0 + n] = hs.to(x.dtype)
        h = hs[-1]
    return out, h


class RGLRUGates(nn.Module):
    """The RG-LRU's parameters (module `rg_lru`, Griffin's RG-LRU): `recurrent_param [width]` (the
    learned log-decay, a = exp(-c softplus(recurrent_param) r)), and the input and recurrence gates, block-diagonal
    linears with one [block_width, block_width] block per head, stored [in, out] (`x @ W[h] + b[h]`):
    `input_gate_weight`, `recurrent_gate_weight [heads, block_width, block_width]`, `input_gate_bias`,
    `recurrent_gate_bias [heads, block_width]`. Split over TP ranks by heads."""

    def __init__(self, heads: int, block_width: int):
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        per = max(1, heads // tp)
        hseg = split_segment(Segment("heads", heads), tp, rank, [])
        cseg = split_segment(Segment("heads", heads, block_width), tp, rank, [])

        def param(shape, seg):
            p = nn.Parameter(torch.empty(shape))
            return attach(p, ParamSplit("column", 0, (seg,), tuple(shape), tp, rank, "RGLRU"))
        self.recurrent_param = param((per * block_width,), cseg)
        self.input_gate_weight = param((per, block_width, block_width), hseg)
        self.input_gate_bias = param((per, block_width), hseg)
        self.recurrent_gate_weight = param((per, block_width, block_width), hseg)
        self.recurrent_gate_bias = param((per, block_width), hseg)

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, heads * block_width] -> (input gate, recurrence gate) [N, heads * block_width], sigmoids of the
        block-diagonal linears (in x's dtype, as transformers' baddbmm)."""
        N = x.shape[0]
        H, bw = self.input_gate_bias.shape
        xr = x.reshape(N, H, bw).transpose(0, 1)                                    # [H, N, bw]
        gi = torch.baddbmm(self.input_gate_bias[:, None, :].to(x.dtype), xr, self.input_gate_weight.to(x.dtype))
        ga = torch.baddbmm(self.recurrent_gate_bias[:, None, :].to(x.dtype), xr, self.recurrent_gate_weight.to(x.dtype))
        return (torch.sigmoid(gi.transpose(0, 1).reshape(N, H * bw)),
                torch.sigmoid(ga.transpose(0, 1).reshape(N, H * bw)))

    def extra_repr(self) -> str:
        H, bw = self.input_gate_bias.shape
        return f"heads={H} (per rank), block_width={bw}"


class RGLRU(RecurrentMixer):
    """The state and math of a Griffin recurrent block (the `rg_lru` block kind; the generated block subclasses it and
    adds its input projections x and y and its output projection): the x branch goes through a depthwise causal
    conv1d (`conv_1d`, kernel `conv_kernel`, optional bias, no activation) and the RG-LRU (`rg_lru`, RGLRUGates):
    with the gates i = sigmoid(x W_i + b_i), r = sigmoid(x W_r + b_r) per head block, log a = -c r softplus(recurrent_param)
    (c = `decay_scale`, Griffin's 8), the state evolves h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t); at a sequence's
    position 0 the state is reset (a_t = 0) and the input not normalized (transformers' `reset`). The output is h times
    the y branch (the generated block's activation of its y projection). Heads split over TP ranks (each rank its
    heads' channels of x, y, the conv, the gates and the output projection's input).

    States per sequence: `conv` [width, kernel - 1] (model dtype) and `lru` [width] (float32)."""

    def __init__(self, width: int, heads: int, conv_kernel: int, conv_bias: bool = True, decay_scale: float = 8.0,
                 fields: Optional[dict] = None):
        # fields: the config fields of the sizes ({"heads": "num_attention_heads", "width": "lru_width"}), for refusals
        super().__init__()
        named = _fields_named(fields)
        if width % heads:
            raise ValueError(f"rg_lru: width {width}{named('width')} must be a multiple of heads "
                             f"{heads}{named('heads')} (the gates' diagonal blocks)")
        tp = get_tp_size()
        problems = [f"rg_lru: {heads} heads{named('heads')} (the gates' diagonal blocks, with their channels) cannot "
                    f"be split over tensor parallel size {tp}"] if heads % tp else []
        raise_or_defer(self, problems)
        self.block_width = width // heads
        self.heads = max(1, heads // tp)                 # per rank
        self.width = self.heads * self.block_width       # per rank
        self.conv_kernel = conv_kernel
        self.decay_scale = float(decay_scale)
        self.normalize_input = True      # sqrt(1 - a^2) on the input (tests switch it off: a sensitivity arm)
        self.conv_1d = CausalConv1d((("x", heads, self.block_width),), conv_kernel, conv_bias)
        self.rg_lru = RGLRUGates(heads, self.block_width)
        self.state_spec = {"conv": ((self.width, conv_kernel - 1), None), "lru": ((self.width,), torch.float32)}

    def mix(self, positions: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """positions [N], x [N, width] (the x projection, this rank's channels), y [N, width] (the activated y branch)
        -> RG-LRU(conv(x)) * y [N, width] (before the output projection), states updated."""
        ctx = get_context()
        conv_state, lru_state = self.states["conv"], self.states["lru"]
        w, cb = self.conv_1d.weight, self.conv_1d.bias
        slots = decode_slots(ctx)
        if slots is not None:                          # one token each, batched, graph-safe (slots: a device tensor)
            h, new_conv = causal_conv1d_step(x, w, cb, gather_states(conv_state, slots), activation=None)
            scatter_states(conv_state, slots, new_conv)
        else:
            seqs = step_sequences(ctx)
            h = torch.empty_like(x)
            for s, e, slot, cont in seqs:
                cs = slot_state(conv_state, slot, cont)
                h[s:e], new_conv = causal_conv1d(x[s:e], w, cb, cs, activation=None)
                conv_state[slot] = new_conv.to(conv_state.dtype)
        log_a, reset, xn = self._decay_and_input(positions, h)
        if slots is not None:
            a = torch.exp(log_a) * ~reset
            st = a.float() * gather_states(lru_state, slots) + xn.float()
            scatter_states(lru_state, slots, st)
            out = st.to(x.dtype)
        else:
            # a prompt chunk: the reset (position 0) can only be the first token of a sequence that starts here, whose
            # state is zero, so the chunked scan runs on the unreset decays (a_0 multiplies a zero state)
            out = torch.empty_like(h)
            for s, e, slot, cont in seqs:
                out[s:e], lru_state[slot] = rg_lru_scan_chunked(xn[s:e], log_a[s:e], slot_state(lru_state, slot, cont))
        return out * y

    def _decay_and_input(self, positions: torch.Tensor, h: torch.Tensor):
        """(log a_t, reset [N, 1], the normalized, gated input), as Griffin's RG-LRU computes them (in the model
        dtype): the reset is position 0, a device comparison (no host value); there the input is not normalized and
        a_t is zero (applied by the caller)."""
        gate_x, gate_a = self.rg_lru.gates(h)
        log_a = -self.decay_scale * gate_a * F.softplus(self.rg_lru.recurrent_param.to(h.dtype))
        xn = h * gate_x
        reset = (positions.reshape(-1) == 0)[:, None]
        if self.normalize_input:
            mult = torch.sqrt(1 - torch.exp(2 * log_a))
            xn = xn * torch.where(reset, torch.ones_like(mult), mult).to(h.dtype)
        return log_a, reset, xn

    def extra_repr(self) -> str:
        return (f"width={self.width}, heads={self.heads} (per rank), block_width={self.block_width}, conv_kernel="
                f"{self.conv_kernel}, decay_scale={self.decay_scale}")
