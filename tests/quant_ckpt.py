"""Tiny quantized checkpoints in the real formats, written from a float32 tiny checkpoint, and their references.

- fp8 block-wise (Qwen3-*-FP8 / DeepSeek-V3): every decoder linear weight float8_e4m3fn with a float32
  `<layer>.weight_scale_inv` per [bn, bk] block; config `quantization_config = {quant_method: fp8, fmt: e4m3,
  activation_scheme: dynamic, weight_block_size: [bn, bk]}`; lm_head / embeddings / norms stay as they are.
- compressed-tensors float-quantized (llm-compressor FP8 / FP8_DYNAMIC / W8A16): float8 weights with a
  `<layer>.weight_scale` per channel [N, 1] or per tensor [1], a static `<layer>.input_scale` [1] when
  activations are static; config_groups / ignore as llm-compressor writes them.
Each writer also writes the dequantized float32 checkpoint (same config without quantization_config): what
transformers runs as the reference. Activation quantization is emulated on the transformers side by forward
pre-hooks (`act_quant_hooks`), written independently of the runtime's ActQuant.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FMAX = 448.0
LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                   "up_proj.weight", "down_proj.weight",
                   # multi-head latent attention (DeepSeek-V2 / V3: quantized in their FP8 releases)
                   "q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight")


def _is_linear(name: str) -> bool:
    return ".layers." in name and name.endswith(LINEAR_SUFFIXES)


def _chosen(name: str, linears) -> bool:
    """Whether a writer quantizes tensor `name`: a weight of one of the module names `linears`, or (None) of the
    decoder's usual projections."""
    return _is_linear(name) if linears is None else name.endswith(".weight") and name[:-len(".weight")] in linears


def _copy_small_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)


def _write(dst: Path, tensors: dict, qc: dict | None) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    if qc is not None:
        cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _ue8m0(s: torch.Tensor) -> torch.Tensor:
    """A scale rounded up to a power of two (UE8M0), as DeepGEMM / transformers' ceil_to_ue8m0."""
    return torch.exp2(torch.ceil(torch.log2(s)))


def quantize_block(w: torch.Tensor, block, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scale_inv [ceil(N/bn), ceil(K/bk)]): scale = block amax / 448 (`pow2`: rounded up to
    a power of two, UE8M0)."""
    bn, bk = block
    N, K = w.shape
    gn, gk = -(-N // bn), -(-K // bk)
    scale = torch.empty(gn, gk)
    q = torch.empty(N, K, dtype=FP8)
    for i in range(gn):
        for j in range(gk):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s = blk.abs().max().clamp(min=1e-12) / FMAX
            s = _ue8m0(s) if pow2 else s
            scale[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / s).clamp(-FMAX, FMAX).to(FP8)
    return q, scale


def dequant_block(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    bn, bk = block
    out = q.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= scale[i, j]
    return out


def write_fp8_block(src: Path, dst: Path, ref: Path, block=(32, 32), skip=(), ue8m0: str | None = None,
                    linears=None) -> tuple[Path, Path]:
    """The fp8 block-wise checkpoint of `src` in `dst`, its dequantized float32 twin in `ref`. Layers whose name
    contains one of `skip` stay float (and are listed in modules_to_not_convert). `ue8m0` (DeepSeek-V3.1's
    `scale_fmt: ue8m0`): power-of-two scales stored as "f32" (the release), "e8m0" (torch.float8_e8m0fnu) or "u8"
    (e8m0 bytes). `linears`: the module names whose `.weight` is quantized (default: the decoder's usual projection
    names)."""
    src, dst, ref = Path(src), Path(dst), Path(ref)
    _copy_small_files(src, dst)
    _copy_small_files(src, ref)
    sd = load_file(str(src / "model.safetensors"))
    out, deq = {}, {}
    for name, t in sd.items():
        if _chosen(name, linears) and not any(s in name for s in skip):
            q, s = quantize_block(t.float(), block, pow2=ue8m0 is not None)
            stored = {None: s, "f32": s, "e8m0": s.to(torch.float8_e8m0fnu),
                      "u8": (torch.log2(s) + 127).round().to(torch.uint8)}[ue8m0]
            out[name], out[name[:-len("weight")] + "weight_scale_inv"] = q, stored
            deq[name] = dequant_block(q, s, block)
        else:
            out[name] = deq[name] = t
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
          "weight_block_size": list(block), "modules_to_not_convert": list(skip) or None}
    if ue8m0:
        qc["scale_fmt"] = "ue8m0"
    return _write(dst, out, qc), _write(ref, deq, None)


def write_ct_fp8(src: Path, dst: Path, ref: Path, *, strategy: str = "channel", act: str | None = "token",
                 input_scales: dict | None = None, linears=None) -> tuple[Path, Path]:
    """compressed-tensors float-quantized: weights per `strategy` ("channel" | "tensor"); act None (W8A16),
    "token" (dynamic) or "static" (per-tensor `input_scale` from `input_scales[layer prefix]`). `linears`: the
    module names whose `.weight` is quantized (as llm-compressor's `targets: [Linear]` picks the model's linear
    layers); default: the decoder's usual projection names."""
    src, dst, ref = Path(src), Path(dst), Path(ref)
    _copy_small_files(src, dst)
    _copy_small_files(src, ref)
    sd = load_file(str(src / "model.safetensors"))
    out, deq = {}, {}
    for name, t in sd.items():
        if _chosen(name, linears) and t.dim() == 2 and t.is_floating_point():
            w = t.float()
            amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
            s = amax.clamp(min=1e-12) / FMAX
            q = (w / (s if strategy == "channel" else s[0])).clamp(-FMAX, FMAX).to(FP8)
            base = name[:-len(".weight")]
            out[name], out[base + ".weight_scale"] = q, s
            deq[name] = q.float() * (s if strategy == "channel" else s[0])
            if act == "static":
                out[base + ".input_scale"] = torch.tensor([input_scales[base]], dtype=torch.float32)
        else:
            out[name] = deq[name] = t
    ia = None
    if act == "token":
        ia = {"actorder": None, "block_structure": None, "dynamic": True, "group_size": None, "num_bits": 8,
              "observer": None, "observer_kwargs": {}, "strategy": "token", "symmetric": True, "type": "float"}
    elif act == "static":
        ia = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
              "observer": "minmax", "observer_kwargs": {}, "strategy": "tensor", "symmetric": True, "type": "float"}
    qc = {"config_groups": {"group_0": {
        "input_activations": ia, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": strategy, "symmetric": True,
                    "type": "float"}}},
        "format": "float-quantized", "global_compression_ratio": 1.5, "ignore": ["lm_head"],
        "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}
    return _write(dst, out, qc), _write(ref, deq, None)


