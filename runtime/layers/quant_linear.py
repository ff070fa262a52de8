"""Packed low-precision weights of a linear layer (runtime/layers/linear.py `_Linear.packed`), set at load.

On CUDA a quantized checkpoint's 4-bit (AWQ / GPTQ) or fp8 layer keeps its weights packed, with no dequantized copy:
`PackedInt4` (qweight int32 [N, K / 8], scales [N, K / g], zeros uint8 [N, K / g]) and `PackedFp8` (float8_e4m3fn
[N, K], float32 scales [N, ceil(K / bk)], one per row and bk columns). Their forward is the weight-only GEMM of
runtime/ops/quant_gemv.py (bf16 / fp16 activations on CUDA, up to GEMV_MAX_M rows: decode, the split-K GEMV or the
tensor-core tile as quant_gemv.gemv_choice picks; fp8 with inputs quantized per token and 128 columns from
fp8_block_gemm.DECODE_MIN_M rows: the block-scaled float8 GEMM; more rows, a prefill
chunk: for such fp8 the block-scaled float8 GEMM (ops/fp8_block_gemm.py),
otherwise the weight dequantized for the call by one Triton kernel, then cuBLAS), or, on the CPU (tests), F.linear on the dequantized
weight: the same values the reference layer holds (dequant_int4 / dequant_fp8 round (q - z) * s and
q * s once to the activation dtype), so a packed model on the CPU must give the reference model's tokens.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.ops import fp8_block_gemm, quant_tinygemm
from xllm_gen.runtime.ops import quant_gemv as Q

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def _locks(N: int, device) -> Optional[torch.Tensor]:
    """The layer's own split-K counters (ops/quant_splitk.py), allocated at load (never inside a graph capture)."""
    from xllm_gen.runtime.ops.quant_splitk import new_lock_buffer
    return new_lock_buffer(N, device) if device.type == "cuda" else None


