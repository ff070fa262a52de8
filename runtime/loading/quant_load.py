"""Loading quantized checkpoint tensors into the linear layers (called by runtime.loading.loader).

For each checkpoint tensor a parameter loads, `QuantLoad.source` returns what the parameter's own weight loader
reads (so TP sharding stays the layer's business): the tensor itself when it is stored in a float dtype, the
dequantizing view of a float8 weight and its scale (runtime.layers.quant.Fp8WeightView), or, for online fp8, the
per-channel quantized view of a linear layer's float weight. It records the layers whose weights were quantized;
`finish` gives each its activation quantization (runtime.layers.quant.ActQuant). A float8 tensor without its
scale, a scale of the wrong shape, or a fused layer whose sources are partly quantized are errors naming the
tensor.
"""
from __future__ import annotations

from typing import Optional

import torch

from xllm_gen.runtime.layers.quant import ActQuant, Fp8WeightView, OnlineFp8View
from xllm_gen.runtime.loading.quant_config import QuantConfig, block_grid

_FP8_DTYPES = {"F8_E4M3"}


class QuantLoadError(ValueError):
    pass


def _dtype(sl) -> str:
    try:
        return sl.get_dtype()
    except AttributeError:
        return {torch.float8_e4m3fn: "F8_E4M3"}.get(getattr(sl, "dtype", None), "")


def _shape(sl) -> tuple:
    return tuple(int(s) for s in (sl.get_shape() if hasattr(sl, "get_shape") else sl.shape))