# ---------------------------------------------------------------------------------------------- fp8 KV-cache scales
KV_CT_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor",
                "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
                "observer_kwargs": {}}


def write_kv_scaled(src: Path, ref: Path, k_factor: float = 400.0, v_factor: float = 1e-3) -> Path:
    """A float32 Qwen3-style checkpoint of `src` in `ref` whose K / V sit far from fp8's range, the same model up to
    rounding: k_norm weights times `k_factor` and q_norm's divided by it (K values past 448, the scores as before),
    v_proj times `v_factor` and o_proj divided by it (V below e4m3's smallest subnormal). What an fp8 KV cache
    without scales cannot hold."""
    src, ref = Path(src), Path(ref)
    _copy_small_files(src, ref)
    sd = {k: v.float() for k, v in load_file(str(src / "model.safetensors")).items()}
    for name in list(sd):
        if name.endswith("self_attn.k_norm.weight"):
            sd[name] = sd[name] * k_factor
        elif name.endswith("self_attn.q_norm.weight"):
            sd[name] = sd[name] / k_factor
        elif name.endswith("self_attn.v_proj.weight"):
            sd[name] = sd[name] * v_factor
        elif name.endswith("self_attn.o_proj.weight"):
            sd[name] = sd[name] / v_factor
    return _write(ref, sd, None)


def calibrate_kv_scales(model, ids: torch.Tensor, margin: float = 1.25) -> dict:
    """{layer index: (k_scale, v_scale)} of a transformers Qwen3-style model: margin x amax / 448 of K (after
    k_norm; rotary turns pairs, so up to sqrt(2) x that: the margin) and V over one pass."""
    amax: dict = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        for which, mod in (("k", layer.self_attn.k_norm), ("v", layer.self_attn.v_proj)):
            handles.append(mod.register_forward_hook(
                lambda m, args, out, key=(i, which): amax.__setitem__(key, max(amax.get(key, 0.0),
                                                                               float(out.abs().max())))))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    n = len(model.model.layers)
    return {i: (margin * 1.4143 * amax[(i, "k")] / FMAX, margin * amax[(i, "v")] / FMAX) for i in range(n)}


