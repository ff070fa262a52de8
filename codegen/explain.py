"""`xllm-gen --explain`: the resolved spec as text, and per-variant parameter/byte tables.

The resolved-spec text is also the golden file of the tests (tests/golden/<name>.resolved.txt).
"""
from __future__ import annotations

from typing import List

from .explain_blocks import _block, _proj, _steps
from .ir import (
    LayoutChoice,
    ModelIR,
    RankTableIR,
    VariantIR,
)
from .ir.params import layout_text

DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "fp32": 4,
               "float": 4, "float8": 1, "fp8": 1}


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
        if f.derived:
            w(f"  {f.name:<{width}}  {f.type:<9}  = {f.expr}")
            continue
        if f.default_expr is not None:
            default = f"  (default {f.default_expr})"
        elif f.default is not None:
            default = f"  (default {f.default!r})"
        else:
            default = "  (optional)" if f.optional else "  (required)"
        if f.if_null is not None:
            default += f"  (null: {f.if_null})"
        if f.read_if is not None:
            default += f"  (read only where {f.read_if})"
        extra = (f"  values: {', '.join(f.values)}" if f.values else "") + \
            (f"  aliases: {', '.join(f'{a}={t}' for a, t in f.aliases)}" if f.aliases else "") + \
            (f"  in [{f.bounds[0]}, {f.bounds[1]}]" if f.bounds != (None, None) else "") + \
            ("  (an int read by its truth)" if f.truthy else "")
        w(f"  {f.name:<{width}}  {f.type:<9}  <- {' | '.join(f.paths)}{default}{extra}")
    if ir.config_assume:
        w("config assumed (not modelled; another value is refused): " +
          ", ".join(f"{k}={v!r}" for k, v in ir.config_assume))
    if ir.config_defaults:
        w("config defaults (transformers', where config.json omits an assumed field): " +
          ", ".join(f"{k}={v!r}" for k, v in ir.config_defaults))
    if ir.config_ignore:
        w("config ignored (does not change the math): " + ", ".join(ir.config_ignore))
    w("")
    w("decoder:" if ir.decoder_prefix == "model" else f"decoder ({ir.decoder_prefix}):")
    w(f"  embed_tokens  embedding(vocab={ir.embed.vocab}, dim={ir.embed.dim}"
      + (f", scale={ir.embed.scale}" + (f" rounded to {ir.embed.scale_dtype})" if ir.embed.scale_dtype != "model"
                                          else ")") if ir.embed.scale else ")"))
    if ir.embed_positions:
        pe = ir.embed_positions
        w(f"  embed_positions  {pe.kind}(positions={pe.positions}, dim={pe.dim}"
          + (f", offset={pe.offset}" if pe.offset else "")
          + (f", frequencies={pe.frequencies}" if pe.kind == "sinusoidal" and pe.frequencies != "fairseq" else "")
          + (f", scale={pe.scale}" if pe.scale is not None else "")
          + "): added to the embedding" + ("" if pe.enabled.literal is True else f", where {pe.enabled}"))
    if ir.project_in:
        w(f"  project_in  {_proj(ir.project_in)}: embedding -> residual width")
    if ir.embed_norm:
        w(f"  embed_norm  {_block(ir.embed_norm)}: normalizes the embedding output")
    ple = ir.per_layer_input
    if ple:
        w(f"  per_layer_input  [tokens, {ple.layers} x {ple.dim}] = (per_layer_projection_norm({_block(ple.norm)})("
          f"per_layer_model_projection(h0) * {ple.project_scale}) + embed_tokens_per_layer(ids, vocab={ple.vocab}) * "
          f"{ple.embed_scale}) * {ple.combine_scale}; layer i reads slice i"
          + (f"; where {ple.enabled}" if ple.enabled.literal is not True else ""))
    w(f"  layers x {ir.layer.count}  ({ir.layer.class_name}):")
    for b in ir.layer.blocks:
        w(f"    {b.name}: {_block(b)}")
    lay = ir.layer
    flows = [("    dataflow:", lay.steps)] if lay.alt_cond is None else [
        (f"    dataflow where {lay.alt_cond} is false ({lay.class_name}):", lay.steps),
        (f"    dataflow where {lay.alt_cond} holds ({lay.alt_class_name}):", lay.alt_steps)]
    for name, inst in lay.shared:
        w(f"    {name}: shared by the layers with equal {inst} (the first holds the weights; KV cache, state and "
          f"adapters per layer)")
    for name, only in lay.only_in:
        w(f"    {name}: only in the {'layers' if lay.alt_cond.per_layer else 'checkpoints'} where {lay.alt_cond} is "
          f"{'true' if only else 'false'}")
    for title, steps in flows:
        w(title)
        _steps(w, steps)
    if lay.output_scale:
        w(f"    then the whole residual stream times the layer's learned scalar {lay.output_scale} [1]")
    if lay.stream_scale:
        w(f"    then the whole residual stream times {lay.stream_scale} (where not 1)")
    if lay.stored_as:
        w(f"    weights: layer i runs the stored layer f\"{lay.stored_as}\" (equal prefixes: the same weights, the "
          f"first layer holds them; a KV cache and state per executed layer)")
    if ir.schedule:
        sch = ir.schedule
        w("  schedule (the stream rewritten before the layers where each rewrite's condition holds, in order):")
        for n in sch.norms:
            w(f"    {n.name}: {n.kind}(dim={n.dim}, eps={n.eps}{'' if n.weight else ', no weight'})")
        for name, dim in sch.vectors:
            w(f"    {name}: a learned vector [{dim}]")
        for op in sch.ops:
            terms = " + ".join(f"{norm}({v})" if norm else v for v, norm in op.terms)
            w(f"    {op.target} = {terms}  where {op.when}")
    if ir.deepstack_after:
        w(f"  deepstack after layers {', '.join(map(str, ir.deepstack_after))}")
    if ir.deepstack_levels:
        w(f"  deepstack: level k after layer k, k < {ir.deepstack_levels}")
    if ir.hyper_head:
        w(f"  hyper_head  {_block(ir.hyper_head)}: the streams (the embedding copied {ir.hyper_head.streams} times "
          f"before layer 0) collapsed to one")
    if ir.norm:
        w(f"  norm  {_block(ir.norm)}" + (f" where {ir.norm_enabled}" if ir.norm_enabled.literal is not True else ""))
    else:
        w("  norm  none" + ("" if ir.hyper_head else " (the last residual add only)"))
    if ir.residual_float32.literal is not False:
        w("  residual stream in float32" + (f" where {ir.residual_float32}" if ir.residual_float32.literal is not True
                                            else "") + " (layer norms read it in the model dtype, the final norm in "
                                                       "float32)")
    if ir.project_out:
        w(f"  project_out  {_proj(ir.project_out)}: residual -> LM head width")
    if ir.head_transform:
        ht = ir.head_transform
        w(f"  head_transform  dense(in={ht.in_}, out={ht.out}, replicated"
          + (f", bias={ht.bias}" if ht.bias.literal is not False else "") + f") -> {ht.activation}"
          + (f" -> {_block(ht.norm)}" if ht.norm else "") + ": before the LM head")
    w(f"lm_head  (vocab={ir.lm_head.vocab}, dim={ir.lm_head.dim}, tied={ir.lm_head.tie}"
      + (f", logit_scale={ir.lm_head.logit_scale}" if ir.lm_head.logit_scale else "")
      + (f", bias={ir.lm_head.bias}" if ir.lm_head.bias.literal is not False else "")
      + (f", rows L2-normalized={ir.lm_head.normalize}" if ir.lm_head.normalize.literal is not False else "")
      + (f", softcap={ir.lm_head.softcap})" if ir.lm_head.softcap else ")"))
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
        w("    dataflow:")
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
        if p.experts is not None:
            shard += " (per expert)" if p.shard != "expert" else ""
        if p.when is not None:
            cond += f"  [only where {'' if p.when[1] else 'not '}({p.when[0]})]"
        w(f"  {p.name}  {shape}  {shard}{cond}")
        layout = (f" (rows {wt.layout})" if isinstance(wt.layout, LayoutChoice) else
                  f" (rows {layout_text(wt.layout)})" if wt.layout else "") + \
            (" (stored transposed)" if wt.transpose else "") + \
            (f" ({wt.interleave} segments interleaved)" if wt.interleave > 1 else "") + \
            ((" (stored under a leading unit dim)" if wt.squeeze is True else f" (stored with unit dims at {list(wt.squeeze)})")
             if wt.squeeze else "")
        if wt.groups:         # a segment mapping whose tensors hold several segments (keys `k+v`)
            grouped = {n: g for g in wt.groups for n in g.segments}
            parts, seen = [], set()
            for seg, src in zip((s.name for s in p.segments), wt.sources):
                g = grouped.get(seg)
                if g is None:
                    parts.append(f"{seg}: {src}")
                elif g.key not in seen:
                    seen.add(g.key)
                    parts.append(f"{g.key}: {src} (rows {g})")
            w(f"      <- {', '.join(parts)}{layout}")
        else:
            w(f"      <- {' + '.join(wt.sources)}{layout}")
    if ir.ignored:
        w("ignored checkpoint tensors: " + ", ".join(ir.ignored))
    if ir.checkpoint_renames:
        w("checkpoint tensor names rewritten at load: " + ", ".join(f"{a} -> {b if isinstance(b, str) else ' | '.join(b)}" for a, b in ir.checkpoint_renames))
    w("")
    r = ir.runner
    w(f"runner: positions {r.position_kind}" + (", multimodal" if r.multimodal else ""))
    w(f"tensor parallel sizes checked: {', '.join(map(str, ir.tp_sizes))}")
    return "\n".join(out) + "\n"


