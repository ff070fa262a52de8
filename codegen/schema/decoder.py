"""The `decoder` section: the LM head, the block kinds a layer may hold (`LayerBlock`), `Layers` (blocks,
dataflow, shared blocks), deepstack, the embedding projection, the head transform, and `Decoder` itself."""
from __future__ import annotations

from typing import Annotated, Dict, List, Literal, Optional, Union

from pydantic import Field, StrictInt, StrictStr

from .attention import AttentionBlock, MLAAttentionBlock
from .base import Dim, Flag, Num, Strict
from .blocks import (
    EmbeddingBlock,
    FusedLinearBlock,
    LayerNormBlock,
    LinearBlock,
    PositionEmbeddingBlock,
    ResidualGateBlock,
    RMSNormBlock,
)
from .dataflow import BranchStep, DataflowChoice, ParallelStep, ResidualStep
from .hyper import HyperConnectionBlock
from .mlp import GatedMLPBlock, MLPBlock, MoEBlock
from .recurrent import (
    ChannelMixBlock,
    GatedDeltaNetBlock,
    LightningAttentionBlock,
    Mamba2Block,
    MambaBlock,
    MLSTMBlock,
    RGLRUBlock,
    ShortConvBlock,
    WKVBlock,
)
from .schedule import Schedule


class LMHeadBlock(Strict):
    kind: Literal["lm_head"]
    vocab: Dim
    dim: Dim
    tie: Flag                            # true, false, or a bool config symbol (decided by the checkpoint)
    softcap: Optional[Num] = None        # final logit soft-capping (Gemma 2); None = off
    logit_scale: Optional[Num] = None    # logits are multiplied by it, before any soft-cap (Granite:
                                         # "1 / logits_scaling"); None = 1
    bias: Flag = False                   # a [vocab] bias (Phi, GPT-J), split over ranks as the weight is
    normalize: Flag = False              # each row of the weight L2-normalized once at load (Baichuan2's NormHead);
                                         # an untied head only


LayerBlock = Annotated[
    Union[RMSNormBlock, LayerNormBlock, LinearBlock, FusedLinearBlock, AttentionBlock, GatedMLPBlock, MLPBlock,
          MoEBlock, MLAAttentionBlock, GatedDeltaNetBlock, Mamba2Block, MambaBlock,
          ShortConvBlock, RGLRUBlock, LightningAttentionBlock, HyperConnectionBlock, WKVBlock, ChannelMixBlock, MLSTMBlock,
          ResidualGateBlock],
    Field(discriminator="kind"),
]
NormBlock = Annotated[Union[RMSNormBlock, LayerNormBlock], Field(discriminator="kind")]

class Layers(Strict):
    count: Dim
    blocks: Dict[StrictStr, LayerBlock]
    dataflow: Union[List[Union[ResidualStep, ParallelStep, BranchStep]], DataflowChoice]
    # blocks whose weights several layers reuse: block name -> an expression over config symbols and `layer`, the
    # instance the layer uses; layers with equal values share the block's parameters (the first such layer holds
    # them, under its name). Each layer keeps its own module state (KV cache, recurrent state) and LoRA adapters
    shared: Dict[StrictStr, StrictStr] = {}
    # a learned scalar parameter of each layer (its name, e.g. `layer_scalar`: `model.layers.{i}.layer_scalar [1]`) that
    # multiplies the whole residual stream after the layer's last step (Gemma 4)
    output_scale: Optional[StrictStr] = None
    # a constant (a number expression over config symbols and `layer`) that multiplies the whole residual stream after
    # the layer's last step, where it is not 1 (RWKV's inference rescale: 0.5 after every rescale_every-th layer)
    stream_scale: Optional[Num] = None
    # the checkpoint prefix of layer `layer`'s parameters, with `{<expression>}` placeholders over config symbols and
    # `layer` (`"model.layers.{layer % 4}."`): layers whose prefixes are equal run the same weights (the first holds
    # them; each keeps its own KV cache slot and state), read from the checkpoint under that prefix. Looped decoders
    # (a block of layers run several times, a layer stack run in cycles)
    stored_as: Optional[StrictStr] = None