def write_kv_scales(ref: Path, dst: Path, scales: dict, form: str = "attn", scheme: str | None = "ct",
                    prefix: str = "model.layers.{i}.self_attn") -> Path:
    """`ref`'s tensors plus per-layer KV-cache scales [1] float32 (`scales` {layer: (k, v)}; a value None leaves that
    tensor out) in `dst`, named as `form` writes them: "attn" (llm-compressor / Quark: <attn>.k_scale, .v_scale),
    "modelopt" (<attn>.k_proj.k_scale, .v_proj.v_scale), "output" (<attn>.k_proj.output_scale, ...), "kv" (older:
    one <attn>.kv_scale, the k value). `scheme` "ct": compressed-tensors with a kv_cache_scheme and no weight
    groups (a KV-cache-only recipe); None: no quantization_config."""
    ref, dst = Path(ref), Path(dst)
    _copy_small_files(ref, dst)
    sd = load_file(str(ref / "model.safetensors"))
    names = {"attn": ("{p}.k_scale", "{p}.v_scale"), "modelopt": ("{p}.k_proj.k_scale", "{p}.v_proj.v_scale"),
             "output": ("{p}.k_proj.output_scale", "{p}.v_proj.output_scale"), "kv": ("{p}.kv_scale", None)}[form]
    for i, pair in scales.items():
        p = prefix.format(i=i)
        for pattern, value in zip(names, pair):
            if pattern is not None and value is not None:
                sd[pattern.format(p=p)] = torch.tensor([value], dtype=torch.float32) if not torch.is_tensor(value) \
                    else value
    qc = None
    if scheme == "ct":
        qc = {"config_groups": {}, "format": "float-quantized", "ignore": [], "kv_cache_scheme": KV_CT_SCHEME,
              "quant_method": "compressed-tensors", "quantization_status": "compressed"}
    return _write(dst, sd, qc)


def _rt(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x / s).clamp(-FMAX, FMAX).to(FP8).float() * s


def emulate(x: torch.Tensor, kind: str, group: int = 0, scale: float | None = None, pow2: bool = False) -> torch.Tensor:
    """The reference activation quantization (loops over groups; float32). `pow2`: the dynamic scales rounded up to
    powers of two (UE8M0)."""
    xf = x.float()
    if kind == "static":
        y = _rt(xf, torch.tensor(scale))
    elif kind == "token":
        y = _rt(xf, (xf.abs().amax(-1, keepdim=True) / FMAX).clamp(min=1e-12))
    else:
        parts = []
        for j in range(0, xf.shape[-1], group):
            g = xf[..., j:j + group]
            s = (g.abs().amax(-1, keepdim=True) / FMAX).clamp(min=1e-12)
            parts.append(_rt(g, _ue8m0(s) if pow2 else s))
        y = torch.cat(parts, -1)
    return y.to(x.dtype)


def act_quant_hooks(model, kind: str, group: int = 0, scales: dict | None = None, skip=(), pow2: bool = False) -> list:
    """Forward pre-hooks on the decoder's linear layers of a transformers model (but those whose name contains one
    of `skip`): their inputs quantized (`pow2`: UE8M0 scales)."""
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and _is_linear(name + ".weight") and not any(s in name for s in skip):
            s = None if scales is None else scales[name]
            handles.append(mod.register_forward_pre_hook(
                lambda m, args, s=s: (emulate(args[0], kind, group, s, pow2),) + tuple(args[1:])))
    return handles


def calibrate_input_scales(model, ids: torch.Tensor) -> dict:
    """Static per-tensor input scales (amax / 448 over a calibration pass); q/k/v (and gate/up) of a layer read
    the same input, so they get the same scale."""
    amax: dict = {}
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and _is_linear(name + ".weight"):
            handles.append(mod.register_forward_pre_hook(
                lambda m, args, n=name: amax.__setitem__(n, max(amax.get(n, 0.0), float(args[0].abs().max())))))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return {n: a / FMAX for n, a in amax.items()}


