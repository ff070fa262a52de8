"""Fused ops: each one a torch reference (ops/reference.py), a Triton kernel (ops/triton_kernels.py's namespace) and a
torch custom op `xllm::<name>` with a fake implementation. CUDA tensors go to the Triton kernel, anything
else to the reference. Set XLLM_OPS=torch to force the references on CUDA too (debugging).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from xllm_gen.runtime.ops import reference

__all__ = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_and_mul", "rope", "qk_norm_rope", "store_kvcache",
           "skinny_gemm", "vision_rope", "reference", "use_triton"]

_FORCE_TORCH = os.environ.get("XLLM_OPS", "").lower() == "torch"


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and not _FORCE_TORCH


def _direct() -> bool:
    """Eager CUDA calls (and CUDA-graph capture) launch the Triton kernel directly: the custom op's Python
    dispatch costs tens of microseconds per call, which adds up to milliseconds in an eager prefill.
    Under torch.compile the custom ops are used, so the kernels stay opaque to tracing."""
    return not _FORCE_TORCH and not torch.compiler.is_compiling()


def _tk():
    from xllm_gen.runtime.ops import triton_kernels
    return triton_kernels


# ---------------------------------------------------------------- rms_norm
def _norm_dtype(x_dtype, w_dtype, weight_offset):
    return x_dtype if weight_offset else torch.promote_types(x_dtype, w_dtype)


@torch.library.custom_op("xllm::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    if use_triton(x):
        return _tk().rms_norm(x, weight, eps, weight_offset)
    return reference.rms_norm(x, weight, eps, weight_offset)


@_rms_norm.register_fake
def _(x, weight, eps, weight_offset=0.0):
    return torch.empty_like(x, dtype=_norm_dtype(x.dtype, weight.dtype, weight_offset))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """weight_offset 0: HF's w-scaled RMSNorm (`weight * x_normed.to(dtype)`); 1.0: the (1 + weight) RMSNorm,
    computed in float32 and cast to x's dtype."""
    if not x.is_cuda:  # skip the custom-op dispatch cost on the CPU path
        return reference.rms_norm(x, weight, eps, weight_offset)
    if _direct():
        return _tk().rms_norm(x, weight, eps, weight_offset)
    return torch.ops.xllm.rms_norm(x, weight, eps, weight_offset)


# ---------------------------------------------------------------- fused residual add + rms_norm
@torch.library.custom_op("xllm::fused_add_rms_norm", mutates_args=())
def _fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float, weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return _tk().fused_add_rms_norm(x, residual, weight, eps, weight_offset)
    y, r = reference.fused_add_rms_norm(x, residual, weight, eps, weight_offset)
    return y, r


@_fused_add_rms_norm.register_fake
def _(x, residual, weight, eps, weight_offset=0.0):
    r = torch.empty_like(x, dtype=torch.promote_types(x.dtype, residual.dtype))
    return torch.empty_like(r, dtype=_norm_dtype(r.dtype, weight.dtype, weight_offset)), r


def fused_add_rms_norm(x, residual, weight, eps, weight_offset: float = 0.0):
    """Returns (rms_norm(x + residual), x + residual)."""
    if not x.is_cuda:
        return reference.fused_add_rms_norm(x, residual, weight, eps, weight_offset)
    if _direct():
        return _tk().fused_add_rms_norm(x, residual, weight, eps, weight_offset)
    return torch.ops.xllm.fused_add_rms_norm(x, residual, weight, eps, weight_offset)


# ---------------------------------------------------------------- silu_and_mul
@torch.library.custom_op("xllm::silu_and_mul", mutates_args=())
def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return _tk().silu_and_mul(x)
    return reference.silu_and_mul(x)


@_silu_and_mul.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not x.is_cuda:
        return reference.silu_and_mul(x)
    if _direct():
        return _tk().silu_and_mul(x)
    return torch.ops.xllm.silu_and_mul(x)


# ---------------------------------------------------------------- gelu_and_mul
@torch.library.custom_op("xllm::gelu_and_mul", mutates_args=())
def _gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    if use_triton(x):
        return _tk().gelu_and_mul(x, approximate)
    return reference.gelu_and_mul(x, approximate)


@_gelu_and_mul.register_fake
def _(x, approximate="tanh"):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """x [..., 2n] -> gelu(x[..., :n]) * x[..., n:]; approximate "tanh" (gelu_pytorch_tanh) or "none" (erf)."""
    if not x.is_cuda:
        return reference.gelu_and_mul(x, approximate)
    if _direct():
        return _tk().gelu_and_mul(x, approximate)
    return torch.ops.xllm.gelu_and_mul(x, approximate)


# ---------------------------------------------------------------- q/k norm + rotary
@torch.library.custom_op("xllm::qk_norm_rope", mutates_args=())
def _qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: Optional[torch.Tensor],
                  k_weight: Optional[torch.Tensor], eps: float, positions: torch.Tensor,
                  inv_freq: torch.Tensor, cos_sin_cache: torch.Tensor,
                  axis_map: Optional[torch.Tensor], attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        return _tk().qk_norm_rope(q, k, q_weight, k_weight, eps, positions, cos_sin_cache, axis_map)
    qo, ko = reference.qk_norm_rope(q, k, q_weight, k_weight, eps, positions, inv_freq, axis_map, attention_factor)
    return qo.contiguous(), ko.contiguous()


