"""The recurrent-state blocks (`RECURRENT_KINDS`): `GatedDeltaNetIR`, `Mamba2IR`, `MambaIR`, `ShortConvIR`,
`RGLRUIR`, `LightningIR`, `WKVIR`, `ChannelMixIR`, `MLSTMIR`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from .params import SegmentIR
from .values import Size, Value


@dataclass(frozen=True)
class GatedDeltaNetIR:
    """A gated DeltaNet mixer (runtime: the generated class over L.GatedDeltaNet, a recurrent-state mixer)."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    key_heads: Size
    value_heads: Size
    key_head_dim: Size
    value_head_dim: Size
    conv_kernel: Size
    eps: Value
    activation: Value
    projections: Tuple[Tuple[str, Tuple[str, ...]], ...]   # (module, segments) in order
    out_name: str
    conv_bias: bool
    rep: Any                      # value heads per key head (an expression)
    decay: str = "head"           # head (g per value head) | channel (g per value head and key channel)
    gate_activation: str = "silu"  # the gated norm's activation of z: silu | sigmoid
    low_rank: Tuple[Tuple[str, str, Any], ...] = ()   # (projection, its low-rank input module, rank)
    beta_scale: Value = Value(literal=1.0)   # beta = beta_scale * sigmoid(b)
    bounded_decay: Value = Value(literal=False)   # g = lower_bound * sigmoid(exp(A_log) (a + dt_bias))
    decay_lower_bound: Value = Value(literal=-5.0)

    def segment(self, name: str) -> "SegmentIR":
        """A projection segment, split by key heads (each with its value heads)."""
        a = self.rep * self.key_head_dim if self.decay == "channel" else self.rep
        unit = {"q": self.key_head_dim, "k": self.key_head_dim, "v": self.rep * self.value_head_dim,
                "z": self.rep * self.value_head_dim, "b": self.rep, "a": a}[name]
        return SegmentIR(name, self.key_heads, unit)

    def low_rank_of(self, projection: str):
        """(module, rank) of a projection's low-rank input, else None."""
        return next(((m, r) for p, m, r in self.low_rank if p == projection), None)


@dataclass(frozen=True)
class Mamba2IR:
    """A Mamba-2 mixer (runtime: the generated class over L.Mamba2, a recurrent-state mixer)."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    heads: Size
    head_dim: Size
    groups: Size
    state_size: Size
    conv_kernel: Size
    chunk_size: Size
    eps: Value
    activation: Value
    bias: Value
    conv_bias: Value
    in_proj: str
    out_name: str
    time_step_min: Value = Value(literal=0.0)    # dt's clamp in a prompt chunk
    time_step_max: Optional[Value] = None        # None: no upper bound
    out_bias: Optional[Value] = None             # the output projection's bias (None: as `bias`)
    in_scale: Tuple[Tuple[str, Value], ...] = ()  # per-segment output multipliers of in_proj (z, x, B, C, dt)
    out_scale: Optional[Value] = None            # the output projection's output multiplier
    gated_norm: Value = Value(literal=True)      # the gated RMSNorm exists (else y * silu(z))
    norm_before_gate: Value = Value(literal=False)   # w * rmsnorm(y) * silu(z) instead of w * rmsnorm(y * silu(z))


@dataclass(frozen=True)
class MambaIR:
    """A Mamba-1 mixer, the selective scan (runtime: the generated class over L.Mamba, a recurrent-state mixer)."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    intermediate: Size
    state_size: Size
    time_step_rank: Size
    conv_kernel: Size
    activation: Value
    bias: Value
    conv_bias: Value
    inner_norm: Optional[str]             # None | "weightless" | "weight"
    inner_eps: Optional[Value]
    in_proj: str
    out_name: str
    heads: Optional[Size] = None          # multi-head Mamba (Zamba): heads of head_dim channels, x_proj / dt_proj per head
    head_dim: Optional[Size] = None

    def intermediate_fields(self, ir) -> str:
        """The config.json field (or the expression over symbols) giving the channels, for refusals."""
        sym = getattr(self.intermediate, "symbol", None)
        return ir.config_source(sym) if sym else str(getattr(self.intermediate, "source", self.intermediate))

    def heads_field(self, ir) -> str:
        sym = getattr(self.heads, "symbol", None)
        return ir.config_source(sym) if sym else str(getattr(self.heads, "source", self.heads))


