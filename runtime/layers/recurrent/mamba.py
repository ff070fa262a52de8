"""Mamba (1)'s selective-scan mixer: `selective_scan` (a prompt chunk, sequential scan), `selective_state_step` (a
decode step), `HeadwiseLinear` (Zamba's per-head projections) and the `Mamba` mixer.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.executor.context import get_context
from xllm_gen.runtime.executor.distributed import get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, Segment, attach, raise_or_defer, split_segment

# the state helpers and kernels through the package (R.<name>): a test patching recurrent.<name> reaches every mixer
from xllm_gen.runtime.layers import recurrent as R
from xllm_gen.runtime.layers.recurrent.conv import CausalConv1d
from xllm_gen.runtime.layers.recurrent.state import RecurrentMixer, _fields_named


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
    with A = -exp(A_log) [intermediate, state_size] and the D skip, y * silu(z) (SiLU whatever `activation` says). TP splits the channels (intermediate):
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
        slots = R.decode_slots(ctx)
        decode = slots is not None
        if decode:                                     # one token each, batched, graph-safe (slots: a device tensor)
            h, new_conv = R.causal_conv1d_step(x, w, cb, R.gather_states(conv_state, slots))
            R.scatter_states(conv_state, slots, new_conv)
        else:
            seqs = R.step_sequences(ctx)
            h = torch.empty_like(x)
            for s, e, slot, cont in seqs:
                cs = R.slot_state(conv_state, slot, cont)
                h[s:e], new_conv = R.causal_conv1d(x[s:e], w, cb, cs)
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
            y, st = R.selective_state_step(h, dt, A, B, C, D, R.gather_states(ssm_state, slots))
            R.scatter_states(ssm_state, slots, st)
        else:
            dt = F.softplus(dt.float() + dt_bias.float())
            y = torch.empty(N, self.intermediate, dtype=torch.float32, device=x.device)
            for s, e, slot, cont in seqs:
                st = R.slot_state(ssm_state, slot, cont)
                y[s:e], ssm_state[slot] = R.selective_scan(h[s:e], dt[s:e], A, B[s:e], C[s:e], D, st)
        return (y * F.silu(z)).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"intermediate={self.intermediate} (per rank), heads={self.heads}, state_size={self.state_size}, time_step_rank="
                f"{self.time_step_rank}, conv_kernel={self.conv_kernel}, inner_norm={self.inner_norm}")
