"""FP8 quantization semantics of the linear layers (runtime/loading/quant_config.py reads the config).

Weights are dequantized at load (`Fp8WeightView`: the checkpoint's float8 values times their block / channel /
tensor scales, read lazily for this rank's rows and columns only, so any TP split works, also one that cuts a
scale block); the layer then holds them in the compute dtype. Activations are quantized as the checkpoint's
kernels would (`ActQuant`: an fp8 e4m3 round trip with dynamic per-token-group, per-token or per-tensor scales,
or the checkpoint's static `input_scale`; on CUDA one Triton launch, ops/fp8_act_quant.py, bit for bit the torch
ops of `ActQuant.reference`, except the per-tensor kind, which stays in torch). Online fp8 (`OnlineFp8View`) quantizes a float weight per output
channel at load. CPU and CUDA compute the same thing: these are the reference semantics a fused fp8 GEMM is
tested against.
"""
from __future__ import annotations

from typing import Optional

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)       # 448
INT8_MAX = 127.0
_MIN_SCALE = 1e-12


def div_rn(a: torch.Tensor, b) -> torch.Tensor:
    """a / b correctly rounded on every device. CUDA torch divides by a Python number as a multiply by its
    reciprocal (at times one ulp off: a different fp8 scale than the CPU's); a divisor tensor on a's device is a
    true division there, as on the CPU and in ops/fp8_act_quant.py (div_rn)."""
    if not isinstance(b, torch.Tensor):
        b = torch.full((), b, dtype=a.dtype, device=a.device)      # a fill kernel: capturable in a CUDA graph
    return a / b