def _permute(w, n_head: int):
    """llama.cpp's convert_hf_to_gguf q/k row order (transformers' GGUF loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_llama_gguf(src: Path, out: Path, qtype: str = "Q8_0") -> Path:
    """A tiny LlamaForCausalLM checkpoint as llama.cpp's converter writes it: llama.* metadata, llama.cpp tensor
    names, q/k rows permuted, 2-D weights quantized to `qtype` (norms float32)."""
    import gguf
    import numpy as np

    cfg = json.loads((Path(src) / "config.json").read_text())
    sd = load_file(str(Path(src) / "model.safetensors"))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    q = getattr(gguf.GGMLQuantizationType, qtype)
    for name, t in sd.items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            i, rest = name.split(".")[2], ".".join(name.split(".")[3:])
            mod, suffix = rest.rsplit(".", 1)
            g = f"blk.{i}.{GGUF_NAMES[mod]}.{suffix}"
            if mod == "self_attn.q_proj":
                a = _permute(a, heads)
            elif mod == "self_attn.k_proj":
                a = _permute(a, kv)
        if a.ndim == 2:
            w.add_tensor(g, gguf.quants.quantize(np.ascontiguousarray(a), q), raw_dtype=q)
        else:
            w.add_tensor(g, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


# ---------------------------------------------------------------------------------------------- AWQ / GPTQ
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # AutoAWQ: nibble i of a word holds output column AWQ_ORDER[i] of its 8


def _int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize_int(w: torch.Tensor, bits: int, group: int, sym: bool, perm=None, min_zero: int = 0):
    """Round-to-nearest per group of input columns (of the act-order permutation `perm` when given), as GPTQ / AWQ
    store it: (codes [N, K], scales float16 [N, G], zeros [N, G], g_idx [K]); w ~ (codes - zeros[g_idx]) * scales."""
    N, K = w.shape
    g = K if group == -1 else group
    maxq = 2**bits - 1
    perm = torch.arange(K) if perm is None else perm
    wg = w[:, perm].reshape(N, K // g, g)
    if sym:
        s = (wg.abs().amax(-1) * 2 / maxq).clamp(min=1e-6)
        z = torch.full_like(s, (maxq + 1) // 2)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo) / maxq).clamp(min=1e-6)
        z = torch.round(-lo / s).clamp(min_zero, maxq)
    s = s.half()
    q = torch.clamp(torch.round(wg / s.float()[..., None]) + z[..., None], 0, maxq).reshape(N, K)
    codes = torch.empty_like(q)
    codes[:, perm] = q
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[perm] = (torch.arange(K) // g).to(torch.int32)
    return codes.to(torch.int64), s, z.to(torch.int64), g_idx


def dequant_int(codes, scales, zeros, g_idx) -> torch.Tensor:
    gi = g_idx.long()
    return (codes.float() - zeros.float()[:, gi]) * scales.float()[:, gi]


def pack_awq_cols(v: torch.Tensor, order=AWQ_ORDER) -> torch.Tensor:
    """[R, C] 4-bit values -> int32 [R, C / 8]: nibble i of word c holds column 8c + order[i] (bit by bit)."""
    R, C = v.shape
    out = torch.zeros(R, C // 8, dtype=torch.int64)
    for i in range(8):
        col = v[:, order[i]::8]
        for bit in range(4):
            out |= ((col >> bit) & 1) << (4 * i + bit)
    return _int32(out)


def pack_gptq(v: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Values packed 32 / bits to an int32 along `dim` (0: GPTQ qweight's input rows, 1: qzeros' columns), value i
    of a word in bits [i * bits, (i + 1) * bits) (bit by bit)."""
    p = 32 // bits
    v = v if dim == 0 else v.T
    out = torch.zeros(v.shape[0] // p, v.shape[1], dtype=torch.int64)
    for i in range(p):
        row = v[i::p] & (2**bits - 1)          # two's complement of a -1 (GPTQ v1 zero 0) wraps to all ones
        for bit in range(bits):
            out |= ((row >> bit) & 1) << (bits * i + bit)
    out = _int32(out)
    return out if dim == 0 else out.T.contiguous()


def write_awq(src: Path, dst: Path, ref: Path, group: int = 128, skip=(), order=AWQ_ORDER) -> tuple[Path, Path]:
    """AutoAWQ GEMM (version gemm, zero_point, bits 4) of `src` in `dst`; the dequantized float32 twin in `ref`.
    `order` other than AWQ's writes the nibbles in that order (sensitivity arms)."""
    src, dst, ref = Path(src), Path(dst), Path(ref)
    _copy_small_files(src, dst)
    _copy_small_files(src, ref)
    sd = load_file(str(src / "model.safetensors"))
    out, deq = {}, {}
    for name, t in sd.items():
        if _is_linear(name) and not any(s in name for s in skip):
            codes, s, z, g_idx = quantize_int(t.float(), 4, group, sym=False)
            base = name[: -len(".weight")]
            out[base + ".qweight"] = pack_awq_cols(codes.T.contiguous(), order)
            out[base + ".qzeros"] = pack_awq_cols(z.T.contiguous(), order)
            out[base + ".scales"] = s.T.contiguous()
            deq[name] = dequant_int(codes, s, z, g_idx)
        else:
            out[name] = deq[name] = t
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
          "modules_to_not_convert": list(skip) or None}
    return _write(dst, out, qc), _write(ref, deq, None)


