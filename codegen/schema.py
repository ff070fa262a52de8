"""The spec language: pydantic v2 models, strict, unknown keys forbidden.

This file is the reference for what a spec may contain. Sizes and numbers are either literals or names of
config symbols (keys of the `config` section); there are no expressions: derived sizes are computed by the
resolver. Cross-field checks (symbols exist, dataflow references, weights vs parameters, TP divisibility,
variants) live in resolver.py, in one place.
"""
from __future__ import annotations

from typing import Annotated, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Symbol = StrictStr                                   # the name of a config symbol
Dim = Union[StrictInt, Symbol]                       # a size: an int literal or an int config symbol
Num = Union[StrictInt, StrictFloat, Symbol]          # a number: a literal or a float/int config symbol
Flag = Union[StrictBool, Symbol]                     # a bool literal or a bool config symbol
Scalar = Union[StrictBool, StrictInt, StrictFloat, List[StrictInt]]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=False)


# ---- config mapping: spec symbol <- config.json field(s) -------------------------------------------------

class ConfigField(Strict):
    """`name: {type: int, from: [dotted.path, fallback.path], default: 10}`; the first present path wins.

    A derived symbol reads no config.json field: `name: {type: int, length_of: other}` is the length of the
    int_tuple symbol `other` (e.g. the number of deepstack levels = len(deepstack_visual_indexes)); it is
    rendered as a property of Config and evaluated for every variant."""
    type: Literal["int", "float", "bool", "int_tuple"]
    from_: Optional[Union[StrictStr, List[StrictStr]]] = Field(default=None, alias="from")
    length_of: Optional[Symbol] = None
    default: Optional[Scalar] = None
    doc: StrictStr = ""


# ---- blocks ----------------------------------------------------------------------------------------------

class Projection(Strict):
    """A linear projection inside a composite block; `name` is its module (and parameter) name."""
    name: StrictStr
    bias: StrictBool = False


class FusedProjection(Strict):
    """A fused projection: several named output segments stacked along the output dim."""
    name: StrictStr
    segments: List[StrictStr]
    bias: StrictBool = False


class EmbeddingBlock(Strict):
    kind: Literal["embedding"]
    vocab: Dim
    dim: Dim


class RMSNormBlock(Strict):
    kind: Literal["rmsnorm"]
    dim: Dim
    eps: Num


class LayerNormBlock(Strict):
    kind: Literal["layernorm"]
    dim: Dim
    eps: Num
    bias: StrictBool = True


class LinearBlock(Strict):
    kind: Literal["linear"]
    in_: Dim = Field(alias="in")
    out: Dim
    parallel: Literal["column", "row", "replicated"]
    bias: StrictBool = False


class FusedLinearBlock(Strict):
    """Column-parallel linear whose output is named segments, e.g. {gate: inter, up: inter}."""
    kind: Literal["fused_linear"]
    in_: Dim = Field(alias="in")
    segments: Dict[StrictStr, Dim]
    bias: StrictBool = False


class QKNorm(Strict):
    """Per-head norm of q and k before rotary (Qwen3)."""
    kind: Literal["rmsnorm"]
    eps: Num
    q: StrictStr = "q_norm"
    k: StrictStr = "k_norm"


class Rotary(Strict):
    kind: Literal["neox", "mrope_interleaved", "mrope_blocked"]
    theta: Num
    max_position: Dim
    mrope_section: Optional[Union[List[StrictInt], Symbol]] = None


class AttentionBlock(Strict):
    """Self-attention with GQA: fused q/k/v projection (segments q, k, v), optional per-head q/k norm,
    rotary embedding, paged attention, output projection."""
    kind: Literal["attention"]
    hidden: Dim
    heads: Dim
    kv_heads: Dim
    head_dim: Dim
    qkv: FusedProjection
    out: Projection
    rotary: Rotary
    qk_norm: Optional[QKNorm] = None
    scale: Optional[Num] = None          # default head_dim ** -0.5


