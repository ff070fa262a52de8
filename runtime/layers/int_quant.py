"""Integer weight-only checkpoints (AWQ GEMM, GPTQ): a quantized layer's packed tensors seen as its weight.

`IntWeightView` reads `<layer>.qweight`, `.qzeros`, `.scales` (and GPTQ's `.g_idx`) lazily, like a safetensors slice,
and gives any [rows, cols] window of the layer's [out, in] weight (only the packed words, groups and scales under
that window are read, so any TP split works, also one that cuts a group or a packed word):

- AWQ (AutoAWQ, version gemm): qweight int32 [in, out / 8], qzeros int32 [in / g, out / 8], scales [in / g, out];
  the 8 nibbles of a word hold output columns in the order [0, 2, 4, 6, 1, 3, 5, 7]; w = (q - z) * s.
- GPTQ (bits 4 or 8, p = 32 / bits values a word): qweight int32 [in / p, out] (input rows packed in order,
  low bits first), qzeros int32 [groups, out / p] (output columns in order), scales [groups, out], g_idx int32 [in]
  (the group of each input row: i // g without act-order; any map with desc_act); checkpoint_format gptq stores
  the zeros minus 1 (zero = stored + 1), gptq_v2 as they are; w = (q - z) * s[g_idx].

- compressed-tensors pack-quantized (llm-compressor W4A16 / W8A16): weight_packed int32 [out, in / p] (input
  columns packed in order, low bits first, each value stored plus 2^(bits-1)), weight_scale [out, groups],
  weight_shape [2] (the unpacked [out, in]), asymmetric: weight_zero_point int32 [out / p, groups] (output rows packed,
  the same offset), act-order: weight_g_idx [in]; w = (q - z) * s[g_idx] (z = 2^(bits-1) when symmetric).

`component` chooses what a read returns, all float32: "weight" (the dequantized weight, the reference semantics:
(q - z) * s in float32, rounded once to the layer's dtype when copied), or "codes", "zeros", "scales" (per element),
which the loader reads through the same weight loader to repack this rank's part for the int4 GEMM
(runtime/layers/quant_linear.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from xllm_gen.runtime.layers.quant import _norm_index

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)         # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8


class IntQuantError(ValueError):
    pass


def _shape(sl) -> tuple:
    return tuple(int(s) for s in (sl.get_shape() if hasattr(sl, "get_shape") else sl.shape))


def _dtype(sl) -> str:
    try:
        return sl.get_dtype()
    except AttributeError:
        return str(getattr(sl, "dtype", ""))


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> [R * p, C]: row r * p + i from bits [i * bits, (i + 1) * bits) of row r (GPTQ qweight)."""
    p = 32 // bits
    shifts = (bits * torch.arange(p, dtype=torch.int32))[None, :, None]
    v = (words.to(torch.int32)[:, None, :] >> shifts) & ((1 << bits) - 1)
    return v.reshape(words.shape[0] * p, words.shape[1])