def write_gptq(src: Path, dst: Path, ref: Path, *, bits: int = 4, group: int = 128, sym: bool = True,
               desc_act: bool = False, fmt: str = "gptq", zero_bias: bool = True, declared_fmt: str | None = None,
               seed: int = 0, linears=None) -> tuple[Path, Path]:
    """AutoGPTQ / GPTQModel layout of `src` in `dst` (`fmt` gptq: zeros stored minus 1; gptq_v2: as they are;
    desc_act: a random act-order permutation per layer, its g_idx); zero `.bias` tensors for bias-free layers, as
    AutoGPTQ writes them. `declared_fmt` overrides the config's checkpoint_format (sensitivity arms). `linears`: the
    module names whose `.weight` is quantized (default: the decoder's usual projection names)."""
    src, dst, ref = Path(src), Path(dst), Path(ref)
    _copy_small_files(src, dst)
    _copy_small_files(src, ref)
    sd = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    out, deq = {}, {}
    for name, t in sd.items():
        if _chosen(name, linears):
            K = t.shape[1]
            perm = torch.randperm(K, generator=gen) if desc_act else None
            codes, s, z, g_idx = quantize_int(t.float(), bits, group, sym, perm, min_zero=1 if fmt == "gptq" else 0)
            base = name[: -len(".weight")]
            out[base + ".qweight"] = pack_gptq(codes.T.contiguous(), bits, 0)
            out[base + ".qzeros"] = pack_gptq((z - (1 if fmt == "gptq" else 0)).T.contiguous(), bits, 1)
            out[base + ".scales"] = s.T.contiguous()
            out[base + ".g_idx"] = g_idx
            if zero_bias and base + ".bias" not in sd:
                out[base + ".bias"] = torch.zeros(t.shape[0], dtype=torch.float16)
            deq[name] = dequant_int(codes, s, z, g_idx)
        else:
            out[name] = deq[name] = t
    qc = {"bits": bits, "group_size": group, "damp_percent": 0.01, "desc_act": desc_act, "static_groups": False,
          "sym": sym, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model",
          "quant_method": "gptq", "checkpoint_format": declared_fmt or fmt, "use_exllama": False,
          "exllama_config": {"version": 1}, "use_cuda_fp16": False, "module_name_preceding_first_block": None}
    return _write(dst, out, qc), _write(ref, deq, None)


