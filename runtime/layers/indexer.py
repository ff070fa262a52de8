"""The sparse-attention indexer (a "lightning indexer" for sparse attention): each query attends only to the
`topk` earlier keys a light scorer ranks highest.

Per token t (x the attention's input, q_in the query latent the attention's low-rank q is made from):

    q[t]  = rotary(wq_b(q_in[t]))             [heads, head_dim]   (the first rope_dim dims rotate; or the last)
    k[t]  = rotary(layernorm(wk(x[t])))       [head_dim]          (one key per token, shared by the indexer heads)
    w[t]  = weights_proj(x[t]) * heads ** -0.5   (float32)        [heads]
    score[t, s] = sum_h w[t, h] * relu(head_dim ** -0.5 * q[t, h] . k[s])   (float32), for s <= t (causal)
    select[t] = the min(topk, seq_len) best s among the causal ones (all of them when t + 1 <= topk)

and the attention of query t sees only the keys in select[t] (on top of the causal mask). This is transformers'
DeepseekV32Indexer / GlmMoeDsaIndexer: its scores over the whole cached row with the causal mask added, then
top-min(topk, row length); the selected masked positions stay masked by the causal mask, so it is the same set. The
Hadamard rotation and the fp8 scoring of the reference implementation are not modeled (an orthogonal rotation keeps
q . k; transformers skips both too).

The keys k are cached per sequence in a paged cache of their own beside the KV cache (`k_cache` [num_blocks,
block_size, head_dim] in the model dtype, allocated by the runner with the same blocks and slots as the KV cache),
so prefix caching, chunked prefill and preemption keep them with the KV they belong to. The selection is a boolean
mask [N, L] (query token, key position; L the step's longest sequence) that the attention backend ANDs with its
causal mask (`Attention.forward(..., key_mask=)`); it is also left in the forward context, so that a later layer
without an indexer of its own reuses it (GLM-MoE-DSA's "shared" layers: `shared_selection()`). Computed in torch
(the CPU backend's path); the CUDA attention path does not take a key mask and refuses a model with an indexer at
load. Replicated under tensor parallelism: every rank computes the same selection.
"""
from __future__ import annotations

import torch
from torch import nn

from xllm_gen.runtime.executor.context import get_context
from xllm_gen.runtime.layers.linear import ReplicatedLinear
from xllm_gen.runtime.layers.moe import linear_float32
from xllm_gen.runtime.layers.norm import LayerNorm
from xllm_gen.runtime.layers.rotary import Rotary

SELECTION_KEY = "sparse_indexer_selection"      # the step's last selection, in ForwardContext.extra


