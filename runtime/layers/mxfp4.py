"""MXFP4 checkpoint weights (`quant_method: mxfp4`, gpt-oss's published form): a tensor stored as its packed e2m1
values and e8m0 scales, seen as the float tensor it stands for.

A checkpoint tensor `T` in MXFP4 is stored as two tensors (transformers' integrations/mxfp4.py, OpenAI's release):
- `T_blocks` uint8 [..., rows, K / 32, 16]: 32 e2m1 values per group along the last (input, reduction) dim, two a
  byte, element 2j in the low nibble and 2j + 1 in the high one; a 4-bit code is sign (bit 3) and magnitude
  (0, 0.5, 1, 1.5, 2, 3, 4, 6 by the low 3 bits);
- `T_scales` uint8 [..., rows, K / 32] (or float8_e8m0fnu): one e8m0 scale per group, 2^(s - 127) (255 is NaN,
  refused).
The dequantized value is e2m1(code) * 2^(s - 127), exact in float32 (and in bfloat16: same exponent range).

`Mxfp4View` reads them lazily like a safetensors slice: any window of the dequantized [..., rows, K] tensor reads
only the groups and scales under it (so any TP split works, also one that cuts a group). The groups always run along
the input dimension, so the dequantized tensor is [..., out, in] (the layout of the runtime's linear and expert
parameters) whatever layout the checkpoint's float form uses: a `weights` entry's `transpose` (gpt-oss stores its
float experts [E, in, out]) does not apply to it (runtime.loading.loader). The runtime dequantizes at load on every
device (CPU: the reference semantics; CUDA: the memory cost is logged by runtime.loading.quant_load).
"""
from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32                       # values per e8m0 scale
SCALE_DTYPES = ("U8", "F8_E8M0")
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


class Mxfp4Error(ValueError):
    pass


def _shape(sl) -> tuple:
    return tuple(int(s) for s in (sl.get_shape() if hasattr(sl, "get_shape") else sl.shape))


def _dtype(sl) -> str:
    try:
        return sl.get_dtype()
    except AttributeError:
        return {torch.uint8: "U8", getattr(torch, "float8_e8m0fnu", None): "F8_E8M0"}.get(sl.dtype, str(sl.dtype))


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [..., G, 16] and scales [..., G] -> float32 [..., G * 32]."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    b = blocks.to(torch.int64)
    v = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])
    v = torch.ldexp(v, (scales.to(torch.int32) - 127)[..., None].to(torch.float32))
    return v.reshape(*blocks.shape[:-2], blocks.shape[-2] * v.shape[-1])


class Mxfp4View:
    """The dequantized float32 tensor of `<name>_blocks` / `<name>_scales` (see the module doc). `open` checks their
    dtypes and shapes against each other, naming the tensor."""

    packed_along_input = True                 # the loader does not apply a `transpose` to it (see the module doc)

    def __init__(self, blocks, scales, names: tuple, shape: tuple, scale_view: bool):
        self.blocks, self.scales, self.names, self.shape = blocks, scales, names, shape
        self._scale_view = scale_view          # stored as float8_e8m0fnu: read its bytes

    @classmethod
    def open(cls, ckpt, name: str) -> "Mxfp4View":
        bname, sname = name + BLOCKS_SUFFIX, name + SCALES_SUFFIX
        if sname not in set(ckpt.names()):
            raise Mxfp4Error(f"missing tensor {sname!r}: the e8m0 scales of the MXFP4 weight {bname!r}")
        blocks, scales = ckpt.slice(bname), ckpt.slice(sname)
        if _dtype(blocks) != "U8":
            raise Mxfp4Error(f"tensor {bname!r}: dtype {_dtype(blocks)}, expected U8 (two e2m1 values a byte)")
        if _dtype(scales) not in SCALE_DTYPES:
            raise Mxfp4Error(f"tensor {sname!r}: dtype {_dtype(scales)}, expected U8 or F8_E8M0 (e8m0 scales)")
        sb, ss = _shape(blocks), _shape(scales)
        if len(sb) < 3 or sb[-1] != GROUP // 2:
            raise Mxfp4Error(f"tensor {bname!r} has shape {sb}: MXFP4 blocks are [..., rows, groups, {GROUP // 2}] "
                             f"(groups of {GROUP} values, two a byte); other group sizes are not supported")
        if ss != sb[:-1]:
            raise Mxfp4Error(f"tensor {sname!r} has shape {ss}, expected {sb[:-1]}: one scale per group of "
                             f"{GROUP} values of {bname!r} {sb}")
        view = cls(blocks, scales, (bname, sname), sb[:-2] + (sb[-2] * GROUP,), _dtype(scales) == "F8_E8M0")
        if (view._read_scales(tuple(slice(None) for _ in ss)) == 255).any():
            raise Mxfp4Error(f"tensor {sname!r}: an e8m0 scale of 255 (NaN)")
        return view

    def _read_scales(self, idx: tuple) -> torch.Tensor:
        s = self.scales[idx]
        return s.view(torch.uint8) if self._scale_view else s

    def get_shape(self) -> list:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, idx) -> torch.Tensor:
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) > len(self.shape):
            raise IndexError(f"too many indices for a {len(self.shape)}-D MXFP4 tensor")
        idx = idx + (slice(None),) * (len(self.shape) - len(idx))
        rng = []
        for s, n in zip(idx, self.shape):
            if not isinstance(s, slice) or s.step not in (None, 1):
                raise TypeError("an MXFP4 weight supports plain slices only")
            a, b, _ = s.indices(n)
            rng.append((a, max(a, b)))
        (c0, c1) = rng[-1]
        lead = tuple(slice(a, b) for a, b in rng[:-1])
        if c1 <= c0 or any(b <= a for a, b in rng[:-1]):
            return torch.empty([b - a for a, b in rng], dtype=torch.float32)
        g0, g1 = c0 // GROUP, -(-c1 // GROUP)
        out = dequantize(self.blocks[lead + (slice(g0, g1), slice(None))],
                         self._read_scales(lead + (slice(g0, g1),)))
        return out[..., c0 - g0 * GROUP: c1 - g0 * GROUP]
