"""The whole model: the runner hints (`RunnerIR`), per-variant sizes and TP tables (`RankTableIR`, `VariantIR`),
the embedding projection and head transform (`ProjectionIR`, `HeadTransformIR`) and `ModelIR`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from .attention import AttentionIR
from .blocks import EmbeddingIR, NormIR, PositionEmbeddingIR
from .config import ConfigFieldIR
from .layers import ChoiceIR, LayerIR, LMHeadIR
from .params import ParamIR, WeightIR
from .values import Size, Value
from .vision import VisionIR


@dataclass(frozen=True)
class RunnerIR:
    """What the generated runner specializes (derived from the model; deployment is engine options)."""
    position_kind: str            # rope | mrope
    multimodal: bool = False
    deepstack_levels_field: Optional[str] = None   # the Config field with the number of deepstack levels


@dataclass(frozen=True)
class RankTableIR:
    """Per-rank view of one variant at one tensor-parallel size."""
    tp: int
    heads_per_rank: Tuple[Tuple[str, int, int], ...]     # (attention block, q heads, kv heads) per rank
    params: Tuple[Tuple[str, Tuple[int, ...], int], ...]  # (param, per-rank shape, numel), layer params once
    layer_numel: int
    total_numel: int
    # (param, segment, checkpoint rows, rows over all ranks): the widths padded with zero rows to split (an MLP's
    # intermediate that the TP size does not divide; runtime/executor/sharding.py)
    padded: Tuple[Tuple[str, str, int, int], ...] = ()


@dataclass(frozen=True)
class VariantIR:
    name: str
    values: Tuple[Tuple[str, Any], ...]                   # every config symbol, defaults filled in
    tied: bool
    layers: int


@dataclass(frozen=True)
class ProjectionIR:
    """decoder.project_in / project_out: a replicated linear between the embedding's and the residual's widths."""
    name: str                     # project_in | project_out
    in_: Size
    out: Size
    bias: Value
    enabled: Value                # where it exists (a literal true: always)


@dataclass(frozen=True)
class PerLayerInputIR:
    """decoder.per_layer_input: (norm(proj(h0) * project_scale) + embed_per_layer(ids) * embed_scale) * combine_scale,
    [tokens, layers * dim]; layer i reads columns [i * dim, (i + 1) * dim)."""
    vocab: Size
    dim: Size
    layers: Size
    hidden: Size
    embed_scale: Value
    project_scale: Value
    combine_scale: Value
    norm: NormIR
    enabled: Value


@dataclass(frozen=True)
class HeadTransformIR:
    """decoder.head_transform: norm(act(dense(x))) before the LM head (a replicated linear, an activation, a norm)."""
    in_: Size
    out: Size
    bias: Value
    activation: Value
    norm: Optional[NormIR] = None


@dataclass(frozen=True)
class ModelIR:
    name: str
    spec_path: str                # relative to the repository (or cwd)
    spec_files: Tuple[str, ...]   # the spec and those it extends
    description: str
    class_prefix: str
    architectures: Tuple[str, ...]
    config: Tuple[ConfigFieldIR, ...]
    embed: EmbeddingIR
    layer: LayerIR
    norm: Optional[NormIR]        # None: the last residual is added without a norm
    lm_head: LMHeadIR
    deepstack_after: Tuple[int, ...]
    params: Tuple[ParamIR, ...]
    weights: Tuple[WeightIR, ...]  # in parameter order
    ignored: Tuple[str, ...]
    runner: RunnerIR
    tp_sizes: Tuple[int, ...]
    variants: Tuple[VariantIR, ...]
    decoder_prefix: str = "model"
    deepstack_levels: Optional[Size] = None    # deepstack after layers 0..levels-1 (a loop bound)
    vision: Optional[VisionIR] = None
    spec_file: str = ""                                # absolute path of the spec (where its project is)
    checkpoint_renames: Tuple[Tuple[str, str], ...] = ()   # (regex, replacement) over checkpoint tensor names
    config_assume: Tuple[Tuple[str, Any], ...] = ()   # config.json path -> the value the spec assumes
    config_ignore: Tuple[str, ...] = ()                # config.json paths (patterns) that do not change the math
    config_defaults: Tuple[Tuple[str, Any], ...] = ()  # assumed path -> transformers' default when it is absent
    embed_positions: Optional[PositionEmbeddingIR] = None   # absolute positions added to the embedding
    embed_norm: Optional[NormIR] = None                     # a norm of the embedding output (Bloom)
    norm_enabled: Value = Value(literal=True)               # where the final norm exists
    residual_float32: Value = Value(literal=False)          # the residual stream in float32
    project_in: Optional[ProjectionIR] = None               # embedding width -> residual width
    project_out: Optional[ProjectionIR] = None              # residual width -> LM head width
    head_transform: Optional[HeadTransformIR] = None        # dense -> act -> norm before the LM head
    per_layer_input: Optional[PerLayerInputIR] = None      # a per-layer second input of the layers (Gemma 4)
    hyper_head: Optional[Any] = None       # HyperIR: the residual streams' final collapse (hyper-connections)
    schedule: Optional[Any] = None         # ScheduleIR: rewrites of the stream before chosen layers (looped decoders)

    @property
    def model_class(self) -> str:
        return f"{self.class_prefix}ForConditionalGeneration" if self.vision else f"{self.class_prefix}ForCausalLM"

    @property
    def text_model_class(self) -> str:
        return f"{self.class_prefix}Model" if self.decoder_prefix == "model" else f"{self.class_prefix}TextModel"

    @property
    def decoder_attr(self) -> str:
        """The decoder's attribute in the container `model` ('' when the decoder is `model` itself)."""
        return "" if self.decoder_prefix == "model" else self.decoder_prefix.split(".", 1)[1]

    @property
    def decoder_path(self) -> str:
        """The decoder module as an expression on the top-level model (self.model, self.model.language_model)."""
        return "self." + self.decoder_prefix

    @property
    def derived_config(self) -> Tuple[ConfigFieldIR, ...]:
        return tuple(f for f in self.config if f.derived)

    @property
    def read_config(self) -> Tuple[ConfigFieldIR, ...]:
        return tuple(f for f in self.config if not f.derived)

    @property
    def weights_before_layers(self) -> Tuple[WeightIR, ...]:
        first = next((i for i, w in enumerate(self.weights) if w.param.per_layer), len(self.weights))
        return tuple(w for w in self.weights[:first] if not w.param.only_if_untied)

    @property
    def weights_after_layers(self) -> Tuple[WeightIR, ...]:
        first = next((i for i, w in enumerate(self.weights) if w.param.per_layer), len(self.weights))
        return tuple(w for w in self.weights[first:] if not w.param.per_layer and not w.param.only_if_untied)

    @property
    def deepstack_is_prefix(self) -> bool:
        """Deepstack after layers 0, 1, ..., k-1 (Qwen3-VL): rendered as one enumerate loop."""
        return self.deepstack_after == tuple(range(len(self.deepstack_after)))

    @property
    def choices(self) -> Tuple[ChoiceIR, ...]:
        out = []
        for s in self.layer.all_steps:
            for st in getattr(s, "branches", (s,)):
                if st.choice is not None:
                    out.append(st.choice)
        return tuple(out)

    def config_source(self, symbol: str) -> str:
        """The config.json path a symbol reads first (its name for a derived symbol), for messages."""
        for f in self.config:
            if f.name == symbol:
                return f.paths[0] if f.paths else symbol
        return symbol

    def choice_of(self, block: str) -> Optional[Tuple[ChoiceIR, str]]:
        """(the choice, its module name) when `block` is an alternative of a per-layer choice."""
        for s in self.layer.all_steps:
            for st in getattr(s, "branches", (s,)):
                if st.choice is not None and block in st.choice.alternatives:
                    return st.choice, st.block
        return None

    def choice_mixed(self, module: str) -> bool:
        """The per-layer choice that builds `module` has alternatives of different inputs (positions or not)."""
        return any(st.mixed_input for s in self.layer.all_steps for st in getattr(s, "branches", (s,))
                   if st.choice is not None and st.block == module)

    @property
    def attention_blocks(self) -> Tuple[AttentionIR, ...]:
        return tuple(b for b in self.layer.blocks if isinstance(b, AttentionIR))
