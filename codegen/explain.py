"""`xllm-gen --explain`: the resolved spec as text, and per-variant parameter/byte tables.

The resolved-spec text is also the golden file of the tests (tests/golden/<name>.resolved.txt).
"""
from __future__ import annotations

from typing import List

from .ir import (
    MLAIR,
    MLPIR,
    MLSTMIR,
    RGLRUIR,
    WKVIR,
    AttentionIR,
    ChannelMixIR,
    GatedDeltaNetIR,
    GatedMLPIR,
    LightningIR,
    LinearIR,
    Mamba2IR,
    MambaIR,
    ModelIR,
    MoEIR,
    NormIR,
    PatchMergerIR,
    RankTableIR,
    ShortConvIR,
    VariantIR,
    VisionAttentionIR,
    VisionMLPIR,
)

DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "fp32": 4,
               "float": 4, "float8": 1, "fp8": 1}


def _proj(p) -> str:
    return (f"linear(in={p.in_}, out={p.out}, replicated" + (f", bias={p.bias}" if p.bias.literal is not False else "")
            + (f", where {p.enabled}" if p.enabled.literal is not True else "") + ")")


def _scales(segs, out=None, out_name="") -> str:
    """`  x {k: key_multiplier}`: a projection's per-segment / output multipliers, as explain shows them."""
    txt = (" x {" + ", ".join(f"{k}: {v}" for k, v in segs) + "}") if segs else ""
    return txt + (f", {out_name} x {out}" if out is not None and out_name else f" x {out}" if out is not None else "")


def _steps(w, steps) -> None:
    for s in steps:
        if getattr(s, "value", None) is not None:
            chain = " -> ".join((f"{op.norm} -> " if op.norm else "") + op.block for op in s.branches)
            w(f"      branch {s.value} = [{' | '.join(s.inputs)}] -> {chain} (no residual)"
              + (f" where {s.when}" if s.when is not None else ""))
        elif hasattr(s, "branches"):
            w("      parallel residual: " + " + ".join(f"{b.norm or '(no norm)'}"
                                                        + (f" x {b.input_scale}" if b.input_scale else "")
                                                        + f" -> {b.block}" + (f" -> {b.post_norm}" if b.post_norm else "")
                                                        + (f" x {b.scale}" if b.scale else "")
                                                        for b in s.branches)
              + (f"; the sum -> {s.post_norm}" if s.post_norm else ""))
        elif getattr(s, "hyper", None):
            block = s.block if s.choice is None else f"{s.block} = ({s.choice.describe()})"
            w(f"      streams: {s.hyper}.pre -> {s.norm or '(no norm)'} -> {block}"
              + (f" -> {s.post_norm}" if s.post_norm else "") + (f" x {s.scale}" if s.scale else "")
              + f" -> {s.hyper}.post + {s.hyper}.mix(streams)")
        else:
            block = s.block if s.choice is None else f"{s.block} = ({s.choice.describe()})"
            w(f"      residual: {s.norm or '(no norm)'}{'(stream + ' + s.add + ')' if s.add else ''}"
              + (f" x {s.input_scale}" if s.input_scale else "")
              + f" -> {block}" + (f" -> {s.post_norm}" if s.post_norm else "")
              + (f" x {s.scale}" if s.scale else "")
              + (f"; post-LN: stream = {s.after_norm}(stream + h)" if s.after_norm else "")
              + (f" (+ branch {s.join})" if getattr(s, "join", None) else "")
              + (f"; stream x {s.residual_scale}" if getattr(s, "residual_scale", None) is not None
                 and not s.residual_normed else "")
              + (f"; gated add by {s.gate}" if getattr(s, "gate", None) else "")
              + (f" where {s.when}" if s.when is not None else ""))


def _query_scale(qs) -> str:
    if qs.form == "power":
        txt = f", query_scale=(1 + (position + {qs.offset}) / {qs.floor}) ** {qs.beta}"
    else:
        txt = f", query_scale=1 + {qs.beta} * log(1 + floor((position + {qs.offset}) / {qs.floor}))"
    return txt + (f" where {qs.enabled}" if qs.enabled.literal is not True else "")