class PerLayerInput(Strict):
    """A second input of every layer computed once from the token ids and the embedding output (Gemma 4's per-layer
    embeddings): `e = embed_tokens_per_layer(ids) * embed_scale` and `p = per_layer_projection_norm(
    per_layer_model_projection(h0) * project_scale)`, both `[tokens, layers, dim]` (h0 the scaled embedding output),
    combined `(p + e) * combine_scale`; layer i reads slice i (an `mlp` with `multiply: per_layer_input`)."""
    vocab: Dim                 # rows of embed_tokens_per_layer
    dim: Dim                   # each layer's width
    embed_scale: Num
    project_scale: Num
    combine_scale: Num
    norm: NormBlock            # per_layer_projection_norm, over `dim`
    enabled: Flag = True       # where the per-layer input exists (its parameters too)


class Deepstack(Strict):
    """Qwen3-VL: deepstack level k is added at visual-token rows after a decoder layer. Give one of:
    `after_layers: [0, 1, 2]` (level k after layer after_layers[k], fixed by the spec) or
    `levels: n` (after layers 0..n-1; n a literal or an int config symbol known from the checkpoint,
    rendered as a loop bound)."""
    after_layers: Optional[List[StrictInt]] = None
    levels: Optional[Dim] = None


class EmbedProjection(Strict):
    """A linear projection between the embedding's width and the residual stream's (OPT's `project_in`, embedding ->
    residual, and `project_out`, residual -> LM head), replicated on every rank; it exists where `enabled` holds (a
    flag: literal, bool symbol or expression over symbols, e.g. `"word_embed_proj_dim != hidden_size"`)."""
    in_: Dim = Field(alias="in")
    out: Dim
    bias: Flag = False
    enabled: Flag = True


class HeadTransform(Strict):
    """The LM head's input transform, BERT's prediction head: `norm(act(dense(x)))` after the final norm (and any
    `project_out`), before the LM head projection (ModernBERT decoder's `lm_head`: dense -> GELU -> LayerNorm). Module
    `head_transform` of the decoder: `dense` a replicated linear `[out, in]` (+ bias), `norm` a norm of width `out`."""
    in_: Dim = Field(alias="in")
    out: Dim
    bias: Flag = False
    activation: StrictStr
    norm: Optional[NormBlock] = None


class Decoder(Strict):
    # module path of the decoder in the model and in the checkpoint. `weights` keys and `from` names of
    # decoder tensors are written `model.<rest>`; with another prefix they mean `<prefix>.<rest>` (so a spec
    # that moves the decoder, e.g. Qwen3-VL's model.language_model, reuses its base's `weights` as they are)
    prefix: StrictStr = "model"
    embed_tokens: EmbeddingBlock
    embed_positions: Optional[PositionEmbeddingBlock] = None   # absolute positions added to the embedding
    embed_norm: Optional[NormBlock] = None   # a norm of the embedding output, before the first layer (Bloom)
    layers: Layers
    norm: Optional[NormBlock] = None     # the final norm (it also adds the last residual); absent: the plain add
    # the final norm exists where this flag holds (OPT: only in its pre-LN form); elsewhere the last residual is
    # added without a norm
    norm_enabled: Flag = True
    # the residual stream kept in float32 (transformers' residual_in_fp32: Mamba, Mamba-2): each layer's step norm reads
    # it cast to the model dtype, the final norm in float32. A flag (a bool symbol: decided by the checkpoint); only
    # with plain `{norm, block}` steps of RMSNorms and a final RMSNorm
    residual_float32: Flag = False
    # embedding width -> residual width, after the embedding (and its scale), before position embeddings are added
    project_in: Optional[EmbedProjection] = None
    # residual width -> the LM head's width, after the final norm
    project_out: Optional[EmbedProjection] = None
    # dense -> act -> norm between the final norm (and project_out) and the LM head (BERT's prediction head)
    head_transform: Optional[HeadTransform] = None
    deepstack: Optional[Deepstack] = None
    # a per-layer second input of the layers (Gemma 4's per-layer embeddings), above
    per_layer_input: Optional[PerLayerInput] = None
    # hyper-connections: the streams' final collapse (a `hyper_connection` without `post`), before `norm`; with it every
    # step of the layers is a `{hyper: HC, ...}` step and the residual stream is `streams` parallel streams
    hyper_head: Optional[HyperConnectionBlock] = None
    # rewrites of the residual stream before chosen layers, with values carried across layers (looped / cycled
    # decoders, with `layers.stored_as`): codegen/schema/schedule.py
    schedule: Optional[Schedule] = None
