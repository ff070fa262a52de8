"""The Triton backend of the fused ops (ops/__init__.py dispatches to it): one namespace over the kernel modules,
each of one kind of kernel with its launcher:

  norm_act_kernels.py   rms_norm, fused_add_rms_norm, silu_and_mul, gelu_and_mul
  rope_kernels.py       qk_norm_rope (q/k per-head RMSNorm + rotary), vision_rope_
  kvcache_kernels.py    store_kvcache
  skinny_fma.py        skinny_gemm (FMA weight stream, 1..8 rows), its launch table and tuning candidates
  skinny_mma.py         skinny_mma_gemm (tensor cores, 9..64 rows, split-K), its configs and candidates

The names are re-exported here unchanged (callers and tests use `triton_kernels.<name>`); new code may import
from the kernel modules directly.
"""
from __future__ import annotations

from xllm_gen.runtime.ops.kvcache_kernels import _kv_rows, _store_kvcache_kernel, store_kvcache
from xllm_gen.runtime.ops.norm_act_kernels import (
    _gelu_and_mul_kernel,
    _rms_norm_kernel,
    _rows,
    _silu_and_mul_kernel,
    fused_add_rms_norm,
    gelu_and_mul,
    norm_out_dtype,
    rms_norm,
    silu_and_mul,
)
from xllm_gen.runtime.ops.rope_kernels import (
    _heads,
    _norm_rope_heads,
    _norm_rope_values,
    _qk_norm_rope_kernel,
    _vision_rope_kernel,
    qk_norm_rope,
    vision_rope_,
)
from xllm_gen.runtime.ops.skinny_fma import (
    SKINNY_MAX_M,
    _skinny_gemm_kernel,
    skinny_gemm,
    skinny_gemm_candidates,
    skinny_gemm_config,
)
from xllm_gen.runtime.ops.skinny_mma import (
    _SPLITK_COUNTERS,
    SKINNY_MMA_MAX_M,
    _skinny_mma_kernel,
    _splitk_counters,
    skinny_mma_block_m,
    skinny_mma_candidates,
    skinny_mma_config,
    skinny_mma_gemm,
)
from xllm_gen.runtime.ops.triton_util import _warps

__all__ = [
    "SKINNY_MAX_M", "SKINNY_MMA_MAX_M", "_SPLITK_COUNTERS", "_gelu_and_mul_kernel", "_heads", "_kv_rows",
    "_norm_rope_heads", "_norm_rope_values", "_qk_norm_rope_kernel", "_rms_norm_kernel", "_rows",
    "_silu_and_mul_kernel", "_skinny_gemm_kernel", "_skinny_mma_kernel", "_splitk_counters", "_store_kvcache_kernel",
    "_vision_rope_kernel", "_warps", "fused_add_rms_norm", "gelu_and_mul", "norm_out_dtype", "qk_norm_rope",
    "rms_norm", "silu_and_mul", "skinny_gemm", "skinny_gemm_candidates", "skinny_gemm_config",
    "skinny_mma_block_m", "skinny_mma_candidates", "skinny_mma_config", "skinny_mma_gemm", "store_kvcache",
    "vision_rope_",
]
