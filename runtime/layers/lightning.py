"""Lightning attention (MiniMax-Text-01 / M1's `linear_attention` layers): a recurrent linear attention with a fixed
decay per head and layer, over a per-sequence state in the state pool (runtime/layers/recurrent/state.py RecurrentMixer).

Per token, with q, k, v = act(qkv_proj(x)) (each head's rows stored together: [q | k | v] per head) and
`slope[h] = 2 ** (-8 (h + 1) / heads) * (1 - layer / (layers - 1 + 1e-5) + 1e-5)`, each head's state S
[head_dim, head_dim] evolves as `S <- exp(-slope) S + k^T v` and the output is `q S`; then an RMSNorm over all heads'
outputs (`norm`, weight [heads * head_dim]; its mean square all-reduced over the TP ranks), times
`sigmoid(output_gate(x))`, and `out_proj`. A prompt chunk runs the block form of transformers' MiniMaxLightningAttention
(blocks of `block_size` tokens: the in-block decayed q k^T products plus the decayed state), from the sequence's slot;
a decode step the recurrent form, batched over the slot tensor (graph-safe). The state is float32.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from xllm_gen.runtime.executor.context import get_context
from xllm_gen.runtime.executor.distributed import all_reduce, get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, Segment, attach, raise_or_defer, split_segment

# the state helpers through the package (R.<name>), as the other mixers: a test patching recurrent.<name> reaches them
from xllm_gen.runtime.layers import recurrent as R
from xllm_gen.runtime.layers.recurrent import RecurrentMixer


def lightning_slopes(heads: int, layer: int, layers: int) -> torch.Tensor:
    """The decay rates [heads] (float32) of a layer: 2 ** (-8 (h + 1) / heads) scaled by 1 - layer / (layers - 1 +
    1e-5) + 1e-5, as transformers' MiniMaxLightningAttention.get_slope_rate (float32 arithmetic)."""
    base = 1 / (2 ** (8 / heads))
    rate = base ** (torch.arange(heads) + 1)
    return (rate * (1 - layer / (layers - 1 + 1e-5) + 1e-5)).float()


def lightning_prefill(q, k, v, slope, state, block_size: int):
    """One sequence: q, k, v [H, T, D], slope [H] (float32), state [H, D, D] (float32). Returns (out [H, T, D] in q's
    dtype, new state float32), the block form of transformers' prefill from `state`."""
    H, T, D = q.shape
    s = slope.to(q.device)[:, None, None]
    S = state.to(q.dtype)
    outs = []
    for start in range(0, T, block_size):
        qb, kb, vb = q[:, start:start + block_size], k[:, start:start + block_size], v[:, start:start + block_size]
        n = qb.shape[1]
        r = torch.arange(1, n + 1, device=q.device, dtype=torch.float32)[:, None]              # [n, 1]
        q_decay = torch.exp(-s * r)                                                           # [H, n, 1]
        k_decay = torch.exp(-s * (n - r))                                                     # [H, n, 1]
        diff = (r - r.t())[None]                                                              # [1, n, n]
        diag = torch.exp(torch.where(s * diff >= 0, -s * diff, float("-inf")))               # [H, n, n]
        intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * diag.to(q.dtype), vb)
        inter = torch.matmul(qb * q_decay.to(q.dtype), S)
        outs.append(inter + intra)
        S = S * torch.exp(-s * n).to(q.dtype) + torch.matmul((kb * k_decay.to(q.dtype)).transpose(-1, -2), vb)
    out = torch.cat(outs, dim=1) if outs else q.new_zeros(H, 0, D)
    return out, S.float()


def lightning_step(q, k, v, slope, state):
    """A decode step of B sequences: q, k, v [B, H, D], state [B, H, D, D]. Returns (out [B, H, D], new state)."""
    ratio = torch.exp(-slope.to(q.device))[None, :, None, None]
    S = ratio * state.float() + torch.matmul(k.float().unsqueeze(-1), v.float().unsqueeze(-2))
    return torch.matmul(q.unsqueeze(-2).to(S.dtype), S)[..., 0, :].to(q.dtype), S


class LightningAttention(RecurrentMixer):
    """The state and math of a lightning attention mixer (the `lightning_attention` block kind; the generated block
    subclasses it and adds its projections): the fixed decay rates of its layer (`slope`, a buffer), the norm over
    all heads (`norm.weight [heads * head_dim]`). Split over TP ranks by heads; the norm's mean square is summed over
    the ranks (one all-reduce).

    State per sequence: `kv` [heads, head_dim, head_dim] (float32)."""

    def __init__(self, heads: int, head_dim: int, layer_idx: int, num_layers: int, block_size: int, eps: float,
                 fields: Optional[dict] = None):
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        problems = []
        if heads % tp:
            name = f" (config.json {fields['heads']})" if fields and "heads" in fields else ""
            problems.append(f"lightning_attention: {heads} heads{name} cannot be split over tensor parallel size {tp}")
        raise_or_defer(self, problems)
        self.total_heads, self.heads, self.head_dim = heads, max(1, heads // tp), head_dim
        self.block_size, self.eps = block_size, eps
        first = rank * self.heads
        self.register_buffer("slope", lightning_slopes(heads, layer_idx, num_layers)[first:first + self.heads],
                             persistent=False)
        seg = split_segment(Segment("heads", heads, head_dim), tp, rank, [])
        self.norm = nn.Module()
        self.norm.weight = attach(nn.Parameter(torch.empty(seg.rows)),
                                  ParamSplit("column", 0, (seg,), (seg.rows,), tp, rank, "LightningAttention"))
        self.state_spec = {"kv": ((self.heads, head_dim, head_dim), torch.float32)}

    def mix(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [N, heads * 3 * head_dim] (after the activation; each head's q | k | v) -> the attention output
        normed over all heads [N, heads * head_dim] (before the output gate), states updated."""
        ctx = get_context()
        N, H, D = qkv.shape[0], self.heads, self.head_dim
        q, k, v = qkv.view(N, H, 3 * D).split(D, dim=-1)
        pool = self.states["kv"]
        slots = R.decode_slots(ctx)
        if slots is not None:                         # decode: one token each, batched, graph-safe
            out, S = lightning_step(q, k, v, self.slope, R.gather_states(pool, slots))
            R.scatter_states(pool, slots, S)
        else:
            out = torch.empty(N, H, D, dtype=qkv.dtype, device=qkv.device)
            for s, e, slot, cont in R.step_sequences(ctx):
                o, S = lightning_prefill(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                                         self.slope, R.slot_state(pool, slot, cont), self.block_size)
                pool[slot] = S
                out[s:e] = o.transpose(0, 1)
        return self._norm(out.reshape(N, H * D))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm over all heads (transformers' MiniMaxRMSNorm: float32 statistics, the weight in the input dtype)."""
        dtype = x.dtype
        h = x.float()
        sq = h.pow(2).sum(-1, keepdim=True)
        if get_tp_size() > 1:
            sq = all_reduce(sq)
        h = h * torch.rsqrt(sq / (self.total_heads * self.head_dim) + self.eps)
        return self.norm.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return (f"heads={self.heads} (per rank), head_dim={self.head_dim}, block_size={self.block_size}, "
                f"eps={self.eps}")
