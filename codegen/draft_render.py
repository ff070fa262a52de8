"""The text of a drafted spec (`xllm-gen draft`, codegen/draft.py): the checklist as comments, then config, decoder,
lm_head, weights."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from .draft_attention import attention_lines, rotary_keys
from .draft_flow import flow_lines
from .draft_forms import flow_weights
from .draft_layer import step
from .draft_mla import render_mla
from .draft_moe import render_block, render_weights
from .draft_parts import prefix_lines
from .draft_qkv import LayoutIf

if TYPE_CHECKING:
    from .draft import Draft, _Layer

ACT_FIELDS = ("hidden_act", "hidden_activation", "activation_function", "activation")


def _yaml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "~"
    if isinstance(v, float):
        text = repr(v)
        return text if ("." in text or "e" in text or "inf" in text or "nan" in text) else text + ".0"
    if isinstance(v, (int,)):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    return json.dumps(v)


def _q(expr: str) -> str:
    """An expression as a YAML scalar (quoted where it is more than a name)."""
    return expr if expr.isidentifier() else json.dumps(expr)


def _act_field(full: dict) -> str | None:
    return next((f for f in ACT_FIELDS if f in full), None)


def _render(d: Draft, target: str, config_class: str, full: dict, names: set, controls: dict, layer: _Layer,
            norm_kind: str, eps: str, sparse: tuple = (None, {}, None)) -> str:
    """The spec text: the checklist as comments, then config, decoder, lm_head, weights. `sparse`: (the MoE, its
    block's field values, the condition of the sparse layers: None where every layer is)."""
    rel = layer.rel
    moe, moe_fields, sparse_if = sparse
    dense = layer.down is not None and not (moe is not None and sparse_if is None)    # a dense MLP on some layers

    def bias_flag(*mods: str) -> str:
        flags = {controls.get(m + ".bias") for m in mods}
        present = {(m + ".bias") in names for m in mods}
        if len(flags) > 1 or len(present) > 1:
            d.checklist.append(f"the biases of {', '.join(rel(m) for m in mods)} are controlled by different flags "
                               f"({', '.join(sorted(str(f) for f in flags))}): one flag per fused projection")
        flag = next(iter(flags))
        if flag:
            d.symbols[flag] = f"{{type: bool, from: {flag}, default: {_yaml_scalar(full.get(flag))}}}"
            return flag
        return "true" if all(present) else "false"

    q, qkv_fused, gate_up_fused, gated = layer.q, layer.qkv_fused, layer.gate_up_fused, layer.gated
    max_pos = "max_position_embeddings" if "max_position_embeddings" in d.symbols else "8192"
    if max_pos == "8192" and "rope_theta" in d.symbols:
        d.checklist.append("no max_position_embeddings field: the rotary table length is a literal 8192")
    if layer.mla is None:
        qb = bias_flag(q, layer.k, layer.v) if q else bias_flag(qkv_fused)
        ob = bias_flag(layer.o)
    if dense:
        up_b = bias_flag(gate_up_fused) if gate_up_fused else bias_flag(*([layer.gate, layer.up] if gated else
                                                                          [layer.up]))
        down_b = bias_flag(layer.down)
    tied = "lm_head.weight" not in names or "tie_word_embeddings" in full
    attn_name, mlp_name = rel(layer.attn_mod), rel(layer.mlp_mod)
    arch = d.architecture
    attn_lines = render_mla(d, layer.mla, controls, names, full, max_pos, rel) if layer.mla else [
        f"      {attn_name}:", "        kind: attention", "        hidden: hidden_size",
        "        heads: num_attention_heads", f"        kv_heads: {_q(layer.kv_heads or 'num_key_value_heads')}", "        head_dim: head_dim",
        f"        qkv: {{name: {qkv_fused.rsplit('.', 1)[1] if qkv_fused else 'qkv_proj'}, segments: [q, k, v], "
        f"bias: {qb}}}",
        f"        out: {{name: {layer.o.rsplit('.', 1)[1]}, bias: {ob}}}"]
    if layer.attn is not None:
        attn_lines += attention_lines(layer.attn)
    if layer.mla is None and "rope_theta" in d.symbols:
        keys = rotary_keys(layer.attn) if layer.attn is not None else ""
        theta, scaling = (layer.attn.theta, layer.attn.scaling) if layer.attn and layer.attn.theta else (
            "rope_theta", "rope_scaling")
        attn_lines.append(f"        rotary: {{kind: neox, {keys}theta: {theta}, max_position: {max_pos}, "
                          f"scaling: {scaling}}}")
    L = []
    L.append(f"# CHECKLIST: drafted by `xllm-gen draft {target}` from transformers' {arch} (config class "
             f"{config_class}).")
    L.append("# A draft is a first guess of a Llama-like pre-norm decoder. Before trusting it, decide each item, then")
    L.append("# run: xllm-gen --dry-run THIS.yaml && xllm-gen verify THIS.yaml CHECKPOINT_DIR")
    for item in d.checklist:
        L.append(f"# - [ ] {item}")
    if not d.checklist:
        L.append("# - [ ] nothing flagged: still read the modeling file against the decoder below")
    L.append("# yaml-language-server: $schema=spec.schema.json")
    L.append("spec_version: 2")
    L.append(f"name: {d.name}")
    L.append(f"class_prefix: {d.prefix}")
    L.append(f"architectures: [{arch}]")
    L.append(f"description: drafted from transformers' {arch}; review the checklist above.")
    L.append("")
    L.append("config:")
    width = max(len(s) for s in d.symbols) + 1
    for s, text in d.symbols.items():
        L.append(f"  {(s + ':').ljust(width)} {text}")
    if d.assume:
        L.append("")
        L.append("# fields the spec does not read: the values it builds in (a checkpoint with another value is refused)")
        L.append("config_assume:")
        for key, value in d.assume.items():
            L.append(f"  {key}: {_yaml_scalar(value)}")
    if d.ignore:
        L.append("")
        L.append("# fields that do not change the forward pass")
        L.append("config_ignore: [" + ", ".join(d.ignore) + "]")
    roles = layer.roles
    norm = f"{{kind: {norm_kind.split('_')[0]}, dim: hidden_size, eps: {eps}" + (
        ", bias: false" if norm_kind == "layernorm_nobias" else "") + (
        ", weight_offset: 1}" if roles and roles.offset else "}")
    act_ref = _act_field(full) or "silu"
    L += ["", "decoder:",
          "  embed_tokens: {kind: embedding, vocab: vocab_size, dim: hidden_size"
          + (f", scale: {d.scales['embed']}}}" if "embed" in d.scales else "}"),
          "  layers:", "    count: num_hidden_layers", "    blocks:"]
    flow = roles.flow if roles is not None and roles.flow is not None and roles.flow.rich else None
    if flow is not None:        # the norms of every drafted form (draft_flow.py)
        L += [f"      {n}: {norm}" for n in flow.norms] + attn_lines
    else:
        L += [*([f"      {rel(layer.attn_norm)}: {norm}"] if layer.attn_norm else []), *attn_lines]
        L += [f"      {rel(n)}: {norm}" for n in ((roles.attn_post, roles.mlp_pre) if roles else (layer.mlp_norm,))
              if n and not (roles and roles.parallel)]
    # the MoE block: named as the module where every layer is sparse, else `moe` (one module with the dense MLP)
    moe_name = None if moe is None else (moe.module if sparse_if is None or not dense else "moe")
    if moe is not None:
        L += render_block(moe, moe_fields, act_ref, moe_name)
    if dense and gated:
        L += [f"      {mlp_name}:", "        kind: gated_mlp", "        hidden: hidden_size", "        intermediate: intermediate_size",
              f"        activation: {act_ref}",
              f"        gate_up: {{name: {gate_up_fused.rsplit('.', 1)[1] if gate_up_fused else 'gate_up_proj'}, "
              f"segments: [gate, up], bias: {up_b}}}",
              f"        down: {{name: {layer.down.rsplit('.', 1)[1]}, bias: {down_b}}}"]
    elif dense:
        L += [f"      {mlp_name}:", "        kind: mlp", "        hidden: hidden_size",
              "        intermediate: intermediate_size",
              f"        activation: {act_ref}",
              f"        up: {{name: {layer.up.rsplit('.', 1)[1]}, bias: {up_b}}}",
              f"        down: {{name: {layer.down.rsplit('.', 1)[1]}, bias: {down_b}}}"]
    if roles and roles.mlp_post and flow is None:
        L.append(f"      {rel(roles.mlp_post)}: {norm}")
    # each residual branch scaled (MiniCPM's scale_depth / sqrt(layers), Granite's residual_multiplier)
    rs = f", scale: {d.scales['residual']}" if "residual" in d.scales else ""
    if moe is not None and dense and sparse_if is not None:
        mlp_step = ([f"      - norm: {rel(layer.mlp_norm)}"] if layer.mlp_norm else []) + [
                    f"      {'  ' if layer.mlp_norm else '- '}block: {{if: {json.dumps(sparse_if)}, then: {moe_name}, else: {mlp_name}, "
                    f"name: {moe.module}}}"] + ([f"        scale: {d.scales['residual']}"] if rs else [])
    else:       # one block: the experts on every layer, or the dense MLP
        mlp_step = [f"      - {step(rel, layer.mlp_norm, moe_name or mlp_name, roles and roles.mlp_post, rs)}"]
    if roles and roles.mlp_post and len(mlp_step) > 1:
        mlp_step.append(f"        post_norm: {rel(roles.mlp_post)}")
    first = [f"      - {step(rel, layer.attn_norm, attn_name, roles and roles.attn_post, rs)}"]
    if roles and roles.parallel:        # both blocks on one norm's output, one residual add (Cohere)
        ff = (f"{{if: {json.dumps(sparse_if)}, then: {moe_name}, else: {mlp_name}, name: {moe.module}}}"
              if moe is not None and dense and sparse_if is not None else moe_name or mlp_name)    # a block choice
        first, mlp_step = [f"      - parallel: [{step(rel, layer.attn_norm, attn_name, None, rs)}, "
                           f"{step(rel, layer.mlp_norm, ff, None, rs)}]"], []
    if flow is not None:
        ff = (f"{{if: {json.dumps(sparse_if)}, then: {moe_name}, else: {mlp_name}, name: {moe.module}}}"
              if moe is not None and dense and sparse_if is not None else moe_name or mlp_name)
        first, mlp_step = flow_lines(flow, lambda b: attn_name if b == attn_name else ff, rs), []
    L += ["    dataflow:", *first, *mlp_step,
          f"  norm: {norm}", "",
          "lm_head: {kind: lm_head, vocab: vocab_size, dim: hidden_size"
          + (", tie: tie_word_embeddings" if tied else "") + (", bias: true" if "lm_head.bias" in names else "")
          + (f", logit_scale: {d.scales['logit']}" if "logit" in d.scales else "")
          + (f", softcap: {d.scales['softcap']}}}" if "softcap" in d.scales else "}")]
    prefixes = prefix_lines(layer, layer.parts)         # draft_parts.py
    L += prefixes + ["", "weights:"]
    fused = [] if layer.mla else [(f"model.layers.{{i}}.{rel(qkv_fused)}", qkv_fused, qb) if qkv_fused else
                                  (f"model.layers.{{i}}.{attn_name}.qkv_proj", {"q": q, "k": layer.k, "v": layer.v}, qb)]
    if dense and gate_up_fused:
        fused.append((f"model.layers.{{i}}.{rel(gate_up_fused)}", gate_up_fused, up_b))
    elif dense and gated:
        fused.append((f"model.layers.{{i}}.{mlp_name}.gate_up_proj", {"gate": layer.gate, "up": layer.up}, up_b))
    for target_name, parts, b in fused:
        for suffix in ("weight", "bias") if b != "false" else ("weight",):
            L.append(f"  {target_name}.{suffix}:")
            if isinstance(parts, str):       # stored stacked: one tensor, split into its segments at load
                L.append(f"    from: {parts}.{suffix}")
                lay = layer.qkv_layout if parts == qkv_fused else None
                if isinstance(lay, LayoutIf):       # chosen by a flag (draft_qkv.py)
                    L += ["    layout:", f"      if: {lay.flag}",
                          f"      then: {{interleave: [q, k, v], per: {lay.then}}}",
                          f"      else: {{interleave: [q, k, v], per: {lay.else_}}}"]
                elif lay not in (None, "tensor"):     # draft_qkv.py
                    L.append(f"    layout: {{interleave: [q, k, v], per: {lay}}}")
                continue
            L.append("    from:")
            for seg, src in parts.items():
                L.append(f"      {seg}: {src}.{suffix}")
    if layer.final_norm != "model.norm" and not any("model.norm.:" in x for x in prefixes):     # the decoder's `norm` loads from the module as named
        L += [f"  model.norm.{p}: {{from: {layer.final_norm}.{p}}}" for p in ("weight", "bias")
              if f"{layer.final_norm}.{p}" in names]
    L += flow_weights(flow, layer.prefix)      # a merged form's norms loaded from another's tensors (draft_flow.py)
    if layer.attn is not None:
        L += layer.attn.weights
    if moe is not None:
        L += render_weights(moe)
    L += ["", "ignore_checkpoint_tensors:", "  - '.*rotary_emb\\.inv_freq$'"]
    if tied:
        L.append("  - '^lm_head\\.weight$'")
    L += ["", "tensor_parallel:", "  sizes: [1, 2]", ""]
    return "\n".join(L)
