"""q/k per-head RMSNorm + rotary with the KV-cache write in the same launch (decode): the kernel of
rope_kernels.qk_norm_rope (`_norm_rope_heads`, one program per token) also writes the token's normed, rotated k
and its v into the paged caches [num_blocks, block_size, Hk, D] at its slot (slot -1: padding row, skipped), so the
attention layer launches no store_kvcache. The k written to the cache is the k returned (computed once, stored
twice), by the same code as qk_norm_rope's, so both are bit for bit what qk_norm_rope + store_kvcache give.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops import pdl
from xllm_gen.runtime.ops.pdl import pdl_enter
from xllm_gen.runtime.ops.rope_kernels import _heads, _norm_rope_heads, _norm_rope_values, _RopeLaunch
from xllm_gen.runtime.ops.triton_util import _warps


@triton.jit
def _qk_norm_rope_store_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, kc_ptr, vc_ptr, slot_ptr,
                               pos_ptr, cache_ptr, axis_ptr, sqn, sqh, skn, skh, svn, svh, stride_pos_axis, H, Hk,
                               eps, HEAD_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr, QH_BLOCK: tl.constexpr,
                               KH_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, HAS_NORM: tl.constexpr,
                               IS_MROPE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    j = tl.arange(0, HALF_BLOCK)
    jm = j < HALF
    if IS_MROPE:
        axis = tl.load(axis_ptr + j, mask=jm, other=0).to(tl.int64)
        p = tl.load(pos_ptr + axis * stride_pos_axis + n, mask=jm, other=0).to(tl.int64)
    else:
        p = tl.load(pos_ptr + n).to(tl.int64)
    c = tl.load(cache_ptr + p * HEAD_DIM + j, mask=jm, other=0.0)
    s = tl.load(cache_ptr + p * HEAD_DIM + HALF + j, mask=jm, other=0.0)
    _norm_rope_heads(q_ptr + n * sqn, sqh, qw_ptr, qo_ptr + n * H * HEAD_DIM, H, c, s, j, jm, eps,
                     HEAD_DIM, QH_BLOCK, HAS_NORM)
    # k once, stored twice (returned and cached): the cache holds exactly the k returned
    k1, k2 = _norm_rope_values(k_ptr + n * skn, skh, kw_ptr, Hk, c, s, j, jm, eps, HEAD_DIM, KH_BLOCK, HAS_NORM)
    h = tl.arange(0, KH_BLOCK)[:, None]
    mk = (h < Hk) & jm[None, :]
    tl.store(ko_ptr + n * Hk * HEAD_DIM + h * HEAD_DIM + j[None, :], k1, mask=mk)
    tl.store(ko_ptr + n * Hk * HEAD_DIM + h * HEAD_DIM + HALF + j[None, :], k2, mask=mk)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    row = tl.maximum(slot, 0) * Hk * HEAD_DIM
    hk_store = tl.where(slot >= 0, Hk, 0)               # a padding row (slot -1) writes nothing
    ms = (h < hk_store) & jm[None, :]
    tl.store(kc_ptr + row + h * HEAD_DIM + j[None, :], k1, mask=ms)
    tl.store(kc_ptr + row + h * HEAD_DIM + HALF + j[None, :], k2, mask=ms)
    d = tl.arange(0, D_BLOCK)[None, :]
    m = (h < hk_store) & (d < HEAD_DIM)
    vv = tl.load(v_ptr + n * svn + h * svh + d, mask=m, other=0.0)
    tl.store(vc_ptr + row + h * HEAD_DIM + d, vv, mask=m)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: Optional[torch.Tensor],
                       k_weight: Optional[torch.Tensor], eps: float, positions: torch.Tensor,
                       cos_sin_cache: torch.Tensor, axis_map: Optional[torch.Tensor], k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """rope_kernels.qk_norm_rope(q, k, ...) -> (q, k), and k (normed, rotated), v [N, Hk, D] written to the
    caches at slot_mapping [N] (-1: skipped), in one launch. Caches contiguous, of k's dtype."""
    if v.shape != k.shape or k_cache.dtype != k.dtype or v_cache.dtype != v.dtype:
        raise ValueError(f"qk_norm_rope_store: k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)}, caches "
                         f"{k_cache.dtype} / {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("qk_norm_rope_store: caches must be contiguous [num_blocks, block_size, Hk, D]")
    r = _RopeLaunch(q, k, q_weight, k_weight, positions, axis_map, "qk_norm_rope_store")
    v = _heads(v)
    if r.N == 0:
        return r.qo, r.ko
    _qk_norm_rope_store_kernel[(r.N,)](
        r.q, r.k, v, r.qw, r.kw, r.qo, r.ko, k_cache, v_cache, slot_mapping, r.positions, cos_sin_cache, r.ax,
        r.q.stride(0), r.q.stride(1), r.k.stride(0), r.k.stride(1), v.stride(0), v.stride(1), r.pos_stride,
        r.H, r.Hk, eps, HEAD_DIM=r.D, HALF_BLOCK=r.half_block, QH_BLOCK=r.qh, KH_BLOCK=r.kh,
        D_BLOCK=triton.next_power_of_2(r.D), HAS_NORM=r.has_norm, IS_MROPE=r.is_mrope,
        num_warps=_warps(r.qh * r.half_block), **pdl.launch(r.q))
    return r.qo, r.ko


@dataclass
class RopeStore:
    """A decode step's q/k norm + rotary + KV-cache write, handed to the attention instead of run before it
    (runtime/layers/fused.qk_norm_rope_store): the attention's Triton decode kernel does it in its own launch
    (decode_attention's `rope` prologue); any other kernel runs `apply` first, the kernel above."""
    k: torch.Tensor                          # [N, Hk, D] as the projection left it
    v: torch.Tensor                          # [N, Hk, D]
    q_weight: Optional[torch.Tensor]         # the q / k RMSNorm weights (None: no norms)
    k_weight: Optional[torch.Tensor]
    eps: float
    positions: torch.Tensor                  # [N], or [axes, N] with axis_map (mRoPE)
    cos_sin_cache: torch.Tensor              # [max_position, D]: cos | sin
    slot_mapping: torch.Tensor               # [N], -1: a padding row
    q: Optional[torch.Tensor] = None         # the q it was made for: the attention must get exactly that q
    axis_map: Optional[torch.Tensor] = None  # mRoPE: [D/2], the positions row each frequency reads

    def check(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """q / k as the attention got them must be the ones given with this (nothing changed q or k in between)."""
        if (self.q is not None and q is not self.q) or k is not self.k:
            raise RuntimeError("q or k changed between qk_norm_rope_store and the attention that runs its rotary: the "
                               "generated code must pass into_attention=False there")

    def apply(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
        """(q, k) normed and rotated, k and v written to the caches: the separate kernel."""
        return qk_norm_rope_store(q, self.k, self.v, self.q_weight, self.k_weight, self.eps, self.positions,
                                  self.cos_sin_cache, self.axis_map, k_cache, v_cache, self.slot_mapping)

    def launch_args(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale) -> tuple:
        """The decode kernel's prologue arguments (k, v, q / k norm weights, positions, cos / sin, slots, the axis map,
        the k and v row and head strides, the positions' axis stride, eps), checked against q and the caches."""
        B, H, D = q.shape
        Hk = k_cache.shape[2]
        k, v = _heads(self.k), _heads(self.v)
        pos, ax = self.positions, self.axis_map
        if pos.stride(-1) != 1:
            pos = pos.contiguous()
        multi = pos.dim() == 2
        if (k.shape != (B, Hk, D) or v.shape != k.shape or D & (D - 1) or k_cache.dtype != q.dtype
                or v_cache.dtype != q.dtype or pos.dim() not in (1, 2) or pos.shape[-1] < B
                or multi != (ax is not None) or (multi and (ax.shape != (D // 2,) or ax.device != q.device))
                or self.slot_mapping.shape[0] < B or self.cos_sin_cache.shape[-1] != D):
            raise ValueError(f"decode attention rope prologue: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, v "
                             f"{tuple(v.shape)}, caches {k_cache.dtype} {tuple(k_cache.shape)}, positions "
                             f"{tuple(pos.shape)}, axis map {None if ax is None else tuple(ax.shape)}, cos/sin "
                             f"{tuple(self.cos_sin_cache.shape)}")
        if not all(isinstance(s, (int, float)) and float(s) == 1.0 for s in (k_scale, v_scale)):
            raise ValueError("decode attention rope prologue: a scaled KV cache (the prologue writes unscaled values)")
        qw = self.q_weight if self.q_weight is not None else q
        kw = self.k_weight if self.k_weight is not None else q
        return (k, v, qw, kw, pos, self.cos_sin_cache, self.slot_mapping, ax if multi else pos,
                k.stride(0), k.stride(1), v.stride(0), v.stride(1), pos.stride(0) if multi else 0, float(self.eps))