class QuantLoad:
    def __init__(self, model: torch.nn.Module, ckpt, qc: Optional[QuantConfig]):
        self.model, self.ckpt, self.qc = model, ckpt, qc
        self.layers: dict[str, list] = {}          # module name -> [(source, static input scale or None)]
        self.plain: dict[str, list] = {}           # module name -> float sources of a quantized-capable layer
        self.used: set[str] = set()                # scale tensors consumed
        self.names = set(ckpt.names())

    def _module(self, param: str):
        from xllm_gen.runtime.layers.linear import _Linear
        mod_name, _, attr = param.rpartition(".")
        try:
            mod = self.model.get_submodule(mod_name)
        except AttributeError:
            return mod_name, None
        return mod_name, (mod if isinstance(mod, _Linear) and attr == "weight" else None)

    def _is_router(self, mod_name: str) -> bool:
        """A linear layer beside a FusedMoE in its parent module: the MoE router, never quantized online."""
        from xllm_gen.runtime.layers.moe import FusedMoE
        parent = self.model.get_submodule(mod_name.rpartition(".")[0]) if "." in mod_name else self.model
        return any(isinstance(m, FusedMoE) for m in parent.children())

    def source(self, param: str, name: str, sl):
        """What parameter `param` loads for checkpoint tensor `name` (lazy slice `sl`)."""
        dtype = _dtype(sl)
        qc = self.qc
        mod_name, linear = self._module(param)
        if dtype not in _FP8_DTYPES:
            if qc is not None and qc.method == "online-fp8" and linear is not None and not self._is_router(mod_name):
                self.layers.setdefault(mod_name, []).append((name, None))
                return OnlineFp8View(sl)
            if linear is not None:
                self.plain.setdefault(mod_name, []).append(name)
            return sl
        if qc is None or qc.method == "online-fp8":
            raise QuantLoadError(f"tensor {name!r} is float8 ({dtype}), but config.json has no quantization_config "
                                 f"that gives its scales")
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is None:
            raise QuantLoadError(f"tensor {name!r} is float8 ({dtype}) but is not a layer's '.weight': only linear "
                                 f"weights can be quantized ({qc.method})")
        shape = _shape(sl)
        if len(shape) != 2:
            raise QuantLoadError(f"tensor {name!r}: a float8 weight must be 2-D [out, in], got shape {shape}")
        sname = f"{base}.{qc.scale_suffix}"
        if sname not in self.names:
            raise QuantLoadError(f"missing tensor {sname!r}: the scale of the float8 weight {name!r} ({qc.method})")
        scale = self.ckpt.slice(sname)[:].float()
        block = self._block(name, sname, shape, tuple(scale.shape), scale)
        if block is None:
            raise QuantLoadError(f"tensor {sname!r} has shape {tuple(scale.shape)}, which is not a scale of the "
                                 f"float8 weight {name!r} {shape}: expected "
                                 + self._expected(shape))
        if not torch.isfinite(scale).all() or (scale <= 0).any():
            raise QuantLoadError(f"tensor {sname!r}: scales must be finite and > 0")
        self.used.add(sname)
        input_scale = None
        if qc.act == "static":
            iname = f"{base}.input_scale"
            if iname not in self.names:
                raise QuantLoadError(f"missing tensor {iname!r}: the static activation scale of {name!r}")
            t = self.ckpt.slice(iname)[:].float()
            if t.numel() != 1 or not torch.isfinite(t).all() or t.item() <= 0:
                raise QuantLoadError(f"tensor {iname!r}: a static input scale is one finite value > 0, got shape "
                                     f"{tuple(t.shape)}")
            input_scale = float(t.reshape(()).item())
            self.used.add(iname)
        if linear is None:
            raise QuantLoadError(f"tensor {name!r} is float8, but parameter {param!r} is not a linear layer's weight "
                                 f"(quantized embeddings / heads / experts are not supported)")
        self.layers.setdefault(mod_name, []).append((name, input_scale))
        return Fp8WeightView(sl, scale.reshape(block_grid(shape, block)), block)

    def _expected(self, shape) -> str:
        if self.qc.weight_block:
            return f"{block_grid(shape, self.qc.weight_block)} (blocks of {self.qc.weight_block[0]}x{self.qc.weight_block[1]})"
        return f"() or (1,) per tensor, or ({shape[0]}, 1) per channel"

    def _block(self, name, sname, shape, sshape, scale) -> Optional[tuple]:
        """The block one scale covers, from the config and the scale's shape; None: mis-shaped."""
        if self.qc.weight_block:
            return self.qc.weight_block if sshape == block_grid(shape, self.qc.weight_block) else None
        if scale.numel() == 1 and len(sshape) <= 2:
            return (shape[0], shape[1])
        if sshape in ((shape[0], 1), (shape[0],)):
            return (1, shape[1])
        return None

    def finish(self) -> set[str]:
        """Gives each quantized linear layer its activation quantization; returns the scale tensors used."""
        from xllm_gen.runtime.layers.linear import RowParallelLinear
        for mod_name, srcs in self.layers.items():
            if mod_name in self.plain:
                raise QuantLoadError(f"layer {mod_name!r}: tensor(s) {', '.join(self.plain[mod_name])} are not "
                                     f"quantized but {srcs[0][0]!r} is: a fused layer's sources must all be")
            mod = self.model.get_submodule(mod_name)
            act = self.qc.act
            if act is None:
                continue
            if act == "static":           # a fused layer (q|k|v) takes the largest of its sources' scales
                mod.act_quant = ActQuant("static", scale=max(s for _, s in srcs))
                continue
            aq = ActQuant(act, self.qc.act_group)
            if act == "group" and isinstance(mod, RowParallelLinear) and mod.tp_size > 1:
                seg = mod.weight.tp_split.segments[0]
                if seg.start % aq.group or (seg.rows % aq.group and seg.stop != seg.size):
                    raise QuantLoadError(
                        f"layer {mod_name!r} ({type(mod).__name__}): its {seg.size} input features split over "
                        f"tp={mod.tp_size} give rank {mod.tp_rank} columns [{seg.start}, {seg.stop}), which do not "
                        f"fall on the activation groups of {aq.group} (weight_block_size): each rank's columns must "
                        f"start on a multiple of {aq.group}")
            mod.act_quant = aq
        return self.used
