"""The decoder-layer part of the resolver: each block kind to its IR (`resolve_block`) and its parameters with
their sharding (`block_params`), both a dispatch table keyed by the block kind (`BLOCK_KINDS`, `BLOCK_PARAMS`). A
mixin of resolver._Resolver, which provides err / dim / num / positive / flag / ident / symbol and the spec, as
resolver_vision.py is for the vision tower.

Each family of block kinds has its own module, a mixin with its `resolve_<kind>` and `<kind>_params`:
resolver_attention.py (attention), resolver_mla.py (mla_attention), resolver_recurrent.py (short_conv, rg_lru, mamba2,
mamba, gated_delta_net), resolver_lightning.py (lightning_attention), resolver_wkv.py (wkv, channel_mix), resolver_mlstm.py (mlstm), resolver_gate.py (residual_gate), resolver_mlp.py (gated_mlp, mlp, moe); the norms and linears are here; what they share
(activation tables, sub_norm, lora, scales, ParamBuilder) is in resolver_block_common.py. A new block kind is one
module: its mixin in `BlockResolver`'s bases and one row in each table."""
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
    HyperIR,
    LightningIR,
    LinearIR,
    Mamba2IR,
    MambaIR,
    MoEIR,
    NormIR,
    ParamIR,
    ResidualGateIR,
    SegmentIR,
    ShortConvIR,
    Size,
)
from .resolver_attention import AttentionResolver
from .resolver_block_common import (  # noqa: F401  (the tables and helpers, importable from here as before)
    ACTIVATIONS,
    GATED_ACTIVATIONS,
    PARAM_ACTIVATIONS,
    ROTARY_KINDS,
    BlockCommon,
    ParamBuilder,
    _is_int,
    _maybe,
)
from .resolver_gate import ResidualGateResolver
from .resolver_hyper import HyperResolver
from .resolver_lightning import LightningResolver
from .resolver_mla import MLAResolver
from .resolver_mlp import FeedForwardResolver
from .resolver_mlstm import MLSTMResolver
from .resolver_recurrent import RecurrentResolver
from .resolver_wkv import WKVResolver
from .schema import (
    AttentionBlock,
    ChannelMixBlock,
    FusedLinearBlock,
    GatedDeltaNetBlock,
    GatedMLPBlock,
    HyperConnectionBlock,
    LayerNormBlock,
    LightningAttentionBlock,
    LinearBlock,
    Mamba2Block,
    MambaBlock,
    MLAAttentionBlock,
    MLPBlock,
    MLSTMBlock,
    MoEBlock,
    ResidualGateBlock,
    RGLRUBlock,
    RMSNormBlock,
    ShortConvBlock,
    WKVBlock,
)


class BlockResolver(AttentionResolver, RecurrentResolver, FeedForwardResolver, BlockCommon, MLAResolver,
                    LightningResolver, HyperResolver, WKVResolver, MLSTMResolver, ResidualGateResolver):

    def resolve_block(self, path, name, b, unique_kind: bool):
        """The block's IR, by its kind's resolver (`BLOCK_KINDS`); its generated class is `<prefix><Kind>` when it
        is the only block of its kind, else `<prefix><CamelName>`."""
        method, kind_class = BLOCK_KINDS[type(b)]
        prefix = self.spec.class_prefix
        camel = "".join(p.capitalize() for p in name.split("_"))
        class_name = f"{prefix}{kind_class}" if unique_kind and kind_class else f"{prefix}{camel}"
        return getattr(self, method)(path, name, b, class_name)

    def resolve_layer_norm(self, path, name: str, b, class_name: str):
        """A norm block of the layer (`rmsnorm` / `layernorm`)."""
        return self.resolve_norm(path, name, b, context="layer")

    def resolve_linear(self, path, name: str, b, class_name: str):
        """A `linear` block (one projection, column / row / replicated)."""
        return LinearIR("linear", name, self.dim(path + ("in",), b.in_), (((name, self.dim(path + ("out",), b.out)),)),
                        b.parallel, b.bias)

    def resolve_fused_linear(self, path, name: str, b, class_name: str):
        """A `fused_linear` block (2 or more segments, column parallel)."""
        if len(b.segments) < 2:
            raise self.err(path + ("segments",), f"{self._where(path)}.segments: a fused linear has 2 or more segments")
        segs = tuple((self.ident(path + ("segments", k), k, "segment name", at_key=True),
                      self.dim(path + ("segments", k), v)) for k, v in b.segments.items())
        return LinearIR("fused_linear", name, self.dim(path + ("in",), b.in_), segs, "column", b.bias)

    @staticmethod
    def norm_params(pb: ParamBuilder, b) -> List[ParamIR]:
        """A norm: its weight (and bias), replicated; a gated norm's modules norm, mlp.fc1, mlp.fc2 (the plain weight
        where the gate is off)."""
        P = pb.P
        if b.gate_rank is not None:
            on = None if b.gate_enabled.literal is True else (b.gate_enabled, True)
            ps = [P("norm.weight", (b.dim,), "replicated", when=on),
                  P("mlp.fc1.weight", (b.gate_rank, b.dim), "replicated", when=on),
                  P("mlp.fc2.weight", (b.dim, b.gate_rank), "replicated", when=on)]
            if on is not None:
                ps.append(P("weight", (b.dim,), "replicated", when=(b.gate_enabled, False)))
            return ps
        return ([P("weight", (b.dim,), "replicated")] if b.weight else []) + \
            ([P("bias", (b.dim,), "replicated")] if b.bias else [])

    @staticmethod
    def linear_params(pb: ParamBuilder, b) -> List[ParamIR]:
        """A linear / fused_linear block: column, row or replicated."""
        P, column, row = pb.P, pb.column, pb.row
        one = Size.of(1)
        out_total = b.out_sizes[0][1]
        for _, s in b.out_sizes[1:]:
            out_total = out_total + s
        if b.parallel == "column":
            return column("", b.in_features, [SegmentIR(n, s, one) for n, s in b.out_sizes], b.bias)
        if b.parallel == "row":
            return row("", SegmentIR(b.name, b.in_features, one), out_total, b.bias)
        return [P("weight", (out_total, b.in_features), "replicated")] + \
            ([P("bias", (out_total,), "replicated")] if b.bias else [])

    @staticmethod
    def block_params(prefix: str, block: str, b, per_layer: bool) -> List[ParamIR]:
        """A resolved block's parameters under the module `prefix`, by its kind (`BLOCK_PARAMS`)."""
        return BLOCK_PARAMS[type(b)](ParamBuilder(prefix, block, per_layer), b)