def _human(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _runs(value) -> str:
    """A long per-layer list with runs of equal items, written as runs: ['full_attention' * 28]."""
    if not isinstance(value, (list, tuple)) or len(value) < 8:
        return str(value)
    for period in (2, 3, 4):            # a repeated pattern: ['sliding_attention', 'full_attention'] * 21
        if len(value) % period == 0 and list(value) == list(value[:period]) * (len(value) // period) \
                and len(set(value[:period])) > 1:
            return f"{list(value[:period])} * {len(value) // period}"
    parts, i = [], 0
    while i < len(value):
        j = i
        while j < len(value) and value[j] == value[i]:
            j += 1
        parts.append(repr(value[i]) + (f" * {j - i}" if j - i > 1 else ""))
        i = j
    return "[" + ", ".join(parts) + "]"


def format_variant(ir: ModelIR, v: VariantIR, table: RankTableIR, dtype: str) -> str:
    nbytes = DTYPE_BYTES[dtype]
    out: List[str] = []
    w = out.append
    per_rank = f", per rank at tp={table.tp}" if table.tp > 1 else ""
    w(f"variant {v.name} ({v.layers} layers, {'tied' if v.tied else 'untied'} lm_head, {dtype}{per_rank})")
    sets = ", ".join(f"{k}={_runs(val)}" for k, val in v.values)
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
    if table.padded:
        w(f"  padded with zero rows to split over {table.tp} ranks (exact: zero up/gate rows, zero down columns; "
          f"the checkpoint's rows are the real ones):")
        for n, seg, size, total in table.padded:
            w(f"    {n} {seg}: {size} -> {total} ({total // table.tp} per rank)")
    return "\n".join(out) + "\n"


def explain(ir: ModelIR, files: dict, dtype: str = "bfloat16", tp: int = 1) -> str:
    """The resolved spec and each variant's table at TP size `tp`, from the runtime's plan (the rendered model
    built on the meta device). A size that cannot be split raises ShardingError."""
    module = model_module_of(ir, files)
    parts = [format_resolved(ir)]
    for v in ir.variants:
        parts.append(format_variant(ir, v, tp_rank_table(ir, files, v, tp, module), dtype))
    return "\n".join(parts)


# ------------------------------------------------------------------ per-rank tables from the runtime's plan
def model_module_of(ir: ModelIR, files: dict):
    """The spec's generated model module, rendered (`files`, from the compiler) and imported as a fresh
    module: what `--explain --tp N` builds on the meta device. Nothing is written."""
    import importlib.util
    import sys

    name = f"_xllm_gen_explain_{ir.name}"
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = f"<generated/{ir.name}/model.py, rendered by --explain>"
    sys.modules[name] = module                     # dataclasses resolve their module while the class is made
    try:
        exec(compile(files["model.py"], module.__file__, "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    return module


def variant_config(module, ir: ModelIR, v: VariantIR):
    """The generated Config of a variant: its symbol values written at each symbol's config.json path, read
    back by the generated `Config.from_hf` (defaults and derived symbols as for a real checkpoint)."""
    values = dict(v.values)
    hf: dict = {"architectures": list(ir.architectures)}
    # mappings first (a rope symbol's rope_parameters), then the fields inside them (rope_parameters.rope_theta):
    # in declaration order the mapping written after its theta overwrote the variant's theta
    for f in sorted(ir.config, key=lambda f: not isinstance(values.get(f.name), dict)):
        if not f.paths or values.get(f.name) is None:
            continue
        value = values[f.name]
        if "[*]" in f.paths[0]:        # a per-element read: the list of mappings, one entry per element
            head, rest = f.paths[0].split("[*].", 1)
            _put(hf, head, [{} for _ in value], keep=True)
            for element, item in zip(_get(hf, head), value):
                _put(element, rest, item)
            continue
        _put(hf, f.paths[0], list(value) if isinstance(value, tuple) else (dict(value) if isinstance(value, dict)
                                                                           else value))
    for key, value in ir.config_assume:     # a variant is a checkpoint the spec models: it has the assumed values
        if isinstance(value, dict) and set(value) == {"any_of"}:
            value = value["any_of"][0]
        if value is None:
            continue
        if "[*]" in key:
            head, rest = key.split("[*].", 1)
            for element in _get(hf, head) or ():
                _put(element, rest, value, keep=True)
            continue
        _put(hf, key, value, keep=True)
    return module.Config.from_hf(hf)


def _get(node: dict, path: str):
    for p in path.split("."):
        node = node.get(p) if isinstance(node, dict) else None
    return node


def _put(node: dict, path: str, value, keep: bool = False) -> None:
    """node[path] = value (`keep`: unless the field is there), creating the mappings on the way."""
    *parents, leaf = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    if isinstance(node, dict) and not (keep and leaf in node):
        node[leaf] = value


def rank_table_from_plan(ir: ModelIR, plan, rank: int = 0) -> RankTableIR:
    """A RankTableIR (what format_variant prints) from one rank of runtime tp_check.tp_plan: parameters of
    repeated blocks (decoder layers, vision blocks, deepstack mergers) once, as `{i}`, with this rank's
    shapes; per layer = one decoder layer; total = everything this rank holds."""
    import re

    r = plan.ranks[[x.rank for x in plan.ranks].index(rank)]
    layer0 = f"{ir.decoder_prefix}.layers.0."
    rows, seen, layer_numel, padded = [], set(), 0, []
    for p in r.params:
        key = re.sub(r"\.\d+\.", ".{i}.", p.name)
        if p.name.startswith(layer0):
            layer_numel += p.numel
        if key in seen:
            continue
        seen.add(key)
        rows.append((key, tuple(p.shape), p.numel))
        padded += [(key, s.name, s.size, s.padded) for s in p.segments if getattr(s, "padded", 0)]
    heads = tuple((n[len(layer0):].split(".")[0], h, kv) for n, h, kv in r.heads if n.startswith(layer0))
    return RankTableIR(plan.tp_size, heads, tuple(rows), layer_numel, r.numel, tuple(padded))


def tp_rank_table(ir: ModelIR, files: dict, v: VariantIR, tp: int, module=None) -> RankTableIR:
    """Rank 0's table of variant `v` at TP size `tp`, from the runtime's own plan (the layers' sharding).
    A size that cannot be split raises the runtime's ShardingError naming the parameters."""
    from xllm_gen.runtime.executor.tp_check import tp_plan

    module = module or model_module_of(ir, files)
    return rank_table_from_plan(ir, tp_plan(module, variant_config(module, ir, v), tp, ranks=(0,)))
