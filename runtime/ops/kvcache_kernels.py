"""Triton kernel of the paged KV-cache write (store_kvcache): the step's k, v rows into the caches at their slots,
optionally divided by per-tensor or per-KV-head scales, fp8 saturated. The launcher accepts CPU tensors when
TRITON_INTERPRET=1 was set before triton was imported (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops import pdl
from xllm_gen.runtime.ops.pdl import pdl_enter
from xllm_gen.runtime.ops.triton_util import _warps


# ---------------------------------------------------------------------------------------------- KV-cache write
@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, skn, svn, k_scale, v_scale, ks_ptr, vs_ptr,
                          ROW: tl.constexpr, BLOCK: tl.constexpr, SCALED: tl.constexpr = False,
                          FP8: tl.constexpr = False, D: tl.constexpr = 1, K_HEAD: tl.constexpr = False,
                          V_HEAD: tl.constexpr = False, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = (offs < ROW) & (slot >= 0)
    kk = tl.load(k_ptr + n * skn + offs, mask=mask, other=0.0)
    vv = tl.load(v_ptr + n * svn + offs, mask=mask, other=0.0)
    if SCALED:          # KV-cache scales: the cache holds k / k_scale (correctly rounded, as torch's)
        ks = k_scale
        vs = v_scale
        if K_HEAD:      # per KV head: element (head h, d) of the row by k_scale[h]
            ks = tl.load(ks_ptr + offs // D, mask=offs < ROW, other=1.0)
        if V_HEAD:
            vs = tl.load(vs_ptr + offs // D, mask=offs < ROW, other=1.0)
        kk = tl.math.div_rn(kk.to(tl.float32), ks)
        vv = tl.math.div_rn(vv.to(tl.float32), vs)
    if FP8:             # float8 e4m3: saturate at +-448 (as the torch reference does)
        kk = tl.minimum(tl.maximum(kk.to(tl.float32), -448.0), 448.0)
        vv = tl.minimum(tl.maximum(vv.to(tl.float32), -448.0), 448.0)
    tl.store(kc_ptr + slot * ROW + offs, kk.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * ROW + offs, vv.to(vc_ptr.dtype.element_ty), mask=mask)


def _kv_rows(x: torch.Tensor) -> torch.Tensor:
    N, Hk, D = x.shape
    if x.stride(2) != 1 or x.stride(1) != D:
        x = x.contiguous()
    return x


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale=1.0, v_scale=1.0) -> None:
    """k_scale / v_scale: floats (per tensor) or float32 tensors [Hk] / [Hk, 1] on k's device (per KV head)."""
    N, Hk, D = k.shape
    if N == 0:
        return
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kvcache: caches must be contiguous [num_blocks, block_size, Hk, D]")
    if v.shape[-1] != D:
        raise ValueError(f"store_kvcache: k and v rows differ in width ({D} vs {v.shape[-1]})")
    k, v = _kv_rows(k), _kv_rows(v)
    row = Hk * D
    B = triton.next_power_of_2(row)
    heads = {}
    for name, sc in (("k", k_scale), ("v", v_scale)):
        if isinstance(sc, torch.Tensor):
            if sc.numel() != Hk or sc.dtype != torch.float32 or sc.device != k.device or not sc.is_contiguous():
                raise ValueError(f"store_kvcache: per-KV-head {name}_scale must be a contiguous float32 [{Hk}] tensor "
                                 f"on {k.device}, got {tuple(sc.shape)} {sc.dtype} on {sc.device}")
            heads[name] = sc.reshape(-1)
    ks = 1.0 if "k" in heads else float(k_scale)
    vs = 1.0 if "v" in heads else float(v_scale)
    scaled = bool(heads) or ks != 1.0 or vs != 1.0
    _store_kvcache_kernel[(N,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ks, vs,
                                heads.get("k", k), heads.get("v", k), ROW=row, BLOCK=B, SCALED=scaled,
                                FP8=k_cache.dtype == torch.float8_e4m3fn, D=D, K_HEAD="k" in heads,
                                V_HEAD="v" in heads, num_warps=_warps(B), **pdl.launch(k))