# block kind (schema) -> (its resolver method, its generated class name when it is the only block of its kind)
BLOCK_KINDS = {
    RMSNormBlock: ("resolve_layer_norm", None),
    LayerNormBlock: ("resolve_layer_norm", None),
    LinearBlock: ("resolve_linear", None),
    FusedLinearBlock: ("resolve_fused_linear", None),
    AttentionBlock: ("resolve_attention", "Attention"),
    MLAAttentionBlock: ("resolve_mla", "Attention"),
    ShortConvBlock: ("resolve_short_conv", "ShortConv"),
    RGLRUBlock: ("resolve_rg_lru", "RGLRU"),
    Mamba2Block: ("resolve_mamba2", "Mamba2"),
    MambaBlock: ("resolve_mamba", "Mamba"),
    GatedDeltaNetBlock: ("resolve_gated_delta_net", "GatedDeltaNet"),
    LightningAttentionBlock: ("resolve_lightning", "LightningAttention"),
    WKVBlock: ("resolve_wkv", "WKV"),
    ChannelMixBlock: ("resolve_channel_mix", "ChannelMix"),
    MLSTMBlock: ("resolve_mlstm", "MLSTM"),
    GatedMLPBlock: ("resolve_gated_mlp", "MLP"),
    MLPBlock: ("resolve_mlp", "MLP"),
    MoEBlock: ("resolve_moe", "SparseMoeBlock"),
    HyperConnectionBlock: ("resolve_hyper_connection", None),
    ResidualGateBlock: ("resolve_residual_gate", None),
}

# resolved block (IR) -> its parameters with their sharding
BLOCK_PARAMS = {
    NormIR: BlockResolver.norm_params,
    LinearIR: BlockResolver.linear_params,
    AttentionIR: AttentionResolver.attention_params,
    MLAIR: lambda pb, b: MLAResolver.mla_params(pb.prefix, pb.block, b, pb.per_layer, _maybe),
    ShortConvIR: RecurrentResolver.short_conv_params,
    RGLRUIR: RecurrentResolver.rg_lru_params,
    Mamba2IR: RecurrentResolver.mamba2_params,
    MambaIR: RecurrentResolver.mamba_params,
    GatedDeltaNetIR: RecurrentResolver.gated_delta_net_params,
    LightningIR: lambda pb, b: LightningResolver.lightning_params(pb.prefix, pb.block, b, pb.per_layer),
    WKVIR: WKVResolver.wkv_params,
    ChannelMixIR: WKVResolver.channel_mix_params,
    MLSTMIR: MLSTMResolver.mlstm_params,
    MoEIR: FeedForwardResolver.moe_params,
    MLPIR: FeedForwardResolver.mlp_params,
    GatedMLPIR: FeedForwardResolver.gated_mlp_params,
    HyperIR: HyperResolver.hyper_params,
    ResidualGateIR: ResidualGateResolver.residual_gate_params,
}