# ---------------------------------------------------------------------------------------------- MXFP4
# OCP MX e2m1 values by 4-bit code (bit 3: sign), as transformers' integrations/mxfp4.py FP4_VALUES
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def quantize_mxfp4(w: torch.Tensor, swap_nibbles: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float (K a multiple of 32) -> (blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32]): per 32
    values an e8m0 scale 2^(s - 127) (the smallest that keeps the group's amax within e2m1's 6) and the values rounded
    to the nearest e2m1 code, two a byte, element 2j in the low nibble (`swap_nibbles`: the high one, a sensitivity
    arm). Written independently of the runtime (checked against transformers' dequantizer by the tests)."""
    *pre, K = w.shape
    g = w.float().reshape(*pre, K // 32, 32)
    amax = g.abs().amax(-1).clamp(min=2.0 ** -126)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    v = g / torch.exp2(e)[..., None]
    lut = torch.tensor(E2M1)
    codes = (v[..., None] - lut).abs().argmin(-1)              # nearest value (ties: the lower code; -0 never wins)
    lo, hi = codes[..., 0::2], codes[..., 1::2]
    if swap_nibbles:
        lo, hi = hi, lo
    blocks = (lo | (hi << 4)).to(torch.uint8)
    return blocks, (e + 127).to(torch.uint8)


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1)
    b = blocks.long()
    v = torch.stack([lut[b & 15], lut[b >> 4]], -1).reshape(*blocks.shape[:-1], -1)
    v = v * torch.exp2(scales.float() - 127)[..., None]
    return v.reshape(*blocks.shape[:-2], -1)


def write_mxfp4_experts(src: Path, dst: Path, ref: Path, *, suffixes=("mlp.experts.gate_up_proj",
                                                                       "mlp.experts.down_proj"),
                        transposed: bool = True, swap_nibbles: bool = False, scale_shift: int = 0,
                        modules_to_not_convert=("model.layers.*.self_attn",)) -> tuple[Path, Path]:
    """gpt-oss's published MXFP4 form of `src` in `dst`: each tensor ending in one of `suffixes` (a stacked expert
    weight, stored [E, in, out] when `transposed`, as gpt-oss's float checkpoint does) replaced by `<name>_blocks`
    uint8 [E, out, in / 32, 16] and `<name>_scales` uint8 [E, out, in / 32] (packed along the input dim); the
    dequantized float32 twin (the same names and layout as `src`) in `ref`. `scale_shift` is added to every stored
    scale after dequantizing the twin (a sensitivity arm: each scale off by that many powers of two)."""
    src, dst, ref = Path(src), Path(dst), Path(ref)
    _copy_small_files(src, dst)
    _copy_small_files(src, ref)
    sd = load_file(str(src / "model.safetensors"))
    out, deq = {}, {}
    for name, t in sd.items():
        if name.endswith(suffixes):
            nat = t.float().transpose(-2, -1) if transposed else t.float()        # [..., out, in]
            blocks, scales = quantize_mxfp4(nat)
            d = dequant_mxfp4(blocks, scales)
            deq[name] = (d.transpose(-2, -1) if transposed else d).contiguous()
            if swap_nibbles:
                blocks, _ = quantize_mxfp4(nat, swap_nibbles=True)
            out[name + "_blocks"] = blocks
            out[name + "_scales"] = (scales.int() + scale_shift).to(torch.uint8)
        else:
            out[name] = deq[name] = t
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": list(modules_to_not_convert)}
    return _write(dst, out, qc), _write(ref, deq, None)


def edit_ckpt(src: Path, dst: Path, tensors=None, qc=None) -> Path:
    """A copy of checkpoint `src` in `dst`, its tensors edited in place by `tensors(state_dict)` and its
    quantization_config by `qc(dict)` (fault and sensitivity arms)."""
    shutil.copytree(src, dst)
    if tensors:
        sd = load_file(str(dst / "model.safetensors"))
        tensors(sd)
        save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if qc:
        cfg = json.loads((dst / "config.json").read_text())
        qc(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ---------------------------------------------------------------------------------------------- compressed-tensors int
def write_ct_pack(src: Path, dst: Path, ref: Path, *, bits: int = 4, group: int = 32, sym: bool = True,
                  strategy: str = "group", act_order: bool = False, seed: int = 0) -> tuple[Path, Path]:
    """llm-compressor's W4A16 / W8A16 checkpoint (compressed-tensors `pack-quantized`), written and read back by the
    compressed-tensors library itself: its quantization parameters (`calculate_qparams`), its compressor
    (`PackedQuantizationCompressor.compress`: weight_packed / weight_scale / weight_shape / weight_zero_point) and its
    QuantizationConfig; the reference checkpoint holds the library's `decompress` of every layer. `act_order`: each
    input column in a random group (actorder "group" of earlier llm-compressor releases; the library now refuses to
    write it, checkpoints written with it are served), `weight_g_idx` beside the packed weight,
    quantized and dequantized here by that map (the library's compressor takes groups in order)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    src, dst, ref = Path(src), Path(dst), Path(ref)
    _copy_small_files(src, dst)
    _copy_small_files(src, ref)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy,
                            group_size=group if strategy == "group" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    gen = torch.Generator().manual_seed(seed)
    out, deq = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not _is_linear(name):
            out[name] = deq[name] = w
            continue
        base = name[: -len(".weight")]
        N, K = w.shape
        g = group if strategy == "group" else K
        g_idx = (torch.randperm(K, generator=gen) // g) if act_order else torch.arange(K) // g
        cols = [w.float()[:, g_idx == j] for j in range(K // g)]
        scale, zp = calculate_qparams(torch.stack([c.amin(1) for c in cols], 1),
                                      torch.stack([c.amax(1) for c in cols], 1), args)
        scale, zp = scale.to(w.dtype), torch.round(zp).to(torch.int8)
        if not act_order:
            part = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp},
                                                         scheme)
            out.update({f"{base}.{k}": v for k, v in part.items()})
            deq[name] = PackedQuantizationCompressor.decompress(part, scheme)["weight"].float()
            continue
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        s, z = scale.float()[:, g_idx], zp.float()[:, g_idx]
        q = torch.clamp(torch.round(w.float() / s) + z, lo, hi)
        out[f"{base}.weight_packed"] = pack_to_int32(q.to(torch.int8), bits)
        out[f"{base}.weight_scale"] = scale
        out[f"{base}.weight_shape"] = torch.tensor([N, K])
        out[f"{base}.weight_g_idx"] = g_idx.to(torch.int32)
        if not sym:
            out[f"{base}.weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0)
        deq[name] = ((q - z) * s.to(w.dtype).float()).to(w.dtype).float()
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=["lm_head"],
                            quantization_status="compressed").to_dict()
    if act_order:               # as releases of llm-compressor before the library dropped actorder "group" wrote it
        qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    return _write(dst, out, qc), _write(ref, deq, None)


def write_ct_int8(src: Path, dst: Path, ref: Path, *, strategy: str = "channel", act: str | None = "token",
                  input_scales: dict | None = None) -> tuple[Path, Path]:
    """llm-compressor's W8A8 / W8A16 int8 checkpoint (compressed-tensors `int-quantized`), written by the library:
    `calculate_qparams` and `NaiveQuantizationCompressor.compress` (int8 `weight`, `weight_scale` per channel or
    tensor), its QuantizationConfig; `act` None (W8A16), "token" (dynamic per token) or "static" (per-tensor
    `input_scale` from `input_scales[layer prefix]`). The reference holds the library's `decompress`."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    src, dst, ref = Path(src), Path(dst), Path(ref)
    _copy_small_files(src, dst)
    _copy_small_files(src, ref)
    ia = None if act is None else QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy=act if act ==
                                                   "token" else "tensor", dynamic=act == "token")
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int", symmetric=True,
                                                                             strategy=strategy),
                                input_activations=ia)
    out, deq = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not _is_linear(name):
            out[name] = deq[name] = w
            continue
        base = name[: -len(".weight")]
        wf = w.float()
        lo, hi = (wf.amin(1, keepdim=True), wf.amax(1, keepdim=True)) if strategy == "channel" else \
            (wf.amin().reshape(1), wf.amax().reshape(1))
        scale, zp = calculate_qparams(lo, hi, scheme.weights)
        part = NaiveQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(w.dtype),
                                                     "weight_zero_point": zp.to(torch.int8)}, scheme)
        out.update({f"{base}.{k}": v for k, v in part.items() if k != "weight_zero_point"})
        deq[name] = NaiveQuantizationCompressor.decompress(part, scheme)["weight"].float()
        if act == "static":
            out[base + ".input_scale"] = torch.tensor([input_scales[base]], dtype=torch.float32)
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="int-quantized", ignore=["lm_head"],
                            quantization_status="compressed").to_dict()
    return _write(dst, out, qc), _write(ref, deq, None)


