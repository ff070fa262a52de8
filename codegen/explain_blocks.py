"""The resolved spec's blocks as `xllm-gen --explain` text (explain.py): each block kind's line (`_block`: its
projections, scales, rotary, LoRA, sub-norms, routing, activation) and a layer's dataflow steps (`_steps`)."""
from __future__ import annotations

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
    MoEIR,
    NormIR,
    PatchMergerIR,
    ShortConvIR,
    VisionAttentionIR,
    VisionMLPIR,
)


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
    rot += f", longrope_factors={r.longrope_factors}" if r.longrope_factors != "by_context" else ""
    rot += ", longrope_mscale" if r.longrope_mscale else ""
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
        if getattr(b, "center", None) is not None and b.center.literal is not True:
            where += f", centered only where {b.center} (else x / rms(x) * w)"
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
                + (f", alibi(bias_max={b.alibi}" + (f", scale={b.alibi_scale}" if b.alibi_scale else "")
                   + (", bfloat16 at absolute key positions" if b.alibi_bf16 else "")
                   + (f", where {b.alibi_when}" if b.alibi_when else "") + ")" if b.alibi else "")
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