def unpack_cols(words: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """int32 [R, C] -> [R, C * p]: column c * p + order[i] from bits [i * bits, ...) of column c (AWQ: AWQ_ORDER;
    GPTQ qzeros: in order)."""
    p = 32 // bits
    shifts = (bits * torch.arange(p, dtype=torch.int32))[None, None, :]
    v = (words.to(torch.int32)[:, :, None] >> shifts) & ((1 << bits) - 1)          # [R, C, nibble i]
    if order is not None:
        v = v[:, :, torch.tensor([order.index(j) for j in range(p)])]               # -> [R, C, column j]
    return v.reshape(words.shape[0], words.shape[1] * p)


class IntWeightView:
    """The [out, in] weight of one AWQ / GPTQ layer (see the module doc). `open` checks the tensors' shapes and
    dtypes against each other and the config, naming the tensor."""
    COMPONENTS = ("codes", "zeros", "scales")

    def __init__(self, method, bits, group, zero_offset, qweight, qzeros, scales, g_idx, names, shape,
                 component="weight"):
        self.method, self.bits, self.group, self.zero_offset = method, bits, group, zero_offset
        self.qweight, self.qzeros, self.scales, self.g_idx = qweight, qzeros, scales, g_idx
        self.names, self.shape, self.component = names, shape, component

    @classmethod
    def open(cls, ckpt, base: str, qc) -> "IntWeightView":
        if qc.method == "pack-quantized":
            return cls._open_pack_quantized(ckpt, base, qc)
        names = {k: f"{base}.{k}" for k in ("qweight", "qzeros", "scales", "g_idx")}
        have = set(ckpt.names())
        for k in ("qweight", "qzeros", "scales"):
            if names[k] not in have:
                raise IntQuantError(f"missing tensor {names[k]!r}: {qc.method} layer {base!r} has "
                                    f"{names['qweight']!r} but not its {k}")
        qw, qz, sc = (ckpt.slice(names[k]) for k in ("qweight", "qzeros", "scales"))
        for k, sl in (("qweight", qw), ("qzeros", qz)):
            if _dtype(sl) not in ("I32", "torch.int32"):
                raise IntQuantError(f"tensor {names[k]!r}: dtype {_dtype(sl)}, expected I32 (packed {qc.bits}-bit)")
        if _dtype(sc) not in ("F16", "BF16", "F32", "torch.float16", "torch.bfloat16", "torch.float32"):
            raise IntQuantError(f"tensor {names['scales']!r}: dtype {_dtype(sc)}, expected F16, BF16 or F32")
        p = 32 // qc.bits
        s_qw, s_qz, s_sc = _shape(qw), _shape(qz), _shape(sc)
        if len(s_qw) != 2:
            raise IntQuantError(f"tensor {names['qweight']!r}: shape {s_qw}, expected 2-D")
        K, N = (s_qw[0], s_qw[1] * p) if qc.method == "awq" else (s_qw[0] * p, s_qw[1])
        g = K if qc.group == -1 else qc.group
        ng = -(-K // g)
        want = {"scales": (s_sc, (ng, N)), "qzeros": (s_qz, (ng, -(-N // p)))}
        gi = None
        if qc.method == "gptq" and qc.act_order and names["g_idx"] not in have:
            raise IntQuantError(f"missing tensor {names['g_idx']!r}: gptq desc_act=true (act-order) layer {base!r} "
                                f"needs its group index per input row (groups in order would dequantize it wrong)")
        if qc.method == "gptq" and names["g_idx"] in have:
            gi = ckpt.slice(names["g_idx"])
            if _dtype(gi) not in ("I32", "I64", "torch.int32", "torch.int64"):
                raise IntQuantError(f"tensor {names['g_idx']!r}: dtype {_dtype(gi)}, expected I32 (group indices)")
            want["g_idx"] = (_shape(gi), (K,))
        for k, (got, exp) in want.items():
            if tuple(got) != exp:
                raise IntQuantError(
                    f"tensor {names[k]!r} has shape {tuple(got)}, expected {exp} for {names['qweight']!r} {s_qw} "
                    f"({qc.method}, bits {qc.bits}, group_size {qc.group}: in_features {K}, out_features {N})")
        if gi is not None:
            g_idx = gi[:].to(torch.int64)
            if g_idx.min() < 0 or g_idx.max() >= ng:
                raise IntQuantError(f"tensor {names['g_idx']!r}: group indices must lie in [0, {ng})")
        else:
            g_idx = None
        used = [names[k] for k in ("qweight", "qzeros", "scales")] + ([names["g_idx"]] if gi is not None else [])
        v = cls(qc.method, qc.bits, g, qc.zero_offset, qw, qz, sc, g_idx, used, (N, K))
        return v

    @classmethod
    def _open_pack_quantized(cls, ckpt, base: str, qc) -> "IntWeightView":
        names = {k: f"{base}.weight_{k}" for k in ("packed", "scale", "shape", "zero_point", "g_idx")}
        have = set(ckpt.names())
        for k in ("packed", "scale", "shape"):
            if names[k] not in have:
                raise IntQuantError(f"missing tensor {names[k]!r}: compressed-tensors layer {base!r} has "
                                    f"{names['packed']!r} but not its weight_{k}")
        qw, sc = ckpt.slice(names["packed"]), ckpt.slice(names["scale"])
        if _dtype(qw) not in ("I32", "torch.int32"):
            raise IntQuantError(f"tensor {names['packed']!r}: dtype {_dtype(qw)}, expected I32 (packed {qc.bits}-bit)")
        if _dtype(sc) not in ("F16", "BF16", "F32", "torch.float16", "torch.bfloat16", "torch.float32"):
            raise IntQuantError(f"tensor {names['scale']!r}: dtype {_dtype(sc)}, expected F16, BF16 or F32")
        shape = ckpt.slice(names["shape"])[:].reshape(-1).tolist()
        if len(shape) != 2 or min(shape) < 1:
            raise IntQuantError(f"tensor {names['shape']!r} = {shape}: expected the weight's [out, in]")
        N, K = (int(v) for v in shape)
        p = 32 // qc.bits
        g = K if qc.group == -1 else qc.group
        ng = -(-K // g)
        want = {"packed": (_shape(qw), (N, -(-K // p))), "scale": (_shape(sc), (N, ng))}
        qz = None
        if names["zero_point"] in have:
            qz = ckpt.slice(names["zero_point"])
            if _dtype(qz) not in ("I32", "torch.int32"):
                raise IntQuantError(f"tensor {names['zero_point']!r}: dtype {_dtype(qz)}, expected I32")
            want["zero_point"] = (_shape(qz), (-(-N // p), ng))
        if qc.act_order and names["g_idx"] not in have:
            raise IntQuantError(f"missing tensor {names['g_idx']!r}: compressed-tensors actorder 'group' layer {base!r} "
                                f"needs its group index per input column (groups in order would dequantize it wrong)")
        gi = ckpt.slice(names["g_idx"]) if names["g_idx"] in have else None
        if gi is not None:
            want["g_idx"] = (_shape(gi), (K,))
        for k, (got, exp) in want.items():
            if tuple(got) != exp:
                raise IntQuantError(
                    f"tensor {names[k]!r} has shape {tuple(got)}, expected {exp} for {names['packed']!r} "
                    f"(pack-quantized, bits {qc.bits}, group_size {qc.group}: weight_shape [{N}, {K}])")
        g_idx = None
        if gi is not None:
            g_idx = gi[:].to(torch.int64)
            if g_idx.min() < 0 or g_idx.max() >= ng:
                raise IntQuantError(f"tensor {names['g_idx']!r}: group indices must lie in [0, {ng})")
        used = [names[k] for k in ("packed", "scale", "shape")] + [names[k] for k, t in (("zero_point", qz), ("g_idx", gi))
                                                                   if t is not None]
        return cls("pack-quantized", qc.bits, g, 0, qw, qz, sc, g_idx, used, (N, K))

    def with_component(self, component: str) -> "IntWeightView":
        return IntWeightView(self.method, self.bits, self.group, self.zero_offset, self.qweight, self.qzeros,
                             self.scales, self.g_idx, self.names, self.shape, component)

    def get_shape(self) -> list:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "F32"

    def _groups(self, c0: int, c1: int) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx[c0:c1]
        return torch.arange(c0, c1) // self.group

    def read(self, r0: int, r1: int, c0: int, c1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, zeros, scales) of the window, each float32 [r1 - r0, c1 - c0]."""
        p, bits = 32 // self.bits, self.bits
        w0, w1 = r0 // p, -(-r1 // p)                       # packed output columns under rows [r0, r1)
        grp = self._groups(c0, c1)
        g0, g1 = int(grp.min()), int(grp.max()) + 1
        if self.method == "awq":
            codes = unpack_cols(self.qweight[c0:c1, w0:w1], bits, AWQ_ORDER)[:, r0 - w0 * p: r1 - w0 * p].T
            zeros = unpack_cols(self.qzeros[g0:g1, w0:w1], bits, AWQ_ORDER)[:, r0 - w0 * p: r1 - w0 * p]
        elif self.method == "pack-quantized":       # [out, in]-major: codes along rows, scales / zeros transposed
            k0, k1 = c0 // p, -(-c1 // p)
            codes = unpack_cols(self.qweight[r0:r1, k0:k1], bits)[:, c0 - k0 * p: c1 - k0 * p]
            if self.qzeros is None:                  # symmetric: every zero at the storage offset
                zeros = torch.full((g1 - g0, r1 - r0), 1 << (bits - 1), dtype=torch.int32)
            else:
                zeros = unpack_rows(self.qzeros[w0:w1, g0:g1], bits)[r0 - w0 * p: r1 - w0 * p].T
            scales = self.scales[r0:r1, g0:g1].to(torch.float32).T
            idx = grp - g0
            return codes.to(torch.float32), zeros.to(torch.float32)[idx].T, scales[idx].T
        else:
            k0, k1 = c0 // p, -(-c1 // p)
            codes = unpack_rows(self.qweight[k0:k1, r0:r1], bits)[c0 - k0 * p: c1 - k0 * p].T
            zeros = unpack_cols(self.qzeros[g0:g1, w0:w1], bits)[:, r0 - w0 * p: r1 - w0 * p] + self.zero_offset
        scales = self.scales[g0:g1, r0:r1].to(torch.float32)
        idx = grp - g0
        return codes.to(torch.float32), zeros.to(torch.float32)[idx].T, scales[idx].T

    def __getitem__(self, idx) -> torch.Tensor:
        (r0, r1), (c0, c1) = _norm_index(idx, self.shape)
        if r1 <= r0 or c1 <= c0:
            return torch.empty(max(0, r1 - r0), max(0, c1 - c0))
        codes, zeros, scales = self.read(r0, r1, c0, c1)
        if self.component == "codes":
            return codes
        if self.component == "zeros":
            return zeros
        if self.component == "scales":
            return scales
        return (codes - zeros) * scales


def pack_components(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                    group: int) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This rank's [N, K] codes / zeros / scales (per element, float32) -> (qweight int32 [N, K / 8] in the int4
    GEMM's layout, scales float16/float32 [N, K / g], zeros uint8 [N, K / g]), or None where the weight is not
    4-bit codes with zeros and scales constant over each run of `group` columns from column 0 (act-order GPTQ, a TP
    split that cuts a group, 8-bit): that layer then keeps its dequantized weight."""
    from xllm_gen.runtime.ops.quant_gemv import pack_int4
    if codes.shape[-1] % 8:
        return None
    groups = int4_groups(codes, zeros, scales, group)
    return None if groups is None else (pack_int4(codes.to(torch.uint8)), *groups)


def int4_groups(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                group: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(scales float16 where exact else float32, zeros uint8), each [..., K / group], of per-element 4-bit codes /
    zeros / scales [..., K] (float32) whose zeros and scales are constant over each run of `group` columns from
    column 0; None otherwise (the weight then stays dequantized)."""
    K = codes.shape[-1]
    if K % group or codes.min() < 0 or codes.max() > 15 or zeros.min() < 0 or zeros.max() > 255:
        return None
    z, s = zeros[..., ::group], scales[..., ::group]
    if not (torch.equal(zeros, z.repeat_interleave(group, -1)) and torch.equal(scales, s.repeat_interleave(group, -1))):
        return None
    s16 = s.to(torch.float16)
    return (s16 if torch.equal(s16.to(torch.float32), s) else s).contiguous(), z.to(torch.uint8).contiguous()