def emulate_int8(x: torch.Tensor, kind: str, scale: float | None = None) -> torch.Tensor:
    """The reference int8 activation quantization, symmetric, as vLLM's int8 kernels: scale amax / 127 per token
    (or the static scale), values rounded half to even and clamped to [-128, 127] (float32)."""
    xf = x.float()
    s = torch.tensor(scale) if kind == "static" else (xf.abs().amax(-1, keepdim=True) / 127.0).clamp(min=1e-12)
    return (torch.round(xf / s).clamp(-128, 127) * s).to(x.dtype)


def int8_act_hooks(model, kind: str, scales: dict | None = None) -> list:
    """Forward pre-hooks quantizing the decoder's linear layers' inputs to int8 (emulate_int8)."""
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and _is_linear(name + ".weight"):
            s = None if scales is None else scales[name]
            handles.append(mod.register_forward_pre_hook(
                lambda m, args, s=s: (emulate_int8(args[0], kind, s),) + tuple(args[1:])))
    return handles


# ---------------------------------------------------------------------------------------------- quantized experts
class _Restore:
    def __init__(self, mod):
        self.mod = mod

    def remove(self) -> None:
        self.mod.__dict__.pop("forward", None)         # back to the class's forward


def expert_act_quant(model, quant=None) -> list:
    """Replaces the forward of a transformers model's stacked experts (modules holding 3-D `gate_up_proj [E, 2I, H]`
    and `down_proj [E, H, I]`) with a plain per-expert loop in which `quant(x, which)` (which: "in" for the
    experts' input, "down" for the intermediate) is applied to each projection's input, as a quantized checkpoint's
    fused MoE kernel does; quant None: no quantization (the loop's faithfulness to transformers' own forward is a
    test of its own). Returns handles whose remove() restores the module's forward."""
    import torch.nn.functional as F
    handles = []
    for mod in model.modules():
        gu, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
        if not (isinstance(gu, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter) and gu.dim() == 3):
            continue

        def forward(hidden_states, top_k_index, top_k_weights, mod=mod):
            q = quant or (lambda x, which: x)
            out = torch.zeros_like(hidden_states)
            x = q(hidden_states, "in")
            for e in range(mod.gate_up_proj.shape[0]):
                tok, pos = torch.where(top_k_index == e)
                if not len(tok):
                    continue
                gate, up = F.linear(x[tok], mod.gate_up_proj[e]).chunk(2, dim=-1)
                h = q(mod.act_fn(gate) * up, "down")
                y = F.linear(h, mod.down_proj[e]) * top_k_weights[tok, pos, None]
                out.index_add_(0, tok, y.to(out.dtype))
            return out
        mod.forward = forward
        handles.append(_Restore(mod))
    assert handles, "no stacked experts module found"
    return handles


def hf_linear_tensors(ckpt: Path) -> dict[str, list[str]]:
    """checkpoint tensor (name without `.weight`) -> the transformers nn.Linear modules (not the output head) that
    load it: what llm-compressor's `targets: [Linear]` quantizes. Matched by value, so renames between the file and
    the modules (transformers' conversions) do not matter."""
    from hf_ref import hf_model
    model = hf_model(ckpt)
    head = model.get_output_embeddings()
    by_shape: dict = {}
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and m is not head:
            by_shape.setdefault(tuple(m.weight.shape), []).append((n, m.weight.detach()))
    found: dict = {}
    for name, t in load_file(str(Path(ckpt) / "model.safetensors")).items():
        if name.endswith(".weight") and t.dim() == 2:
            mods = [n for n, w in by_shape.get(tuple(t.shape), ()) if torch.equal(t.float(), w.float())]
            if mods:
                found[name[: -len(".weight")]] = mods
    return found


