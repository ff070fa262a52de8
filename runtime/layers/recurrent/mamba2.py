"""Mamba-2's SSD mixer: `ssd_chunk_scan` (a prompt chunk, chunked state-space duality) and `ssd_step` (a decode
step), `GroupedGatedRMSNorm` (the gated norm per group) and the `Mamba2` mixer.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.executor.context import get_context
from xllm_gen.runtime.executor.distributed import all_reduce, get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, Segment, attach, raise_or_defer, split_segment

# the state helpers and kernels through the package (R.<name>): a test patching recurrent.<name> reaches every mixer
from xllm_gen.runtime.layers import recurrent as R
from xllm_gen.runtime.layers.recurrent.conv import CausalConv1d
from xllm_gen.runtime.layers.recurrent.state import RecurrentMixer, _fields_named


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
        lo, hi = time_step_limit            # a max of None (an expression's 'no bound') is no clamp from above
        self.time_step_limit = (float(lo), float("inf") if hi is None else float(hi))
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
        slots = R.decode_slots(ctx)
        if slots is not None:                                   # decode: one token each, batched, graph-safe
            h, new_conv = R.causal_conv1d_step(xbc, w, cb, R.gather_states(conv_state, slots))
            R.scatter_states(conv_state, slots, new_conv)
            x, B, C = self._split(h)
            y, st = R.ssd_step(x, dt, A, B, C, self.D, R.gather_states(ssm_state, slots))
            R.scatter_states(ssm_state, slots, st)
        else:
            y = torch.empty(N, H, P, dtype=torch.float32, device=xbc.device)
            lo, hi = self.time_step_limit
            dtc = torch.clamp(dt, min=lo, max=hi)
            for s, e, slot, cont in R.step_sequences(ctx):
                cs = R.slot_state(conv_state, slot, cont)
                h, new_conv = R.causal_conv1d(xbc[s:e], w, cb, cs)
                conv_state[slot] = new_conv.to(conv_state.dtype)
                x, B, C = self._split(h)
                st = R.slot_state(ssm_state, slot, cont)
                y[s:e], ssm_state[slot] = R.ssd_chunk_scan(x, dtc[s:e], A, B, C, self.D, st, self.chunk_size)
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
