"""The spec language: pydantic v2 models, strict, unknown keys forbidden.

This package is the reference for what a spec may contain (`xllm-gen --json-schema` exports it for editors).
Sizes, numbers and flags are literals, config symbol names, or expressions over config symbols
(codegen/expr.py: `hidden_size // num_attention_heads`; per-layer values may read `layer`). Cross-field
checks (symbols exist, dataflow references, weights vs parameters, TP divisibility, variants) live in
resolver.py, in one place. The model spec holds only the model: deployment (graph buckets, batch sizes,
chunked prefill, TP size) are engine options.

One module per section (every name is importable from `codegen.schema`, as it was from the one module):
base.py (the value kinds Dim / Num / Flag / Scalar, the Strict base), config.py (`config`), blocks.py (projections,
embeddings, norms, linears), attention.py (`attention`, `mla_attention`), recurrent.py (`gated_delta_net`, `mamba2`,
`mamba`, `short_conv`, `rg_lru`, `lightning_attention`, `wkv`, `channel_mix`, `mlstm`), mlp.py (`gated_mlp`, `mlp`, `moe`), dataflow.py (a layer's steps and per-layer
choices), decoder.py (`decoder`, `LayerBlock`), weights.py (`weights`), vision.py (`vision`), spec.py (`Spec`,
`BLOCK_KINDS`). A field's documentation is its trailing or preceding `# ...` comment (`xllm-gen --json-schema` reads
them from every module here). A new block kind: its model in the module of its family (or a new one) and in
`decoder.LayerBlock`.
"""
# ruff: noqa: F401
from .attention import (
    AttentionBlock,
    AttentionExperts,
    Differential,
    Indexer,
    KeyBias,
    LoRA,
    MLAAttentionBlock,
    OutGate,
    QKNorm,
    QueryScale,
    Rotary,
    SubNorm,
    VNorm,
)
from .base import (
    Dim,
    Flag,
    Num,
    Scalar,
    Strict,
    Symbol,
)
from .blocks import (
    EmbeddingBlock,
    FusedLinearBlock,
    FusedProjection,
    LayerNormBlock,
    LinearBlock,
    MixerProjection,
    NormGate,
    PositionEmbeddingBlock,
    Projection,
    ResidualGateBlock,
    RMSNormBlock,
)
from .config import (
    ConfigField,
)
from .dataflow import (
    Branch,
    BranchOp,
    BranchStep,
    Choice,
    DataflowChoice,
    ParallelStep,
    ResidualStep,
    Select,
)
from .decoder import (
    Decoder,
    Deepstack,
    EmbedProjection,
    HeadTransform,
    LayerBlock,
    Layers,
    LMHeadBlock,
    NormBlock,
    PerLayerInput,
)
from .hyper import (
    HyperConnectionBlock,
    HyperMix,
    HyperNorm,
    HyperPost,
    HyperPre,
)
from .mlp import (
    ActivationForm,
    GatedMLPBlock,
    MLPBlock,
    MoEBlock,
    Router,
    RouterNorm,
    RoutingGroups,
    SharedExpert,
)
from .recurrent import (
    ChannelMixBlock,
    GatedDeltaNetBlock,
    GatedDeltaNetProjection,
    LightningAttentionBlock,
    LowRankInput,
    Mamba2Block,
    MambaBlock,
    MambaInnerNorm,
    MLSTMBlock,
    RGLRUBlock,
    ShortConvBlock,
    WKVBlock,
)
from .schedule import (
    BeforeLayer,
    Schedule,
    StreamTerm,
)
from .spec import (
    BLOCK_KINDS,
    AssumeAnyOf,
    Spec,
    TensorParallel,
)
from .vision import (
    PatchEmbedBlock,
    PatchMergerBlock,
    PosEmbedBlock,
    Vision,
    VisionAttentionBlock,
    VisionDeepstack,
    VisionLayerBlock,
    VisionLayers,
    VisionMLPBlock,
    VisionRotary,
)
from .weights import (
    RowLayout,
    RowLayoutChoice,
    SegmentSource,
    WeightEntry,
)
