"""Pure-torch paged attention: the CPU backend and the oracle of the CUDA backends."""
from __future__ import annotations

from typing import Optional

import torch

from xllm_gen.runtime.attention.base import FULL, AttentionBackend, AttentionVariant
from xllm_gen.runtime.executor.context import ForwardContext
from xllm_gen.runtime.ops.reference import dequantize_kv


class TorchPagedBackend(AttentionBackend):
    """Causal attention over the paged cache in float32, all sequences of a step in one batched computation:
    each sequence's K/V pages are gathered through its block table into a padded [B, L, Hk, D] batch, its query
    tokens (the last `query_len` of its `seq_len` tokens) into [B, Q, H, D], and one masked softmax covers all
    (HF eager semantics, see `attend`, the per-sequence oracle this path is tested against). GQA without
    copies: query heads are grouped [Hk, H // Hk] against their KV head. A row with no KV (padding) gives zeros.
    If the caches are empty (no KV cache attached, e.g. a cache-less prefill), the step's k/v are used.
    Variants (sliding window, logit soft-cap) only change the mask / scores: no per-variant plan is needed, and
    neither do layer shapes: each call reads its heads and widths from q / k / v (value heads may have a width of
    their own: v [N, Hk, Dv], v_cache [..., Hk, Dv] -> out [N, H, Dv]).
    A scaled cache (k_scale / v_scale: per-tensor fp8 KV-cache scales) is read back as cache * scale in float32."""

    def __init__(self):
        self._ctx = None
        self._seq_lens = None
        self._q_bounds = None
        self._batch = None

    def plan(self, ctx: ForwardContext) -> None:
        self._ctx = ctx
        self._seq_lens = ctx.seq_lens_cpu if ctx.seq_lens_cpu is not None else ctx.seq_lens.tolist()
        cu = ctx.cu_seqlens_q.tolist()
        self._q_bounds = list(zip(cu[:-1], cu[1:]))
        self._batch = None
        self._masks = {}
        self._decode_masks = {}          # [B, L] key masks of the decode path (the general path's are [B,1,1,Q,L])
        self._live = [i for i, ((q0, q1), n) in enumerate(zip(self._q_bounds, self._seq_lens)) if q1 > q0 and n > 0]
        # a pure decode step: row i is sequence i's one query, every sequence has KV (the common step)
        self._decode = bool(cu) and cu == list(range(len(cu))) and all(n > 0 for n in self._seq_lens)

    def decode_page_table(self, ctx: ForwardContext):
        if ctx is not self._ctx or not self._decode or ctx.block_tables.shape[1] == 0:
            return None
        bs = ctx.block_size
        lens = ctx.seq_lens.to(torch.int32)
        pages = (lens + bs - 1) // bs
        indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=lens.device)
        indptr[1:] = torch.cumsum(pages, 0)
        cols = torch.arange(ctx.block_tables.shape[1], device=lens.device)
        indices = ctx.block_tables[cols[None, :] < pages[:, None]].to(torch.int32)
        return indptr, indices, lens - (pages - 1) * bs

    def reset(self) -> None:
        self._ctx = None
        self._seq_lens = None
        self._q_bounds = None
        self._batch = None

    def _index(self, device):
        """Per step: the rows with work, their query token indices [B, Q] (padded with the row's first) and
        validity, key positions' validity [B, L], and each query's absolute position [B, Q]."""
        if self._batch is None:
            rows = [(i, q0, q1, L) for i, ((q0, q1), L) in enumerate(zip(self._q_bounds, self._seq_lens))
                    if q1 > q0 and L > 0]
            if not rows:
                self._batch = ()
                return self._batch
            Q = max(q1 - q0 for _, q0, q1, _ in rows)
            L = max(n for *_, n in rows)
            j = torch.arange(Q)
            q0 = torch.tensor([r[1] for r in rows])
            qlen = torch.tensor([r[2] - r[1] for r in rows])
            lens = torch.tensor([r[3] for r in rows])
            q_valid = j[None, :] < qlen[:, None]
            q_index = torch.where(q_valid, q0[:, None] + j[None, :], q0[:, None])
            q_pos = (lens - qlen)[:, None] + j[None, :]
            k_valid = torch.arange(L)[None, :] < lens[:, None]
            self._batch = (torch.tensor([r[0] for r in rows]), q_index.to(device), q_valid.to(device),
                           q_pos.to(device), k_valid.to(device), L)
        return self._batch

    def _mask(self, variant: AttentionVariant, q_pos, k_valid, q_valid):
        """[B, 1, 1, Q, L]: key p visible to the query at position i iff p <= i (and p > i - W with a window W);
        padded query rows see key 0 (their output is dropped) so that no softmax row is empty."""
        key = (variant.sliding_window, variant.chunk_size)
        if key not in self._masks:
            kpos = torch.arange(k_valid.shape[1], device=k_valid.device)[None, None, :]
            qpos = q_pos[:, :, None]
            visible = (kpos <= qpos) & k_valid[:, None, :]
            if variant.sliding_window is not None:
                visible &= kpos > qpos - variant.sliding_window
            if variant.chunk_size is not None:       # chunked local attention: the query's own chunk only
                visible &= torch.div(kpos, variant.chunk_size, rounding_mode="floor") == \
                    torch.div(qpos, variant.chunk_size, rounding_mode="floor")
            visible |= (~q_valid[:, :, None]) & (kpos == 0)
            self._masks[key] = visible[:, None, None]
        return self._masks[key]

    def forward(self, q, k, v, k_cache, v_cache, ctx, scale, variant: Optional[AttentionVariant] = None,
                sinks: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None,
                k_scale: float = 1.0, v_scale: float = 1.0, key_mask: Optional[torch.Tensor] = None,
                key_bias: Optional[torch.Tensor] = None, alibi_bf16_scale: Optional[float] = None):
        """key_mask [N, L] bool (a sparse-attention indexer's selection): query token t sees key position p only
        where key_mask[t, p], besides the causal mask and the variant's. key_bias [N, Hk, L] float32 (a per-key score
        bias, runtime/layers/key_bias.py): added to the scores of query token t's heads of KV head h against key p
        after scaling and any soft-cap (transformers adds its float mask there); -inf hides the key.
        alibi_bf16_scale: the ALiBi bias in its bfloat16 form (alibi_bias)."""
        if ctx is not self._ctx:
            self.plan(ctx)
        variant = variant or FULL
        N, H, D = q.shape
        Hk, Dv = k.shape[1], v.shape[-1]        # value heads may be narrower or wider than q / k heads
        g = H // Hk
        out = torch.zeros(N, H, Dv, dtype=q.dtype, device=q.device)
        use_cache = k_cache is not None and k_cache.numel() > 0
        if not self._live:
            return out
        if self._decode and use_cache and len(self._live) > 1 and variant.logit_softcap is None and sinks is None \
                and alibi_slopes is None and key_mask is None and key_bias is None:
            return self._decode_step(q, k_cache, v_cache, ctx, scale, variant, k_scale, v_scale)
        if len(self._live) == 1 and use_cache:   # one sequence: slices, no gather indices (cheaper at batch 1)
            i = self._live[0]
            (q0, q1), n = self._q_bounds[i], self._seq_lens[i]
            bs = k_cache.shape[1]
            blocks = ctx.block_tables[i, :(n + bs - 1) // bs].long()
            ks = dequantize_kv(k_cache[blocks].reshape(-1, Hk, D)[:n], k_scale)
            vs = dequantize_kv(v_cache[blocks].reshape(-1, Hk, Dv)[:n], v_scale)
            out[q0:q1] = attend(q[q0:q1], ks, vs, scale, n - (q1 - q0), variant.sliding_window,
                                variant.logit_softcap, sinks, alibi_slopes, variant.chunk_size,
                                None if key_mask is None else key_mask[q0:q1, :n],
                                None if key_bias is None else key_bias[q0:q1, :, :n],
                                alibi_bf16_scale).to(q.dtype)
            return out
        rows, q_index, q_valid, q_pos, k_valid, L = self._index(q.device)
        B = len(rows)
        if use_cache:
            bs = k_cache.shape[1]
            nblk = (L + bs - 1) // bs
            blocks = ctx.block_tables[rows.to(ctx.block_tables.device), :nblk].long()
            ks = dequantize_kv(k_cache[blocks].reshape(B, nblk * bs, Hk, D)[:, :L], k_scale)
            vs = dequantize_kv(v_cache[blocks].reshape(B, nblk * bs, Hk, Dv)[:, :L], v_scale)
        else:
            if any(q1 - q0 != n for (q0, q1), n in zip(self._q_bounds, self._seq_lens) if n):
                raise ValueError("without a KV cache every sequence must be computed whole")
            kv_index = q_index[:, :L]            # the whole sequence is the query: same token indices
            ks, vs = k[kv_index], v[kv_index]
        qf = q[q_index].float().view(B, -1, Hk, g, D).permute(0, 2, 3, 1, 4)       # [B, Hk, g, Q, D]
        kf = ks.float().permute(0, 2, 1, 3)[:, :, None]                             # [B, Hk, 1, L, D]
        # positions past a row's length may hold stale or unwritten pages: zero V there (0 * NaN is NaN)
        vf = torch.where(k_valid[:, :, None, None], vs.float(), 0.0).permute(0, 2, 1, 3)[:, :, None]
        s = torch.matmul(qf, kf.transpose(-1, -2)) * scale                          # [B, Hk, g, Q, L]
        if alibi_slopes is not None:     # ALiBi: slope_h * (key position - query position)
            kp = torch.arange(L, device=q.device)[None, None, None, None, :]               # [1, 1, 1, 1, L]
            s = s + alibi_bias(alibi_slopes.float().view(1, Hk, g, 1, 1), kp, q_pos[:, None, None, :, None],
                               alibi_bf16_scale)
        if variant.logit_softcap is not None:
            s = torch.tanh(s / variant.logit_softcap) * variant.logit_softcap
        if key_bias is not None:         # [N, Hk, L] -> [B, Hk, 1, Q, L]
            s = s + key_bias[q_index][:, :, :, :L].float().permute(0, 2, 1, 3)[:, :, None]
        visible = self._mask(variant, q_pos, k_valid, q_valid)
        if key_mask is not None:         # the indexer's selection (padded query rows keep their key 0)
            chosen = key_mask[q_index][:, :, :L] | ~q_valid[:, :, None]
            visible = visible & chosen[:, None, None]
        s = s.masked_fill(~visible, float("-inf"))
        o = torch.matmul(_softmax(s, None if sinks is None else sinks.float().view(1, Hk, g, 1, 1)), vf)
        o = o.permute(0, 3, 1, 2, 4).reshape(B, -1, H, Dv)
        out[q_index[q_valid]] = o[q_valid].to(q.dtype)
        return out

    def _decode_step(self, q, k_cache, v_cache, ctx, scale, variant, k_scale=1.0, v_scale=1.0):
        """A decode step of B sequences (one query each, at position len - 1): every key up to the length is
        visible (within the window), so the mask is the keys' validity and no query gather is needed; one SDPA
        call over the gathered pages, GQA without copies (enable_gqa)."""
        B, H, D = q.shape
        Hk, Dv = k_cache.shape[2], v_cache.shape[-1]
        window, chunk = variant.sliding_window, variant.chunk_size
        if (window, chunk) not in self._decode_masks:
            lens = torch.tensor(self._seq_lens)
            L = int(lens.max())
            kpos = torch.arange(L)[None, :]
            visible = kpos < lens[:, None]
            if window is not None:
                visible &= kpos > (lens[:, None] - 1) - window
            if chunk is not None:                    # the query (at len - 1) sees its own chunk only
                visible &= kpos >= (lens[:, None] - 1) // chunk * chunk
            self._decode_masks[(window, chunk)] = visible.to(q.device)
        visible = self._decode_masks[(window, chunk)]
        L = visible.shape[1]
        bs = k_cache.shape[1]
        nblk = (L + bs - 1) // bs
        blocks = ctx.block_tables[:, :nblk].long()
        keep = visible[:, :, None, None]
        # pages past a row's length may hold stale or unwritten values: zeroed (0 * NaN is NaN)
        ks = torch.where(keep, dequantize_kv(k_cache[blocks].reshape(B, nblk * bs, Hk, D)[:, :L], k_scale), 0.0)
        vs = torch.where(keep, dequantize_kv(v_cache[blocks].reshape(B, nblk * bs, Hk, Dv)[:, :L], v_scale), 0.0)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.float().unsqueeze(2), ks.float().transpose(1, 2), vs.float().transpose(1, 2),
            attn_mask=visible[:, None, None, :], scale=scale, enable_gqa=H != Hk)      # [B, H, 1, Dv]
        return o.squeeze(2).to(q.dtype)


