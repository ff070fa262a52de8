"""`xllm-gen --explain`: the resolved spec as text, and per-variant parameter/byte tables.

The resolved-spec text is also the golden file of the tests (tests/golden/<name>.resolved.txt).
"""
from __future__ import annotations

from typing import List, Optional

from .ir import (AttentionIR, GatedMLPIR, LinearIR, ModelIR, NormIR, PatchMergerIR, RankTableIR, VariantIR,
                 VisionAttentionIR, VisionMLPIR)

DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "fp32": 4,
               "float": 4, "float8": 1, "fp8": 1}


def _block(b) -> str:
    if isinstance(b, NormIR):
        return f"{b.kind}(dim={b.dim}, eps={b.eps}{', bias' if b.bias else ''})"
    if isinstance(b, LinearIR):
        outs = ", ".join(f"{n}={s}" for n, s in b.out_sizes)
        return f"{b.kind}(in={b.in_features}, out=[{outs}], {b.parallel}{', bias' if b.bias else ''})"
    if isinstance(b, AttentionIR):
        rot = f"{b.rotary.kind}(theta={b.rotary.theta}, max_position={b.rotary.max_position}"
        rot += f", mrope_section={b.rotary.mrope_section})" if b.rotary.mrope_section else ")"
        qk = f", qk_norm=rmsnorm({b.qk_norm[0]}, {b.qk_norm[1]}, eps={b.qk_norm[2]})" if b.qk_norm else ""
        return (f"attention {b.class_name}(hidden={b.hidden}, heads={b.heads}, kv_heads={b.kv_heads}, "
                f"head_dim={b.head_dim}, {b.qkv_name}=[{', '.join(b.qkv_segments)}]{' +bias' if b.qkv_bias else ''}, "
                f"{b.out_name}{' +bias' if b.out_bias else ''}, rotary={rot}{qk}, "
                f"scale={b.scale if b.scale else 'head_dim ** -0.5'})")
    if isinstance(b, VisionAttentionIR):
        return (f"vision_attention(hidden={b.hidden}, heads={b.heads}, head_dim={b.head_dim}, qkv=[q, k, v] +bias "
                f"(fused in the checkpoint), proj +bias, rotary=rotary_2d(theta={b.theta}), within each image / frame)")
    if isinstance(b, VisionMLPIR):
        return f"vision_mlp(hidden={b.hidden}, intermediate={b.intermediate}, {b.activation}, linear_fc1, linear_fc2)"
    if isinstance(b, PatchMergerIR):
        return (f"patch_merger(dim={b.dim}, merged={b.merged}, out={b.out}, layernorm {b.norm.replace('_', ' ')}, "
                f"eps={b.eps}, gelu)")
    if isinstance(b, GatedMLPIR):
        return (f"gated_mlp {b.class_name}(hidden={b.hidden}, intermediate={b.intermediate}, {b.activation}, "
                f"{b.gate_up_name}=[{', '.join(b.gate_up_segments)}], {b.down_name})")
    return repr(b)


