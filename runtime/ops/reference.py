"""Pure-torch references of the fused ops.

These are the CPU implementations and the oracles of the Triton kernels. Their arithmetic follows
Hugging Face transformers' modules (RMSNorm, rotary, gated MLP, attention) step by step (same op order, same dtype casts), so
that float32 runs on CPU match HF bit for bit.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """weight_offset 0: HF's w-scaled RMSNorm, float32 variance, `weight * x_normed.to(input_dtype)`.
    weight_offset != 0: HF's (offset + w) RMSNorm (offset 1), all in float32,
    `(x_normed * (offset + weight.float()))` cast to the input dtype at the end."""
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    if weight_offset:
        return (h * (weight_offset + weight.float())).to(dtype)
    return weight * h.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       weight_offset: float = 0.0):
    """(rms_norm(residual + x), residual + x); the sum is rounded to the input dtype first (as HF)."""
    new_residual = residual + x
    return rms_norm(new_residual, weight, eps, weight_offset), new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    return F.silu(x[..., :n]) * x[..., n:]


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(x[..., :n]) * x[..., n:] (HF's GELU-gated MLP: act_fn(gate_proj(x)) * up_proj(x)); approximate "tanh" or
    "none" (exact erf)."""
    n = x.shape[-1] // 2
    return F.gelu(x[..., :n], approximate=approximate) * x[..., n:]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, axis_map: Optional[torch.Tensor], dtype,
                 attention_factor: float = 1.0):
    """cos, sin [N, D] in `dtype`, computed as HF's rotary embedding modules do (float32, multiplied by the rope
    type's attention factor, then cast).

    positions [N] (neox) or [3, N] (mRoPE, with axis_map [D/2] giving the position axis of each frequency slot).
    """
    inv_freq = inv_freq.to(device=positions.device, dtype=torch.float)
    freqs = positions[..., None].float() * inv_freq          # [N, D/2] or [3, N, D/2]
    cos = freqs.cos()
    sin = freqs.sin()
    if positions.dim() == 2:
        idx = axis_map.to(device=positions.device, dtype=torch.long).view(1, 1, -1).expand(1, cos.shape[1], -1)
        cos = cos.gather(0, idx).squeeze(0)
        sin = sin.gather(0, idx).squeeze(0)
    cos = torch.cat((cos, cos), dim=-1)
    sin = torch.cat((sin, sin), dim=-1)
    if attention_factor != 1.0:
        cos = cos * attention_factor
        sin = sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
         axis_map: Optional[torch.Tensor] = None, attention_factor: float = 1.0):
    """HF apply_rotary_pos_emb on q [N, H, D], k [N, Hk, D] (neox / rotate_half layout)."""
    cos, sin = rope_cos_sin(positions, inv_freq, axis_map, q.dtype, attention_factor)
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    q_out = (q * cos) + (rotate_half(q) * sin)
    k_out = (k * cos) + (rotate_half(k) * sin)
    return q_out, k_out


def qk_norm_rope(q, k, q_weight, k_weight, eps, positions, inv_freq, axis_map=None, attention_factor=1.0):
    """Per-head RMSNorm of q and k (when weights are given), then rotary."""
    if q_weight is not None:
        q = rms_norm(q, q_weight, eps)
    if k_weight is not None:
        k = rms_norm(k, k_weight, eps)
    return rope(q, k, positions, inv_freq, axis_map, attention_factor)


FP8_MAX = 448.0     # the largest finite float8 e4m3fn value


def unit_scale(scale) -> bool:
    """Whether a KV-cache scale is the plain 1.0 (a float; a per-head scale is a tensor, never unit)."""
    return not isinstance(scale, torch.Tensor) and scale == 1.0