def _rotary(r) -> str:
    if r is None:
        return "none"
    rot = f"{r.kind if not r.kind_symbol else 'kind=' + r.kind_symbol}(theta={r.theta}, max_position={r.max_position}"
    rot += f", mrope_section={r.mrope_section}" if r.mrope_section else ""
    rot += f", fraction={r.fraction}" if r.fraction else ""
    rot += f", dim={r.dim}" if r.dim else ""
    rot += f", layout={r.layout_symbol or r.layout}" if r.layout_symbol or r.layout != "neox" else ""
    rot += f", enabled={r.enabled}" if r.enabled.literal is not True else ""
    rot += f", original_max_position={r.original_max_position}" if r.original_max_position else ""
    rot += f", direction={r.direction}" if r.direction != "forward" else ""
    return rot + (f", scaling={r.scaling})" if r.scaling else ")")


def _lora(lo) -> str:
    if lo is None:
        return ""
    return (f", lora={lo.name}(rank={lo.rank}, {'per segment' if lo.per == 'segment' else 'whole projection'}"
            + (f", where {lo.enabled}" if lo.enabled.literal is not True else "") + ", per layer)")


def _sub_norm(n) -> str:
    if n is None:
        return ""
    return (f", sub_norm={n.kind}({n.name}, eps={n.eps}, over the whole width"
            + (f", weight = {n.weight_offset:g} + w" if n.weight_offset else "") + (", bias" if n.bias else "") + ")")