@_qk_norm_rope.register_fake
def _(q, k, q_weight, k_weight, eps, positions, inv_freq, cos_sin_cache, axis_map, attention_factor=1.0):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)


def qk_norm_rope(q, k, q_weight, k_weight, eps, positions, inv_freq, cos_sin_cache, axis_map=None,
                 attention_factor: float = 1.0):
    """q [N, H, D], k [N, Hk, D] -> per-head RMSNorm (weights may be None: no norm) then rotary.

    positions [N] (neox) or [3, N] (mRoPE, axis_map [D/2] int32 gives each frequency slot's axis).
    The CPU path computes cos/sin from inv_freq as HF does, times attention_factor (the rope type's, e.g.
    yarn's); the Triton path reads cos_sin_cache [max_position, D] float32 (cos | sin halves), which already
    holds that factor (Rotary builds it so).
    """
    if not q.is_cuda:
        return reference.qk_norm_rope(q, k, q_weight, k_weight, eps, positions, inv_freq, axis_map, attention_factor)
    if _direct():
        return _tk().qk_norm_rope(q, k, q_weight, k_weight, eps, positions, cos_sin_cache, axis_map)
    return torch.ops.xllm.qk_norm_rope(q, k, q_weight, k_weight, eps, positions, inv_freq, cos_sin_cache, axis_map,
                                       attention_factor)


def rope(q, k, positions, inv_freq, cos_sin_cache, axis_map=None, attention_factor: float = 1.0):
    return qk_norm_rope(q, k, None, None, 0.0, positions, inv_freq, cos_sin_cache, axis_map, attention_factor)


# ---------------------------------------------------------------- KV-cache write
@torch.library.custom_op("xllm::store_kvcache", mutates_args=("k_cache", "v_cache"))
def _store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    if use_triton(k):
        _tk().store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        reference.store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@_store_kvcache.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    return None


def store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """k, v [N, Hk, D] -> caches [num_blocks, block_size, Hk, D] at flat slots; slot -1 is skipped. k_scale / v_scale:
    KV-cache scales per tensor (floats) or per KV head ([Hk, 1] float32 tensors) (the cache holds k / k_scale,
    v / v_scale; a float8 cache saturates at +-448)."""
    per_head = isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor)
    if not k.is_cuda or (per_head and not _direct()):
        # (per-KV-head scales under torch.compile or XLLM_OPS=torch: the torch store; the custom op takes floats)
        reference.store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    if _direct():       # per-KV-head scales ([Hk, 1] float32 tensors) too: the kernel reads them per head
        _tk().store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    torch.ops.xllm.store_kvcache(k, v, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale))


# ---------------------------------------------------------------- vision rotary (in place on CUDA)
@torch.library.custom_op("xllm::vision_rope_", mutates_args=("q", "k"))
def _vision_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if use_triton(q):
        _tk().vision_rope_(q, k, cos, sin)
        return
    q2, k2 = reference.vision_rope(q, k, cos, sin)
    q.copy_(q2)
    k.copy_(k2)


def vision_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The vision tower's 2-D rotary on q, k [P, H, D] by cos, sin [P, D] (float32 math, results in q's dtype).
    On CUDA one Triton kernel rotates both in place (they are views of the fresh qkv projection) and returns
    them; on CPU the reference returns new tensors."""
    if not q.is_cuda or _FORCE_TORCH:
        return reference.vision_rope(q, k, cos, sin)
    if _direct():
        _tk().vision_rope_(q, k, cos, sin)
    else:
        torch.ops.xllm.vision_rope_(q, k, cos, sin)
    return q, k


# ---------------------------------------------------------------- skinny GEMM (decode GEMV)
def skinny_gemm_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The torch reference of skinny_gemm: F.linear (output in x's dtype)."""
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


@torch.library.custom_op("xllm::skinny_gemm", mutates_args=())
def _skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 config: Optional[list[int]] = None) -> torch.Tensor:
    if use_triton(x):
        return _tk().skinny_gemm(x, weight, bias, config=tuple(config) if config else None)
    return skinny_gemm_reference(x, weight, bias)


@_skinny_gemm.register_fake
def _(x, weight, bias, config=None):
    return x.new_empty((x.shape[0], weight.shape[0]))


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                config: Optional[tuple] = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight [N, K]^T (+ bias), M <= 64, in x's dtype (fp32 accumulation): a Triton kernel
    that streams the weight at HBM speed for decode batches; F.linear on CPU. config: (BLOCK_N, BLOCK_K,
    num_warps, num_stages) for the FMA kernel (M <= 8; default the launch table's, skinny_fma.skinny_gemm_config),
    (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) for the tensor-core one (9..64 rows; default
    skinny_mma_config's)."""
    if not x.is_cuda:
        return skinny_gemm_reference(x, weight, bias)
    if _direct():
        return _tk().skinny_gemm(x, weight, bias, config=config)
    return torch.ops.xllm.skinny_gemm(x, weight, bias, list(config) if config else None)