def _softmax(s: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax over the last dim; with `sinks` (broadcast to s[..., :1]) each row's sink logit joins the
    denominator as transformers computes it: the row and its sink concatenated, max-subtracted, softmax, sink
    dropped."""
    if sinks is None:
        return torch.softmax(s, dim=-1)
    comb = torch.cat([s, sinks.expand(*s.shape[:-1], 1)], dim=-1)
    comb = comb - comb.max(dim=-1, keepdim=True).values
    return torch.softmax(comb, dim=-1)[..., :-1]


def alibi_bias(slopes: torch.Tensor, kpos: torch.Tensor, qpos: torch.Tensor,
               bf16_scale: Optional[float] = None) -> torch.Tensor:
    """The ALiBi bias (float32, broadcast over slopes / key positions / query positions): slope * (kpos - qpos); with
    `bf16_scale`, the bias at the absolute key positions computed in bfloat16 and then scaled,
    bf16(bf16(slope) * bf16(kpos)) * bf16_scale (a reference that builds its bias tensor in bfloat16, positions
    included, and divides it by sqrt(head_dim) rounds all three, and its rounding depends on the absolute position:
    the relative form cannot match it where the slopes are not powers of two; positions past 256 are rounded to
    bfloat16's 8 significant bits, 257 to 256, as transformers' Falcon `slopes.bfloat16() * arange` does)."""
    if bf16_scale is None:
        return slopes * (kpos - qpos)
    return (slopes.bfloat16() * kpos.bfloat16()).float() * bf16_scale


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int,
           sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
           sinks: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None,
           chunk_size: Optional[int] = None, key_mask: Optional[torch.Tensor] = None,
           key_bias: Optional[torch.Tensor] = None, alibi_bf16_scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of q [Q, H, D] against k [L, Hk, D], v [L, Hk, Dv] -> [Q, H, Dv]; query j sits at position
    q_offset + j.

    HF eager semantics: scores = q k^T * scale; with logit_softcap c, scores = c * tanh(scores / c) (before the
    mask); key p is visible to query position i iff p <= i and, with a sliding window W, p > i - W. `sinks` [H]:
    a per-head logit in the softmax denominator (attention sinks). `alibi_slopes` [H]: ALiBi, slope_h * (key position -
    query position) added to the scaled scores (its bfloat16 form with `alibi_bf16_scale`: alibi_bias). With a chunk
    size C, also p // C == i // C (chunked local
    attention). `key_mask` [Q, L] bool: query j sees key p only where key_mask[j, p] (a sparse-attention
    indexer's selection). `key_bias` [Q, Hk, L]: added to the scores of each KV head's query heads after any soft-cap
    (a per-key score bias; -inf hides the key)."""
    Q, H, D = q.shape
    L, Hk, _ = k.shape
    g = H // Hk
    qf = q.float().transpose(0, 1)                                   # [H, Q, D]
    kf = k.float().repeat_interleave(g, dim=1).transpose(0, 1)       # [H, L, D]
    vf = v.float().repeat_interleave(g, dim=1).transpose(0, 1)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale                 # [H, Q, L]
    qpos = torch.arange(Q, device=q.device)[:, None] + q_offset
    kpos = torch.arange(L, device=q.device)[None, :]
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes.float().view(H, 1, 1), kpos, qpos, alibi_bf16_scale)
    if logit_softcap is not None:
        s = torch.tanh(s / logit_softcap) * logit_softcap
    if key_bias is not None:
        s = s + key_bias.float().repeat_interleave(g, dim=1).transpose(0, 1)
    hidden = kpos > qpos
    if sliding_window is not None:
        hidden = hidden | (kpos <= qpos - sliding_window)
    if chunk_size is not None:        # chunked local attention: keys of the query's own chunk only
        hidden = hidden | (kpos // chunk_size != qpos // chunk_size)
    if key_mask is not None:
        hidden = hidden | ~key_mask
    s = s.masked_fill(hidden, float("-inf"))
    p = _softmax(s, None if sinks is None else sinks.float().view(H, 1, 1))
    return torch.matmul(p, vf).transpose(0, 1)                       # [Q, H, D]
