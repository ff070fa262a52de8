"""The `residual_gate` block kind: a learned per-channel gate on a step's residual add, `x = residual(w) * x +
branch(w) * h` (codegen/gate_expr.py: the formulas over `w`). Its IR (`resolve_residual_gate`) and its parameter
(`residual_gate_params`: `weight [hidden]`, replicated). A mixin of resolver._Resolver (through
resolver_blocks.BlockResolver), which provides err / dim; a step names the block with `gate:` (resolver.py)."""
from __future__ import annotations

from typing import List

from . import gate_expr
from .ir import ParamIR, ResidualGateIR
from .resolver_block_common import ParamBuilder
from .schema import ResidualGateBlock


class ResidualGateResolver:
    def resolve_residual_gate(self, path, name: str, b: ResidualGateBlock, class_name: str) -> ResidualGateIR:
        py = {}
        for key in ("branch", "residual"):
            src = getattr(b, key)
            try:
                tree = gate_expr.parse(src)
                gate_expr.check_finite(tree)
            except gate_expr.GateExprError as exc:
                raise self.err(path + (key,), f"{self._where(path)}.{key}: {exc}") from None
            py[key] = None if gate_expr.is_one(tree) else gate_expr.render(tree)
        if py["branch"] is None and py["residual"] is None:
            raise self.err(path, f"{self._where(path)}: both formulas are 1 (a plain residual add): delete the gate",
                           at_key=True)
        return ResidualGateIR("residual_gate", name, self.dim(path + ("hidden",), b.hidden), str(b.branch),
                              str(b.residual), py["branch"], py["residual"])

    @staticmethod
    def residual_gate_params(pb: ParamBuilder, b: ResidualGateIR) -> List[ParamIR]:
        return [pb.P("weight", (b.hidden,), "replicated")]
