"""The resolved spec (the IR): frozen dataclasses with every derived size computed (by resolver.py).

Sizes stay symbolic (`Size`: a sum of products of ints and config symbols) so that the generated code
works for any checkpoint of the family; `VariantIR` holds the same sizes evaluated for a named variant,
per tensor-parallel size.

One module per section (every name is importable from `codegen.ir`, as it was from the one module): values.py
(Size, Ratio, Value), config.py, params.py (segments, parameters, weights), blocks.py (norm, embeddings, linear),
attention.py (attention, MLA), mlp.py (gated_mlp, mlp, moe), recurrent.py (the recurrent-state kinds),
layers.py (BlockIR, the dataflow steps, LayerIR, LMHeadIR), vision.py (the vision tower), model.py (RunnerIR,
VariantIR, ModelIR). A new block kind: its IR in the module of its family (or a new one) and in
`layers.BlockIR`.
"""
# ruff: noqa: F401
from .attention import (
    MLAIR,
    AttentionExpertsIR,
    AttentionIR,
    IndexerIR,
    KeyBiasIR,
    LoRAIR,
    QKNormIR,
    QueryScaleIR,
    RotaryIR,
    SubNormIR,
)
from .blocks import (
    EmbeddingIR,
    LinearIR,
    NormIR,
    PositionEmbeddingIR,
    ResidualGateIR,
)
from .config import (
    ConfigFieldIR,
)
from .hyper import (
    HyperIR,
)
from .layers import (
    BlockIR,
    BranchStepIR,
    ChoiceIR,
    LayerIR,
    LMHeadIR,
    ParallelStepIR,
    StepIR,
)
from .mlp import (
    MLPIR,
    GatedMLPIR,
    MoEIR,
)
from .model import (
    HeadTransformIR,
    ModelIR,
    PerLayerInputIR,
    ProjectionIR,
    RankTableIR,
    RunnerIR,
    VariantIR,
)
from .params import (
    AllOf,
    LayoutChoice,
    ParamIR,
    SegmentGroupIR,
    SegmentIR,
    WeightIR,
)
from .recurrent import (
    MLSTMIR,
    RECURRENT_KINDS,
    RGLRUIR,
    WKVIR,
    ChannelMixIR,
    GatedDeltaNetIR,
    LightningIR,
    Mamba2IR,
    MambaIR,
    ShortConvIR,
)
from .values import (
    Factor,
    Ratio,
    Size,
    Value,
    size_at,
)
from .vision import (
    PatchEmbedIR,
    PatchMergerIR,
    PosEmbedIR,
    VisionAttentionIR,
    VisionIR,
    VisionMLPIR,
    VisionStepIR,
)