def ceil_pow2(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= s (float32, normal, > 0), on the bits: exact (UE8M0 scales)."""
    bits = s.contiguous().view(torch.int32)
    e = bits & 0x7F800000
    return torch.where((bits & 0x7FFFFF) != 0, e + 0x800000, e).view(torch.float32)


def fp8_round_trip(x: torch.Tensor, scale) -> torch.Tensor:
    """x quantized to fp8 e4m3 with `scale` (x / scale saturated to +-448) and back, in float32."""
    return div_rn(x, scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(torch.float32) * scale


class ActQuant:
    """The activation quantization of one linear layer's input (called in its forward).

    kind: "group" (per token and group of `group` input columns, dynamic), "token" (per token, dynamic),
    "tensor" (one dynamic scale), "static" (the checkpoint's input_scale): fp8 e4m3; "int8_token", "int8_tensor",
    "int8_static": the same scales for int8 (symmetric: scale = amax / 127, q = round(x / scale) half to even,
    clamped to [-128, 127], as vLLM's int8 kernels). Under TP a row-parallel layer quantizes its own input
    columns (per token: this rank's columns, as vLLM's kernels do). `pow2` (fp8 dynamic kinds; a checkpoint's
    `scale_fmt: ue8m0`): each scale rounded up to a power of two, as DeepSeek's inference code and DeepGEMM's UE8M0
    recipe quantize the activations of the DeepSeek-V3.1 / V3.2 FP8 releases."""

    def __init__(self, kind: str, group: int = 0, scale: Optional[float] = None, pow2: bool = False):
        if pow2 and kind not in ("group", "token", "tensor"):
            raise ValueError(f"ActQuant: power-of-two scales are for the dynamic fp8 kinds, not {kind!r}")
        self.kind, self.group, self.scale, self.pow2 = kind, int(group), scale, bool(pow2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.kind in ("group", "token", "static"):     # one Triton launch, bit for bit the torch ops
            from xllm_gen.runtime.ops.fp8_act_quant import fp8_act_quant
            return fp8_act_quant(x, self.group if self.kind == "group" else None,
                                 self.scale if self.kind == "static" else None, self.pow2)
        return self.reference(x)

    def _dynamic(self, amax: torch.Tensor) -> torch.Tensor:
        s = div_rn(amax, FP8_MAX).clamp(min=_MIN_SCALE)
        return ceil_pow2(s) if self.pow2 else s

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        if self.kind.startswith("int8_"):
            if self.kind == "int8_static":
                s = self.scale
            else:
                amax = xf.abs().amax(dim=-1, keepdim=True) if self.kind == "int8_token" else xf.abs().amax()
                s = div_rn(amax, INT8_MAX).clamp(min=_MIN_SCALE)
            return (torch.round(div_rn(xf, s)).clamp(-INT8_MAX - 1, INT8_MAX) * s).to(dtype)
        if self.kind == "static":
            return fp8_round_trip(xf, self.scale).to(dtype)
        if self.kind == "tensor":
            return fp8_round_trip(xf, self._dynamic(xf.abs().amax())).to(dtype)
        if self.kind == "token":
            return fp8_round_trip(xf, self._dynamic(xf.abs().amax(dim=-1, keepdim=True))).to(dtype)
        K, g = xf.shape[-1], self.group                    # "group": the last group may be partial
        pad = (-K) % g
        xp = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
        xg = xp.reshape(*xp.shape[:-1], -1, g)
        y = fp8_round_trip(xg, self._dynamic(xg.abs().amax(dim=-1, keepdim=True))).reshape(xp.shape)
        return (y[..., :K] if pad else y).to(dtype)

    def __repr__(self) -> str:
        extra = f", group={self.group}" if self.kind == "group" else (
            f", scale={self.scale:g}" if self.kind in ("static", "int8_static") else "")
        extra += ", pow2" if self.pow2 else ""
        return f"ActQuant({self.kind}{extra})"


def _norm_index(idx, shape) -> tuple:
    """A 2-D read index (slice, or a tuple of slices) -> ((r0, r1), (c0, c1))."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    idx = idx + (slice(None),) * (2 - len(idx))
    out = []
    for s, n in zip(idx, shape):
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError("a quantized weight supports plain slices only")
        a, b, _ = s.indices(n)
        out.append((a, max(a, b)))
    return tuple(out)


class Fp8WeightView:
    """A float8 checkpoint weight [N, K] and its scale, seen as the dequantized float32 tensor (lazily, like a
    safetensors slice: only the rows / columns read, and the scales over them, are loaded).

    `block`: (rows, cols) of one scale; the scale tensor is [ceil(N / rows), ceil(K / cols)] (a per-tensor scale
    is one block of [N, K], a per-channel one blocks of [1, K])."""

    COMPONENTS = ("codes", "scales")       # what a repacking loader reads per element (runtime/layers/quant_linear)

    def __init__(self, weight, scale: torch.Tensor, block: tuple, component: str = "weight"):
        self.weight, self.scale, self.block, self.component = weight, scale.float(), block, component
        self.shape = tuple(int(s) for s in weight.get_shape()) if hasattr(weight, "get_shape") else tuple(weight.shape)

    def with_component(self, component: str) -> "Fp8WeightView":
        """The same window reads giving "codes" (the float8 values) or "scales" (each element's), float32."""
        return Fp8WeightView(self.weight, self.scale, self.block, component)

    def get_shape(self) -> list:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, idx) -> torch.Tensor:
        (r0, r1), (c0, c1) = _norm_index(idx, self.shape)
        bn, bk = self.block
        R0, C0 = r0 // bn * bn, c0 // bk * bk
        w = self.weight[R0:r1, C0:c1].to(torch.float32)
        s = self.scale[R0 // bn: -(-r1 // bn), C0 // bk: -(-c1 // bk)]
        s = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]
        out = w if self.component == "codes" else s if self.component == "scales" else w * s
        return out[r0 - R0:, c0 - C0:]


class OnlineFp8View:
    """A float checkpoint weight [N, K] quantized per output channel at load (scale = row amax / 448) and
    dequantized: what `quantization="fp8"` serves. Rows are independent, so any row range reads whole rows."""

    COMPONENTS = ("codes", "scales")

    def __init__(self, weight, component: str = "weight"):
        self.weight, self.component = weight, component
        self.shape = tuple(int(s) for s in weight.get_shape()) if hasattr(weight, "get_shape") else tuple(weight.shape)

    def with_component(self, component: str) -> "OnlineFp8View":
        return OnlineFp8View(self.weight, component)

    def get_shape(self) -> list:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, idx) -> torch.Tensor:
        (r0, r1), (c0, c1) = _norm_index(idx, self.shape)
        w = self.weight[r0:r1].to(torch.float32)
        s = div_rn(w.abs().amax(dim=1, keepdim=True), FP8_MAX).clamp(min=_MIN_SCALE)
        if self.component == "codes":
            return (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(torch.float32)[:, c0:c1]
        if self.component == "scales":
            return s.expand(-1, c1 - c0)
        return fp8_round_trip(w, s)[:, c0:c1]
