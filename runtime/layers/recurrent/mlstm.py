"""The mLSTM mixer (`MLSTM`): a matrix-memory LSTM cell per head over a per-sequence state, with exponential input
gates and sigmoid forget gates stabilized by a running maximum, and a per-head LayerNorm of its output.

Per head, with i, f the (soft-capped) gate pre-activations, the state (C [Dk, Dv], n [Dk], m) evolves as

    m' = max(logsigmoid(f) + m, i);  a = exp(logsigmoid(f) + m - m');  b = exp(i - m')
    C' = a C + b k v^T;  n' = a n + b k;  h = (q' C') / (max(|q' n'|, exp(-m')) + eps),  q' = q Dk ** -0.5

(a fresh state: zeros). `mlstm_step` is one token of a batch (a decode step, graph-safe), `mlstm_scan` a prompt chunk of
one sequence token by token: the reference's recurrent form, the same float32 operations.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.executor.context import get_context
from xllm_gen.runtime.executor.distributed import get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, Segment, attach, raise_or_defer, split_segment

# the state helpers through the package (R.<name>): a test patching recurrent.<name> reaches every mixer
from xllm_gen.runtime.layers import recurrent as R
from xllm_gen.runtime.layers.recurrent.state import RecurrentMixer, _fields_named


def mlstm_step(q, k, v, i, f, C, n, m, eps: float):
    """One token: q, k [B, H, Dk], v [B, H, Dv], i, f [B, H, 1] (gate pre-activations), the state C [B, H, Dk, Dv],
    n [B, H, Dk], m [B, H, 1] float32 -> (h [B, H, Dv] in q's dtype, C', n', m')."""
    dtype = q.dtype
    dk = q.shape[-1]
    f_log = F.logsigmoid(f)
    m_new = torch.max(f_log + m, i)
    a = torch.exp(f_log + m - m_new)
    b = torch.exp(i - m_new)
    q_scaled = q * (dk ** (-0.5))
    C_new = a[:, :, :, None] * C + b[:, :, :, None] * (k[:, :, :, None] @ v[:, :, None, :])
    n_new = a * n + b * k
    h_num = (q_scaled[:, :, None, :] @ C_new.to(dtype)).squeeze(2).to(torch.float32)
    qn = (q_scaled[:, :, None, :] @ n_new[:, :, :, None].to(dtype)).squeeze(2)
    h_den = (torch.maximum(qn.abs(), torch.exp(-m_new)) + eps).to(torch.float32)
    return (h_num / h_den).to(dtype), C_new.float(), n_new.float(), m_new.float()


def mlstm_scan(q, k, v, i, f, state, eps: float):
    """A prompt chunk of one sequence, token by token: q, k [T, H, Dk], v [T, H, Dv], i, f [T, H], state (C, n, m)
    [H, ...] float32 -> (h [T, H, Dv], (C, n, m) after the last token)."""
    C, n, m = (s[None] for s in state)
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        h, C, n, m = mlstm_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], i[t:t + 1, :, None], f[t:t + 1, :, None],
                                C, n, m, eps)
        out[t] = h[0]
    return out, (C[0], n[0], m[0])


class MultiHeadLayerNorm(nn.Module):
    """A LayerNorm over each head's channels (statistics in float32, cast back), then the weight (and bias) over all
    heads' channels [heads * head_dim], split over TP ranks by heads."""

    def __init__(self, heads_seg, head_dim: int, eps: float, bias: bool, tp: int, rank: int):
        super().__init__()
        self.head_dim, self.eps = head_dim, eps
        width = heads_seg.rows

        def param():
            return attach(nn.Parameter(torch.empty(width)), ParamSplit("column", 0, (heads_seg,), (width,), tp, rank,
                                                                      "MLSTM"))
        self.weight = param()
        self.bias = param() if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, heads, head_dim] -> [N, heads * head_dim]."""
        xf = x.float()
        y = (xf - xf.mean(dim=-1, keepdim=True)) * torch.rsqrt(xf.var(dim=-1, keepdim=True, unbiased=False) + self.eps)
        y = y.to(x.dtype).reshape(x.shape[0], -1) * self.weight
        return y + self.bias if self.bias is not None else y


class MLSTM(RecurrentMixer):
    """The state and math of an mLSTM mixer (the `mlstm` block kind; the generated block adds its q / k / v / gate
    projections and its output projection): the recurrence above per head from the sequence's slot, then the per-head
    LayerNorm (`multihead_norm`). Heads split over TP ranks.

    State per sequence: `C` [heads, Dk, Dv], `n` [heads, Dk], `m` [heads, 1] (float32, this rank's heads)."""

    def __init__(self, heads: int, qk_dim: int, v_dim: int, eps: float, norm_eps: float, norm_bias: bool = False,
                 gate_soft_cap: Optional[float] = None, fields: Optional[dict] = None):
        super().__init__()
        named = _fields_named(fields)
        tp, rank = get_tp_size(), get_tp_rank()
        problems = []
        for what, size in (("qk_dim", qk_dim), ("v_dim", v_dim)):
            if size % heads:
                raise ValueError(f"mlstm: {what} {size}{named(what)} must be a multiple of heads {heads}"
                                 f"{named('heads')}")
        if heads % tp:
            problems.append(f"mlstm: {heads} heads{named('heads')} cannot be split over tensor parallel size {tp}")
        raise_or_defer(self, problems)
        self.heads = max(1, heads // tp)                  # per rank
        self.dk, self.dv = qk_dim // heads, v_dim // heads
        self.eps = float(eps)
        self.gate_soft_cap = gate_soft_cap
        self.multihead_norm = MultiHeadLayerNorm(split_segment(Segment("heads", heads, self.dv), tp, rank, []),
                                                 self.dv, norm_eps, norm_bias, tp, rank)
        f32 = torch.float32
        self.state_spec = {"C": ((self.heads, self.dk, self.dv), f32), "n": ((self.heads, self.dk), f32),
                           "m": ((self.heads, 1), f32)}

    def cap(self, x: torch.Tensor) -> torch.Tensor:
        """A gate pre-activation's soft cap, cap * tanh(x / cap) (none without a cap)."""
        c = self.gate_soft_cap
        return x if c is None else c * torch.tanh(x / c)

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """q, k [N, heads * Dk], v [N, heads * Dv], i, f [N, heads] (capped pre-activations; this rank's heads) ->
        the per-head normed output [N, heads * Dv], each sequence from its state slot."""
        ctx = get_context()
        N, H = q.shape[0], self.heads
        q, k, v = q.reshape(N, H, self.dk), k.reshape(N, H, self.dk), v.reshape(N, H, self.dv)
        Cp, npool, mp = self.states["C"], self.states["n"], self.states["m"]
        slots = R.decode_slots(ctx)
        if slots is not None:                       # one token each, batched, graph-safe
            h, C2, n2, m2 = mlstm_step(q, k, v, i[:, :, None], f[:, :, None], R.gather_states(Cp, slots),
                                       R.gather_states(npool, slots), R.gather_states(mp, slots), self.eps)
            for pool, new in ((Cp, C2), (npool, n2), (mp, m2)):
                R.scatter_states(pool, slots, new)
        else:
            h = torch.empty_like(v)
            for s, e, slot, cont in R.step_sequences(ctx):
                state = tuple(R.slot_state(p, slot, cont) for p in (Cp, npool, mp))
                h[s:e], (Cp[slot], npool[slot], mp[slot]) = R.mlstm_scan(q[s:e], k[s:e], v[s:e], i[s:e], f[s:e],
                                                                         state, self.eps)
        return self.multihead_norm(h)

    def extra_repr(self) -> str:
        return (f"heads={self.heads} (per rank), qk_head_dim={self.dk}, v_head_dim={self.dv}, eps={self.eps}, "
                f"gate_soft_cap={self.gate_soft_cap}")
