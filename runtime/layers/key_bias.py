"""A learned per-key score bias computed from the values (a "dynamic mask" attention): every score of query t
against key s gets an additive bias of the key's KV head, and a query that sees more than `keep` keys attends only
to the `keep` keys of highest bias.

Per token s (v[s] the token's values, all KV heads concatenated, as the cache holds them):

    b[s, h] = exp(A[h] * softplus(dt_proj(v[s]))[h])          [kv_heads]    (a linear [kv_heads, kv_heads * head_dim])
    score[t, h', s] = scale * q[t, h'] . k[s, h] + b[s, h]      (h = h' // (heads / kv_heads), before the softmax)

and with `keep` K: where query t sees more than K keys (causal, within any window), only its K keys of highest
b[., h] stay visible for the heads of KV head h. This is how transformers' reference builds its dynamic mask: it adds
the bias (repeated over the KV groups) as the attention mask and, once the row holds more than
`keep_window_size` keys, keeps the row's top-K of (bias, or the dtype's minimum where masked); the masked keys it
may pick stay masked, so a row that sees at most K keys keeps them all, and one that sees more keeps its K best.

The biases are cached per token in a paged cache of their own beside the KV cache (`k_cache` [num_blocks,
block_size, kv_heads] float32, allocated by the runner on the KV cache's blocks and slots, as the sparse indexer's
keys), so that chunked prefill, prefix caching and preemption keep them with the values they come from. `forward`
returns the step's bias as a tensor [N, kv_heads, L] (query token, KV head, key position; -inf for the keys the
top-K drops) that the torch attention backend adds to the scores (`Attention.forward(..., key_bias=)`); the CUDA
attention path takes no such operand and refuses a model with this layer at load.

Tensor parallelism: dt_proj reads every KV head's values, so each rank all-gathers the step's values (one copy of
each KV head: with fewer KV heads than ranks, the ranks that replicate a head give it once), computes the biases
of every KV head with the replicated dt_proj and A, and keeps its own heads'.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.executor.context import get_context
from xllm_gen.runtime.executor.distributed import all_gather, get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import replicated


class ValueKeyBias(nn.Module):
    """forward(v [N, local kv_heads * head_dim], dt_proj, A) -> the score bias [N, local kv_heads, L] float32 (see
    the module doc). No parameters of its own: dt_proj and A belong to the attention block (transformers' names)."""

    def __init__(self, kv_heads: int, keep: Optional[int] = None, sliding_window: Optional[int] = None):
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
            raise ValueError(f"value key bias: kv_heads must be an int >= 1, got {kv_heads!r}")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"value key bias: keep must be None or an int >= 1, got {keep!r}")
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(f"value key bias: {kv_heads} KV heads over {tp} tensor-parallel ranks (neither divides "
                             f"the other)")
        self.total_kv_heads = kv_heads
        self.tp = tp
        if kv_heads >= tp:                       # rank r holds KV heads r * kv / tp ... (r + 1) * kv / tp - 1
            self.kv_heads, self.first = kv_heads // tp, rank * (kv_heads // tp)
            self.gather_ranks = None
        else:                                    # KV heads replicated: rank r holds head r // (tp / kv)
            rep = tp // kv_heads
            self.kv_heads, self.first = 1, rank // rep
            self.gather_ranks = torch.arange(kv_heads) * rep     # one rank per head, in head order
        self.keep = keep
        self.sliding_window = sliding_window
        self.k_cache = torch.tensor([])        # [num_blocks, block_size, kv_heads] float32, attached by the runner
        self.cache_dtype = torch.float32

    @staticmethod
    def gain(kv_heads: int) -> nn.Parameter:
        """The per-KV-head gain A [kv_heads], replicated (every rank computes every head's bias)."""
        return replicated(nn.Parameter(torch.zeros(kv_heads)), "ValueKeyBias")

    @property
    def cache_width(self) -> int:
        return self.kv_heads

    def cache_bytes_per_token(self, elem: int) -> int:
        """Bytes of this layer's bias cache per token (float32, whatever `elem`)."""
        return self.kv_heads * 4

    def biases(self, v: torch.Tensor, dt_proj: nn.Module, A: torch.Tensor) -> torch.Tensor:
        """b [N, this rank's kv_heads] float32 of the step's tokens (v [N, this rank's kv_heads * head_dim])."""
        if self.tp > 1:
            full = all_gather(v.contiguous(), dim=-1)                         # every rank's heads, rank order
            if self.gather_ranks is not None:
                full = full.view(v.shape[0], self.tp, -1)[:, self.gather_ranks.to(v.device)]
            v = full.reshape(v.shape[0], -1)
        dt = dt_proj(v)                                                       # [N, kv_heads], every head
        b = torch.exp(A.to(dt.dtype) * F.softplus(dt))
        return b[:, self.first:self.first + self.kv_heads].float()

    def forward(self, v: torch.Tensor, dt_proj: nn.Module, A: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        b = self.biases(v.reshape(v.shape[0], -1), dt_proj, A)
        cached = self.k_cache.numel() > 0
        if cached:
            keep = ctx.slot_mapping >= 0
            self.k_cache.view(-1, self.kv_heads)[ctx.slot_mapping[keep].long()] = b[keep]
        seq_lens = ctx.seq_lens_cpu if ctx.seq_lens_cpu is not None else ctx.seq_lens.tolist()
        cu = ctx.cu_seqlens_q.tolist()
        L = max(seq_lens, default=0)
        out = torch.zeros(b.shape[0], self.kv_heads, L, dtype=torch.float32, device=b.device)
        for i, n in enumerate(seq_lens):
            q0, q1 = cu[i], cu[i + 1]
            if q1 <= q0 or n <= 0:
                continue
            if cached:
                bs = self.k_cache.shape[1]
                blocks = ctx.block_tables[i, :(n + bs - 1) // bs].long()
                keys = self.k_cache[blocks].reshape(-1, self.kv_heads)[:n]          # [n, Hk]
            else:
                if q1 - q0 != n:
                    raise ValueError("value key bias: without a cache every sequence must be computed whole")
                keys = b[q0:q1]
            rows = keys.t()[None].expand(q1 - q0, -1, -1)                         # [Q, Hk, n]
            if self.keep is not None:
                rows = self._top_keep(rows, n, q1 - q0, v.dtype)
            out[q0:q1, :, :n] = rows
        return out

    def _top_keep(self, rows: torch.Tensor, n: int, q: int, dtype: torch.dtype) -> torch.Tensor:
        """The rows' biases with -inf on the visible keys beyond each query's `keep` best (queries that see at most
        `keep` keys keep them all).

        Ties (equal biases: the same token's values at the first layer) are broken as transformers breaks them,
        by torch.topk (unsorted) over the row transformers builds: the query's keys in position order, the hidden
        ones at the model dtype's minimum, in the model dtype; the row is every key of the sequence (a prompt's
        prefill, a decode step), or at a decode step of a windowed layer its last `sliding_window` keys (transformers'
        sliding-window cache). transformers' cached and uncached forwards already differ there (rows of other
        lengths); a prompt prefilled in several chunks has shorter rows than transformers' one-pass prefill."""
        qpos = torch.arange(n - q, n, device=rows.device)[:, None]
        kpos = torch.arange(n, device=rows.device)[None, :]
        visible = kpos <= qpos
        start = 0
        if self.sliding_window is not None:
            visible &= kpos > qpos - self.sliding_window
            if q == 1:                     # a decode step: transformers' window cache holds the last W keys
                start = max(0, n - self.sliding_window)
        if n - start <= self.keep:         # transformers selects only where its row is longer than `keep`
            return rows
        low = torch.finfo(dtype).min
        scores = rows[:, :, start:].to(dtype).masked_fill(~visible[:, None, start:], low)
        idx = scores.topk(self.keep, dim=-1, largest=True, sorted=False).indices + start
        chosen = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device).scatter_(-1, idx, True)
        return rows.masked_fill(visible[:, None, :] & ~chosen, float("-inf"))

    def extra_repr(self) -> str:
        return f"kv_heads={self.kv_heads} (this rank's), keep={self.keep}, sliding_window={self.sliding_window}"
