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
                   "up_proj.weight", "down_proj.weight")


def _is_linear(name: str) -> bool:
    return ".layers." in name and name.endswith(LINEAR_SUFFIXES)


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


def quantize_block(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scale_inv [ceil(N/bn), ceil(K/bk)]): scale = block amax / 448."""
    bn, bk = block
    N, K = w.shape
    gn, gk = -(-N // bn), -(-K // bk)
    scale = torch.empty(gn, gk)
    q = torch.empty(N, K, dtype=FP8)
    for i in range(gn):
        for j in range(gk):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s = blk.abs().max().clamp(min=1e-12) / FMAX
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


def write_fp8_block(src: Path, dst: Path, ref: Path, block=(32, 32), skip=()) -> tuple[Path, Path]:
    """The fp8 block-wise checkpoint of `src` in `dst`, its dequantized float32 twin in `ref`. Layers whose name
    contains one of `skip` stay float (and are listed in modules_to_not_convert)."""
    src, dst, ref = Path(src), Path(dst), Path(ref)
    _copy_small_files(src, dst)
    _copy_small_files(src, ref)
    sd = load_file(str(src / "model.safetensors"))
    out, deq = {}, {}
    for name, t in sd.items():
        if _is_linear(name) and not any(s in name for s in skip):
            q, s = quantize_block(t.float(), block)
            out[name], out[name[:-len("weight")] + "weight_scale_inv"] = q, s
            deq[name] = dequant_block(q, s, block)
        else:
            out[name] = deq[name] = t
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
          "weight_block_size": list(block), "modules_to_not_convert": list(skip) or None}
    return _write(dst, out, qc), _write(ref, deq, None)


def write_ct_fp8(src: Path, dst: Path, ref: Path, *, strategy: str = "channel", act: str | None = "token",
                 input_scales: dict | None = None) -> tuple[Path, Path]:
    """compressed-tensors float-quantized: weights per `strategy` ("channel" | "tensor"); act None (W8A16),
    "token" (dynamic) or "static" (per-tensor `input_scale` from `input_scales[layer prefix]`)."""
    src, dst, ref = Path(src), Path(dst), Path(ref)
    _copy_small_files(src, dst)
    _copy_small_files(src, ref)
    sd = load_file(str(src / "model.safetensors"))
    out, deq = {}, {}
    for name, t in sd.items():
        if _is_linear(name):
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


def _rt(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x / s).clamp(-FMAX, FMAX).to(FP8).float() * s


def emulate(x: torch.Tensor, kind: str, group: int = 0, scale: float | None = None) -> torch.Tensor:
    """The reference activation quantization (loops over groups; float32)."""
    xf = x.float()
    if kind == "static":
        y = _rt(xf, torch.tensor(scale))
    elif kind == "token":
        y = _rt(xf, (xf.abs().amax(-1, keepdim=True) / FMAX).clamp(min=1e-12))
    else:
        parts = []
        for j in range(0, xf.shape[-1], group):
            g = xf[..., j:j + group]
            parts.append(_rt(g, (g.abs().amax(-1, keepdim=True) / FMAX).clamp(min=1e-12)))
        y = torch.cat(parts, -1)
    return y.to(x.dtype)


def act_quant_hooks(model, kind: str, group: int = 0, scales: dict | None = None, skip=()) -> list:
    """Forward pre-hooks on the decoder's linear layers of a transformers model (but those whose name contains one
    of `skip`): their inputs quantized."""
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and _is_linear(name + ".weight") and not any(s in name for s in skip):
            s = None if scales is None else scales[name]
            handles.append(mod.register_forward_pre_hook(
                lambda m, args, s=s: (emulate(args[0], kind, group, s),) + tuple(args[1:])))
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
