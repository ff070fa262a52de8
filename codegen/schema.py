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
    """`name: {type: int, from: [dotted.path, fallback.path], default: 10}`; the first present path wins."""
    type: Literal["int", "float", "bool", "int_tuple"]
    from_: Union[StrictStr, List[StrictStr]] = Field(alias="from")
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
    """Qwen3-VL: deepstack level k is added at visual-token rows after decoder layer after_layers[k]."""
    after_layers: List[StrictInt]


class Decoder(Strict):
    embed_tokens: EmbeddingBlock
    layers: Layers
    norm: NormBlock
    deepstack: Optional[Deepstack] = None


# ---- weights, runner, tensor parallel -------------------------------------------------------------------

class WeightEntry(Strict):
    """How one parameter is loaded: checkpoint source(s) and sharding rule.

    `from` defaults to the parameter's own name; a mapping {segment: tensor} stacks several checkpoint
    tensors into a fused parameter, in the block's segment order. `{i}` stands for the layer index."""
    from_: Optional[Union[StrictStr, Dict[StrictStr, StrictStr]]] = Field(default=None, alias="from")
    shard: Literal["replicated", "colwise", "rowwise", "vocab"]


class Runner(Strict):
    max_batch: StrictInt
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
    weights: Dict[StrictStr, WeightEntry]
    ignore_checkpoint_tensors: List[StrictStr] = []
    runner: Runner
    tensor_parallel: TensorParallel
    variants: Dict[StrictStr, Dict[StrictStr, Scalar]] = {}


BLOCK_KINDS = ("embedding", "rmsnorm", "layernorm", "linear", "fused_linear", "attention", "gated_mlp", "lm_head")