def _block(b) -> str:
    if getattr(b, "kind", None) == "hyper_connection":
        return b.describe()
    if getattr(b, "kind", None) == "residual_gate":
        return f"residual_gate(hidden={b.hidden}: x = ({b.residual}) * x + ({b.branch}) * h, w = weight)"
    if isinstance(b, NormIR):
        off = f", weight = {b.weight_offset:g} + w" if b.weight_offset else ""
        bias = (f", bias where {b.bias_flag}" if b.bias_flag is not None else ", bias") if b.bias else ""
        where = f", only where {b.enabled} (else the identity)" if b.enabled.literal is not True else ""
        gate = ""
        if b.gate_rank is not None:
            gate = (f", gated: y * sigmoid(mlp.fc2(silu(mlp.fc1(y)))) of rank {b.gate_rank}"
                    + (f" where {b.gate_enabled}" if b.gate_enabled.literal is not True else ""))
        return f"{b.kind}(dim={b.dim}, eps={b.eps}{bias}{', no weight' if not b.weight else ''}{off}{where}{gate})"
    if isinstance(b, LinearIR):
        outs = ", ".join(f"{n}={s}" for n, s in b.out_sizes)
        return f"{b.kind}(in={b.in_features}, out=[{outs}], {b.parallel}{', bias' if b.bias else ''})"
    if isinstance(b, AttentionIR):
        rot = _rotary(b.rotary)
        n = b.qk_norm
        qk = ""
        if n:
            extra = ("" if n.over == "head" else ", over the projection") + \
                    ("" if n.at == "before_rotary" else ", after rotary") + \
                    (f", weight = {n.weight_offset:g} + w" if n.weight_offset else "") + (", bias" if n.bias else "") + \
                    (", a weight per head" if n.per_head_weights else "") + (", no weight" if n.weightless else "") + \
                    (f", where {n.enabled}" if n.enabled is not None else "")
            qk = f", qk_norm={n.kind}({n.q}, {n.k}, eps={n.eps}{extra})"
        return (f"attention {b.class_name}(hidden={b.hidden}, "
                + (f"input_width={b.input_width}, " if b.input_width is not None else "")
                + f"heads={b.heads}, kv_heads={b.kv_heads}, "
                f"head_dim={b.head_dim}, {b.qkv_name}=[{', '.join(b.qkv_segments)}] bias={b.qkv_bias}"
                f"{_scales(b.qkv_scale)}, {b.out_name} bias={b.out_bias}{_scales((), b.out_scale)}, rotary={rot}{qk}, "
                f"scale={b.scale if b.scale else 'head_dim ** -0.5'}"
                + (f", sliding_window={b.sliding_window}" if b.sliding_window else "")
                + (f", chunk_size={b.chunk_size}" if b.chunk_size else "")
                + (_query_scale(b.query_scale) if b.query_scale else "")
                + (f", softcap={b.softcap}" if b.softcap else "")
                + (f", clip_qkv={b.clip_qkv}" if b.clip_qkv else "") + (", sinks" if b.sinks else "") \
                + (f", out_gate={b.out_gate[1]}({b.out_gate[0]}"
                   + (f" + {b.out_gate_bias}[head]" if b.out_gate_bias else "") + f") per {b.out_gate[2]}"
                   + (f" bias={b.out_gate_proj_bias}" if b.out_gate_proj_bias is not None else "")
                   if b.out_gate else "")
                + (f", out_gate={b.q_gate}(in q's rows, per head [q, gate]) per element" if b.q_gate else "")
                + (f", alibi(bias_max={b.alibi})" if b.alibi else "")
                + (f", key_bias(exp({b.key_bias.gain} * softplus({b.key_bias.proj}(v))), keep={b.key_bias.keep})"
                   if b.key_bias else "") + _sub_norm(b.sub_norm)
                + (f", kv_nvfp4={b.kv_nvfp4} (k, v rounded to NVFP4 before the cache)" if b.kv_nvfp4 else "")
                + (f", differential(eps={b.differential})" if b.differential else "") + _lora(b.lora)
                + (f", v_norm(eps={b.v_norm}, no weight)" if b.v_norm else "")
                + (f", values_from_keys={b.values_from_keys} (no v segment there)" if b.values_from_keys else "")
                + (f", kv_source={b.kv_source} (another layer: q alone, that layer's KV cache read, none written)"
                   if b.kv_source else "")
                + (f", experts(count={b.experts.count}, top_k={b.experts.top_k}, router={b.experts.router}, routed q="
                   f"{b.experts.q}, routed out={b.out_name}: slot s's head h attends KV head h)" if b.experts else "")
                + ")")
    if isinstance(b, LightningIR):
        return (f"lightning_attention {b.class_name}(hidden={b.hidden}, heads={b.heads}, head_dim={b.head_dim}, "
                f"activation={b.activation}, decay per head exp(-2 ** (-8 (h + 1) / heads) * (1 - layer / ({b.layers} - 1 "
                f"+ 1e-5) + 1e-5)), block_size={b.block_size}, {b.qkv}=[q, k, v] per head, norm over all heads "
                f"(eps={b.eps}), sigmoid({b.gate}), {b.out_name}; state per sequence: kv [heads, head_dim, head_dim] "
                f"float32)")
    if isinstance(b, MLSTMIR):
        return (f"mlstm {b.class_name}(hidden={b.hidden}, heads={b.heads}, qk_dim={b.qk_dim}, v_dim={b.v_dim}, eps="
                f"{b.eps}, norm_eps={b.norm_eps}, gate_soft_cap={b.gate_soft_cap}, bias={b.bias}, norm_bias="
                f"{b.norm_bias}, {b.q} | {b.k} | {b.v} | {b.ogate} | {b.igate} | {b.fgate}, per head the mLSTM "
                f"recurrence (exp input gate, sigmoid forget gate, max stabilizer), per-head LayerNorm, "
                f"{b.out_name}(sigmoid(ogate) * h); state per sequence: C [heads, qk_dim // heads, v_dim // heads], "
                f"n [heads, qk_dim // heads], m [heads, 1] float32)")
    if isinstance(b, WKVIR):
        return (f"wkv {b.class_name}(hidden={b.hidden}, width={b.width}, {b.key} | {b.value} | {b.receptance} of the "
                f"token-shifted input (x * time_mix + prev * (1 - time_mix)), per channel the WKV recurrence (decay "
                f"-exp(time_decay), bonus time_first), {b.out_name}(sigmoid(r) * wkv); state per sequence: shift "
                f"[hidden], num, den, max [width] float32)")
    if isinstance(b, ChannelMixIR):
        return (f"channel_mix {b.class_name}(hidden={b.hidden}, intermediate={b.intermediate}, activation="
                f"{b.activation}, sigmoid({b.receptance}) * {b.value}(act({b.key})) of the token-shifted input; state "
                f"per sequence: shift [hidden]; {b.receptance} replicated)")
    if isinstance(b, RGLRUIR):
        return (f"rg_lru {b.class_name}(hidden={b.hidden}, width={b.width}, heads={b.heads}, conv_kernel="
                f"{b.conv_kernel}, activation={b.activation}, decay_scale={b.decay_scale}, bias={b.bias}, conv_bias="
                f"{b.conv_bias}, {b.x_proj} -> conv_1d -> rg_lru (gates per head block of width // heads, "
                f"h = a h + sqrt(1 - a^2) (i x), reset at position 0), times act({b.y_proj}), {b.out_name}; state per "
                f"sequence: conv [width, conv_kernel - 1], lru [width] float32)")
    if isinstance(b, ShortConvIR):
        return (f"short_conv {b.class_name}(hidden={b.hidden}, conv_kernel={b.conv_kernel}, bias={b.bias}, "
                f"{b.in_proj}=[B, C, x], {b.out_name}: C * conv(B * x); state per sequence: conv [hidden, "
                f"conv_kernel - 1])")
    if isinstance(b, Mamba2IR):
        return (f"mamba2 {b.class_name}(hidden={b.hidden}, heads={b.heads}, head_dim={b.head_dim}, groups={b.groups}, "
                f"state_size={b.state_size}, conv_kernel={b.conv_kernel}, chunk_size={b.chunk_size}, activation="
                f"{b.activation}, eps={b.eps}, bias={b.bias}, conv_bias={b.conv_bias}, {b.in_proj}=[z, x, B, C, dt]"
                f"{_scales(b.in_scale)}, "
                + (f"gated_norm={b.gated_norm}, " if b.gated_norm.literal is not True else "")
                + (f"norm_before_gate={b.norm_before_gate}, " if b.norm_before_gate.literal is not False else "")
                + (f"dt clamped to [{b.time_step_min}, {b.time_step_max or 'inf'}] in a prompt, "
                   if b.time_step_min.literal != 0.0 or b.time_step_max else "")
                + f"{b.out_name}" + (f" bias={b.out_bias}" if b.out_bias is not None else "") + _scales((), b.out_scale)
                + "; state per sequence: conv [channels, conv_kernel - 1], ssm [heads, head_dim, "
                "state_size] float32)")
    if isinstance(b, MambaIR):
        norm = (f", inner_norm=rmsnorm{'' if b.inner_norm == 'weight' else ' weightless'}(dt, B, C; eps={b.inner_eps})"
                if b.inner_norm else "")
        return (f"mamba {b.class_name}(hidden={b.hidden}, intermediate={b.intermediate}, state_size={b.state_size}, "
                + (f"heads={b.heads} x head_dim={b.head_dim} (x_proj, dt_proj, B, C per head), " if b.heads else "")
                + f"time_step_rank={b.time_step_rank}, conv_kernel={b.conv_kernel}, activation={b.activation}, bias="
                f"{b.bias}, conv_bias={b.conv_bias}{norm}, {b.in_proj}=[x, z], x_proj=[dt, B, C], dt_proj, "
                f"{b.out_name}; state per sequence: conv [intermediate, conv_kernel - 1], ssm [intermediate, "
                f"state_size] float32)")
    if isinstance(b, GatedDeltaNetIR):
        proj = ", ".join(f"{m}{'(' + b.low_rank_of(m)[0] + ', rank ' + str(b.low_rank_of(m)[1]) + ')' if b.low_rank_of(m) else ''}"
                         f"=[{', '.join(segs)}]" for m, segs in b.projections)
        if b.decay != "head":
            proj += f", decay per {b.decay}"
        if b.gate_activation != "silu":
            proj += f", norm gate {b.gate_activation}"
        if b.bounded_decay.literal is not False:
            proj += f", bounded decay {b.decay_lower_bound} * sigmoid(exp(A_log) (a + dt_bias)) where {b.bounded_decay}"
        return (f"gated_delta_net {b.class_name}(hidden={b.hidden}, key_heads={b.key_heads}, value_heads="
                f"{b.value_heads}, key_head_dim={b.key_head_dim}, value_head_dim={b.value_head_dim}, conv_kernel="
                f"{b.conv_kernel}{', conv bias' if b.conv_bias else ''}, activation={b.activation}, eps={b.eps}, "
                f"{'' if b.beta_scale.literal == 1.0 else f'beta_scale={b.beta_scale}, '}"
                f"{proj}, {b.out_name}; state per sequence: conv [channels, conv_kernel - 1], recurrent "
                f"[value_heads, key_head_dim, value_head_dim] float32)")
    if isinstance(b, MLAIR):
        def _indexer_text(ix) -> str:
            layout = ix.rope_layout_symbol or ix.rope_layout
            return (f", sparse: each query attends to the top {ix.topk} keys of an indexer(heads={ix.heads}, "
                    f"head_dim={ix.head_dim}, wq_b over the query latent, wk -> k_norm (layernorm, eps={ix.k_norm_eps}), "
                    f"rope on {'the last ' if ix.rope_position == 'last' else ''}{ix.rope_dims} dims ({layout}), weights_proj float32, keys cached per token)"
                    + (f", layers where {ix.share} reuse the previous indexer layer's selection"
                       if ix.share.literal is not False else ""))
        r = b.rotary
        rot = f"neox(theta={r.theta}, max_position={r.max_position}, dim={b.qk_rope_head_dim}"
        rot += f", layout={r.layout_symbol or r.layout}" if r.layout_symbol or r.layout != "neox" else ""
        rot += f", enabled={r.enabled}" if r.enabled.literal is not True else ""
        rot += f", original_max_position={r.original_max_position}" if r.original_max_position else ""
        rot += f", scaling={r.scaling})" if r.scaling else ")"
        q = ("q_proj" if b.q_lora_rank is None else
             f"q_a_proj(rank={b.q_lora_rank}) -> [q_a_layernorm, raw] -> {b.q_gate} per head [q | output gate (sigmoid)]"
             if b.q_gate else
             f"q_a_proj(rank={b.q_lora_rank}) -> q_a_layernorm -> q_b_proj"
             + (f" where {b.q_lora_when}, else q_proj" if b.q_lora_when else ""))
        scale = str(b.scale) if b.scale else "(qk_nope_head_dim + qk_rope_head_dim) ** -0.5"
        return (f"mla_attention {b.class_name}(hidden={b.hidden}, heads={b.heads}, q: {q}, kv_a_proj_with_mqa -> "
                f"latent(rank={b.kv_lora_rank}) -> kv_a_layernorm -> kv_b_proj, qk_nope_head_dim={b.qk_nope_head_dim}, "
                f"qk_rope_head_dim={b.qk_rope_head_dim}, v_head_dim={b.v_head_dim}, latent_eps={b.latent_eps}, "
                f"bias={b.bias}, {b.out_name} bias={b.out_bias}, rotary={rot}, scale={scale}"
                + (" x yarn mscale(factor, mscale_all_dim) ** 2" if b.scale_mscale else "")
                + (f", query latent x {b.q_scale}" if b.q_scale else "")
                + (f", normalized latent x {b.latent_scale}" if b.latent_scale else "")
                + (f", rope key normalized by {b.rope_key_norm}" if b.rope_key_norm else "")
                + (f", sliding_window={b.sliding_window}" if b.sliding_window else "")
                + (", sinks" if b.sinks else "")
                + (f", out_gate={b.out_gate[1]}({b.out_gate[0]}) per {b.out_gate[2]}" if b.out_gate else "")
                + (", K/V cached expanded per head" if b.kv_cache == "expanded" else
                   ", the latent + rope key cached (kv_b_proj absorbed)")
                + (_indexer_text(b.indexer) if b.indexer is not None else "") + ")")
    if isinstance(b, VisionAttentionIR):
        return (f"vision_attention(hidden={b.hidden}, heads={b.heads}, head_dim={b.head_dim}, qkv=[q, k, v] +bias "
                f"(fused in the checkpoint), proj +bias, rotary=rotary_2d(theta={b.theta}), within each image / frame)")
    if isinstance(b, VisionMLPIR):
        return f"vision_mlp(hidden={b.hidden}, intermediate={b.intermediate}, {b.activation}, linear_fc1, linear_fc2)"
    if isinstance(b, PatchMergerIR):
        return (f"patch_merger(dim={b.dim}, merged={b.merged}, out={b.out}, layernorm {b.norm.replace('_', ' ')}, "
                f"eps={b.eps}, gelu)")
    if isinstance(b, GatedMLPIR):
        return (f"gated_mlp {b.class_name}(hidden={b.hidden}, intermediate={b.intermediate}, act={_act(b)}, "
                f"{b.gate_up_name}=[{', '.join(b.gate_up_segments)}] bias={b.gate_up_bias}{_scales(b.gate_up_scale)}, "
                f"{b.down_name} bias={b.down_bias}{_scales((), b.down_scale)}{_sub_norm(b.sub_norm)}{_lora(b.lora)})")
    if isinstance(b, MLPIR):
        return (f"mlp {b.class_name}(hidden={b.hidden}, intermediate={b.intermediate}, act={b.activation}, "
                f"{b.up_name} bias={b.up_bias}{_scales((), b.up_scale)}, {b.down_name} bias={b.down_bias}"
                f"{_scales((), b.down_scale)}{_sub_norm(b.sub_norm)}"
                + (", act(up) * the layer's slice of decoder.per_layer_input" if b.multiply else "") + ")")
    if isinstance(b, MoEIR):
        return (f"moe {b.class_name}(hidden={b.hidden}, experts={b.experts}, top_k={b.top_k}, "
                f"intermediate={b.intermediate}, act={_act(b)}, norm_topk_prob={b.norm_topk_prob}, router "
                f"{b.router_name} (replicated, " + ("float32, " if b.router_float32 else "")
                + ("softmax top-k" if b.plain_routing else _routing(b))
                + (f", bias={b.router_bias}" if b.router_bias.literal is not False else "")
                + ("), experts.gate_up_proj=[gate, up], experts.down_proj, " if b.expert_mlp == "gated" else
                   "), plain experts down(act(up)): experts.up_proj, experts.down_proj, ")
                + (f"expert biases={b.expert_bias}, " if b.expert_bias.literal is not False else "")
                + f"{b.parallel} parallel"
                + (f"; shared expert {b.shared.name}(intermediate={b.shared.intermediate}, "
                   + ("gate_up_proj=[gate, up], " if b.expert_mlp == "gated" else "up_proj, ")
                   + "down_proj)" + (f" scaled by sigmoid({b.shared_gate})" if b.shared_gate else "")
                   + (f" times {b.shared_scale}" if b.shared_scale else "")
                   + (f" where {b.shared_enabled}" if b.shared_enabled else "")
                   + (f" bias={getattr(b.shared, 'gate_up_bias', None) or b.shared.up_bias}"
                      if (getattr(b.shared, 'gate_up_bias', None) or b.shared.up_bias).literal is not False else "")
                   if b.shared else "")
                + (f"; output normalized by {b.out_norm.kind}({b.out_norm.name}, eps={b.out_norm.eps})"
                   if b.out_norm else "")
                + (f"; experts' input normalized by {b.expert_norm.kind}({b.expert_norm.name}, eps={b.expert_norm.eps})"
                   if b.expert_norm else "")
                + (f"; each expert's output normalized by rmsnorm(experts.{b.expert_out_norm.name}, a weight per "
                   f"expert, eps={b.expert_out_norm.eps})" if b.expert_out_norm else "")
                + (f"; the shared expert's output by {b.shared_out_norm.kind}({b.shared.name}."
                   f"{b.shared_out_norm.name}, eps={b.shared_out_norm.eps})" if b.shared_out_norm else "")
                + ("; router input = " + (f"rmsnorm(x, eps={b.router_norm_eps}, no weight)" if b.router_norm_eps
                                          else "x") + (" * router_input.weight" if b.router_input_weight else "")
                   + (f" * {b.router_input_scale}" if b.router_input_scale else "") if b.router_input else "")
                + ("; weights x expert_scale[expert]" if b.expert_scale else "") + ")")
    return repr(b)


