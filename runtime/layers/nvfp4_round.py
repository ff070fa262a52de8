"""Rounding to NVFP4 and back (a fake quantization): E2M1 values with one E4M3 scale per 16 consecutive values of
the last dimension, rounded to nearest-even. An attention whose keys and values were trained so rounded attends over
them rounded (attention `kv_nvfp4`): the layer rounds its k and v before the KV cache, so every reader of the cache
(a layer that shares it, `kv_source`) reads them rounded too (the rounding is per token and per head, so rounding
before the cache equals rounding the gathered cache)."""
from __future__ import annotations

import torch


def nvfp4_round(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] (d a multiple of 16) rounded to NVFP4 and back, in x's dtype: per block of 16, scale =
    e4m3(clamp(amax / 6, 2 ** -9, 448)); magnitudes / scale clamped to 6 and rounded (ties to even) on the E2M1
    grid (steps of 0.5 below 2, 1 below 4, 2 up to 6); computed in float32."""
    if x.shape[-1] % 16:
        raise ValueError(f"nvfp4_round: the last dimension ({x.shape[-1]}) must be a multiple of 16")
    blocks = x.float().unflatten(-1, (-1, 16))
    scale = (blocks.abs().amax(-1, keepdim=True) / 6).clamp(2 ** -9, 448).to(torch.float8_e4m3fn).float()
    scaled = blocks / scale
    magnitude = scaled.abs().clamp(max=6)
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    rounded = torch.round(magnitude / step) * step
    return (rounded.copysign(scaled) * scale).flatten(-2).to(x.dtype)
