"""The top level: `Spec` (name, architectures, config, decoder, vision, weights, tensor parallel, variants), and
the block kinds the language has (`BLOCK_KINDS`)."""
from __future__ import annotations

from typing import Annotated, Dict, List, Literal, Optional, Union

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from .base import Scalar, Strict
from .config import ConfigField
from .decoder import Decoder, LMHeadBlock
from .vision import Vision
from .weights import WeightEntry


class AssumeAnyOf(Strict):
    """`config_assume: {gating: {any_of: [true, per-head]}}`: values that mean the same to transformers (which the
    spec models alike); a checkpoint with any other value is refused naming the field."""
    any_of: List[Union[StrictBool, StrictInt, StrictFloat, StrictStr, None]] = Field(min_length=1)


class TensorParallel(Strict):
    """The TP sizes the spec's shapes must allow, checked statically for every variant (the TP size a model
    is served with is an engine option)."""
    sizes: List[StrictInt]


class Spec(Strict):
    spec_version: Literal[2]                           # the language version: 2
    name: StrictStr                      # output package generated/<name>/ (a Python identifier)
    description: StrictStr = ""          # the generated model's docstring
    class_prefix: StrictStr              # generated class names: <prefix>Config, <prefix>Attention, <prefix>ForCausalLM
    architectures: List[StrictStr]       # config.json `architectures` this spec serves (one spec per architecture)
    config: Dict[StrictStr, ConfigField]  # config symbols: spec name -> how it is read from config.json
    # config.json fields that change the math but that the spec does not read, with the value it assumes
    # (a checkpoint with another value is refused); dotted paths
    # (a checkpoint with another value is refused); dotted paths; `{any_of: [...]}`: values transformers treats alike
    config_assume: Dict[StrictStr, Annotated[Union[AssumeAnyOf, Scalar], Field(union_mode="left_to_right")]] = {}
    # transformers' default of an assumed field (the value its config class fills in when config.json omits it,
    # e.g. partial_rotary_factor: 0.5): the guard compares the effective value with config_assume, so a checkpoint
    # without the field is refused where the family's default differs from what the spec assumes
    config_defaults: Dict[StrictStr, Scalar] = {}
    # config.json fields that do not change the math (fnmatch patterns over dotted paths); a checkpoint field
    # that is neither read, assumed, ignored nor a generic transformers field is refused at load
    config_ignore: List[StrictStr] = []
    decoder: Decoder                     # embedding, decoder layers (blocks + dataflow), final norm
    lm_head: LMHeadBlock                 # the output projection (tied or not)
    vision: Optional[Vision] = None      # a vision tower (multimodal models)
    # parameter name -> checkpoint tensor(s), only where they differ ({i} = layer index)
    weights: Dict[StrictStr, WeightEntry] = {}
    # parameter-name prefix -> checkpoint-name prefix, for every parameter without a `weights` entry (the longest
    # matching prefix wins): `{model.layers.: transformer.h., lm_head.: embed_out.}`
    checkpoint_prefixes: Dict[StrictStr, StrictStr] = {}
    ignore_checkpoint_tensors: List[StrictStr] = []  # regexes of checkpoint tensors that are not parameters
    # regex -> replacement: checkpoint tensor names rewritten at load by the first pattern that matches (re.sub,
    # once), before `weights` / `ignore_checkpoint_tensors` see them (transformers' conversion-mapping renames of an
    # original release: Kimi Linear's `{'\.block_sparse_moe\.': '.mlp.'}`); a list of n replacements splits the tensor
    # into n equal chunks of its first dim, the k-th read under the k-th name (transformers' Chunk(dim=0): HRM-Text's
    # fused `attn.gqkv_proj` read as gate / q / k / v)
    checkpoint_renames: Dict[StrictStr, Union[StrictStr, List[StrictStr]]] = {}
    tensor_parallel: TensorParallel      # TP sizes every variant's shapes must allow (a static check)
    # named config.json value sets (symbol -> value; others take their defaults) for static checks and --explain
    variants: Dict[StrictStr, Dict[StrictStr, Scalar]] = {}


BLOCK_KINDS = ("embedding", "rmsnorm", "layernorm", "linear", "fused_linear", "attention", "gated_mlp", "mlp", "moe", "lm_head",
               "mla_attention", "gated_delta_net", "mamba2", "mamba", "short_conv", "rg_lru",
               "lightning_attention", "hyper_connection", "residual_gate", "wkv", "channel_mix", "mlstm", "conv3d_patch_embed", "interpolated_pos_embed", "rotary_2d", "vision_attention", "vision_mlp",
               "patch_merger")