class SparseIndexer(nn.Module):
    """forward(positions [N], x [N, hidden], q_in [N, q_in]) -> the key mask [N, L] bool (see the module doc).

    Modules (transformers' names): wq_b (q_in -> heads * head_dim), wk (hidden -> head_dim), k_norm (LayerNorm of
    head_dim with weight and bias), weights_proj (hidden -> heads, computed in float32); all replicated. The rotary
    turns the first `rope_dim` dims of each indexer q head and of the key with the attention's rope frequencies
    (`theta`, `max_position`, `scaling`: transformers passes the attention's cos / sin) in `layout` (neox halves, or
    interleaved pairs); `rope_position` "last": the last `rope_dim` dims turn instead (HY-V4's indexer)."""

    def __init__(self, hidden: int, q_in: int, heads: int, head_dim: int, rope_dim: int, topk: int, theta: float,
                 max_position: int, scaling=None, layout: str = "neox", original_max_position=None,
                 eps: float = 1e-6, rope_position: str = "first"):
        super().__init__()
        for name, v in (("heads", heads), ("head_dim", head_dim), ("topk", topk), ("q_in", q_in)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"sparse indexer: {name} must be an int >= 1, got {v!r}")
        if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or not 0 <= rope_dim <= head_dim:
            raise ValueError(f"sparse indexer: the rope dims ({rope_dim!r}) must be an int in 0..head_dim "
                             f"({head_dim})")
        self.heads, self.head_dim, self.rope_dim, self.topk = heads, head_dim, rope_dim, topk
        self.wq_b = ReplicatedLinear(q_in, heads * head_dim, bias=False)
        self.wk = ReplicatedLinear(hidden, head_dim, bias=False)
        self.k_norm = LayerNorm(head_dim, eps)
        self.weights_proj = ReplicatedLinear(hidden, heads, bias=False)
        self.rotary = Rotary(head_dim, theta, max_position, scaling=scaling, rotary_dim=rope_dim, layout=layout,
                             original_max_position=original_max_position, position=rope_position)
        self.softmax_scale = head_dim ** -0.5
        self.k_cache = torch.tensor([])       # [num_blocks, block_size, head_dim], attached by the runner

    def cache_bytes_per_token(self, elem: int) -> int:
        """Bytes of this indexer's key cache per token (at `elem` bytes per element)."""
        return self.head_dim * elem

    def forward(self, positions: torch.Tensor, x: torch.Tensor, q_in: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        n = x.shape[0]
        q = self.wq_b(q_in).view(n, self.heads, self.head_dim)
        k = self.k_norm(self.wk(x)).view(n, 1, self.head_dim)
        q, k = self.rotary(positions, q, k)
        k = k.reshape(n, self.head_dim)
        w = linear_float32(self.weights_proj, x) * self.heads ** -0.5          # [N, heads] float32
        if self.k_cache.numel():
            keep = ctx.slot_mapping >= 0
            self.k_cache.view(-1, self.head_dim)[ctx.slot_mapping[keep].long()] = k[keep].to(self.k_cache.dtype)
        mask = self.select(q, k, w, ctx)
        ctx.extra[SELECTION_KEY] = mask
        return mask

    def select(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ctx) -> torch.Tensor:
        """The key mask [N, L] of the step's queries: per sequence, its cached keys (or this step's, without a
        cache) scored by its queries, the causal best min(topk, len) kept."""
        seq_lens = ctx.seq_lens_cpu if ctx.seq_lens_cpu is not None else ctx.seq_lens.tolist()
        cu = ctx.cu_seqlens_q.tolist()
        L = max(seq_lens, default=0)
        mask = torch.zeros(q.shape[0], L, dtype=torch.bool, device=q.device)
        cached = self.k_cache.numel() > 0
        for i, n in enumerate(seq_lens):
            q0, q1 = cu[i], cu[i + 1]
            if q1 <= q0 or n <= 0:
                continue
            if cached:
                bs = self.k_cache.shape[1]
                blocks = ctx.block_tables[i, :(n + bs - 1) // bs].long()
                keys = self.k_cache[blocks].reshape(-1, self.head_dim)[:n]
            else:
                if q1 - q0 != n:
                    raise ValueError("sparse indexer: without a key cache every sequence must be computed whole")
                keys = k[q0:q1]
            # transformers' order: per head q . k scaled, relu, then the heads weighted and summed (float32)
            s = torch.relu(torch.matmul(q[q0:q1].float(), keys.float().t()) * self.softmax_scale)   # [Q, H, n]
            score = torch.matmul(w[q0:q1].unsqueeze(1), s).squeeze(1)                              # [Q, n]
            qpos = torch.arange(n - (q1 - q0), n, device=q.device)[:, None]
            causal = torch.arange(n, device=q.device)[None, :] <= qpos
            score = score.masked_fill(~causal, float("-inf"))
            idx = score.topk(min(self.topk, n), dim=-1).indices
            chosen = torch.zeros_like(causal).scatter_(1, idx, True) & causal
            mask[q0:q1, :n] = chosen
        return mask

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, head_dim={self.head_dim}, rope_dim={self.rope_dim}, topk={self.topk}, "
                f"layout={self.rotary.layout!r}" + (f", rope_position={self.rotary.position!r}"
                                                    if self.rotary.position != "first" else ""))


def shared_selection() -> torch.Tensor:
    """The key mask the last indexer of this step computed (a layer that reuses an earlier layer's selection)."""
    mask = get_context().extra.get(SELECTION_KEY)
    if mask is None:
        raise RuntimeError("a layer reuses the sparse-attention selection of an earlier indexer layer, but no "
                           "layer before it in this step has an indexer (the first indexed layer must run its own)")
    return mask
