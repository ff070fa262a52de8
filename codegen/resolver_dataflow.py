"""The dataflow part of the resolver that a layer's steps do not cover: a dataflow chosen by a config flag, or per
layer by an expression that reads `layer` (`dataflow: {if: flag, then: [...], else: [...]}`). A mixin of resolver._Resolver (which provides err / expr /
ident and the spec), as resolver_blocks.py is for the block kinds."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .expr import is_symbol
from .ir import LayerIR, Value
from .schema import DataflowChoice


class DataflowResolver:
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
        for name, _ in only:
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