def quantize_kv(x: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    """x [..., Hk, D] as the KV cache stores it: x / scale rounded to `dtype` (float8 e4m3: saturated at +-448, as the
    CUDA store kernel's conversion does); a cache of another dtype with scale 1.0: a plain cast. `scale`: a float (per
    tensor) or a float32 tensor [Hk, 1] (per KV head, broadcast over the head's D values)."""
    if dtype == torch.float8_e4m3fn:
        xs = x.float() if unit_scale(scale) else x.float() / scale
        return xs.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return (x if unit_scale(scale) else x.float() / scale).to(dtype)


def dequantize_kv(x: torch.Tensor, scale) -> torch.Tensor:
    """A cache [..., Hk, D] read back: float32 x * scale (x itself for scale 1.0: the caller converts); `scale` as in
    quantize_kv."""
    return x if unit_scale(scale) else x.float() * scale


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale=1.0, v_scale=1.0) -> None:
    """k, v [N, Hk, D] into caches [num_blocks, block_size, Hk, D] at flat slots; slot -1 is skipped. k_scale /
    v_scale: the KV-cache scales, per tensor (floats) or per KV head ([Hk, 1] tensors) (a float8 cache holds
    k / k_scale, read back times k_scale)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    kc[slots] = quantize_kv(k[keep], k_scale, kc.dtype)
    vc[slots] = quantize_kv(v[keep], v_scale, vc.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def vision_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The vision tower's rotary (HF `apply_rotary_pos_emb_vision`): q, k [P, H, D] rotated in float32 by cos, sin
    [P, D] (x * cos + rotate_half(x) * sin), returned in their dtype (new tensors)."""
    c, s = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()

    def rot(x):
        xf = x.float()
        return (xf * c + _rotate_half(xf) * s).to(x.dtype)
    return rot(q), rot(k)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, indptr: torch.Tensor,
                           indices: torch.Tensor, last_page_len: torch.Tensor, sm_scale: float,
                           window_left: int = -1, soft_cap: Optional[float] = None,
                           sinks: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None,
                           k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Decode attention over a CSR page table, one row at a time in float32 (the oracle of the Triton kernel in
    ops/decode_attention.py): q [B, H, D] is each row's last position; a row with no pages gives zeros. `sinks`
    [H]: a logit per head joins the softmax denominator. `chunk_size` C: the keys of the query's chunk only.
    k_scale / v_scale: the cache holds K / k_scale and V / v_scale (a scaled float8 cache): read back times them."""
    B, H, D = q.shape
    page, Hk = k_cache.shape[1], k_cache.shape[2]
    ptr, last = indptr.tolist(), last_page_len.tolist()
    out = torch.zeros(B, H, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        pages = indices[ptr[b]: ptr[b + 1]].long()
        if not len(pages):
            continue
        L = (len(pages) - 1) * page + last[b]
        k = k_cache[pages].reshape(-1, Hk, D)[:L].float() * k_scale
        v = v_cache[pages].reshape(-1, Hk, D)[:L].float() * v_scale
        start = max(0, L - 1 - window_left) if window_left >= 0 else 0
        if chunk_size is not None:        # chunked local attention: the query's own chunk
            start = max(start, (L - 1) // chunk_size * chunk_size)
        k, v = k[start:], v[start:]
        qb = q[b].float().view(Hk, H // Hk, D)
        s = torch.einsum("kgd,nkd->kgn", qb, k) * sm_scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        if sinks is None:
            p = s.softmax(-1)
        else:
            p = torch.cat([s, sinks.float().view(Hk, H // Hk, 1)], dim=-1).softmax(-1)[..., :-1]
        out[b] = torch.einsum("kgn,nkd->kgd", p, v).reshape(H, D)
    return out.to(q.dtype)


LN2 = math.log(2.0)      # FlashInfer's log-sum-exp is base 2 (state_t::get_lse: m + log2(d), logits times log2(e))


def per_query_head(scale: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A per-KV-head scale ([Hk] or [Hk, 1]) as float32 [num_heads]: query head h gets its group's, scale[h // G]."""
    s = scale.float().reshape(-1)
    if num_heads % s.numel():
        raise ValueError(f"{s.numel()} per-KV-head scales do not divide {num_heads} query heads")
    return s.repeat_interleave(num_heads // s.numel())


def fold_k_scale(q: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """q [N, H, D] with each query head times its KV head's K-cache scale (k_scale [Hk] or [Hk, 1], float32), in
    float32, rounded once to q's dtype: q_h . (k_cache * k_scale[kh]) = (q_h * k_scale[kh]) . k_cache, so an attention
    kernel that reads the cache unscaled, at the unchanged softmax scale, computes the scaled cache's scores."""
    s = per_query_head(k_scale, q.shape[1]).to(q.device).view(1, -1, 1)
    return (q.float() * s).to(q.dtype)


def attention_epilogue(out: torch.Tensor, lse: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
                       v_scale: Optional[torch.Tensor] = None, lse_base2: bool = True) -> torch.Tensor:
    """An attention output [N, H, Dv] of plain softmax attention turned into (a) softmax attention with a sink logit
    s_h per head, and / or (b) read from a V cache scaled per KV head; a new tensor in out's dtype.

    (a) With S = sum_j exp(x_j) = exp(lse) (lse [N, H] of the same logits; base 2 as FlashInfer returns it:
    lse_e = lse * ln 2), softmax with the sink is sum_j exp(x_j) v_j / (S + exp(s_h)) = out * S / (S + exp(s_h)) =
    out * sigmoid(lse_e - s_h): exact. A row with no keys (lse -inf, or NaN) gives zeros.
    (b) sum_j p_j (v_cache_j * v_scale[kh]) = out * v_scale[kh] (v_scale [Hk] or [Hk, 1]) for the query heads of
    KV head kh."""
    N, H = out.shape[:2]
    f = torch.ones(N, H, dtype=torch.float32, device=out.device)
    if sinks is not None:
        lse_e = lse.float() * (LN2 if lse_base2 else 1.0)
        f = torch.nan_to_num(torch.sigmoid(lse_e - sinks.float().view(1, H)), nan=0.0)
    if v_scale is not None:
        f = f * per_query_head(v_scale, H).to(out.device).view(1, H)
    f = f.unsqueeze(-1)
    return torch.where(f != 0, out.float() * f, 0.0).to(out.dtype)