def _routing(b) -> str:
    """A moe block's routing other than plain softmax top-k."""
    if b.routing == "sparsemixer":
        return f"sparsemixer(jitter_eps={b.jitter_eps})"
    out = f"{b.scoring_symbol or b.scoring} scores"
    if b.selection_bias.literal is not False:
        out += f", selection-only bias {b.router_name}.e_score_correction_bias" + \
            (f" on the {b.selection_bias_on}" if b.selection_bias_on != "scores" else "") + \
            (f" where {b.selection_bias}" if b.selection_bias.literal is not True else "")
    if b.groups:
        out += f", top {b.groups[1]} of {b.groups[0]} groups by {b.groups[2]}"
        if b.groups_dropped != "excluded":
            out += " (the other groups' experts at choice score 0)"
    out += ", top-k" + (f" of the experts and {b.identity_experts} identity experts (weight x input)"
                        if b.identity_experts else "")
    if b.renormalize_min:
        out += f", renormalized by a sum clamped to >= {b.renormalize_min}"
    if b.renormalize_epsilon:
        out += f", renormalized by sum + {b.renormalize_epsilon}"
    if b.routed_scale:
        out += f", weights x {b.routed_scale}"
    if b.weights_on == "input":
        out += ", weights scale the experts' input"
    return out


