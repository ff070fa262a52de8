"""The dataflow part of the resolver that a layer's steps do not cover: a dataflow chosen by a config flag, or per
layer by an expression that reads `layer` (`dataflow: {if: flag, then: [...], else: [...]}`). A mixin of resolver._Resolver (which provides err / expr /
ident and the spec), as resolver_blocks.py is for the block kinds."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .errors import did_you_mean
from .expr import is_symbol
from .ir import LayerIR, ParallelStepIR, Value
from .schema import DataflowChoice


class DataflowResolver:
    def parallel_step(self, st, sp, where: str, step, blocks, used) -> ParallelStepIR:
        """`{parallel: [...], post_norm: P}`: the branches read the same residual (each through its own norm, or the
        stream itself without one); each branch's post_norm normalizes its output, P the sum."""
        if len(st.parallel) < 2:
            raise self.err(sp + ("parallel",), f"{where}.parallel: list two or more branches")
        branches = []
        for j, br in enumerate(st.parallel):
            for key in ("after_norm", "when", "add", "gate", "residual_scale"):
                if getattr(br, key) is not None:
                    raise self.err(sp + ("parallel", j, key), f"{where}.parallel[{j}].{key}: not supported in a "
                                                              f"parallel step")
            if br.residual != "stream":
                raise self.err(sp + ("parallel", j, "residual"), f"{where}.parallel[{j}].residual: not supported "
                                                                 f"in a parallel step")
            shared = (st.parallel[0].norm,) if j and st.parallel[0].norm else ()
            branches.append(step(br, sp + ("parallel", j), f"{where}.parallel[{j}]", shared))
        if st.post_norm is not None:
            pp = sp + ("post_norm",)
            if st.post_norm not in blocks:
                raise self.err(pp, f"{where}.post_norm: no block '{st.post_norm}' in decoder.layers.blocks"
                                   f"{did_you_mean(st.post_norm, blocks)}")
            if blocks[st.post_norm].kind not in ("rmsnorm", "layernorm"):
                raise self.err(pp, f"{where}.post_norm: block '{st.post_norm}' is {blocks[st.post_norm].kind}, "
                                   f"expected rmsnorm or layernorm")
            if st.post_norm in used:
                raise self.err(pp, f"{where}.post_norm: block '{st.post_norm}' is already used by "
                                   f"{used[st.post_norm]}; each block is used once")
            used[st.post_norm] = where
        return ParallelStepIR(tuple(branches), st.post_norm)

    def dataflow_choice(self, layer: LayerIR, df: DataflowChoice, resolved) -> LayerIR:
        """`dataflow: {if: flag, then: [...], else: [...]}`: a layer class per dataflow (the `then` one a subclass
        overriding forward); the blocks that only one dataflow uses exist only in its checkpoints (in its layers,
        where the expression reads `layer`: each layer is built with the class of its dataflow)."""
        path = ("decoder", "layers", "dataflow")
        cond = self.expr(path + ("if",), df.if_, per_layer=True)   # may read `layer`: a dataflow per layer
        (else_steps, else_used), (then_steps, then_used) = resolved
        only = tuple((b.name, b.name in then_used) for b in layer.blocks if (b.name in then_used) != (b.name in else_used))
        chosen = {b for s in then_steps + else_steps for st in getattr(s, "branches", (s,)) if st.choice
                  for b in st.choice.alternatives}
        gated = {b for s in then_steps + else_steps if getattr(s, "when", None) is not None
                 and getattr(s, "value", None) is None for b in (s.norm, s.block, s.post_norm) if b}
        for name, _ in only:
            if name in gated:
                raise self.err(path, f"decoder.layers.blocks.{name}: a step with `when` must be in both dataflows "
                                     f"of `dataflow: {{if: ...}}` (its blocks exist where its `when` holds)",
                               at_key=True)
            if name in chosen:
                raise self.err(path, f"decoder.layers.blocks.{name}: a per-layer choice's block must be used by both "
                                     f"dataflows of `dataflow: {{if: ...}}`", at_key=True)
        if df.name is not None:
            self.ident(path + ("name",), df.name, "class name part")
            suffix = df.name
        else:
            suffix = "".join(w[:1].upper() + w[1:] for w in df.if_.split("_")) if is_symbol(df.if_) else "Then"
        return dataclasses.replace(layer, alt_cond=Value(expr=cond), alt_steps=then_steps, only_in=only,
                                   alt_class_name=f"{self.spec.class_prefix}{suffix}DecoderLayer")

    def check_dataflow_variant(self, name: str, values: Mapping[str, Any], layer: LayerIR) -> None:
        """The dataflow's `if` gives a bool for the variant (for each layer where it reads `layer`)."""
        if layer.alt_cond is None:
            return
        per_layer = layer.alt_cond.per_layer
        for li in (range(layer.count.eval(values)) if per_layer else (None,)):
            at = f" (layer {li})" if per_layer else ""
            try:
                x = layer.alt_cond.eval(values, li)
            except Exception as exc:  # noqa: BLE001 - the spec's formula fails for this variant
                raise self.err(("decoder", "layers", "dataflow", "if"), f"variants.{name}: the dataflow's `if` "
                                                                        f"fails{at}: {type(exc).__name__}: {exc}") from None
            if not isinstance(x, bool):
                raise self.err(("decoder", "layers", "dataflow", "if"),
                               f"variants.{name}: the dataflow's `if` gives {x!r}{at}, not a bool")
