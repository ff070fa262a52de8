"""What an attention kernel that knows neither attention sinks nor per-KV-head KV-cache scales needs around it to
compute both (FlashInfer's paged prefill / decode wrappers; runtime/attention/flashinfer_run.py):

- before: `fold_k_scale(q, k_scale)`: each query head times its KV head's K-cache scale (the softmax scale stays);
- after: `attention_epilogue_(out, lse, sinks, v_scale)`: in place, out[n, h] *= sigmoid(lse_e[n, h] - sinks[h])
  (softmax with a sink logit per head, from the kernel's log-sum-exp; FlashInfer's is base 2, lse_e = lse2 * ln 2)
  times v_scale[h // group] (a V cache scaled per KV head).

One small Triton kernel each (no host sync, fixed launch shape: capturable in CUDA graphs); torch references in
ops/reference.py (`fold_k_scale`, `attention_epilogue`), used off CUDA and as the kernels' oracles.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops import reference

TILE = 4096         # elements (heads x padded head_dim) one program handles


@triton.jit
def _fold_k_scale_kernel(q_ptr, s_ptr, o_ptr, stride_qn, stride_qh, H, GROUP: tl.constexpr, D: tl.constexpr,
                         D_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D_PAD)
    h_ok = h < H
    m = h_ok[:, None] & (d < D)[None, :]
    x = tl.load(q_ptr + n * stride_qn + h[:, None] * stride_qh + d[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + h // GROUP, mask=h_ok, other=1.0)
    tl.store(o_ptr + (n * H + h[:, None]) * D + d[None, :], (x * s[:, None]).to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _epilogue_kernel(o_ptr, lse_ptr, sinks_ptr, vs_ptr, stride_on, stride_oh, stride_ln, H, LSE_SCALE,
                     GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                     HAS_SINKS: tl.constexpr, HAS_V: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D_PAD)
    h_ok = h < H
    f = tl.full([BLOCK_H], 1.0, tl.float32)
    if HAS_SINKS:       # sigmoid(lse_e - sink): 0 for a row without keys (lse -inf: exp(+inf) = inf), NaN guarded
        lse = tl.load(lse_ptr + n * stride_ln + h, mask=h_ok, other=float("-inf")) * LSE_SCALE
        sink = tl.load(sinks_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
        f = 1.0 / (1.0 + tl.exp(sink - lse))
        f = tl.where(lse == lse, f, 0.0)
    if HAS_V:
        f = f * tl.load(vs_ptr + h // GROUP, mask=h_ok, other=1.0)
    m = h_ok[:, None] & (d < D)[None, :]
    ptr = o_ptr + n * stride_on + h[:, None] * stride_oh + d[None, :]
    o = tl.load(ptr, mask=m, other=0.0).to(tl.float32)
    o = tl.where((f != 0.0)[:, None], o * f[:, None], 0.0)
    tl.store(ptr, o.to(o_ptr.dtype.element_ty), mask=m)


def _grid_tile(H: int, D: int) -> tuple[int, int, int]:
    d_pad = triton.next_power_of_2(D)
    block_h = max(1, min(triton.next_power_of_2(H), TILE // d_pad))
    return d_pad, block_h, triton.cdiv(H, block_h)


def _head_scales(scale: torch.Tensor, num_heads: int, device) -> tuple[torch.Tensor, int]:
    s = scale.reshape(-1)
    if s.dtype != torch.float32 or s.device != torch.device(device) or not s.is_contiguous():
        raise ValueError(f"per-KV-head scales must be a contiguous float32 tensor on {device}, got {s.dtype} on "
                         f"{s.device}")
    if num_heads % s.numel():
        raise ValueError(f"{s.numel()} per-KV-head scales do not divide {num_heads} query heads")
    return s, num_heads // s.numel()


def fold_k_scale_triton(q: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    N, H, D = q.shape
    s, group = _head_scales(k_scale, H, q.device)
    out = torch.empty(N, H, D, dtype=q.dtype, device=q.device)
    if N == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    d_pad, block_h, hb = _grid_tile(H, D)
    _fold_k_scale_kernel[(N, hb)](q, s, out, q.stride(0), q.stride(1), H, GROUP=group, D=D, D_PAD=d_pad,
                                  BLOCK_H=block_h, num_warps=4)
    return out


def attention_epilogue_triton(out: torch.Tensor, lse: Optional[torch.Tensor] = None,
                              sinks: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                              lse_base2: bool = True) -> torch.Tensor:
    N, H, D = out.shape
    if out.stride(-1) != 1:
        raise ValueError("attention epilogue: the output needs a contiguous last dimension")
    if sinks is not None and (lse is None or lse.shape != (N, H) or lse.stride(-1) != 1 or sinks.shape != (H,)
                              or sinks.stride(0) != 1):
        raise ValueError(f"attention epilogue: sinks need lse [{N}, {H}] (contiguous rows) and sinks [{H}], got "
                         f"{None if lse is None else tuple(lse.shape)} and {tuple(sinks.shape)}")
    if N == 0 or (sinks is None and v_scale is None):
        return out
    vs, group = _head_scales(v_scale, H, out.device) if v_scale is not None else (out, 1)
    d_pad, block_h, hb = _grid_tile(H, D)
    _epilogue_kernel[(N, hb)](out, out if lse is None else lse, out if sinks is None else sinks, vs,
                              out.stride(0), out.stride(1), 0 if lse is None else lse.stride(0), H,
                              reference.LN2 if lse_base2 else 1.0, GROUP=group, D=D, D_PAD=d_pad, BLOCK_H=block_h,
                              HAS_SINKS=sinks is not None, HAS_V=v_scale is not None, num_warps=4)
    return out


def fold_k_scale(q: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """q [N, H, D] times k_scale[h // G] per query head (k_scale [Hk] / [Hk, 1] float32): a new tensor in q's dtype.
    Triton on CUDA, the torch reference elsewhere."""
    from xllm_gen.runtime.ops import use_triton
    return fold_k_scale_triton(q, k_scale) if use_triton(q) else reference.fold_k_scale(q, k_scale)


def attention_epilogue_(out: torch.Tensor, lse: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
                        v_scale: Optional[torch.Tensor] = None, lse_base2: bool = True) -> torch.Tensor:
    """In place: out [N, H, Dv] times sigmoid(lse_e - sinks[h]) (with `sinks` [H]; lse [N, H] base 2 unless
    lse_base2=False) times v_scale[h // G] (with `v_scale` [Hk] / [Hk, 1] float32); returns out. See
    reference.attention_epilogue for the math."""
    from xllm_gen.runtime.ops import use_triton
    if use_triton(out):
        return attention_epilogue_triton(out, lse, sinks, v_scale, lse_base2)
    out.copy_(reference.attention_epilogue(out, lse, sinks, v_scale, lse_base2))
    return out
