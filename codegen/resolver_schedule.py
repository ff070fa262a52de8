"""`decoder.layers.stored_as` and `decoder.schedule` (codegen/schema/schedule.py): looped and cycled decoders. A
layer's `stored_as` names the checkpoint prefix of its weights (equal prefixes: the same weights, each layer its own
KV cache slot); the schedule rewrites the residual stream before chosen layers from values carried across layers."""
from __future__ import annotations

import re

from .errors import did_you_mean
from .ir import ParamIR
from .ir.schedule import BeforeLayerIR, ScheduleIR
from .schema.schedule import StreamTerm


class ScheduleResolver:
    def resolve_stored_as(self) -> str | None:
        """The body of a Python f-string over `layer_idx` and `config` (None without `stored_as`)."""
        src = self.spec.decoder.layers.stored_as
        if src is None:
            return None
        path = ("decoder", "layers", "stored_as")
        if not src.endswith("."):
            raise self.err(path, f"decoder.layers.stored_as: '{src}' is a prefix of parameter names: end it with '.'")
        parts, pos = [], 0
        for m in re.finditer(r"\{([^{}]*)\}", src):
            parts.append(src[pos:m.start()])
            parts.append("{" + self.expr(path, m.group(1), per_layer=True).py() + "}")
            pos = m.end()
        rest = src[pos:]
        if "{" in rest or "}" in rest or any("{" in p or "}" in p for p in parts[::2]):
            raise self.err(path, f"decoder.layers.stored_as: '{src}': unbalanced braces")
        parts.append(rest)
        if len(parts) == 1:
            raise self.err(path, f"decoder.layers.stored_as: '{src}' names one prefix for every layer: give the "
                                 f"layer's index as an expression placeholder, e.g. '{{layer % 4}}'")
        return "".join(parts)

    def resolve_schedule(self, stream_dim, layer) -> ScheduleIR | None:
        s = self.spec.decoder.schedule
        if s is None:
            return None
        base = ("decoder", "schedule")
        d = self.spec.decoder
        for key, on in (("deepstack", d.deepstack is not None), ("per_layer_input", d.per_layer_input is not None),
                        ("hyper_head", d.hyper_head is not None)):
            if on:
                raise self.err(base, f"decoder.schedule: not with decoder.{key}", at_key=True)
        if layer.uses_embeddings:
            raise self.err(base, "decoder.schedule: not with a branch that reads the embeddings", at_key=True)
        norms = []
        for name, b in s.norms.items():
            np_ = base + ("norms", name)
            self.ident(np_, name, "module name")
            norm = self.resolve_norm(np_, name, b)
            if str(norm.dim) != str(stream_dim):
                raise self.err(np_ + ("dim",), f"decoder.schedule.norms.{name}.dim: is {norm.dim}, but the residual "
                                               f"stream's width is {stream_dim}")
            norms.append(norm)
        vectors = []
        for name, size in s.vectors.items():
            vp = base + ("vectors", name)
            self.ident(vp, name, "parameter name")
            dim = self.dim(vp, size)
            if str(dim) != str(stream_dim):
                raise self.err(vp, f"decoder.schedule.vectors.{name}: is {dim}, but the residual stream's width is "
                                   f"{stream_dim}")
            vectors.append((name, dim))
        taken = set(s.norms) & set(s.vectors)
        if taken:
            raise self.err(base, f"decoder.schedule: '{sorted(taken)[0]}' is both a norm and a vector", at_key=True)
        if not s.before_layer:
            raise self.err(base + ("before_layer",), "decoder.schedule.before_layer: list at least one rewrite")
        carried = {op.set for op in s.before_layer if op.set != "stream"}
        readable = {"stream"} | carried | set(s.vectors)
        ops = []
        for i, op in enumerate(s.before_layer):
            op_p = base + ("before_layer", i)
            if op.set in s.vectors or op.set in s.norms:
                raise self.err(op_p + ("set",), f"decoder.schedule.before_layer[{i}].set: '{op.set}' is a "
                                                f"{'vector' if op.set in s.vectors else 'norm'} of the schedule")
            self.ident(op_p + ("set",), op.set, "value name")
            if not op.sum:
                raise self.err(op_p + ("sum",), f"decoder.schedule.before_layer[{i}].sum: list at least one term")
            terms = []
            for j, t in enumerate(op.sum):
                tp = op_p + ("sum", j)
                name, norm = (t.of, t.norm) if isinstance(t, StreamTerm) else (t, None)
                if name not in readable:
                    raise self.err(tp, f"decoder.schedule.before_layer[{i}].sum[{j}]: no value '{name}' (values: "
                                       f"{', '.join(sorted(readable))}){did_you_mean(name, readable)}")
                if norm is not None and norm not in s.norms:
                    raise self.err(tp, f"decoder.schedule.before_layer[{i}].sum[{j}].norm: no norm '{norm}' in "
                                       f"decoder.schedule.norms{did_you_mean(norm, s.norms)}")
                terms.append((name, norm))
            ops.append(BeforeLayerIR(self.flag(op_p + ("when",), op.when, per_layer=True), op.set, tuple(terms)))
        return ScheduleIR(tuple(norms), tuple(vectors), tuple(ops))

    def schedule_params(self, sched: ScheduleIR) -> tuple:
        out = []
        for n in sched.norms:
            out += self.block_params(f"{self.prefix}.{n.name}", f"decoder.schedule.norms.{n.name}", n, False)
        out += [ParamIR(f"{self.prefix}.{name}", "decoder.schedule.vectors", (dim,), "replicated")
                for name, dim in sched.vectors]
        return tuple(out)
