"""Multi-head latent attention over a latent KV cache ("absorbed" form).

The expanded form caches per-head K (nope + rope dims) and V. The latent form caches, per token, the normalized
KV latent c (kv_lora_rank) and the shared rope key k_pe: one K/V "head" of kv_lora_rank + rope dims. kv_b_proj
(per head h: W_UK[h] [nope, C] makes k_nope = W_UK[h] c, W_UV[h] [v, C] makes v = W_UV[h] c) is absorbed:

    q_nope[h] . k_nope[h] = (W_UK[h]^T q_nope[h]) . c          -> q = [W_UK^T q_nope, q_pe], k = [c, k_pe]
    sum_j p_j v_j[h] = W_UV[h] (sum_j p_j c_j)                   -> v = c, out[h] = W_UV[h] out_latent[h]

so attention runs as multi-query attention (one KV head shared by this rank's heads) with q/k of C + rope dims
and v of C dims (runtime Attention with v_head_dim: the V cache at its own width C). Same scores and outputs as the
expanded form up to float rounding; the cache holds (C + rope) + C values per token instead of H (2 nope + rope + v).
"""
from __future__ import annotations

from typing import Optional

import torch


def latent_attention(attn, kv_b_proj, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                     k_pe: torch.Tensor, qk_nope_head_dim: int, v_head_dim: int,
                     key_mask: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q_nope [N, H, nope], q_pe [N, H, rope], latent [N, C] (after kv_a_layernorm), k_pe [N, 1, rope] (rotated);
    `attn` an Attention(H, 1, C + rope, v_head_dim=C), `kv_b_proj` the column-parallel [H * (nope + v), C] linear
    of this rank's heads; `key_mask` (optional): a sparse-attention indexer's selection, passed to the attention;
    `sinks` (optional, [H]): attention sinks, one logit per head in the softmax denominator (W_UV is linear, so the
    sink's share of probability mass carries over to the expanded values unchanged).
    Returns [N, H * v_head_dim]."""
    H, C = q_nope.shape[1], latent.shape[-1]
    if kv_b_proj.act_quant is not None:       # the latent as the quantized linear would read it
        latent = kv_b_proj.act_quant(latent)
    w = kv_b_proj.weight.view(H, qk_nope_head_dim + v_head_dim, C)
    w_uk, w_uv = w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]
    q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)
    q = torch.cat((q_latent, q_pe), dim=-1)
    k = torch.cat((latent.unsqueeze(1), k_pe.to(latent.dtype)), dim=-1)
    extra = {"sinks": sinks} if sinks is not None else {}
    out = attn(q, k, latent.unsqueeze(1).contiguous(), key_mask=key_mask, **extra).view(-1, H, C)
    return torch.einsum("nhc,hvc->nhv", out, w_uv).reshape(-1, H * v_head_dim)