class GatedMLPBlock(Strict):
    """down(act(gate(x)) * up(x)) with gate/up fused into one projection (segments gate, up)."""
    kind: Literal["gated_mlp"]
    hidden: Dim
    intermediate: Dim
    activation: Literal["silu"]
    gate_up: FusedProjection
    down: Projection


class LMHeadBlock(Strict):
    kind: Literal["lm_head"]
    vocab: Dim
    dim: Dim
    tie: Flag                            # true, false, or a bool config symbol (decided by the checkpoint)


LayerBlock = Annotated[
    Union[RMSNormBlock, LayerNormBlock, LinearBlock, FusedLinearBlock, AttentionBlock, GatedMLPBlock],
    Field(discriminator="kind"),
]
NormBlock = Annotated[Union[RMSNormBlock, LayerNormBlock], Field(discriminator="kind")]


class ResidualStep(Strict):
    """`{norm: N, block: B}`: residual += h; h = B(N(residual)) (the norm fuses the residual add)."""
    norm: StrictStr
    block: StrictStr


class Layers(Strict):
    count: Dim
    blocks: Dict[StrictStr, LayerBlock]
    dataflow: List[ResidualStep]


class Deepstack(Strict):
    """Qwen3-VL: deepstack level k is added at visual-token rows after a decoder layer. Give one of:
    `after_layers: [0, 1, 2]` (level k after layer after_layers[k], fixed by the spec) or
    `levels: n` (after layers 0..n-1; n a literal or an int config symbol known from the checkpoint,
    rendered as a loop bound)."""
    after_layers: Optional[List[StrictInt]] = None
    levels: Optional[Dim] = None


class Decoder(Strict):
    # module path of the decoder in the model and in the checkpoint. `weights` keys and `from` names of
    # decoder tensors are written `model.<rest>`; with another prefix they mean `<prefix>.<rest>` (so a spec
    # that moves the decoder, e.g. Qwen3-VL's model.language_model, reuses its base's `weights` as they are)
    prefix: StrictStr = "model"
    embed_tokens: EmbeddingBlock
    layers: Layers
    norm: NormBlock
    deepstack: Optional[Deepstack] = None


class WeightEntry(Strict):
    """How one parameter is loaded: checkpoint source(s) and sharding rule.

    `from` defaults to the parameter's own name; a mapping {segment: tensor} stacks several checkpoint
    tensors into a fused parameter, in the block's segment order. `{i}` stands for the layer index."""
    from_: Optional[Union[StrictStr, Dict[StrictStr, StrictStr]]] = Field(default=None, alias="from")
    shard: Literal["replicated", "colwise", "rowwise", "vocab"]


# ---- vision tower ----------------------------------------------------------------------------------------

class PatchEmbedBlock(Strict):
    """Conv3d patch embedding with kernel = stride = (temporal_patch, patch, patch) over `in_channels`, run
    as one linear over the processor's flattened patch rows. Params proj.weight [dim, C, tp, p, p], proj.bias."""
    kind: Literal["conv3d_patch_embed"]
    in_channels: Dim
    temporal_patch: Dim
    patch: Dim
    dim: Dim


class PosEmbedBlock(Strict):
    """Learned square position table `weight [positions, dim]`, bilinearly interpolated (align corners) to
    each image / frame patch grid."""
    kind: Literal["interpolated_pos_embed"]
    positions: Dim
    dim: Dim


class VisionRotary(Strict):
    """Axial 2-D rotary (patch row | patch column) over the attention's head_dim = hidden / heads."""
    kind: Literal["rotary_2d"]
    theta: Num


class VisionAttentionBlock(Strict):
    """Bidirectional attention within each image / video frame: fused `qkv` (bias; segments q, k, v of
    `heads` heads each, stored fused in the checkpoint), 2-D rotary on q/k, `proj` (bias). Heads are split
    over TP ranks when divisible, else the block is replicated (runtime VisionAttention)."""
    kind: Literal["vision_attention"]
    hidden: Dim
    heads: Dim
    rotary: VisionRotary


