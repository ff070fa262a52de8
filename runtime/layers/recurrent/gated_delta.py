"""The gated delta rule (Gated DeltaNet / Kimi Delta Attention): `gated_delta_rule_chunked` (a prompt chunk, the
UT-transform form) and `gated_delta_rule_step` (a decode step), the decay per value head or per key channel;
`GatedRMSNorm` (the output's gated norm) and the `GatedDeltaNet` mixer.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.executor.context import get_context
from xllm_gen.runtime.executor.distributed import get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, Segment, attach, raise_or_defer, replicated, split_segment

# the state helpers and kernels through the package (R.<name>): a test patching recurrent.<name> reaches every mixer
from xllm_gen.runtime.layers import recurrent as R
from xllm_gen.runtime.layers.recurrent.conv import CausalConv1d
from xllm_gen.runtime.layers.recurrent.state import RecurrentMixer, _fields_named


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
                 decay: str = "head", gate_activation: str = "silu", beta_scale: float = 1.0):
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
        if self.decay == "channel":             # g [N, Hv, Dk]: -exp(A_log[h]) * softplus(a + dt_bias) per channel
            sp = F.softplus(a.float() + self.dt_bias.float()).view(N, Hv, self.key_head_dim)
            g = -self.A_log.float().exp()[:, None] * sp
        else:
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        slots = R.decode_slots(ctx)
        if slots is not None:                                   # decode: one token each, batched, graph-safe
            x, new_conv = R.causal_conv1d_step(qkv, w, cb, R.gather_states(conv_state, slots))
            R.scatter_states(conv_state, slots, new_conv)
            q, k, v = self._split(x)
            out, S = R.gated_delta_rule_step(q, k, v, g, beta, R.gather_states(rec_state, slots))
            R.scatter_states(rec_state, slots, S)
        else:
            out = torch.empty(N, Hv, Dv, dtype=torch.float32, device=qkv.device)
            for s, e, slot, cont in R.step_sequences(ctx):
                cs = R.slot_state(conv_state, slot, cont)
                x, new_conv = R.causal_conv1d(qkv[s:e], w, cb, cs)
                conv_state[slot] = new_conv.to(conv_state.dtype)
                q, k, v = self._split(x)
                rs = R.slot_state(rec_state, slot, cont)
                o, S = R.gated_delta_rule_chunked(q, k, v, g[s:e], beta[s:e], rs)
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