@dataclass(frozen=True)
class ShortConvIR:
    """A gated short-convolution mixer (runtime: the generated class over L.ShortConv, a recurrent-state mixer)."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    conv_kernel: Size
    bias: Value
    in_proj: str
    out_name: str


@dataclass(frozen=True)
class RGLRUIR:
    """A Griffin recurrent block, conv1d + RG-LRU (runtime: the generated class over L.RGLRU, a recurrent-state mixer)."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    width: Size
    heads: Size
    block_width: Any              # width // heads (an expression): the gates' block, a head's channels
    conv_kernel: Size
    activation: Value
    decay_scale: Value
    bias: Value
    conv_bias: Value
    x_proj: str
    y_proj: str
    out_name: str

    def fields(self, ir) -> dict:
        """The config.json field (or the expression over symbols) of the width and the heads, for refusals."""
        out = {}
        for k, size in (("width", self.width), ("heads", self.heads)):
            sym = getattr(size, "symbol", None)
            out[k] = ir.config_source(sym) if sym else str(getattr(size, "source", size))
        return out


@dataclass(frozen=True)
class LightningIR:
    """Lightning attention (runtime: the generated class over L.LightningAttention, a recurrent-state mixer)."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    heads: Size
    head_dim: Size
    layers: Size
    block_size: Size
    eps: Value
    activation: Value
    qkv: str
    gate: str
    out_name: str

    def heads_field(self, ir) -> str:
        sym = getattr(self.heads, "symbol", None)
        return ir.config_source(sym) if sym else str(getattr(self.heads, "source", self.heads))


RECURRENT_KINDS = ("gated_delta_net", "mamba2", "mamba", "short_conv", "rg_lru", "lightning_attention", "wkv", "channel_mix", "mlstm")


@dataclass(frozen=True)
class WKVIR:
    """A WKV time mix (runtime: the generated class over L.WKV, a token-shift recurrent mixer)."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    width: Size
    key: str
    value: str
    receptance: str
    out_name: str

    def width_field(self, ir) -> str:
        sym = getattr(self.width, "symbol", None)
        return ir.config_source(sym) if sym else str(getattr(self.width, "source", self.width))


@dataclass(frozen=True)
class ChannelMixIR:
    """A token-shifted MLP (runtime: the generated class over L.TokenShiftMLP, a state of the previous input)."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    intermediate: Size
    activation: Value
    key: str
    value: str
    receptance: str



@dataclass(frozen=True)
class MLSTMIR:
    """An mLSTM mixer (runtime: the generated class over L.MLSTM, a recurrent-state mixer)."""
    kind: str
    name: str
    class_name: str
    hidden: Size
    heads: Size
    qk_dim: Size
    v_dim: Size
    eps: Value
    norm_eps: Value
    gate_soft_cap: Optional[Value]
    bias: Value
    norm_bias: Value
    q: str
    k: str
    v: str
    ogate: str
    igate: str
    fgate: str
    out_name: str
    qk_head_dim: Any = None       # qk_dim // heads, v_dim // heads (expressions): a head's rows
    v_head_dim: Any = None

    def fields(self, ir) -> dict:
        """The config.json field (or the expression over symbols) of each size, for refusals."""
        out = {}
        for key in ("heads", "qk_dim", "v_dim"):
            size = getattr(self, key)
            sym = getattr(size, "symbol", None)
            f = next((f for f in ir.config if f.name == sym), None) if sym else None
            if f is not None and getattr(f, "expr", None) is not None and not f.paths:   # derived: its formula
                out[key] = f"{sym} = {f.expr}"
            else:
                out[key] = ir.config_source(sym) if sym else str(getattr(size, "source", size))
        return out