def format_resolved(ir: ModelIR) -> str:
    """The resolved spec: symbols, blocks, dataflow, parameters with shapes, sources and sharding."""
    out: List[str] = []
    w = out.append
    w(f"spec {ir.spec_path}" + (f" (extends {', '.join(ir.spec_files[1:])})" if len(ir.spec_files) > 1 else ""))
    w(f"name {ir.name} -> generated/{ir.name}/; model class {ir.model_class}; architectures "
      f"{', '.join(ir.architectures)}")
    w("")
    w("config (symbol <- config.json):")
    width = max(len(f.name) for f in ir.config)
    for f in ir.config:
        if f.length_of:
            w(f"  {f.name:<{width}}  {f.type:<9}  = len({f.length_of})")
            continue
        default = f"  (default {f.default!r})" if f.has_default else "  (required)"
        w(f"  {f.name:<{width}}  {f.type:<9}  <- {' | '.join(f.paths)}{default}")
    w("")
    w(f"decoder:" if ir.decoder_prefix == "model" else f"decoder ({ir.decoder_prefix}):")
    w(f"  embed_tokens  embedding(vocab={ir.embed.vocab}, dim={ir.embed.dim})")
    w(f"  layers x {ir.layer.count}  ({ir.layer.class_name}):")
    for b in ir.layer.blocks:
        w(f"    {b.name}: {_block(b)}")
    w(f"    dataflow:")
    for s in ir.layer.steps:
        w(f"      residual: {s.norm} -> {s.block}")
    if ir.deepstack_after:
        w(f"  deepstack after layers {', '.join(map(str, ir.deepstack_after))}")
    if ir.deepstack_levels:
        w(f"  deepstack: level k after layer k, k < {ir.deepstack_levels}")
    w(f"  norm  {_block(ir.norm)}")
    w(f"lm_head  (vocab={ir.lm_head.vocab}, dim={ir.lm_head.dim}, tied={ir.lm_head.tie})")
    v = ir.vision
    if v:
        pe = v.patch_embed
        w(f"vision ({v.prefix}, {v.class_name}), merge {v.merge}:")
        w(f"  patch_embed  conv3d_patch_embed(in_channels={pe.in_channels}, kernel=stride=({pe.temporal_patch}, "
          f"{pe.patch}, {pe.patch}), dim={pe.dim})")
        w(f"  pos_embed  interpolated_pos_embed(positions={v.pos_embed.positions}, dim={v.pos_embed.dim}, bilinear)")
        w(f"  rotary_pos_emb  rotary_2d(head_dim={v.attention.head_dim}, theta={v.attention.theta})")
        w(f"  blocks x {v.count}  ({v.block_class}):")
        for b in v.blocks:
            w(f"    {b.name}: {_block(b)}")
        w(f"    dataflow:")
        for st in v.steps:
            w(f"      x = x + {st.block}({st.norm}(x))")
        w(f"  merger  {_block(v.merger)}")
        if v.deepstack_merger:
            w(f"  deepstack_merger_list x {v.deepstack_count}  {_block(v.deepstack_merger)}, level k <- block "
              f"{v.deepstack_taps}[k]")
    w("")
    w("parameters (shape; sharding; checkpoint source):")
    for wt in ir.weights + (ir.vision.weights if ir.vision else ()):
        p = wt.param
        shape = "[" + ", ".join(str(s) for s in p.shape) + "]"
        shard = p.shard
        if p.segments:
            shard += " " + ", ".join(f"{s.name}={s.heads}" + (f" x {s.unit}" if s.unit.terms != ((1,),) else "")
                                     + (" (replicable)" if s.replicate_ok else "") for s in p.segments)
        if p.vocab is not None:
            shard += f" (padded {p.vocab})"
        cond = f"  [only if not {p.only_if_untied}]" if p.only_if_untied else ""
        if p.tp_if:
            shard += f" if tp divides {p.tp_if[1]}, else replicated"
        if p.repeat is not None:
            cond += f"  x {p.repeat}"
        w(f"  {p.name}  {shape}  {shard}{cond}")
        w(f"      <- {' + '.join(wt.sources)}")
    if ir.ignored:
        w("ignored checkpoint tensors: " + ", ".join(ir.ignored))
    w("")
    r = ir.runner
    w(f"runner: position_kind={r.position_kind}, max_batch={r.max_batch}, prefill_mode={r.prefill_mode}, "
      f"graph_buckets={', '.join(map(str, r.graph_buckets))}")
    w(f"tensor parallel sizes checked: {', '.join(map(str, ir.tp_sizes))}")
    return "\n".join(out) + "\n"


def _human(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def format_variant(ir: ModelIR, v: VariantIR, table: RankTableIR, dtype: str) -> str:
    nbytes = DTYPE_BYTES[dtype]
    out: List[str] = []
    w = out.append
    per_rank = f", per rank at tp={table.tp}" if table.tp > 1 else ""
    w(f"variant {v.name} ({v.layers} layers, {'tied' if v.tied else 'untied'} lm_head, {dtype}{per_rank})")
    sets = ", ".join(f"{k}={val}" for k, val in v.values)
    w(f"  {sets}")
    for name, h, kv in table.heads_per_rank:
        w(f"  {name}: {h} q heads, {kv} kv heads per rank")
    rows = [(n, "[" + ", ".join(map(str, s)) + "]", c) for n, s, c in table.params]
    width = max(len(n) for n, _, _ in rows)
    swidth = max(len(s) for _, s, _ in rows)
    w(f"  {'parameter':<{width}}  {'shape':>{swidth}}  {'params':>15}  {'bytes':>15}")
    for n, s, c in rows:
        w(f"  {n:<{width}}  {s:>{swidth}}  {c:>15,}  {c * nbytes:>15,}")
    w(f"  {'per layer':<{width}}  {'':>{swidth}}  {table.layer_numel:>15,}  {table.layer_numel * nbytes:>15,}")
    label = f"total ({v.layers} layers)" + (" per rank" if table.tp > 1 else "")
    w(f"  {label:<{width}}  {'':>{swidth}}  {table.total_numel:>15,}  {table.total_numel * nbytes:>15,}"
      f"  ({_human(table.total_numel * nbytes)})")
    return "\n".join(out) + "\n"


def explain(ir: ModelIR, dtype: str = "bfloat16", tables: Optional[List[RankTableIR]] = None) -> str:
    parts = [format_resolved(ir)]
    for i, v in enumerate(ir.variants):
        parts.append(format_variant(ir, v, tables[i] if tables else v.full, dtype))
    return "\n".join(parts)
