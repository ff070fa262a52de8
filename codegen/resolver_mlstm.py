"""The mLSTM part of the resolver (block kind `mlstm`, xLSTM's matrix-memory LSTM mixer): its IR (`resolve_mlstm`)
and its parameters with their sharding (`mlstm_params`). A mixin of resolver._Resolver (through
resolver_blocks.BlockResolver), which provides err / dim / num / positive / flag / ident; the runtime side is
runtime/layers/recurrent/mlstm.py."""
from __future__ import annotations

from typing import List

from .ir import MLSTMIR, ParamIR, SegmentIR, Size
from .resolver_block_common import ParamBuilder, _maybe
from .schema import MLSTMBlock

_KEYS = ("q", "k", "v", "ogate", "igate", "fgate", "out")


class MLSTMResolver:
    def resolve_mlstm(self, path, name: str, b: MLSTMBlock, class_name: str) -> MLSTMIR:
        names = [self.ident(path + (k,), getattr(b, k), "module name") for k in _KEYS]
        for i, (k, v) in enumerate(zip(_KEYS, names)):
            if v == "multihead_norm" or v in names[:i]:
                raise self.err(path + (k,), f"{self._where(path)}.{k}: module name '{v}' is already used in this "
                                            f"block")
        heads, qk, v = (self.dim(path + (k,), getattr(b, k)) for k in ("heads", "qk_dim", "v_dim"))

        def src(size):
            return f"({size.source})" if not isinstance(size, Size) else f"({size})"
        dk, dv = (self.expr(path + (k,), f"{src(s)} // {src(heads)}") for k, s in (("qk_dim", qk), ("v_dim", v)))
        cap = self.positive(path + ("gate_soft_cap",), b.gate_soft_cap) if b.gate_soft_cap is not None else None
        return MLSTMIR("mlstm", name, class_name, self.dim(path + ("hidden",), b.hidden), heads, qk, v,
                       self.positive(path + ("eps",), b.eps, below=1.0),
                       self.positive(path + ("norm_eps",), b.norm_eps, below=1.0), cap,
                       self.flag(path + ("bias",), b.bias), self.flag(path + ("norm_bias",), b.norm_bias), *names,
                       qk_head_dim=dk, v_head_dim=dv)

    @staticmethod
    def mlstm_params(pb: ParamBuilder, b: MLSTMIR) -> List[ParamIR]:
        """q / k / v / the output gate column-parallel by heads (a head's Dk or Dv rows), the input and forget gates
        by heads (one row each, with biases), the per-head norm by heads, the output projection row-parallel."""
        P = pb.P
        one = Size.of(1)
        dk, dv = b.qk_head_dim, b.v_head_dim
        qk, v, h = SegmentIR("heads", b.heads, dk), SegmentIR("heads", b.heads, dv), SegmentIR("heads", b.heads, one)
        ps = []
        for m, rows, seg in ((b.q, b.qk_dim, qk), (b.k, b.qk_dim, qk), (b.v, b.v_dim, v), (b.ogate, b.v_dim, v)):
            ps.append(P(f"{m}.weight", (rows, b.hidden), "colwise", (seg,)))
            if _maybe(b.bias):
                ps.append(P(f"{m}.bias", (rows,), "colwise", (seg,)))
        for m in (b.igate, b.fgate):
            ps += [P(f"{m}.weight", (b.heads, b.hidden), "colwise", (h,)), P(f"{m}.bias", (b.heads,), "colwise", (h,))]
        ps.append(P("multihead_norm.weight", (b.v_dim,), "colwise", (v,)))
        if _maybe(b.norm_bias):
            ps.append(P("multihead_norm.bias", (b.v_dim,), "colwise", (v,)))
        ps.append(P(f"{b.out_name}.weight", (b.hidden, b.v_dim), "rowwise", (v,)))
        if _maybe(b.bias):
            ps.append(P(f"{b.out_name}.bias", (b.hidden,), "replicated"))
        return ps
