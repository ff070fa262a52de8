"""The simple block kinds of a layer and their projections: `Projection`, `FusedProjection`, `MixerProjection`,
the embeddings, the norms (`rmsnorm`, `layernorm`) and the linears (`linear`, `fused_linear`)."""
from __future__ import annotations

from typing import Dict, List, Literal, Optional, Union

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from .base import Dim, Flag, Num, Strict


class Projection(Strict):
    """A linear projection inside a composite block; `name` is its module (and parameter) name. `scale`: its
    output (after the bias and any tensor-parallel reduction) is multiplied by it (muP multipliers: FalconH1's
    `attention_out_multiplier`-style down / out multipliers); attention `out`, MLP `up` / `down` take it."""
    name: StrictStr
    bias: Flag = False
    scale: Optional[Num] = None


class FusedProjection(Strict):
    """A fused projection: several named output segments stacked along the output dim, in the order of the
    block's forward split (attention: q, k, v; gated MLP: gate, up). `scale: {segment: number}`: those segments of
    the output are multiplied by their number (the others by 1) right after the projection (FalconH1's
    `key_multiplier` on k, its gate multiplier on gate)."""
    name: StrictStr
    segments: List[StrictStr]
    bias: Flag = False
    scale: Optional[Dict[StrictStr, Num]] = None


class MixerProjection(Strict):
    """A recurrent mixer's projection given as a mapping instead of a bare module name: `bias` (default: the
    block's `bias`) and `scale` (in_proj: `{segment: number}` per output segment; out: a number)."""
    name: StrictStr
    bias: Optional[Flag] = None
    scale: Optional[Union[Num, Dict[StrictStr, Num]]] = None


class EmbeddingBlock(Strict):
    """Vocab-parallel embedding; `scale` multiplies the output (Gemma: hidden_size ** 0.5, in the model dtype).
    `scale_dtype: bfloat16`: the scale is first rounded to bfloat16 (RecurrentGemma's `normalizer`, a bfloat16
    buffer whatever the model dtype); `model` (default): the model dtype."""
    kind: Literal["embedding"]
    vocab: Dim
    dim: Dim
    scale: Optional[Num] = None
    scale_dtype: Literal["model", "bfloat16"] = "model"


class PositionEmbeddingBlock(Strict):
    """Absolute position embeddings added to the token embedding (after its `scale`), before the first layer:
    `learned`: a table `[positions + offset, dim]` (parameter `embed_positions.weight`, replicated) read at row
    `position + offset` (GPT-2's wpe, OPT's offset 2); `sinusoidal`: the fixed fairseq table (sin of the first
    half of the dims, cos of the second; XGLM), computed, no parameter, read at `position + offset`.
    `frequencies` (sinusoidal only): `fairseq` f_j = 10000 ** (-j / (dim/2 - 1)) (XGLM); `transformer` the original
    Transformer's f_j = 10000 ** (-2j / dim) (CTRL). `zero_row` (sinusoidal only): a table row set to zeros, an int
    symbol or expression, None for none (transformers' padding_idx: XGLM zeroes row pad_token_id). `scale`: the
    position embedding is multiplied by it before it is added (Jais's mup_embeddings_scale, which scales
    wte + wpe). `enabled`: a flag, where the position embedding exists (Jais: learned positions or ALiBi per
    checkpoint); where it does not, no table and nothing added."""
    kind: Literal["learned", "sinusoidal"]
    positions: Dim
    dim: Dim
    offset: StrictInt = 0
    frequencies: Optional[Literal["fairseq", "transformer"]] = None
    zero_row: Optional[Union[StrictStr, StrictInt]] = None
    scale: Optional[Num] = None
    enabled: Flag = True


class NormGate(Strict):
    """A low-rank input-dependent sigmoid gate on a norm's output (A.X-K2's GatedRMSNorm, Megatron's
    GatedNormWrapper): y = norm(x); y * sigmoid(fc2(silu(fc1(y)))) with fc1 [rank, dim], fc2 [dim, rank] (no biases;
    the sigmoid in float32). Modules: `<norm>.norm` (the norm's weight), `<norm>.mlp.fc1`, `<norm>.mlp.fc2`.
    `enabled` (per layer, may read `layer`): the layers with the gate; the others have the plain norm (`<norm>.weight`)."""
    rank: Dim
    enabled: Flag = True


class RMSNormBlock(Strict):
    """y = x / rms(x) * w, or * (1 + w) with `weight_offset: 1` (Gemma); `bias: true` adds a learned bias b (a bool
    config symbol: only in the checkpoints that set it); `weight: false`: no weight, y = x / rms(x) computed in float32
    (NanoChat's parameter-free RMSNorm). `enabled` (a layer block only): a flag, per layer (may read `layer`): where it
    is false the norm is absent, the identity (no parameters; ModernBERT decoder's first layer: `"layer != 0"`)."""
    kind: Literal["rmsnorm"]
    dim: Dim
    eps: Num
    weight_offset: Union[StrictInt, StrictFloat] = 0
    bias: Flag = False
    weight: StrictBool = True
    enabled: Flag = True
    gate: Optional[NormGate] = None      # a low-rank sigmoid gate on the output (a decoder layer's norm only)


class LayerNormBlock(Strict):
    """y = (x - mean) / std * w + b. `weight_offset: 1` scales by (1 + w) (Nemotron's LayerNorm1P); `weight:
    false` and `bias: false` make it non-parametric (OLMo 1's LayerNorm: no parameters at all); `bias` may be a bool
    config symbol (ModernBERT's `norm_bias`). `enabled`: per layer, as an RMSNorm's. `center` (a flag, may be a
    config flag): false drops the mean subtraction, y = x / rms(x) * w (+ b), an RMSNorm computed in float32 and cast
    back before the weight, where a config chooses the norm's form (Cohere 2 MoE: RMSNorm where `rms_norm_eps` is
    set)."""
    kind: Literal["layernorm"]
    dim: Dim
    eps: Num
    bias: Flag = True
    weight: StrictBool = True
    weight_offset: Union[StrictInt, StrictFloat] = 0
    enabled: Flag = True
    center: Flag = True


class LinearBlock(Strict):
    """One linear `in -> out` (weight [out, in], `bias` optional), split as `parallel` says: an operation of a branch,
    or a residual step's block (in = out = the stream width; `row`: each rank multiplies its columns of the whole
    normed stream, one all-reduce; `replicated`; `column` refused there: its output would be a shard)."""
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


class ResidualGateBlock(Strict):
    """`residual_gate`: a learned per-channel gate on a step's residual add, `x = residual(w) * x + branch(w) * h`,
    `w` the block's parameter `weight [hidden]` (read in float32) and `branch` / `residual` elementwise formulas over
    it (codegen/gate_expr.py: numbers, `w`, + - * / **, sigmoid / softplus / exp / log / sqrt / tanh / abs). A step
    names it with `gate:`. Ergo's `attention_residual_gate`: branch `sigmoid(w)`, residual
    `sqrt(1 + sigmoid(w)) * exp(-softplus(w) / 2)`; Doge's `input_residual` gain: residual `w` (branch 1)."""
    kind: Literal["residual_gate"]
    hidden: Dim
    branch: Union[StrictStr, StrictInt, StrictFloat] = 1
    residual: Union[StrictStr, StrictInt, StrictFloat] = 1