class PackedInt4(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.group = int(group)
        self.out_features, self.in_features = qweight.shape[0], qweight.shape[1] * 8
        self.locks = _locks(self.out_features, qweight.device)
        # the same weight in tinygemm's layout, the fastest kernel for 1-4 rows of bf16 (ops/quant_tinygemm.py)
        fits = qweight.is_cuda and quant_tinygemm.supported(self.out_features, self.in_features, self.group,
                                                            qweight.device)
        self.tinygemm = quant_tinygemm.pack(Q.unpack_int4(qweight), scales, zeros, self.group) if fits else None

    def dequantized(self, dtype) -> torch.Tensor:
        if self.qweight.is_cuda:
            return Q.int4_dequantize(self.qweight, self.scales, self.zeros, self.group, dtype)
        return Q.dequant_int4(self.qweight, self.scales, self.zeros, self.group, dtype)

    def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None, act_quant=None) -> torch.Tensor:
        if x.is_cuda and x.dtype in _KERNEL_DTYPES and x.numel() <= Q.GEMV_MAX_M * self.in_features:
            x2 = x.reshape(-1, self.in_features)
            y = Q.int4_gemm(x2, self.qweight, self.scales, self.zeros, self.group, bias, locks=self.locks,
                            tinygemm=self.tinygemm)
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantized(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"int4, N={self.out_features}, K={self.in_features}, group={self.group}"


class PackedFp8(nn.Module):
    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block_cols: int):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.block = (1, int(block_cols))
        self.out_features, self.in_features = weight.shape
        self.locks = _locks(self.out_features, weight.device)
        # the scales as the prefill's block-scaled float8 GEMM reads them (None: that GEMM cannot take the layer)
        self.kernel_scale = (fp8_block_gemm.kernel_scales(scale, self.block[1], self.out_features, self.in_features)
                             if weight.is_cuda else None)

    def dequantized(self, dtype) -> torch.Tensor:
        if self.weight.is_cuda:
            return Q.fp8_dequantize(self.weight, self.scale, self.block, dtype)
        return Q.dequant_fp8(self.weight, self.scale, self.block, dtype)

    def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None, act_quant=None) -> torch.Tensor:
        """act_quant: the layer's input quantization (x went through it): per token and 128 columns lets a prefill
        chunk, and a decode batch of DECODE_MIN_M rows or more, run the block-scaled float8 GEMM
        (ops/fp8_block_gemm.py) instead of dequantize + cuBLAS / a weight-only GEMV."""
        if x.is_cuda and x.dtype in _KERNEL_DTYPES:
            x2 = x.reshape(-1, self.in_features)
            if x2.shape[0] <= Q.GEMV_MAX_M and not fp8_block_gemm.takes_decode(act_quant, x2, self.kernel_scale):
                y = Q.fp8_gemm(x2, self.weight, self.scale, self.block, bias, locks=self.locks)
                return y.reshape(*x.shape[:-1], self.out_features)
            if fp8_block_gemm.takes(act_quant, x2, self.kernel_scale):
                y = fp8_block_gemm.fp8_block_linear(x2, self.weight, self.kernel_scale, bias)
                return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantized(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"fp8 e4m3, N={self.out_features}, K={self.in_features}, scale per row and {self.block[1]} columns"


def pack_fp8_components(codes: torch.Tensor, scales: torch.Tensor, block: Optional[int] = None) -> Optional[tuple]:
    """This rank's [N, K] fp8 values and per-element scales (float32) -> (float8 weight, scales [N, ceil(K / bk)],
    bk), bk the widest of K / 128-multiples / the checkpoint's `block` columns over which every row's scale is
    constant from column 0; None if none (a TP split that cuts a scale block: the layer keeps its dequantized
    weight)."""
    N, K = codes.shape
    for bk in (K,) + tuple(b for b in sorted({512, 256, 128, block or 128}, reverse=True) if b < K):
        s = scales[:, ::bk]
        if torch.equal(scales, s.repeat_interleave(bk, 1)[:, :K]):
            return codes.to(torch.float8_e4m3fn), s.contiguous(), bk
    return None


def rtn_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit quantization of w [N, K] per `group` input columns (AWQ's form):
    (codes uint8 [N, K], scales float16 [N, K / g], zeros uint8 [N, K / g])."""
    N, K = w.shape
    wg = w.float().reshape(N, K // group, group)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    s = ((hi - lo) / 15).clamp(min=1e-6).half()
    z = torch.round(-lo / s.float()).clamp(0, 15)
    q = torch.clamp(torch.round(wg / s.float()[..., None]) + z[..., None], 0, 15)
    return q.reshape(N, K).to(torch.uint8), s, z.to(torch.uint8)


@torch.no_grad()
def quantize_dummy(model: nn.Module, kind: str, pack: Optional[bool] = None, skip: Sequence[str] = ()) -> int:
    """Benchmarks without a quantized checkpoint (load_format="dummy", `_debug={"dummy_quantize": kind}`): every
    linear layer's weight (not an MoE router's) quantized in place, "int4" (round to nearest, groups of 128, zero
    points: an AWQ checkpoint's form), "fp8" (e4m3 per output channel, weights only) or "fp8_block" (e4m3 with a
    scale per 128 x 128 block, as the official *-FP8 releases; held, as a loaded checkpoint's, per row and 128
    columns; the layers' inputs are then quantized as those releases' are: dynamic fp8 per token and 128 columns,
    layers/quant.py ActQuant), packed (`pack`; default on CUDA) or written back dequantized. MoE experts too (as
    FusedMoE.packed). `skip`: module names left unquantized with what they hold, at any depth ("visual" matches
    model.visual; the releases keep e.g. a vision tower in bf16; `_debug={"dummy_quantize_skip": [...]}`). Returns the
    number of layers quantized."""
    from xllm_gen.runtime.layers.linear import _Linear
    from xllm_gen.runtime.layers.moe import FusedMoE
    from xllm_gen.runtime.layers.quant import ActQuant
    if kind not in ("int4", "fp8", "fp8_block"):
        raise ValueError(f"dummy_quantize={kind!r}: 'int4', 'fp8' or 'fp8_block'")
    routers = {id(c) for m in model.modules() if any(isinstance(x, FusedMoE) for x in m.children())
               for c in m.children() if isinstance(c, _Linear)}
    n = 0
    for name, mod in model.named_modules():
        if any(f".{p}." in f".{name}." for p in skip):     # a module named so at any depth, and what it holds
            continue
        if isinstance(mod, FusedMoE):
            n += _quantize_dummy_experts(mod, kind, pack)
            continue
        w = getattr(mod, "weight", None)
        if not isinstance(mod, _Linear) or id(mod) in routers or w is None or w.dim() != 2 or w.shape[1] % 8:
            continue
        do_pack = w.is_cuda if pack is None else pack
        if kind == "int4":
            g = 128 if w.shape[1] % 128 == 0 else w.shape[1]
            codes, s, z = rtn_int4(w, g)
            packed = PackedInt4(Q.pack_int4(codes), s, z, g)
        elif kind == "fp8_block" and w.shape[0] % 128 == 0 and w.shape[1] % 128 == 0:
            packed = PackedFp8(*_fp8_rows(w, 128), 128)                       # scales per row and 128 columns
            mod.act_quant = ActQuant("group", 128)     # and the releases' activations: dynamic, per token and 128
        else:
            packed = PackedFp8(*_fp8_rows(w, w.shape[1]), w.shape[1])
        if do_pack:
            mod.packed = packed
            mod.weight = nn.Parameter(w.new_empty(0), requires_grad=False)
        else:
            w.copy_(packed.dequantized(w.dtype))
        n += 1
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return n


def _fp8_rows(w: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] as float8 e4m3 with a scale per row and bk columns: bk = 128 takes the amax of each 128 x 128 block
    (the *-FP8 releases' block scales, repeated over the block's rows), bk = K one scale per row."""
    N, K = w.shape
    if bk == K:
        s = (w.float().abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
    else:
        sb = (w.float().abs().reshape(N // bk, bk, K // bk, bk).amax((1, 3)) / 448.0).clamp(min=1e-12)
        s = sb.repeat_interleave(bk, 0)
    q = (w.float() / s.repeat_interleave(bk, 1)[:, :K]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s.contiguous()


@torch.no_grad()
def _quantize_dummy_experts(mod, kind: str, pack: Optional[bool]) -> int:
    """quantize_dummy of a FusedMoE: its stacked experts as 4-bit codes (groups of 128, zero points: an AWQ MoE's), or
    float8 (per channel, or 128 x 128 blocks with the inputs and the intermediate quantized per token and 128
    columns, as the FP8 MoE releases), kept packed as a loaded checkpoint's (FusedMoE.packed) or written back
    dequantized. 1 if quantized (gated experts without biases)."""
    from xllm_gen.runtime.layers.quant import ActQuant
    from xllm_gen.runtime.ops.moe import dequantize_packed, pack_nibbles
    if not mod.gated or mod.has_bias:
        return 0
    packed = {}
    for attr in ("gate_up_proj", "down_proj"):
        w = getattr(mod, attr)
        E, N, K = w.shape
        if kind == "int4":
            g = 128 if K % 128 == 0 else K
            codes = torch.empty(E, N, K // 2, dtype=torch.uint8, device=w.device)
            scales = torch.empty(E, N, K // g, dtype=torch.float16, device=w.device)
            zeros = torch.empty(E, N, K // g, dtype=torch.uint8, device=w.device)
            for e in range(E):                               # an expert at a time: no float32 copy of them all
                q, scales[e], zeros[e] = rtn_int4(w[e], g)
                codes[e] = pack_nibbles(q)
            got = (codes, scales, g, zeros)
        else:
            bk = 128 if kind == "fp8_block" and N % 128 == 0 and K % 128 == 0 else K
            codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
            scales = torch.empty(E, N, -(-K // bk), dtype=torch.float32, device=w.device)
            for e in range(E):
                codes[e], scales[e] = _fp8_rows(w[e], bk)
            got = (codes, scales, bk)
        if w.is_cuda if pack is None else pack:
            packed[attr] = got
            setattr(mod, attr, nn.Parameter(w.new_empty(0), requires_grad=False))
        else:
            w.copy_(dequantize_packed(got, w.dtype))
    mod.packed = packed or None
    if kind == "fp8_block":
        mod.act_quant, mod.act_quant_down = ActQuant("group", 128), ActQuant("group", 128)
    return 1