def _act(b) -> str:
    """A gated activation, with a parameterized form's parameters."""
    params = ", ".join(f"{k}={v}" for k, v in getattr(b, "activation_params", ()))
    return f"{b.activation}({params})" if params else str(b.activation)


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
        extra = (f"  values: {', '.join(f.values)}" if f.values else "") + \
            (f"  in [{f.bounds[0]}, {f.bounds[1]}]" if f.bounds != (None, None) else "")
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
          + "): added to the embedding")
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
        layout = (f" (rows per {wt.layout[0]}{' of ' + str(wt.layout[2]) if len(wt.layout) > 2 else ''}: "
                  f"{' '.join(wt.layout[1])})" if wt.layout else "") + \
            (" (stored transposed)" if wt.transpose else "") + \
            (f" ({wt.interleave} segments interleaved)" if wt.interleave > 1 else "") + \
            ((" (stored under a leading unit dim)" if wt.squeeze is True else f" (stored with unit dims at {list(wt.squeeze)})")
             if wt.squeeze else "")
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
    for f in ir.config:
        if not f.paths or values.get(f.name) is None:
            continue
        *parents, leaf = f.paths[0].split(".")
        node = hf
        for p in parents:
            node = node.setdefault(p, {})
        value = values[f.name]
        node[leaf] = list(value) if isinstance(value, tuple) else (dict(value) if isinstance(value, dict) else value)
    for key, value in ir.config_assume:     # a variant is a checkpoint the spec models: it has the assumed values
        *parents, leaf = key.split(".")
        node = hf
        for p in parents:
            node = node.setdefault(p, {})
        if value is not None and isinstance(node, dict) and leaf not in node:
            node[leaf] = value
    return module.Config.from_hf(hf)


