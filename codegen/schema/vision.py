"""The `vision` section: the vision tower's block kinds (patch embedding, position embedding, 2D rotary,
attention, MLP, patch merger), its layers and deepstack, and `Vision` itself."""
from __future__ import annotations

from typing import Annotated, Dict, List, Literal, Optional, Union

from pydantic import Field, StrictInt, StrictStr

from .base import Dim, Num, Strict
from .blocks import LayerNormBlock, RMSNormBlock
from .dataflow import ResidualStep
from .weights import WeightEntry


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
    taps: Union[List[StrictInt], StrictStr]
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
    weights: Dict[StrictStr, WeightEntry] = {}  # full tensor names; {i} is the block (or deepstack level) index