# ---------------------------------------------------------------------------------------------- GGUF, any architecture
GGUF_ARCH = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3",
             "Gemma2ForCausalLM": "gemma2", "LlamaForCausalLM": "llama"}
# K-quant super-blocks of 256 values: bytes a block, byte offsets of the float16 scale fields (d, and dmin where any)
K_QUANT_FIELDS = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
                  "Q6_K": (210, (208,))}


def _k_quant_bytes(rows: int, cols: int, qtype: str, gen: torch.Generator):
    """Random K-quant blocks [rows, cols / 256 * block bytes] (uint8) whose float16 scales are small and finite (the
    gguf package writes no K-quants: random codes, the format's own dequantization gives their values)."""
    import numpy as np
    size, fields = K_QUANT_FIELDS[qtype]
    b = torch.randint(0, 256, (rows, cols // 256, size), generator=gen, dtype=torch.uint8).numpy()
    for k, off in enumerate(fields):
        d = (torch.rand(rows, cols // 256, generator=gen) * 2e-3 + 1e-3) / (k + 1)
        b[..., off:off + 2] = d.to(torch.float16).numpy()[..., None].view(np.uint8)
    return np.ascontiguousarray(b.reshape(rows, -1))


def write_gguf(src: Path, out: Path, qtype="Q8_0", *, tokens: list | None = None, split_max_tensors: int = 0,
               deq: Path | None = None, seed: int = 0) -> Path:
    """A tiny checkpoint of an architecture in GGUF_ARCH as llama.cpp's converter writes it: <arch>.* metadata
    (head_dim as attention.key_length), the gguf package's tensor names, llama's q/k rows permuted, gemma's norms
    stored plus one; 2-D weights in `qtype` (a GGML type name, "F32", or a callable name -> type), the rest float32.
    K-quant tensors hold random codes (see _k_quant_bytes). `deq` receives the float32 checkpoint of what the file
    holds (the HF names and config of `src`, the quantized tensors dequantized by the gguf package; not for llama).
    `tokens`: a gpt2-style token list instead of `<arch>.vocab_size`. `split_max_tensors`: a split set
    (<stem>-0000i-of-0000n.gguf, gguf-split's names); the first file's path is returned."""
    import gguf
    import numpy as np

    cfg = json.loads((Path(src) / "config.json").read_text())
    sd = load_file(str(Path(src) / "model.safetensors"))
    arch = GGUF_ARCH[cfg["architectures"][0]]
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     cfg["num_hidden_layers"])
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    w.add_name("tiny")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if tokens is None:
        w.add_vocab_size(cfg["vocab_size"])
    else:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([1] * len(tokens))
        w.add_token_merges([])
    gen = torch.Generator().manual_seed(seed)
    deq_sd = {}
    for name, t in sd.items():
        a = t.float().numpy()
        base, suffix = name.rsplit(".", 1)
        g = f"{names.get_name(base)}.{suffix}"
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            a = a + 1
        if arch == "llama" and ".q_proj." in name:
            a = _permute(a, heads)
        elif arch == "llama" and ".k_proj." in name:
            a = _permute(a, kv)
        q = qtype(name) if callable(qtype) else qtype
        deq_sd[name] = t.float()
        if a.ndim != 2 or q == "F32":
            w.add_tensor(g, np.ascontiguousarray(a, dtype=np.float32))
            continue
        qt = getattr(gguf.GGMLQuantizationType, q)
        data = _k_quant_bytes(*a.shape, q, gen) if q in K_QUANT_FIELDS else \
            gguf.quants.quantize(np.ascontiguousarray(a), qt)
        if arch != "llama":                   # (llama's q / k rows are permuted in the file: its twin is left out)
            deq_sd[name] = torch.from_numpy(gguf.quants.dequantize(data, qt).copy()).float()
        else:
            assert deq is None and q not in K_QUANT_FIELDS, "a llama GGUF's dequantized twin is not written here"
        w.add_tensor(g, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if deq is not None:
        _copy_small_files(Path(src), Path(deq))
        _write(Path(deq), deq_sd, None)
    if split_max_tensors:
        first = sorted(Path(out).parent.glob(f"{Path(out).stem}-00001-of-*.gguf"))
        return first[0]
    return Path(out)