def rank_table_from_plan(ir: ModelIR, plan, rank: int = 0) -> RankTableIR:
    """A RankTableIR (what format_variant prints) from one rank of runtime tp_check.tp_plan: parameters of
    repeated blocks (decoder layers, vision blocks, deepstack mergers) once, as `{i}`, with this rank's
    shapes; per layer = one decoder layer; total = everything this rank holds."""
    import re

    r = plan.ranks[[x.rank for x in plan.ranks].index(rank)]
    layer0 = f"{ir.decoder_prefix}.layers.0."
    rows, seen, layer_numel = [], set(), 0
    for p in r.params:
        key = re.sub(r"\.\d+\.", ".{i}.", p.name)
        if p.name.startswith(layer0):
            layer_numel += p.numel
        if key in seen:
            continue
        seen.add(key)
        rows.append((key, tuple(p.shape), p.numel))
    heads = tuple((n[len(layer0):].split(".")[0], h, kv) for n, h, kv in r.heads if n.startswith(layer0))
    return RankTableIR(plan.tp_size, heads, tuple(rows), layer_numel, r.numel)


def tp_rank_table(ir: ModelIR, files: dict, v: VariantIR, tp: int, module=None) -> RankTableIR:
    """Rank 0's table of variant `v` at TP size `tp`, from the runtime's own plan (the layers' sharding).
    A size that cannot be split raises the runtime's ShardingError naming the parameters."""
    from xllm_gen.runtime.executor.tp_check import tp_plan

    module = module or model_module_of(ir, files)
    return rank_table_from_plan(ir, tp_plan(module, variant_config(module, ir, v), tp, ranks=(0,)))
