"""A checkpoint's quantization, read from config.json's `quantization_config` (or asked for at load with
`quantization="fp8"`), with plain dict code: no spec ever mentions it, every spec gets it at once.

What is supported (everything else is refused, naming the method or the setting):
- `quant_method: fp8` (the official *-FP8 releases): float8_e4m3fn weights with `weight_scale_inv` per
  `weight_block_size` block (or one per tensor without it); dynamic activation quantization per token and
  group of block-K columns (`activation_scheme: dynamic`), or a static per-tensor `input_scale` (`static`).
  `scale_fmt: ue8m0` (DeepSeek-V3.1 / V3.2): the weight scales are powers of two (stored float32, float8_e8m0fnu
  or as e8m0 bytes), and the dynamic activation scales are rounded up to powers of two.
- `quant_method: compressed-tensors`, `format: float-quantized` (llm-compressor FP8): 8-bit float weights with
  a per-tensor or per-channel `weight_scale`; input activations none (weight-only), dynamic per token or per
  tensor, or static per tensor (`input_scale`); the `ignore` list. `format: pack-quantized` (llm-compressor's
  W4A16 / W8A16): int4 / int8 weights packed in int32 with per-group or per-channel scales, symmetric or with
  packed zero points, act-order `weight_g_idx`; activations none. `format: int-quantized` (W8A8 / W8A16 int8):
  int8 weights with a per-channel / per-tensor `weight_scale`, activations none or int8 symmetric (dynamic per
  token / tensor, static per tensor).
- `quant_method: awq` (AutoAWQ, `version: gemm`, `zero_point: true`, bits 4) and `quant_method: gptq` (AutoGPTQ /
  GPTQModel / optimum, bits 4 or 8, `sym` true or false, `desc_act` false or true (its `g_idx`),
  `checkpoint_format` gptq (zeros stored minus one) or gptq_v2): integer weights with per-group scales and zeros,
  dequantized (runtime/layers/int_quant.py); on CUDA 4-bit weights stay packed for the weight-only GEMM.
- KV-cache scales: compressed-tensors `kv_cache_scheme` (static fp8, strategy `tensor` or `attn_head` (per KV head);
  with no `config_groups`: a KV-cache-only recipe) and fp8's `kv_cache_scheme: static` (AutoFP8); the per-layer k_scale / v_scale tensors are
  read by runtime.loading.kv_scales and used with kv_cache_dtype "fp8".
- `quant_method: mxfp4` (gpt-oss's published form; transformers' Mxfp4Config): any tensor `T` stored as
  `T_blocks` (uint8 e2m1 pairs, groups of 32 along the input dim) and `T_scales` (e8m0 per group), dequantized to
  the compute dtype at load (runtime/layers/mxfp4.py); `modules_to_not_convert` is documentation (the tensors
  stored in a float dtype load as they are). Activations are not quantized.
- online fp8 (`quantization="fp8"` on an unquantized checkpoint): the linear layers' weights quantized per output
  channel at load, MoE experts stored per expert too (not the embeddings, the lm_head, the MoE router or experts
  stored stacked in one tensor), activations dynamically per token. Also on a compressed-tensors KV-cache-only
  checkpoint (float weights; its KV scales kept); on a checkpoint whose weights are quantized other than as fp8
  (awq, gptq, int8, ...) it is refused, naming the checkpoint's format.

Which layers are quantized follows the checkpoint: a float8 weight needs its scale tensor (its absence is an
error naming it); a weight stored in a float dtype (lm_head, embeddings, `ignore` / `modules_to_not_convert`
layers) is loaded as it is. MoE experts stored per expert are read in every format (held dequantized, activations
quantized as the format says: runtime.layers.moe.FusedMoE act_quant / act_quant_down).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

SUPPORTED = ("fp8 (block-wise or per-tensor), compressed-tensors (format float-quantized or pack-quantized), "
             "awq (version gemm), "
             "gptq (bits 4 / 8), mxfp4, online fp8")
# keys of each method's quantization_config that change nothing the runtime computes (bookkeeping)
_FP8_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
             "ignored_layers", "dequantize", "kv_cache_scheme", "scale_fmt"}
# transformers' Mxfp4Config.to_dict (dequantize: a loading option of transformers; the runtime always dequantizes)
_MXFP4_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}
_CT_KEYS = {"quant_method", "format", "config_groups", "ignore", "quantization_status", "global_compression_ratio",
            "kv_cache_scheme", "sparsity_config", "version", "transform_config", "quant_method_version",
            "moe_sparsity_config"}


# kernel choices of the writer's runtime (`use_<kernel>` switches, `<kernel>_config` settings): no effect on the format
_KERNEL_HINT = re.compile(r"use_[a-z0-9_]+|[a-z0-9]+_config")
_AWQ_KEYS = {"quant_method", "bits", "group_size", "zero_point", "version", "modules_to_not_convert", "backend",
             "do_fuse", "fuse_max_seq_len", "modules_to_fuse"}
_GPTQ_KEYS = {"quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format", "damp_percent",
              "damp_auto_increment", "static_groups", "true_sequential", "model_name_or_path", "model_file_base_name",
              "dataset", "tokenizer", "max_input_length",
              "module_name_preceding_first_block", "batch_size", "pad_token_id", "cache_block_outputs",
              "modules_in_block_to_quantize", "backend", "meta", "lm_head", "pack_dtype", "format", "quantizer",
              "modules_to_not_convert", "mse", "v2", "v2_alpha", "act_group_aware", "adapter", "hyb_act",
              "offload_to_disk", "offload_to_disk_path", "rotation", "is_marlin_format", "parallel_packing"}


class QuantConfigError(ValueError):
    pass


@dataclass(frozen=True)
class QuantConfig:
    """What the loader and the linear layers need to know about a checkpoint's quantization.

    method: "fp8" | "compressed-tensors" (float-quantized) | "pack-quantized" (compressed-tensors' integer format) |
        "awq" | "gptq" | "mxfp4" | "online-fp8".
    scale_suffix: the weight scale tensor's name after the layer prefix ("weight_scale_inv" / "weight_scale").
    weight_block: (rows, cols) of one weight scale for fp8 block-wise; None: the scale tensor's shape says
        (per tensor: one value; per channel: one per output row).
    act: activation quantization of the quantized layers: None (weights only), "group" (dynamic, per token and
        group of `act_group` input columns), "token" (dynamic per token), "tensor" (dynamic per tensor),
        "static" (the checkpoint's per-tensor `input_scale`); fp8 e4m3, or int8 with the prefix "int8_".
    ignore: the checkpoint's list of unquantized modules (documentation; the tensors' dtypes decide).
    bits (8 with compressed-tensors: int8 weights), group (-1: one group over all input features), zero_offset (GPTQ v1 stores zeros minus 1: 1),
    awq (AWQ's packing: qweight [in, out / 8] with the interleaved nibble order) of the integer formats.
    scale_pow2: fp8's `scale_fmt: ue8m0`: power-of-two weight scales, and dynamic activation scales rounded up to
        powers of two.
    kv_scheme: "tensor" / "head" when the config promises static fp8 KV-cache scales per tensor / per KV head
    (compressed-tensors `kv_cache_scheme` strategy tensor / attn_head, AutoFP8's `kv_cache_scheme: static`); the
    tensors themselves (runtime.loading.kv_scales) are read whenever the checkpoint holds them, by their shape.
    act_order: GPTQ's `desc_act: true` / compressed-tensors' `actorder: group`: each quantized layer's group map
    (`.g_idx` / `.weight_g_idx`) is part of the format, and its absence an error naming the tensor (groups in order
    would be read wrong, silently)."""
    method: str
    scale_suffix: str = ""
    weight_block: Optional[tuple] = None
    act: Optional[str] = None
    act_group: int = 0
    ignore: tuple = field(default_factory=tuple)
    bits: int = 0
    group: int = 0
    zero_offset: int = 0
    kv_scheme: Optional[str] = None
    scale_pow2: bool = False
    act_order: bool = False

    def describe(self) -> str:
        if self.method == "mxfp4":
            return "mxfp4 (weights e2m1 with an e8m0 scale per 32, dequantized at load; activations none)"
        if self.method in ("awq", "gptq", "pack-quantized"):
            g = "per channel" if self.group == -1 else f"group {self.group}"
            name = "compressed-tensors pack-quantized" if self.method == "pack-quantized" else self.method
            return f"{name} (weights int{self.bits}, {g}; activations none)"
        w = f"block {self.weight_block[0]}x{self.weight_block[1]}" if self.weight_block else "per tensor/channel"
        a = {None: "none", "group": f"dynamic per token-group of {self.act_group}", "token": "dynamic per token",
             "tensor": "dynamic per tensor", "static": "static per tensor"}[self.act.removeprefix("int8_")
                                                                             if self.act else None]
        return (f"{self.method} (weights {'int8' if self.bits == 8 else 'fp8 e4m3'}, {w}; activations {a}"
                f"{'; scales ue8m0 (powers of two)' if self.scale_pow2 else ''})")


def _err(msg: str) -> QuantConfigError:
    return QuantConfigError(f"config.json quantization_config: {msg}")


def _fp8(qc: dict) -> QuantConfig:
    extra = sorted(set(qc) - _FP8_KEYS)
    if extra:
        raise _err(f"quant_method 'fp8' with unsupported field(s) {', '.join(extra)}")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _err(f"fmt={fmt!r} is not supported (fp8 checkpoints: e4m3)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _err(f"activation_scheme={scheme!r} is not supported (dynamic, static)")
    block = qc.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise _err(f"weight_block_size={block!r} must be two positive ints [rows, cols]")
        if scheme != "dynamic":
            raise _err(f"weight_block_size with activation_scheme={scheme!r}: block-wise fp8 quantizes "
                       f"activations dynamically (activation_scheme 'dynamic')")
        block = (int(block[0]), int(block[1]))
    if qc.get("dequantize"):
        raise _err("dequantize=true is not supported")
    scale_fmt = qc.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):
        raise _err(f"scale_fmt={scale_fmt!r} is not supported ('float', 'ue8m0')")
    if scale_fmt == "ue8m0" and scheme != "dynamic":
        raise _err(f"scale_fmt 'ue8m0' with activation_scheme={scheme!r}: UE8M0 scales are dynamic ones")
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + tuple(qc.get("ignored_layers") or ())
    act = "group" if block else ("static" if scheme == "static" else "tensor")
    kv = qc.get("kv_cache_scheme")
    if kv not in (None, "static"):
        raise _err(f"quant_method 'fp8' with kv_cache_scheme={kv!r} is not supported ('static': per-tensor KV-cache "
                   f"scales)")
    return QuantConfig("fp8", "weight_scale_inv", block, act, block[1] if block else 0, ignore,
                       kv_scheme="tensor" if kv else None, scale_pow2=scale_fmt == "ue8m0")


def _pos_int(qc: dict, key: str, allowed, method: str) -> int:
    v = qc.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v not in allowed:
        raise _err(f"quant_method {method!r} with {key}={v!r} is not supported "
                   f"({', '.join(str(a) for a in allowed) if len(allowed) < 8 else 'a power of 2 >= 16, or -1'})")
    return v


_GROUPS = (-1,) + tuple(2 ** i for i in range(4, 15))


def _awq(qc: dict) -> QuantConfig:
    extra = sorted(k for k in set(qc) - _AWQ_KEYS if not _KERNEL_HINT.fullmatch(k))
    if extra:
        raise _err(f"quant_method 'awq' with unsupported field(s) {', '.join(extra)}")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _err(f"quant_method 'awq' with version={qc.get('version')!r} is not supported (supported: 'gemm', "
                   f"AutoAWQ's GEMM packing)")
    if qc.get("zero_point", True) is not True:
        raise _err("quant_method 'awq' with zero_point=false is not supported (AWQ GEMM stores zeros)")
    bits = _pos_int(qc, "bits", (4,), "awq")
    group = _pos_int(qc, "group_size", _GROUPS, "awq")
    return QuantConfig("awq", ignore=tuple(qc.get("modules_to_not_convert") or ()), bits=bits, group=group)


def _mxfp4(qc: dict) -> QuantConfig:
    extra = sorted(set(qc) - _MXFP4_KEYS)
    if extra:
        raise _err(f"quant_method 'mxfp4' with unsupported field(s) {', '.join(extra)} (supported: the OCP MX "
                   f"e2m1 weights with e8m0 scales per 32 values that transformers' Mxfp4Config describes)")
    if not isinstance(qc.get("dequantize", False), bool):
        raise _err(f"quant_method 'mxfp4' with dequantize={qc.get('dequantize')!r}: must be true or false")
    skip = qc.get("modules_to_not_convert") or ()
    if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
        raise _err(f"quant_method 'mxfp4' with modules_to_not_convert={skip!r}: must be a list of module names")
    return QuantConfig("mxfp4", ignore=tuple(skip))


def _gptq(qc: dict) -> QuantConfig:
    extra = sorted(k for k in set(qc) - _GPTQ_KEYS if not _KERNEL_HINT.fullmatch(k))
    if extra:
        raise _err(f"quant_method 'gptq' with unsupported field(s) {', '.join(extra)}")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq")) or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise _err(f"quant_method 'gptq' with checkpoint_format={fmt!r} is not supported ('gptq', 'gptq_v2')")
    if qc.get("is_marlin_format"):
        raise _err("quant_method 'gptq' with is_marlin_format=true is not supported (Marlin repacking)")
    if qc.get("lm_head"):
        raise _err("quant_method 'gptq' with lm_head=true (a quantized lm_head) is not supported")
    if qc.get("pack_dtype", "int32") != "int32":
        raise _err(f"quant_method 'gptq' with pack_dtype={qc.get('pack_dtype')!r} is not supported ('int32')")
    for key in ("sym", "desc_act"):
        if not isinstance(qc.get(key, False), bool):
            raise _err(f"quant_method 'gptq' with {key}={qc.get(key)!r}: must be true or false")
    bits = _pos_int(qc, "bits", (4, 8), "gptq")
    group = _pos_int(qc, "group_size", _GROUPS, "gptq")
    return QuantConfig("gptq", ignore=tuple(qc.get("modules_to_not_convert") or ()), bits=bits, group=group,
                       zero_offset=1 if fmt == "gptq" else 0, act_order=bool(qc.get("desc_act", False)))


def _ct(qc: dict) -> QuantConfig:
    extra = sorted(set(qc) - _CT_KEYS)
    if extra:
        raise _err(f"compressed-tensors with unsupported field(s) {', '.join(extra)}")
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "pack-quantized", "int-quantized"):
        raise _err(f"compressed-tensors format={fmt!r} is not supported (supported: 'float-quantized', "
                   f"'int-quantized', 'pack-quantized')")
    for key in ("sparsity_config", "moe_sparsity_config"):
        if qc.get(key):
            raise _err(f"compressed-tensors {key} is not supported")
    kv = _ct_kv_scheme(qc.get("kv_cache_scheme"))
    groups = qc.get("config_groups")
    if kv and groups in (None, {}):          # KV-cache scales only: the weights are not quantized
        ignore = qc.get("ignore") or ()
        return QuantConfig("compressed-tensors", "weight_scale", None, None, 0, tuple(ignore), kv_scheme=kv)
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _err(f"compressed-tensors needs exactly one config_groups entry (got "
                   f"{len(groups) if isinstance(groups, dict) else groups!r})")
    (gname, g), = groups.items()
    where = f"config_groups.{gname}"
    if not isinstance(g, dict):
        raise _err(f"{where} is not an object")
    targets = g.get("targets")
    if targets not in (["Linear"], ("Linear",)):
        raise _err(f"{where}.targets={targets!r} is not supported (['Linear'])")
    w = g.get("weights")
    if not isinstance(w, dict):
        raise _err(f"{where}.weights is missing")
    if g.get("format") not in (None, fmt):
        raise _err(f"{where}.format={g.get('format')!r} differs from format={fmt!r} (mixed formats are not "
                   f"supported)")
    if fmt == "pack-quantized":
        return _ct_pack(qc, g, w, where)
    kind = "int" if fmt == "int-quantized" else "float"       # int8 (W8A8 / W8A16) or float8 values
    for key, want in (("num_bits", 8), ("type", kind), ("symmetric", True), ("dynamic", False)):
        if w.get(key, want) != want:
            raise _err(f"{where}.weights.{key}={w.get(key)!r} is not supported ({want!r})")
    if w.get("strategy") not in ("tensor", "channel"):
        raise _err(f"{where}.weights.strategy={w.get('strategy')!r} is not supported ('tensor', 'channel')")
    for key in ("group_size", "block_structure", "actorder"):
        if w.get(key) not in (None, False):
            raise _err(f"{where}.weights.{key}={w.get(key)!r} is not supported")
    a = g.get("input_activations")
    act = None
    if a is not None:
        if not isinstance(a, dict):
            raise _err(f"{where}.input_activations is not an object")
        for key, want in (("num_bits", 8), ("type", kind), ("symmetric", True)):
            if a.get(key, want) != want:
                raise _err(f"{where}.input_activations.{key}={a.get(key)!r} is not supported ({want!r})")
        strategy, dynamic = a.get("strategy"), a.get("dynamic")
        prefix = "int8_" if kind == "int" else ""
        if strategy == "token" and dynamic is True:
            act = prefix + "token"
        elif strategy == "tensor" and dynamic is False:
            act = prefix + "static"
        elif strategy == "tensor" and dynamic is True:
            act = prefix + "tensor"
        else:
            raise _err(f"{where}.input_activations strategy={strategy!r} dynamic={dynamic!r} is not supported "
                       f"(token dynamic, tensor static, tensor dynamic)")
    if g.get("output_activations") is not None:
        raise _err(f"{where}.output_activations is not supported")
    return QuantConfig("compressed-tensors", "weight_scale", None, act, 0, _ct_ignore(qc), kv_scheme=kv,
                       bits=8 if kind == "int" else 0)


def _ct_ignore(qc: dict) -> tuple:
    ignore = qc.get("ignore") or ()
    if not isinstance(ignore, (list, tuple)) or not all(isinstance(s, str) for s in ignore):
        raise _err(f"ignore={ignore!r} must be a list of module names")
    return tuple(ignore)


def _ct_pack(qc: dict, g: dict, w: dict, where: str) -> QuantConfig:
    """compressed-tensors `pack-quantized` (llm-compressor's W4A16 / W8A16, GPTQ / AWQ recipes): integer weights,
    8 (4-bit) or 4 (8-bit) values an int32 word along the input dim, offset by 2^(bits-1); `weight_scale`
    [out, groups]; asymmetric: `weight_zero_point` packed along the output dim; `weight_g_idx` with act-order."""
    if w.get("type") != "int":
        raise _err(f"{where}.weights.type={w.get('type')!r} is not supported with format 'pack-quantized' ('int')")
    bits = w.get("num_bits")
    if bits not in (4, 8) or isinstance(bits, bool):
        raise _err(f"{where}.weights.num_bits={bits!r} is not supported (4, 8)")
    if not isinstance(w.get("symmetric", True), bool):
        raise _err(f"{where}.weights.symmetric={w.get('symmetric')!r}: must be true or false")
    if w.get("dynamic", False) is not False:
        raise _err(f"{where}.weights.dynamic={w.get('dynamic')!r} is not supported (false)")
    strategy = w.get("strategy")
    if strategy == "group":
        group = w.get("group_size")
        if group not in _GROUPS[1:] or isinstance(group, bool):
            raise _err(f"{where}.weights.group_size={group!r} is not supported (a power of 2 >= 16)")
    elif strategy == "channel":
        group = -1
    else:
        raise _err(f"{where}.weights.strategy={strategy!r} is not supported with format 'pack-quantized' "
                   f"('group', 'channel')")
    # "static" is the library's alias of "weight" (groups in order: no g_idx), "dynamic" of "group" (weight_g_idx)
    if w.get("actorder") not in (None, False, "group", "dynamic", "weight", "static"):
        raise _err(f"{where}.weights.actorder={w.get('actorder')!r} is not supported (null, 'group', 'dynamic', "
                   f"'weight', 'static')")
    if w.get("block_structure") not in (None, False):
        raise _err(f"{where}.weights.block_structure={w.get('block_structure')!r} is not supported")
    if g.get("input_activations") is not None:
        raise _err(f"{where}.input_activations is not supported with format 'pack-quantized' (weight-only: null)")
    if g.get("output_activations") is not None:
        raise _err(f"{where}.output_activations is not supported")
    return QuantConfig("pack-quantized", ignore=_ct_ignore(qc), bits=bits, group=group,
                       kv_scheme=_ct_kv_scheme(qc.get("kv_cache_scheme")),
                       act_order=w.get("actorder") in ("group", "dynamic"))


# kv_cache_scheme fields of compressed-tensors' QuantizationArgs that change nothing the runtime computes
_CT_KV_BOOKKEEPING = {"observer", "observer_kwargs", "scale_dtype", "zp_dtype"}


def _ct_kv_scheme(kv) -> Optional[str]:
    """compressed-tensors `kv_cache_scheme`: None, static fp8 e4m3 per tensor ("tensor") or per KV head (strategy
    `attn_head`: "head"); anything else is refused naming the field."""
    if kv is None:
        return None
    if not isinstance(kv, dict):
        raise _err(f"kv_cache_scheme={kv!r} is not an object")
    for key, want in (("num_bits", 8), ("type", "float"), ("symmetric", True), ("dynamic", False)):
        if kv.get(key, want) != want:
            raise _err(f"kv_cache_scheme.{key}={kv.get(key)!r} is not supported ({want!r}: static fp8 KV-cache "
                       f"scales)")
    strategy = kv.get("strategy", "tensor")
    if strategy not in ("tensor", "attn_head"):
        raise _err(f"kv_cache_scheme.strategy={strategy!r} is not supported ('tensor': per-tensor, 'attn_head': "
                   f"per-KV-head static fp8 KV-cache scales)")
    for key in ("group_size", "block_structure", "actorder"):
        if kv.get(key) not in (None, False):
            raise _err(f"kv_cache_scheme.{key}={kv.get(key)!r} is not supported")
    extra = sorted(set(kv) - _CT_KV_BOOKKEEPING - {"num_bits", "type", "symmetric", "dynamic", "strategy",
                                                     "group_size", "block_structure", "actorder"})
    if extra:
        raise _err(f"kv_cache_scheme with unsupported field(s) {', '.join(extra)}")
    return "head" if strategy == "attn_head" else "tensor"


def parse_quant_config(hf: Any, quantization: Optional[str] = None) -> Optional[QuantConfig]:
    """The checkpoint's QuantConfig (None: unquantized); `quantization` is the user's LLM(quantization=...).
    Anything not supported raises QuantConfigError naming the method or the setting."""
    qc = hf.get("quantization_config") if isinstance(hf, dict) else None
    if quantization not in (None, "fp8"):
        raise QuantConfigError(f"quantization={quantization!r} is not supported (supported: 'fp8', or a "
                               f"checkpoint's own quantization_config)")
    if qc is None:
        return QuantConfig("online-fp8", "", None, "token") if quantization == "fp8" else None
    if not isinstance(qc, dict):
        raise _err(f"must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        parsed = _fp8(qc)
    elif method == "compressed-tensors":
        parsed = _ct(qc)
    elif method == "awq":
        parsed = _awq(qc)
    elif method == "gptq":
        parsed = _gptq(qc)
    elif method == "mxfp4":
        parsed = _mxfp4(qc)
    else:
        raise _err(f"quant_method={method!r} is not supported (supported: {SUPPORTED})")
    if quantization == "fp8":
        if method == "compressed-tensors" and not qc.get("config_groups"):
            # a KV-cache-only recipe: its weights are float, so they are quantized online; its KV scales stay
            return QuantConfig("online-fp8", "", None, "token", kv_scheme=parsed.kv_scheme)
        if parsed.method not in ("fp8", "compressed-tensors") or parsed.bits == 8:
            raise QuantConfigError(f"quantization='fp8' on a checkpoint quantized with {method!r} "
                                   f"({parsed.describe()}): leave quantization unset to serve the checkpoint's own")
    return parsed


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def kv_cache_torch_dtype(kv_cache_dtype: str, dtype):
    """The KV cache's torch dtype: `dtype` for "auto", float8 e4m3 for "fp8" / "fp8_e4m3" (K and V divided by the
    layer's per-tensor scale from the checkpoint, 1.0 without one, rounded to fp8 when written and read back times
    the scale; runtime.loading.kv_scales)."""
    import torch
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise QuantConfigError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported ({', '.join(KV_CACHE_DTYPES)})")
    return dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def block_grid(shape: tuple, block: tuple) -> tuple:
    """The scale grid of a block-quantized [rows, cols] weight."""
    return (ceil_div(shape[0], block[0]), ceil_div(shape[1], block[1]))

