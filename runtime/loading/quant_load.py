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

import logging
import os
from typing import Optional

import torch

from xllm_gen.runtime.layers.int_quant import IntQuantError, IntWeightView, pack_components
from xllm_gen.runtime.layers.mxfp4 import BLOCKS_SUFFIX, Mxfp4Error, Mxfp4View
from xllm_gen.runtime.layers.quant import ActQuant, Fp8WeightView, OnlineFp8View, ceil_pow2
from xllm_gen.runtime.loading.quant_config import QuantConfig, block_grid


def _pack_forced() -> Optional[bool]:
    """XLLM_PACKED_QUANT=1 / 0: keep quantized weights packed (the weight-only GEMM; on the CPU F.linear on their
    dequantized values) / dequantized at load, on any device; unset: see QuantLoad.packs (read at each load, so TP
    rank processes follow the environment)."""
    return {"1": True, "0": False}.get(os.environ.get("XLLM_PACKED_QUANT", ""))


_FP8_DTYPES = {"F8_E4M3"}
EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")      # FusedMoE's stacked expert weights


logger = logging.getLogger(__name__)


class QuantLoadError(ValueError):
    pass


def packs_experts(qc: Optional[QuantConfig], device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a load of this checkpoint keeps MoE experts packed (QuantLoad.packs' rule for them: float8, or 4-bit
    AWQ / GPTQ / pack-quantized codes): then the model builds its experts on the meta device (layers/moe.py
    experts_on_meta) and the load fills them packed."""
    if qc is None:
        return False
    float8 = qc.method in ("fp8", "compressed-tensors", "online-fp8") and qc.bits != 8
    int4 = qc.method in ("awq", "gptq", "pack-quantized") and qc.bits == 4
    if not (float8 or int4):
        return False
    forced = _pack_forced()
    if forced is not None:
        return forced
    return torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def _placeholder(tensor: torch.Tensor, device=None) -> torch.nn.Parameter:
    """The empty parameter that replaces a packed weight (on `device`, default the weight's); it keeps the weight's
    TP split (how the layer's input features are split: the activation groups' check reads it)."""
    empty = torch.nn.Parameter(torch.empty(0, dtype=tensor.dtype, device=device or tensor.device), requires_grad=False)
    if hasattr(tensor, "tp_split"):
        empty.tp_split = tensor.tp_split
    return empty


def _dtype(sl) -> str:
    try:
        return sl.get_dtype()
    except AttributeError:
        return {torch.float8_e4m3fn: "F8_E4M3"}.get(getattr(sl, "dtype", None), "")


def _shape(sl) -> tuple:
    return tuple(int(s) for s in (sl.get_shape() if hasattr(sl, "get_shape") else sl.shape))


def _nbytes(sl) -> int:
    n = 1
    for d in _shape(sl):
        n *= d
    return n                                         # uint8 blocks and scales: a byte each


class QuantLoad:
    def __init__(self, model: torch.nn.Module, ckpt, qc: Optional[QuantConfig]):
        self.model, self.ckpt, self.qc = model, ckpt, qc
        self.layers: dict[str, list] = {}          # module name -> [(source, static input scale or None)]
        self.experts: dict[str, list] = {}         # a FusedMoE's stacked parameter -> the same, one per expert
        self.plain: dict[str, list] = {}           # module / expert parameter -> float sources of a quantized-capable
                                                   # layer
        self.used: set[str] = set()                # scale tensors consumed
        self.names = set(ckpt.names())
        self.packed: list[str] = []                # layers holding packed weights (runtime/layers/quant_linear.py)
        self.unpacked: list[str] = []              # quantized layers that keep their dequantized weight
        self.mxfp4: dict[str, tuple] = {}          # parameter -> (its MXFP4 source tensors' packed bytes, its bytes)
        self.loose: list = []                      # (parameter, source) of no linear layer, weight-only quantized
        # the device of the model's real parameters (its experts may be on meta: layers/moe.py experts_on_meta)
        self.device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("meta"))
        self._modules: dict[str, tuple] = {}       # _module's answers, by parameter name

    def open(self, name: str):
        """The checkpoint slice of `name`, or, for an AWQ / GPTQ layer's `.weight` (stored as `.qweight`, `.qzeros`,
        `.scales`, `.g_idx`), the view that reads those as the weight; for an MXFP4 tensor (stored as `<name>_blocks`
        and `<name>_scales`, any tensor), the view that dequantizes them (runtime/layers/mxfp4.py)."""
        if name not in self.names and name + BLOCKS_SUFFIX in self.names:
            if self.qc is None or self.qc.method != "mxfp4":
                raise QuantLoadError(f"tensor {name + BLOCKS_SUFFIX!r} is an MXFP4 weight, but config.json's "
                                     f"quantization_config is {self.qc.describe() if self.qc else 'missing'} "
                                     f"(quant_method 'mxfp4' expected)")
            try:
                return Mxfp4View.open(self.ckpt, name)
            except Mxfp4Error as e:
                raise QuantLoadError(str(e)) from None
        if name in self.names or not name.endswith(".weight"):
            return self.ckpt.slice(name)
        base = name[: -len(".weight")]
        packed = next((f"{base}.{k}" for k in ("qweight", "weight_packed") if f"{base}.{k}" in self.names), None)
        if packed is None:
            return self.ckpt.slice(name)
        qc = self.qc
        want = ("awq", "gptq") if packed.endswith(".qweight") else ("pack-quantized",)
        if qc is None or qc.method not in want:
            raise QuantLoadError(f"tensor {packed!r} is a packed integer weight, but config.json's "
                                 f"quantization_config is {qc.describe() if qc else 'missing'} "
                                 f"({' / '.join(want) if packed.endswith('.qweight') else 'compressed-tensors format pack-quantized'} expected)")
        try:
            view = IntWeightView.open(self.ckpt, base, qc)
        except IntQuantError as e:
            raise QuantLoadError(str(e)) from None
        return view

    def _module(self, param: str):
        """(module name, the linear layer whose weight `param` is, or the FusedMoE whose stacked expert weight it
        is, else None). Memoized: a stacked expert parameter takes one tensor per expert (hundreds of thousands of
        calls for a large MoE checkpoint, each a walk of the module tree)."""
        if param not in self._modules:
            self._modules[param] = self._find_module(param)
        return self._modules[param]

    def _find_module(self, param: str):
        from xllm_gen.runtime.layers.linear import _Linear
        from xllm_gen.runtime.layers.moe import FusedMoE
        mod_name, _, attr = param.rpartition(".")
        try:
            mod = self.model.get_submodule(mod_name)
        except AttributeError:
            return mod_name, None
        if isinstance(mod, _Linear) and attr == "weight" or isinstance(mod, FusedMoE) and attr in EXPERT_WEIGHTS:
            return mod_name, mod
        return mod_name, None

    @staticmethod
    def _is_experts(layer) -> bool:
        from xllm_gen.runtime.layers.moe import FusedMoE
        return isinstance(layer, FusedMoE)

    def _record(self, param: str, mod_name: str, layer, name: str, input_scale: Optional[float] = None) -> None:
        """A quantized source of a linear layer, or of a FusedMoE's stacked parameter (its gate / up and its down
        projections take different activation quantizations)."""
        if self._is_experts(layer):
            self.experts.setdefault(param, []).append((name, input_scale))
        else:
            self.layers.setdefault(mod_name, []).append((name, input_scale))

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
        if isinstance(sl, Mxfp4View):            # dequantized into any float parameter; activations untouched
            self.used.update(sl.names)
            param_t = self.model.get_parameter(param)
            self.mxfp4[param] = (self.mxfp4.get(param, (0, 0))[0] + sum(
                _nbytes(self.ckpt.slice(n)) for n in sl.names), param_t.numel() * param_t.element_size())
            return sl
        if isinstance(sl, IntWeightView):
            self.used.update(sl.names)
            if linear is None:                   # weight-only: dequantized into any parameter
                self.loose.append((param, name))
                return sl
            self._record(param, mod_name, linear, name)
            return sl
        int8 = dtype == "I8" and qc is not None and qc.method == "compressed-tensors" and qc.bits == 8
        what = "int8" if int8 else "float8"
        if dtype not in _FP8_DTYPES and not int8:
            if (qc is not None and qc.method == "online-fp8" and linear is not None
                    and (self._is_experts(linear) and len(_shape(sl)) == 2        # one expert's [out, in] tensor
                         or not self._is_experts(linear) and not self._is_router(mod_name))):
                self._record(param, mod_name, linear, name)
                return OnlineFp8View(sl)
            if linear is not None:
                self.plain.setdefault(param if self._is_experts(linear) else mod_name, []).append(name)
            return sl
        if qc is None or qc.method == "online-fp8":
            raise QuantLoadError(f"tensor {name!r} is float8 ({dtype}), but config.json has no quantization_config "
                                 f"that gives its scales")
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is None:
            raise QuantLoadError(f"tensor {name!r} is {what} ({dtype}) but is not a layer's '.weight': only linear "
                                 f"weights can be quantized ({qc.method})")
        shape = _shape(sl)
        if len(shape) != 2:
            raise QuantLoadError(f"tensor {name!r}: a {what} weight must be 2-D [out, in], got shape {shape}")
        sname = f"{base}.{qc.scale_suffix}"
        if sname not in self.names:
            raise QuantLoadError(f"missing tensor {sname!r}: the scale of the {what} weight {name!r} ({qc.method})")
        scale = self._scale(sname)
        block = self._block(name, sname, shape, tuple(scale.shape), scale)
        if block is None:
            raise QuantLoadError(f"tensor {sname!r} has shape {tuple(scale.shape)}, which is not a scale of the "
                                 f"{what} weight {name!r} {shape}: expected "
                                 + self._expected(shape))
        if not torch.isfinite(scale).all() or (scale <= 0).any():
            raise QuantLoadError(f"tensor {sname!r}: scales must be finite and > 0")
        if qc.scale_pow2 and not torch.equal(ceil_pow2(scale), scale):
            bad = scale[ceil_pow2(scale) != scale][0].item()
            raise QuantLoadError(f"tensor {sname!r}: scale_fmt 'ue8m0' promises power-of-two scales, it holds {bad!r}")
        self.used.add(sname)
        input_scale = None
        if qc.act in ("static", "int8_static"):
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
            if qc.act is not None:
                raise QuantLoadError(f"tensor {name!r} is {what} with activation quantization ({qc.describe()}), but "
                                     f"parameter {param!r} is not a linear layer's or a FusedMoE's expert weight: its "
                                     f"input cannot be quantized as the format says")
            self.loose.append((param, name))     # weight-only: dequantized into any parameter
        else:
            self._record(param, mod_name, linear, name, input_scale)
        return Fp8WeightView(sl, scale.reshape(block_grid(shape, block)), block)

    def _scale(self, sname: str) -> torch.Tensor:
        """A weight scale tensor in float32: float8_e8m0fnu converts, and e8m0 bytes (uint8: 2^(b - 127), as MXFP8
        writers store them) are read as such under `scale_fmt: ue8m0`."""
        t = self.ckpt.slice(sname)[:]
        if t.dtype != torch.uint8:
            return t.float()
        if not self.qc.scale_pow2:
            raise QuantLoadError(f"tensor {sname!r} is uint8 (e8m0 scale bytes), but quantization_config has no "
                                 f"scale_fmt 'ue8m0'")
        if (t == 255).any():
            raise QuantLoadError(f"tensor {sname!r}: e8m0 byte 255 is NaN")
        return torch.exp2(t.float() - 127.0)

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

    def packs(self, param: str, tensor: torch.Tensor) -> bool:
        """Whether the quantized layer of `param` keeps its weight packed: XLLM_PACKED_QUANT=1 / 0, else on CUDA in
        bf16 / fp16 (what the weight-only kernels are built and measured for: 2-4x less weight memory, an 8B model's
        batch-1 decode at 0.68x (fp8) / 0.71x (int4) bf16's time on an H200, bench/results/h200_quant_fma_2026-12-04.md),
        dequantized at load elsewhere (CPU, float32: the reference semantics). Float8 and 4-bit experts (a FusedMoE's
        stacked weights) pack the same way (the Triton grouped kernels read them); int8 experts and parameters of no
        linear layer are always held dequantized (no quantized kernel for them)."""
        mod_name, layer = self._module(param)
        if layer is None or not self._is_experts(layer) and self._is_router(mod_name):
            return False            # the router: read in float32 (layers/moe.py linear_float32), kept unpacked
        if self.qc is not None and self.qc.method == "compressed-tensors" and self.qc.bits == 8:
            return False            # int8 weights: no int8 GEMM here, the layer holds them dequantized
        if self._is_experts(layer):     # the rule the model was built by (experts on meta where it holds)
            return packs_experts(self.qc, self.device, tensor.dtype)
        forced = _pack_forced()
        if forced is not None:
            return forced
        return tensor.is_cuda and tensor.dtype in (torch.bfloat16, torch.float16)

    def pack(self, param: str, tensor: torch.Tensor, parts: dict) -> bool:
        """Repacks a quantized layer from this rank's per-element codes / zeros / scales (read through the layer's
        weight loader, so every TP split and fused segment is in place) and drops its dequantized weight; a layer
        whose codes do not pack (act-order GPTQ, 8 bits, a split that cuts a group or scale block) keeps it."""
        from xllm_gen.runtime.layers.quant_linear import PackedFp8, PackedInt4, pack_fp8_components
        mod_name, _, attr = param.rpartition(".")
        mod = self.model.get_submodule(mod_name)
        if self._is_experts(mod):
            return self._pack_experts(mod, mod_name, attr, tensor, parts)
        if "zeros" in parts:
            qc = self.qc
            group = qc.group if qc.group != -1 else tensor.shape[1]
            got = pack_components(parts["codes"], parts["zeros"], parts["scales"], group)
            packed = PackedInt4(*got, group) if got is not None and qc.bits == 4 else None
        else:
            got = pack_fp8_components(parts["codes"], parts["scales"])
            packed = PackedFp8(*got) if got is not None else None
        if packed is None:
            self.unpacked.append(mod_name)
            return False
        if tensor.dtype == torch.float32 and not torch.equal(packed.dequantized(torch.float32), tensor):
            raise QuantLoadError(f"layer {mod_name!r}: the repacked weight differs from the dequantized one")
        empty = _placeholder(tensor)                                                # no dequantized copy
        for m in self._retie(mod, "weight", empty):
            m.packed, m.weight = packed, empty
        self.packed.append(mod_name)
        return True

    def _pack_experts(self, mod, mod_name: str, attr: str, tensor: torch.Tensor, parts: dict) -> bool:
        """A FusedMoE's stacked experts [E, rows, K] kept packed (FusedMoE.packed): float8 codes and scales per row
        and bk columns, or 4-bit codes two to a byte with a zero and a scale per row and group; False for experts
        whose codes do not pack (a split that cuts a scale block or a group, act-order GPTQ, 8 bits): they keep the
        weight. `tensor` may be on the meta device (experts_on_meta): the parts are the only values read."""
        from xllm_gen.runtime.layers.quant_linear import pack_fp8_components
        from xllm_gen.runtime.ops.moe import dequantize_packed, pack_int4_experts
        if not all(bool(torch.isfinite(t.sum())) for t in parts.values()):  # never dequantized here to check
            raise QuantLoadError(f"parameter {mod_name}.{attr}: its experts' quantized checkpoint tensors hold a NaN "
                                 f"(or infinite) value")
        shape = tensor.shape
        if "zeros" in parts:
            group = self.qc.group if self.qc.group != -1 else shape[-1]
            got = pack_int4_experts(parts["codes"].view(shape), parts["zeros"].view(shape),
                                    parts["scales"].view(shape), group) if self.qc.bits == 4 else None
        else:
            block = self.qc.weight_block[1] if self.qc is not None and self.qc.weight_block else None
            got = pack_fp8_components(parts["codes"].reshape(-1, shape[-1]), parts["scales"].reshape(-1, shape[-1]),
                                      block)
            if got is not None:
                codes, scale, bk = got
                got = (codes.view(shape), scale.view(*shape[:-1], -1), bk)
        if got is None:
            self.unpacked.append(f"{mod_name}.{attr}")
            return False
        if tensor.dtype == torch.float32 and not tensor.is_meta:
            if not torch.equal(dequantize_packed(got, torch.float32), tensor):
                raise QuantLoadError(f"parameter {mod_name}.{attr}: the repacked experts differ from the dequantized ones")
        empty = _placeholder(tensor, parts["codes"].device)
        for m in self._retie(mod, attr, empty):
            m.packed = {**(m.packed or {}), attr: got}
            setattr(m, attr, empty)
        self.packed.append(f"{mod_name}.{attr}")
        return True

    def materialize(self, mod_name: str, attr: str, param: torch.nn.Parameter, device) -> torch.nn.Parameter:
        """A meta-device parameter (experts_on_meta) made real on `device`, in its place on `mod_name` and the modules
        that share it, keeping its TP split and weight loader."""
        real = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                  requires_grad=param.requires_grad)
        for key in ("tp_split", "weight_loader"):
            if hasattr(param, key):
                setattr(real, key, getattr(param, key))
        for m in self._retie(self.model.get_submodule(mod_name), attr, real):
            setattr(m, attr, real)
        return real

    def _retie(self, mod, attr: str, placeholder) -> list:
        """The twins of `mod` by `attr`, recorded as sharing `placeholder` (what replaces their packed weight)."""
        twins = self._twins(mod, attr)
        self._by_param[id(placeholder)] = (placeholder, twins)
        return twins

    def _twins(self, mod, attr: Optional[str] = None) -> list:
        """`mod` and the modules that share its weight parameter (`attr`, else the first of weight / the stacked
        expert weights; a block whose weights several layers run: layers.shared share_blocks / share_layers tie
        parameters, not modules), which must be given the same load-time attributes (act_quant, packed)."""
        if not hasattr(self, "_by_param"):
            self._by_param: dict = {}
            for m in self.model.modules():
                for name in ("weight",) + EXPERT_WEIGHTS:
                    p = m._parameters.get(name)
                    if p is not None:        # (the parameter held too: its id is never reused meanwhile)
                        self._by_param.setdefault(id(p), (p, []))[1].append(m)
        for a in (attr,) if attr else ("weight",) + EXPERT_WEIGHTS:
            p = mod._parameters.get(a)
            if p is not None:
                return self._by_param.get(id(p), (p, [mod]))[1]
        return [mod]

    def _zero_biases(self) -> None:
        """GPTQ writers save a `.bias` beside every quantized weight, zeros where the model has none: an all-zero one is
        consumed (a nonzero one the weight plan does not map is left for the unexpected-tensor check)."""
        sources = [n for srcs in (*self.layers.values(), *self.experts.values()) for n, _ in srcs]
        for name in sources + [n for _, n in self.loose]:
            b = name[: -len(".weight")] + ".bias"
            if b in self.names and not self.ckpt.slice(b)[:].any():
                self.used.add(b)         # (a bias the weight plan maps is loaded as well: zeros either way)

    @staticmethod
    def _split_input(mod, attr: str):
        """This rank's input columns of a layer whose input features are split over TP ranks (a row-parallel linear
        layer, a FusedMoE's down projections with parallel="tensor"), else None."""
        from xllm_gen.runtime.layers.linear import RowParallelLinear
        if getattr(mod, "tp_size", 1) <= 1:
            return None
        if isinstance(mod, RowParallelLinear):
            return mod.weight.tp_split.segments[0]
        if attr == "act_quant_down" and mod.parallel == "tensor":
            return mod.down_proj.tp_split.inner.segments[0]
        return None

    def finish(self) -> set[str]:
        """Gives each quantized linear layer (and each FusedMoE with quantized experts) its activation
        quantization; returns the scale tensors used."""
        if self.packed or self.unpacked:
            logger.info("quantized linear layers: %d packed (weight-only GEMM), %d dequantized%s", len(self.packed),
                        len(self.unpacked), f" ({', '.join(self.unpacked[:4])}...)" if self.unpacked else "")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()               # the dropped dequantized weights, for the KV cache
        if self.qc is not None and self.qc.method in ("awq", "gptq", "pack-quantized"):
            self._zero_biases()
        if self.loose:
            logger.info("weight-only quantized tensors dequantized at load into %d parameter(s) of no linear layer "
                        "(%s%s)", len(self.loose), ", ".join(p for p, _ in self.loose[:3]),
                        "..." if len(self.loose) > 3 else "")
        if self.mxfp4:
            packed = sum(b for b, _ in self.mxfp4.values())
            held = sum(h for _, h in self.mxfp4.values())
            dtype = self.model.get_parameter(next(iter(self.mxfp4))).dtype
            logger.info("MXFP4: %d parameters dequantized at load to %s: %.2f GiB held on this rank; the checkpoint's "
                        "packed e2m1 + e8m0 tensors for them: %.2f GiB (all ranks). A fused MXFP4 kernel is not used",
                        len(self.mxfp4), str(dtype).replace("torch.", ""), held / 2**30, packed / 2**30)
        targets = [(m, self.model.get_submodule(m), "act_quant", srcs) for m, srcs in self.layers.items()]
        targets += [(p, self._module(p)[1], "act_quant_down" if p.endswith(".down_proj") else "act_quant", srcs)
                    for p, srcs in self.experts.items()]
        for where, mod, attr, srcs in targets:
            if where in self.plain:
                raise QuantLoadError(f"{'layer' if attr == 'act_quant' and where in self.layers else 'parameter'} "
                                     f"{where!r}: tensor(s) {', '.join(self.plain[where][:4])} are not quantized but "
                                     f"{srcs[0][0]!r} is: a fused layer's sources (and all experts) must all be")
            act = self.qc.act
            if act is None:
                continue
            if act in ("static", "int8_static"):     # a fused layer (q|k|v), the experts: the largest of the scales
                for m in self._twins(mod):
                    setattr(m, attr, ActQuant(act, scale=max(s for _, s in srcs)))
                continue
            aq = ActQuant(act, self.qc.act_group, pow2=self.qc.scale_pow2)
            seg = self._split_input(mod, attr)
            # (a padded split, sharding.split_segment: the real columns [start, stop) count; its zero columns
            # after them change no group's scale)
            if act == "group" and seg is not None and seg.real and (seg.start % aq.group or (
                    seg.real % aq.group and seg.stop != seg.size)):
                raise QuantLoadError(
                    f"{'layer' if where in self.layers else 'parameter'} {where!r} ({type(mod).__name__}): its "
                    f"{seg.size} input features split over tp={mod.tp_size} give rank {mod.tp_rank} columns "
                    f"[{seg.start}, {seg.stop}), which do not fall on the activation groups of {aq.group} "
                    f"(weight_block_size): each rank's columns must start on a multiple of {aq.group}")
            for m in self._twins(mod):
                setattr(m, attr, aq)
        return self.used
