"""The spec resolver's decoder layer (a mixin of resolver._Resolver): a norm block (`resolve_norm`) and the layer
(`resolve_layer`): its blocks, its per-layer choices and its dataflow steps."""
from __future__ import annotations

import dataclasses
import math
from typing import Dict

from .errors import did_you_mean
from .ir import (
    MLAIR,
    MLSTMIR,
    RGLRUIR,
    WKVIR,
    AttentionIR,
    BranchStepIR,
    ChoiceIR,
    GatedDeltaNetIR,
    LayerIR,
    LightningIR,
    Mamba2IR,
    MambaIR,
    NormIR,
    ShortConvIR,
    StepIR,
    Value,
)
from .schema import (
    BranchStep,
    Choice,
    DataflowChoice,
    ParallelStep,
    RMSNormBlock,
    Select,
)

# the attention block kinds (they take the positions)
ATTENTION_IRS = (AttentionIR, MLAIR, GatedDeltaNetIR, Mamba2IR, MambaIR, ShortConvIR, RGLRUIR, LightningIR,
                 WKVIR, MLSTMIR)   # (a recurrent mixer takes them too; most ignore them, rg_lru resets at position 0)

class LayerResolver:
    def resolve_norm(self, path, name, b, context: str = "decoder") -> NormIR:
        """A norm block. `context`: "layer" (a decoder layer's block: `enabled` may be per layer), "decoder" (the
        final / embedding / head-transform norm: always there; `decoder.norm_enabled` is the final norm's flag), or
        "vision" (literal bias only)."""
        eps = self.positive(path + ("eps",), b.eps, below=1.0)
        if b.enabled is not True:
            if context != "layer":
                hint = " (the final norm's flag is decoder.norm_enabled)" if path == ("decoder", "norm") else ""
                raise self.err(path + ("enabled",), f"{self._where(path)}.enabled: only a decoder layer's norm may be "
                                                    f"absent on some layers{hint}", at_key=True)
        enabled = self.rotary_enabled(path + ("enabled",), b.enabled) if context == "layer" else Value(literal=True)
        if enabled.literal is False:
            raise self.err(path + ("enabled",), f"{self._where(path)}.enabled: false: delete the norm (a step without "
                                                f"a norm reads the residual stream)")
        bias_flag = None
        if not isinstance(b.bias, bool):
            if context == "vision":
                raise self.err(path + ("bias",), f"{self._where(path)}.bias: a vision norm's bias is a literal bool")
            bias_flag = self.flag(path + ("bias",), b.bias)
        bias = b.bias if isinstance(b.bias, bool) else True
        if not math.isfinite(b.weight_offset):
            raise self.err(path + ("weight_offset",), f"{self._where(path)}.weight_offset: must be finite")
        if b.weight_offset and not b.weight:
            raise self.err(path + ("weight_offset",), f"{self._where(path)}.weight_offset: a norm without a "
                                                      f"weight (weight: false) has no weight to offset")
        kind = "rmsnorm" if isinstance(b, RMSNormBlock) else "layernorm"
        center = Value(literal=True)
        if kind == "layernorm" and b.center is not True:
            if context == "vision":
                raise self.err(path + ("center",), f"{self._where(path)}.center: a vision norm is a literal form")
            if not b.weight or b.weight_offset:
                raise self.err(path + ("center",), f"{self._where(path)}.center: the RMSNorm form needs a plain "
                                                   f"weight (weight: true, no weight_offset)", at_key=True)
            center = self.flag(path + ("center",), b.center)
            if center.literal is False and bias_flag is None and not bias:
                raise self.err(path + ("center",), f"{self._where(path)}.center: false: write `kind: rmsnorm`",
                               at_key=True)
        gate_rank, gate_enabled = None, Value(literal=True)
        if getattr(b, "gate", None) is not None:
            gp = path + ("gate",)
            if context != "layer":
                raise self.err(gp, f"{self._where(gp)}: only a decoder layer's norm may have a gate", at_key=True)
            if enabled.literal is not True or bias_flag is not None or bias or not b.weight or b.weight_offset:
                raise self.err(gp, f"{self._where(gp)}: a gated norm is a plain RMSNorm with a weight (no bias, "
                                   f"weight_offset or per-layer `enabled`)", at_key=True)
            gate_rank = self.dim(gp + ("rank",), b.gate.rank)
            gate_enabled = self.rotary_enabled(gp + ("enabled",), b.gate.enabled)
            if gate_enabled.literal is False:
                raise self.err(gp + ("enabled",), f"{self._where(gp)}.enabled: false: delete the gate")
        return NormIR(kind, name, self.dim(path + ("dim",), b.dim), eps, bias,
                      weight_offset=float(b.weight_offset), weight=b.weight, enabled=enabled, bias_flag=bias_flag,
                      gate_rank=gate_rank, gate_enabled=gate_enabled, center=center)

    def resolve_layer(self) -> LayerIR:
        L = self.spec.decoder.layers
        base = ("decoder", "layers")
        count = self.dim(base + ("count",), L.count)
        blocks = {}
        kinds_seen: Dict[str, int] = {}
        group = {"gated_mlp": "mlp"}      # both kinds' classes are <prefix>MLP when alone: one name space
        for b in L.blocks.values():
            kinds_seen[group.get(b.kind, b.kind)] = kinds_seen.get(group.get(b.kind, b.kind), 0) + 1
        for name, b in L.blocks.items():
            path = base + ("blocks", name)
            self.ident(path, name, "block name", at_key=True)
            blocks[name] = self.resolve_block(path, name, b,
                                              unique_kind=kinds_seen[group.get(b.kind, b.kind)] == 1)
        steps, used = [], {}

        def step(st, sp, where, shared_norm_ok=()):
            mixers = ("attention", "mla_attention", "gated_delta_net", "mamba2", "mamba", "short_conv", "rg_lru",
                      "lightning_attention", "wkv", "channel_mix", "mlstm", "gated_mlp", "mlp", "moe", "linear")
            choice = None
            # a per-layer expression may read `layer` (MiniMax's per-layer-type beta factors)
            scale = self.num(sp + ("scale",), st.scale, per_layer=True) if st.scale is not None else None
            in_scale = self.num(sp + ("input_scale",), st.input_scale) if st.input_scale is not None else None
            res_scale = (self.num(sp + ("residual_scale",), st.residual_scale, per_layer=True)
                         if getattr(st, "residual_scale", None) is not None else None)
            normed = getattr(st, "residual", "stream") == "normed"
            if normed and (st.norm is None or getattr(st, "add", None) is not None or st.after_norm is not None):
                raise self.err(sp + ("residual",), f"{where}.residual: the stream becomes the normed input of a step "
                                                   f"with a `norm` (no add / after_norm)")
            if res_scale is not None and (st.after_norm is not None or getattr(st, "hyper", None) is not None):
                # residual: stream: x = residual_scale * x + scale * h (Beam's depth-scaled adds)
                raise self.err(sp + ("residual_scale",), f"{where}.residual_scale: scales the stream that the step's "
                                                         f"output joins (not after_norm, nor hyper)")
            if in_scale is not None and st.norm is None:
                raise self.err(sp + ("input_scale",), f"{where}.input_scale: scales the normed input of a step with a "
                                                      f"`norm` (a step without one reads the residual stream itself)")
            when = None
            if getattr(st, "when", None) is not None:     # the step runs only where it holds
                if st.after_norm is not None or getattr(st, "add", None):
                    raise self.err(sp + ("when",), f"{where}.when: a step `{{norm: N, block: B}}` or `{{block: B}}`, "
                                                   f"B a block or a per-layer choice (no after_norm or add)")
                when = Value(expr=self.expr(sp + ("when",), st.when, per_layer=True))
            if isinstance(st.block, Choice):
                c = st.block
                roles = [("norm", st.norm, ("rmsnorm", "layernorm")), (("block", "then"), c.then, mixers),
                         (("block", "else"), c.else_, mixers)]
                cond = self.expr(sp + ("block", "if"), c.if_, per_layer=True)
                module = self.ident(sp + ("block", "name"), c.name or c.else_, "module name")
                if module in blocks and module not in (c.then, c.else_):
                    raise self.err(sp + ("block", "name"), f"{where}.block.name: '{module}' is another block's name")
                choice = ChoiceIR(Value(expr=cond), c.then, c.else_)
            elif isinstance(st.block, Select):
                c = st.block
                if len(c.cases) < 2:
                    raise self.err(sp + ("block", "cases"), f"{where}.block.cases: list two or more cases")
                roles = [("norm", st.norm, ("rmsnorm", "layernorm"))]
                roles += [(("block", "cases", v), b, mixers) for v, b in c.cases.items()]
                sel = self.expr(sp + ("block", "select"), c.select, per_layer=True)
                cases = []
                for v, b in c.cases.items():
                    if b in [x for _, x, _ in cases]:
                        raise self.err(sp + ("block", "cases", v), f"{where}.block.cases.{v}: block '{b}' is already "
                                                                   f"another case's; each case names its own block")
                    cases.append((v, b, self.expr(sp + ("block", "select"), f"({c.select}) == {v!r}", per_layer=True)))
                first = next(iter(c.cases.values()))
                module = self.ident(sp + ("block", "name"), c.name or first, "module name")
                if module in blocks and module not in c.cases.values():
                    raise self.err(sp + ("block", "name"), f"{where}.block.name: '{module}' is another block's name")
                choice = ChoiceIR(Value(expr=sel), cases=tuple(cases))
            else:
                roles = [("norm", st.norm, ("rmsnorm", "layernorm")), ("block", st.block, mixers)]
                module = st.block
            if st.norm is None:
                roles = roles[1:]
            if st.post_norm is not None:
                roles.append(("post_norm", st.post_norm, ("rmsnorm", "layernorm")))
            if getattr(st, "hyper", None) is not None:
                roles.append(("hyper", st.hyper, ("hyper_connection",)))
            if getattr(st, "gate", None) is not None:      # x = residual(w) * x + branch(w) * h
                if st.after_norm is not None or getattr(st, "hyper", None) is not None:
                    raise self.err(sp + ("gate",), f"{where}.gate: gates the residual add of a step with a residual "
                                                   f"stream (not after_norm, whose stream is normalized, nor hyper)")
                roles.append(("gate", st.gate, ("residual_gate",)))
            if st.after_norm is not None:
                if st.norm is not None:
                    raise self.err(sp + ("after_norm",), f"{where}.after_norm: a post-LN step normalizes the residual "
                                                         f"stream after the add; its block reads the stream (no `norm`)")
                roles.append(("after_norm", st.after_norm, ("rmsnorm", "layernorm")))
            for role, ref, kinds in roles:
                rp = sp + (role if isinstance(role, tuple) else (role,))
                role = ".".join(role) if isinstance(role, tuple) else role
                if ref not in blocks:
                    raise self.err(rp, f"{where}.{role}: no block '{ref}' in "
                                       f"decoder.layers.blocks{did_you_mean(ref, blocks)}")
                if blocks[ref].kind not in kinds:
                    raise self.err(rp, f"{where}.{role}: block '{ref}' is "
                                       f"{blocks[ref].kind}, expected {' or '.join(kinds)}")
                if blocks[ref].kind == "linear":      # a linear on the stream: its input and output are whole
                    if blocks[ref].parallel == "column":
                        raise self.err(("decoder", "layers", "blocks", ref, "parallel"),
                                       f"decoder.layers.blocks.{ref}.parallel: column: a residual step's linear "
                                       f"joins the stream whole on every rank; write `row` (each rank multiplies "
                                       f"its columns of the normed stream, one all-reduce) or `replicated`")
                    blocks[ref] = dataclasses.replace(blocks[ref], on_stream=True)
                # a norm may be shared by the branches of one parallel step, and by a branch op and a step
                # (both read the same stream: LongCat-Flash's shortcut MoE and its first MLP)
                if ref in used and not (role == "norm" and (ref in shared_norm_ok or norm_uses.get(ref) == "branch")):
                    raise self.err(rp, f"{where}.{role}: block '{ref}' is already "
                                       f"used by {used[ref]}; each block is used once")
                used[ref] = where
                if role == "norm":
                    norm_uses.setdefault(ref, "step")
            add = None
            if getattr(st, "add", None) is not None:
                if st.add not in values:
                    raise self.err(sp + ("add",), f"{where}.add: no branch value '{st.add}' before this step"
                                                  f"{did_you_mean(st.add, values) if values else ''}")
                if st.norm is None or st.after_norm is not None or choice is not None:
                    raise self.err(sp + ("add",), f"{where}.add: a branch value is added to the input of a step "
                                                  f"`{{norm: N, block: B}}` (no after_norm, no per-layer choice)")
                add = st.add
            join = getattr(st, "join", None)
            if join is not None:
                if join not in values:
                    raise self.err(sp + ("join",), f"{where}.join: no branch value '{join}' before this step"
                                                   f"{did_you_mean(join, values) if values else ''}")
                if st.after_norm is not None or choice is not None or getattr(st, "residual", "stream") != "stream":
                    raise self.err(sp + ("join",), f"{where}.join: a branch value joins the output of a plain residual "
                                                   f"step (no after_norm, no per-layer choice, residual: stream)")
            if choice is not None:
                if not choice.cases and choice.then == choice.else_:
                    raise self.err(sp + ("block", "then"), f"{where}.block: `then` and `else` name the same block")
                takes = {isinstance(blocks[b], ATTENTION_IRS) for b in choice.alternatives}
                # alternatives of different inputs (positions + hidden vs hidden): a per-layer flag in the layer
                return StepIR(st.norm, module, takes == {True}, st.post_norm, choice, scale, st.after_norm,
                              mixed_input=len(takes) > 1, input_scale=in_scale, residual_normed=normed,
                              residual_scale=res_scale, when=when, hyper=getattr(st, "hyper", None),
                              gate=getattr(st, "gate", None))
            return StepIR(st.norm, st.block, isinstance(blocks[st.block], ATTENTION_IRS), st.post_norm, None, scale,
                          st.after_norm, add=add, input_scale=in_scale, residual_normed=normed,
                          residual_scale=res_scale, join=join, join_optional=join in optional_values, when=when,
                          hyper=getattr(st, "hyper", None), gate=getattr(st, "gate", None))

        def branch_step(st, sp, where):
            b = st.branch
            bp = sp + ("branch",)
            name = self.ident(bp + ("name",), b.name, "branch name")
            if name in ("residual", "embeddings") or name in values or name in blocks:
                raise self.err(bp + ("name",), f"{where}.branch.name: '{name}' is already a value or block name")
            if not b.input:
                raise self.err(bp + ("input",), f"{where}.branch.input: list one or more values")
            for j, v in enumerate(b.input):
                if v not in ("residual", "embeddings") and v not in values:
                    raise self.err(bp + ("input", j), f"{where}.branch.input[{j}]: '{v}' is not `residual`, "
                                                      f"`embeddings` or an earlier branch's name")
            if not b.steps:
                raise self.err(bp + ("steps",), f"{where}.branch.steps: list one or more operations")
            ops = []
            for j, op in enumerate(b.steps):
                op_p, op_w = bp + ("steps", j), f"{where}.branch.steps[{j}]"
                roles = ([("norm", op.norm, ("rmsnorm", "layernorm"))] if op.norm is not None else []) + \
                    [("block", op.block, ("attention", "mla_attention", "gated_mlp", "mlp", "moe", "linear"))]
                for role, ref, kinds in roles:
                    if ref not in blocks:
                        raise self.err(op_p + (role,), f"{op_w}.{role}: no block '{ref}' in "
                                                       f"decoder.layers.blocks{did_you_mean(ref, blocks)}")
                    if blocks[ref].kind not in kinds:
                        raise self.err(op_p + (role,), f"{op_w}.{role}: block '{ref}' is {blocks[ref].kind}, "
                                                       f"expected {' or '.join(kinds)}")
                    if ref in used and not (role == "norm" and norm_uses.get(ref) == "step"):
                        raise self.err(op_p + (role,), f"{op_w}.{role}: block '{ref}' is already used by "
                                                       f"{used[ref]}; each block is used once")
                    used[ref] = op_w
                    if role == "norm":
                        norm_uses.setdefault(ref, "branch")
                ops.append(StepIR(op.norm, op.block, isinstance(blocks[op.block], ATTENTION_IRS)))
            when = Value(expr=self.expr(bp + ("when",), b.when, per_layer=True)) if b.when is not None else None
            values.append(name)
            if when is not None:
                optional_values.add(name)
            return BranchStepIR(name, tuple(b.input), tuple(ops), when)

        df = L.dataflow
        if isinstance(df, DataflowChoice):     # one dataflow or the other, by the checkpoint's config
            flows = [(df.else_, base + ("dataflow", "else"), "decoder.layers.dataflow.else"),
                     (df.then, base + ("dataflow", "then"), "decoder.layers.dataflow.then")]
        else:
            flows = [(df, base + ("dataflow",), "decoder.layers.dataflow")]
        resolved, all_used = [], {}
        for flow, fp, fw in flows:
            steps, used, values, norm_uses, optional_values = [], {}, [], {}, set()
            for i, st in enumerate(flow):
                sp = fp + (i,)
                if isinstance(st, BranchStep):
                    steps.append(branch_step(st, sp, f"{fw}[{i}]"))
                elif isinstance(st, ParallelStep):
                    steps.append(self.parallel_step(st, sp, f"{fw}[{i}]", step, blocks, used))
                else:
                    steps.append(step(st, sp, f"{fw}[{i}]"))
            if not steps:
                raise self.err(fp, f"{fw}: list at least one residual step")
            resolved.append((tuple(steps), set(used)))
            all_used.update(used)
        for name in blocks:
            if name not in all_used:
                raise self.err(base + ("blocks", name), f"decoder.layers.blocks.{name}: block is never used by "
                                                        f"decoder.layers.dataflow", at_key=True)
        shared = []
        for bname, src in L.shared.items():
            sp = base + ("shared", bname)
            if bname not in blocks:
                raise self.err(sp, f"decoder.layers.shared: no block '{bname}' in decoder.layers.blocks"
                                   f"{did_you_mean(bname, blocks)}", at_key=True)
            shared.append((bname, Value(expr=self.expr(sp, src, per_layer=True))))
        out_scale = self.spec.decoder.layers.output_scale
        if out_scale is not None:
            op = ("decoder", "layers", "output_scale")
            self.ident(op, out_scale, "parameter name")
            if out_scale in blocks:
                raise self.err(op, f"decoder.layers.output_scale: '{out_scale}' is already a block of the layer")
        stream_scale = self.spec.decoder.layers.stream_scale
        if stream_scale is not None:
            stream_scale = self.num(("decoder", "layers", "stream_scale"), stream_scale, per_layer=True)
        layer = LayerIR(f"{self.spec.class_prefix}DecoderLayer", count, tuple(blocks.values()), resolved[0][0],
                        shared=tuple(shared), output_scale=out_scale, stream_scale=stream_scale,
                        stored_as=self.resolve_stored_as())
        if isinstance(df, DataflowChoice):
            layer = self.dataflow_choice(layer, df, resolved)
        return layer