class VisionMLPBlock(Strict):
    """linear_fc1 (bias) -> GELU -> linear_fc2 (bias); split over TP ranks when `intermediate` is divisible,
    else replicated (runtime VisionMLP)."""
    kind: Literal["vision_mlp"]
    hidden: Dim
    intermediate: Dim
    activation: Literal["gelu_tanh", "gelu"]


class PatchMergerBlock(Strict):
    """merge x merge spatial merge (the merge^2 consecutive patch rows concatenated) then
    linear_fc1 -> GELU (exact) -> linear_fc2 to `out`. `norm: before_merge` is a LayerNorm over `dim` per
    patch (the main merger); `after_merge` over the merged width dim * merge^2 (deepstack mergers)."""
    kind: Literal["patch_merger"]
    dim: Dim
    out: Dim
    norm: Literal["before_merge", "after_merge"]
    eps: Num = 1.0e-6


VisionLayerBlock = Annotated[
    Union[LayerNormBlock, RMSNormBlock, VisionAttentionBlock, VisionMLPBlock], Field(discriminator="kind")]


class VisionLayers(Strict):
    """`count` blocks (module list `blocks`); each residual step of the dataflow is x = x + block(norm(x))."""
    count: Dim
    blocks: Dict[StrictStr, VisionLayerBlock]
    dataflow: List[ResidualStep]


class VisionDeepstack(Strict):
    """Deepstack mergers (module list `deepstack_merger_list`): level k merges the output of vision block
    taps[k]; `taps` is an int_tuple config symbol (deepstack_visual_indexes) or a literal list."""
    taps: Union[List[StrictInt], Symbol]
    merger: PatchMergerBlock


class Vision(Strict):
    """The vision tower: patch_embed -> + pos_embed -> blocks (rotary_pos_emb shared) -> merger, with the
    deepstack mergers fed from the tapped blocks. Patch rows arrive in merge order (merge x merge blocks)."""
    prefix: StrictStr                    # module path in the model and in the checkpoint, e.g. model.visual
    merge: Dim                           # spatial merge size
    patch_embed: PatchEmbedBlock
    pos_embed: PosEmbedBlock
    blocks: VisionLayers
    merger: PatchMergerBlock
    deepstack: Optional[VisionDeepstack] = None
    weights: Dict[StrictStr, WeightEntry]  # full tensor names; {i} is the block (or deepstack level) index


# ---- weights, runner, tensor parallel -------------------------------------------------------------------

class Runner(Strict):
    max_batch: StrictInt
    multimodal: Optional[StrictBool] = None          # default: whether the spec has a `vision` tower
    position_kind: Optional[Literal["rope", "mrope"]] = None   # default: mrope when the rotary is mRoPE
    graph_buckets: Optional[List[StrictInt]] = None   # default 1, 2, 4, 8, then multiples of 16 up to max_batch
    prefill_mode: Literal["whole", "chunked"] = "whole"   # prefill whole prompts, or in chunks


class TensorParallel(Strict):
    sizes: List[StrictInt]


class Spec(Strict):
    spec_version: Literal[1]
    name: StrictStr
    description: StrictStr = ""
    class_prefix: StrictStr
    architectures: List[StrictStr]
    config: Dict[StrictStr, ConfigField]
    decoder: Decoder
    lm_head: LMHeadBlock
    vision: Optional[Vision] = None
    weights: Dict[StrictStr, WeightEntry]
    ignore_checkpoint_tensors: List[StrictStr] = []
    runner: Runner
    tensor_parallel: TensorParallel
    variants: Dict[StrictStr, Dict[StrictStr, Scalar]] = {}


BLOCK_KINDS = ("embedding", "rmsnorm", "layernorm", "linear", "fused_linear", "attention", "gated_mlp", "lm_head",
               "conv3d_patch_embed", "interpolated_pos_embed", "rotary_2d", "vision_attention", "vision_mlp",
               "patch_merger")
