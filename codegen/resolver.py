"""Spec -> frozen IR. All cross-field checks live here (this class and its resolver_*.py mixins), and point at the offending node.

Checks: symbols exist and have the right type; block and module names; the decoder dataflow references
real blocks and uses each once; every parameter the blocks create has exactly one `weights` entry with a
fitting sharding rule, and every entry names a real parameter; fused sources match the block's segments;
tied lm_head consistent with the embedding; graph buckets; each variant (types, heads % kv_heads,
mRoPE sections, deepstack layers); divisibility for every declared tensor-parallel size and variant.
"""
from __future__ import annotations

import dataclasses
import keyword
from typing import Any, Dict, List, Optional, Tuple

from .ir import (
    AllOf,
    AttentionIR,
    ConfigFieldIR,
    EmbeddingIR,
    LayerIR,
    ModelIR,
    NormIR,
    ParamIR,
    RunnerIR,
    Size,
    Value,
    VisionIR,
)
from .loader import LoadedSpec
from .resolver_blocks import ACTIVATIONS, GATED_ACTIVATIONS, BlockResolver, _is_int, _maybe  # noqa: F401
from .resolver_config import HF_ROPE_TYPES, ROPE_TYPES, ConfigResolver  # noqa: F401
from .resolver_dataflow import DataflowResolver
from .resolver_heads import HeadResolver
from .resolver_layer import ATTENTION_IRS, LayerResolver  # noqa: F401
from .resolver_ple import PerLayerInputResolver
from .resolver_positions import PositionsResolver
from .resolver_schedule import ScheduleResolver
from .resolver_symbols import _IDENT, SymbolResolver
from .resolver_variants import MAX_LAYERS, MAX_SIZE, VariantResolver, _is_num, _type_ok  # noqa: F401
from .resolver_vision import VisionResolver
from .resolver_weights import WeightsResolver
from .schema import (
    AssumeAnyOf,
    Spec,
)
from .yaml_loader import display_path

# The spec decides what a model takes: with a `vision` section images, without one text only. A text-only spec may
# not claim a class that takes images: a name with one of transformers' image-text suffixes (Qwen3-VL, Gemma 3, LLaVA)
# that transformers registers in one of its multimodal auto mappings. Remote-code text decoders use the suffix too
# (ChatGLMForConditionalGeneration), and transformers registers them nowhere: what their spec says holds.
MULTIMODAL_SUFFIXES = ("ForConditionalGeneration", "ForImageTextToText", "ForVision2Seq")
MULTIMODAL_MAPPINGS = ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
                       "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES")   # the last: transformers 4's name of the first
# variants are a family's published checkpoints; each is checked statically, the TP sizes on a meta model each
MAX_VARIANTS = 64


def multimodal_registration(arch: str) -> Optional[str]:
    """Why `arch` takes images ("transformers' <mapping>['<model_type>']"), or None where it is not known to: a name
    without a multimodal suffix is never looked up (transformers' tables are imported for the suffixed ones only)."""
    if not arch.endswith(MULTIMODAL_SUFFIXES):
        return None
    try:
        from transformers.models.auto import modeling_auto
    except Exception:  # noqa: BLE001 - no tables to ask: the spec decides, so that a compile (and --check) never
        return None    # depends on whether transformers imports here (a suffix alone refused ChatGLM's text decoder)
    for table in MULTIMODAL_MAPPINGS:
        for model_type, names in getattr(modeling_auto, table, {}).items():
            if arch in ((names,) if isinstance(names, str) else tuple(names)):
                return f"transformers' {table}['{model_type}']"
    return None


class _Resolver(SymbolResolver, ConfigResolver, LayerResolver, HeadResolver, BlockResolver, VisionResolver,
                DataflowResolver, WeightsResolver, PositionsResolver, VariantResolver, PerLayerInputResolver,
                ScheduleResolver):
    def __init__(self, loaded: LoadedSpec):
        self.spec: Spec = loaded.spec
        self.tree = loaded.tree
        self.layouts_to_check: list = []   # (path, where, segments, per, branch) of `weights` row layouts, checked per variant
        self.smap = loaded.tree.smap
        self.config: Dict[str, ConfigFieldIR] = {}
        self.positives: List[Tuple[tuple, Value]] = []   # (path, value) that must be > 0 in every variant
        self.divisors: List[Tuple[tuple, Value]] = []    # (path, symbol) an expression divides by: > 0 at load
        self.below: List[Tuple[tuple, Value, float]] = []  # (path, value, bound): value < bound in every variant
        self.sizes: List[Tuple[tuple, Any]] = []         # (path, size) of every symbolic size: 1..MAX_SIZE

    # ---- sections ---------------------------------------------------------------------------------
    def resolve(self) -> ModelIR:
        s = self.spec
        if self.smap.value(("name",)).file != display_path(self.tree.files[0]) and len(self.tree.files) > 1:
            raise self.err(("name",), f"`name` is inherited ('{s.name}'): a spec that extends another must set "
                                      f"its own name (it picks the output folder generated/<name>/)")
        self.ident(("name",), s.name, "spec name")
        self.ident(("class_prefix",), s.class_prefix, "class prefix")
        if not s.architectures:
            raise self.err(("architectures",), "architectures: list at least one config.json architecture")
        for arch in s.architectures if s.vision is None else ():
            why = multimodal_registration(arch)
            if why is not None:
                raise self.err(("architectures",), f"architectures: {arch} is a multimodal architecture (it takes "
                                                   f"images: {why}): the spec needs its `vision` tower; a text-only "
                                                   f"decoder is served as *ForCausalLM", at_key=True)
        self.resolve_config()

        d = s.decoder
        ep = ("decoder", "embed_tokens")
        if d.embed_tokens.scale_dtype != "model" and d.embed_tokens.scale is None:
            raise self.err(ep + ("scale_dtype",), "decoder.embed_tokens.scale_dtype: there is no `scale` to round")
        embed = EmbeddingIR("embed_tokens", self.dim(ep + ("vocab",), d.embed_tokens.vocab),
                            self.dim(ep + ("dim",), d.embed_tokens.dim),
                            self.positive(ep + ("scale",), d.embed_tokens.scale)
                            if d.embed_tokens.scale is not None else None, d.embed_tokens.scale_dtype)
        project_in = self.resolve_projection("project_in", d.project_in) if d.project_in is not None else None
        if project_in is not None and str(project_in.in_) != str(embed.dim):
            raise self.err(("decoder", "project_in", "in"), f"decoder.project_in.in: is {project_in.in_}, but the "
                                                            f"embedding's width is {embed.dim} (decoder.embed_tokens.dim)")
        # the residual stream's width: the embedding's, or project_in's output
        stream = embed if project_in is None else dataclasses.replace(embed, dim=project_in.out)
        embed_positions = self.resolve_embed_positions(stream) if d.embed_positions is not None else None
        embed_norm = self.resolve_embed_norm(stream) if d.embed_norm is not None else None
        layer = self.resolve_layer()
        norm = self.resolve_norm(("decoder", "norm"), "norm", d.norm) if d.norm is not None else None
        if norm is None and d.norm_enabled is not True:
            raise self.err(("decoder", "norm_enabled"), "decoder.norm_enabled: there is no decoder.norm", at_key=True)
        norm_enabled = self.flag(("decoder", "norm_enabled"), d.norm_enabled)
        residual_float32 = self.flag(("decoder", "residual_float32"), d.residual_float32)
        if residual_float32.literal is not False:
            self.check_residual_float32(layer, norm, norm_enabled, d)
        project_out = self.resolve_projection("project_out", d.project_out) if d.project_out is not None else None
        if project_out is not None and str(project_out.in_) != str(stream.dim):
            raise self.err(("decoder", "project_out", "in"), f"decoder.project_out.in: is {project_out.in_}, but the "
                                                             f"residual stream's width is {stream.dim}")
        lm_head = self.resolve_lm_head(embed)
        head_transform = None
        if d.head_transform is not None:
            head_transform = self.resolve_head_transform(d.head_transform, project_out.out if project_out else stream.dim,
                                                         lm_head)
        self.check_widths(stream, layer, norm)
        hyper_head = self.resolve_hyper_head()
        self.check_hyper(layer, hyper_head, stream.dim)
        self.prefix = self.resolve_prefix()
        schedule = self.resolve_schedule(stream.dim, layer)
        deepstack, levels = (), None
        if d.deepstack:
            dsp = ("decoder", "deepstack")
            if (d.deepstack.after_layers is None) == (d.deepstack.levels is None):
                raise self.err(dsp, "decoder.deepstack: give one of `after_layers: [0, 1, ...]` or `levels: <n or "
                                    "config symbol>` (after layers 0..n-1)", at_key=True)
            if d.deepstack.levels is not None:
                levels = self.dim(dsp + ("levels",), d.deepstack.levels)
            else:
                deepstack = tuple(d.deepstack.after_layers)
                dp = dsp + ("after_layers",)
                if not deepstack:
                    raise self.err(dp, "decoder.deepstack.after_layers: list at least one layer index")
                if list(deepstack) != sorted(set(deepstack)) or deepstack[0] < 0:
                    raise self.err(dp, "decoder.deepstack.after_layers: layer indices must be >= 0, sorted and unique")
        vision = self.resolve_vision(levels) if s.vision else None
        per_layer_input = self.resolve_per_layer_input(stream, layer)

        params = self.collect_params(embed, layer, norm, lm_head, norm_enabled)
        if per_layer_input is not None:
            params = params[:1] + self.per_layer_input_params(per_layer_input) + params[1:]
        if layer.output_scale is not None:      # after the layers' blocks, before the final norm
            at = next((i for i, p in enumerate(params) if not p.name.startswith(f"{self.prefix}.layers.")
                       and i > 0 and params[i - 1].name.startswith(f"{self.prefix}.layers.")), len(params))
            params = params[:at] + self.output_scale_params(layer) + params[at:]
        for proj in (project_out, project_in):
            if proj is not None:
                params = params[:1] + self.projection_params(proj) + params[1:]
        if embed_positions is not None and embed_positions.kind == "learned":
            params = params[:1] + (self.position_param(embed_positions),) + params[1:]
        if embed_norm is not None:
            params = params[:1] + tuple(self.block_params(f"{self.prefix}.embed_norm", "decoder.embed_norm", embed_norm,
                                                          False)) + params[1:]
        if head_transform is not None:     # before the LM head's own parameters
            at = next((i for i, p in enumerate(params) if p.name.startswith("lm_head.")), len(params))
            params = params[:at] + self.head_transform_params(head_transform) + params[at:]
        if hyper_head is not None:         # after the layers, before the final norm and the LM head
            at = next((i for i, p in enumerate(params) if p.name.startswith((f"{self.prefix}.norm.", "lm_head."))),
                      len(params))
            params = params[:at] + tuple(self.block_params(f"{self.prefix}.hyper_head", "decoder.hyper_head",
                                                           hyper_head, False)) + params[at:]
        if schedule is not None:           # after the layers, before the final norm and the LM head
            at = next((i for i, p in enumerate(params) if p.name.startswith((f"{self.prefix}.norm.", "lm_head."))),
                      len(params))
            params = params[:at] + self.schedule_params(schedule) + params[at:]
        weights = self.resolve_weights(params)
        self.check_prefixes(params)
        if vision:
            vparams = self.vision_params(vision)
            vision = dataclasses.replace(vision, weights=self.resolve_weights(vparams, ("vision", "weights")))
            params = params + vparams
        ignored = self.resolve_ignored()
        renames = self.resolve_renames()
        self.check_defaults()
        self.imply_bounds()
        runner = self.resolve_runner(layer, vision, levels)
        tp_sizes = self.resolve_tp()
        if len(s.variants) > MAX_VARIANTS:
            raise self.err(("variants",), f"variants: {len(s.variants)} variants; at most {MAX_VARIANTS} (each is "
                                          f"checked statically: list the family's published checkpoints)",
                           at_key=True)
        variants = tuple(self.resolve_variant_located(name, layer, lm_head, params, tp_sizes, deepstack, levels,
                                                      vision, embed) for name in s.variants)
        for v in variants:
            self.check_layout_variant(v.name, dict(v.values))
            self.check_projection_variant(v.name, dict(v.values), embed, stream, project_in, project_out, lm_head,
                                          head_transform is not None)
        return ModelIR(
            name=s.name, spec_path=display_path(self.tree.files[0]),
            spec_files=tuple(display_path(f) for f in self.tree.files), description=s.description.strip(),
            class_prefix=s.class_prefix, architectures=tuple(s.architectures), config=tuple(self.config.values()),
            embed=embed, layer=layer, norm=norm, lm_head=lm_head, deepstack_after=deepstack, params=params,
            weights=weights, ignored=ignored, checkpoint_renames=renames, runner=runner, tp_sizes=tp_sizes, variants=variants,
            decoder_prefix=self.prefix, deepstack_levels=levels, vision=vision,
            spec_file=str(self.tree.files[0]), config_assume=tuple((k, {'any_of': list(v.any_of)} if isinstance(v, AssumeAnyOf) else v)
                                 for k, v in s.config_assume.items()), config_ignore=tuple(s.config_ignore),
            config_defaults=tuple(s.config_defaults.items()), embed_positions=embed_positions,
            embed_norm=embed_norm, norm_enabled=norm_enabled, project_in=project_in, project_out=project_out,
            residual_float32=residual_float32, head_transform=head_transform, per_layer_input=per_layer_input,
            hyper_head=hyper_head, schedule=schedule)

    def check_residual_float32(self, layer, norm, norm_enabled, d) -> None:
        """decoder.residual_float32: every residual step a plain `{norm: N, block: B}` (post_norm / scale allowed) with
        N an RMSNorm, and a final RMSNorm that always exists (the float32 stream is added only by those norms)."""
        p = ("decoder", "residual_float32")
        blocks = {b.name: b for b in layer.blocks}
        if norm is None or norm.kind != "rmsnorm" or norm_enabled.literal is not True:
            raise self.err(p, "decoder.residual_float32: needs a final `decoder.norm` of kind rmsnorm (always enabled)")
        if d.deepstack or d.embed_norm or d.project_out:
            raise self.err(p, "decoder.residual_float32: not with deepstack, embed_norm or project_out")
        for s in layer.all_steps:
            if hasattr(s, "branches") or getattr(s, "after_norm", None) or not s.norm \
                    or blocks[s.norm].kind != "rmsnorm" or not blocks[s.norm].always:
                raise self.err(p, "decoder.residual_float32: every residual step must be `{norm: N, block: B}` with N "
                                  "an rmsnorm on every layer (no parallel steps, no steps without a norm, no after_norm)")

    # ---- module paths -----------------------------------------------------------------------------
    def resolve_prefix(self) -> str:
        """The decoder's module path: `model`, or `model.<name>` beside a vision tower `model.<other>`."""
        s = self.spec
        pp = ("decoder", "prefix")
        prefix = s.decoder.prefix
        parts = prefix.split(".")
        if parts[0] != "model" or len(parts) > 2 or any(not _IDENT.match(p) or keyword.iskeyword(p) for p in parts):
            raise self.err(pp, f"decoder.prefix: '{prefix}' is not `model` or `model.<name>`")
        if s.vision:
            vp = ("vision", "prefix")
            vparts = s.vision.prefix.split(".")
            if len(parts) != 2:
                raise self.err(pp, "decoder.prefix: with a vision tower the decoder lives beside it in the container "
                                   "`model`: write `model.<name>` (e.g. model.language_model)")
            if vparts[0] != "model" or len(vparts) != 2 or not _IDENT.match(vparts[1]) or keyword.iskeyword(vparts[1]):
                raise self.err(vp, f"vision.prefix: '{s.vision.prefix}' is not `model.<name>`")
            if vparts[1] == parts[1]:
                raise self.err(vp, f"vision.prefix: '{s.vision.prefix}' is also the decoder's prefix")
        return prefix

    def rename(self, name: str) -> str:
        """A decoder tensor written `model.<rest>` in `weights` is `<decoder.prefix>.<rest>`."""
        if self.prefix != "model" and name.startswith("model."):
            return self.prefix + name[len("model"):]
        return name

    # ---- parameters and weights -------------------------------------------------------------------
    def collect_params(self, embed, layer, norm, lm_head, norm_enabled=None) -> Tuple[ParamIR, ...]:
        out: List[ParamIR] = []
        pre = self.prefix
        out.append(ParamIR(f"{pre}.embed_tokens.weight", "decoder.embed_tokens", (embed.vocab, embed.dim), "vocab",
                           vocab=embed.vocab))
        module_of, when_of = {}, {}
        for s in layer.all_steps:
            for st in getattr(s, "branches", (s,)):
                if st.choice is not None:
                    for b in st.choice.alternatives:
                        module_of[b], when_of[b] = st.block, st.choice.when(b)
        for b, in_then in layer.only_in:      # a block that one dataflow of a `dataflow: {if: ...}` uses
            when_of[b] = (layer.alt_cond, in_then)
        for b in layer.blocks:                # a block of a branch that runs on some layers only
            w = layer.branch_when(b.name)
            if w is not None:                 # (a per-layer choice's alternative: both conditions)
                when_of[b.name] = (AllOf((when_of[b.name], (w, True))), True) if b.name in when_of else (w, True)
        for b in layer.blocks:
            ps = self.block_params(f"{pre}.layers.{{i}}.{module_of.get(b.name, b.name)}", f"decoder.layers.blocks.{b.name}",
                                   b, True)
            if isinstance(b, NormIR) and b.enabled.literal is not True:   # a norm absent on some layers
                if b.name in when_of:
                    raise self.err(("decoder", "layers", "blocks", b.name, "enabled"),
                                   f"decoder.layers.blocks.{b.name}.enabled: a norm that one dataflow uses only is "
                                   f"not also enabled per layer", at_key=True)
                ps = [dataclasses.replace(p, when=(b.enabled, True)) for p in ps]
            if b.name in when_of:                # the choice's condition, and the parameter's own where it has one
                w = when_of[b.name]
                ps = [dataclasses.replace(p, when=w if p.when is None else (AllOf((w, p.when)), True)) for p in ps]
            out += ps
        if norm is not None:
            ps = self.block_params(f"{pre}.norm", "decoder.norm", norm, False)
            if norm_enabled is not None and norm_enabled.literal is not True:
                ps = [dataclasses.replace(p, when=(norm_enabled, True)) for p in ps]
            out += ps
        if lm_head.tie.literal is not True:
            out.append(ParamIR("lm_head.weight", "lm_head", (lm_head.vocab, lm_head.dim), "vocab", vocab=lm_head.vocab,
                               only_if_untied=lm_head.tie.symbol))
        if _maybe(lm_head.bias):              # never tied: the embedding has no bias
            out.append(ParamIR("lm_head.bias", "lm_head", (lm_head.vocab,), "vocab", vocab=lm_head.vocab))
        return tuple(out)

    def resolve_runner(self, layer: LayerIR, vision: Optional[VisionIR], levels) -> RunnerIR:
        """What the generated runner specializes, derived from the model (deployment is engine options)."""
        mrope = any(isinstance(b, AttentionIR) and b.rotary is not None and b.rotary.kind.startswith("mrope") for b in layer.blocks)
        field = None
        if vision is not None and levels is not None:
            field = levels.symbol if isinstance(levels, Size) else None
            if field is None:
                raise self.err(("decoder", "deepstack", "levels"),
                               "decoder.deepstack.levels: a multimodal runner reads the number of levels from "
                               "Config: name a config symbol, e.g. `levels: deepstack_levels`")
        return RunnerIR("mrope" if mrope else "rope", vision is not None, field)

    def resolve_tp(self) -> Tuple[int, ...]:
        sizes = self.spec.tensor_parallel.sizes
        tp = ("tensor_parallel", "sizes")
        for i, n in enumerate(sizes):
            if n < 1:
                raise self.err(tp + (i,), f"tensor_parallel.sizes[{i}]: must be >= 1, got {n}")
            if n in sizes[:i]:
                raise self.err(tp + (i,), f"tensor_parallel.sizes[{i}]: {n} is listed twice")
        return tuple(sizes)


_SHARD_WORDS = {"colwise": "column-parallel", "rowwise": "row-parallel", "vocab": "vocab-parallel",
                "replicated": "replicated"}


def resolve(loaded: LoadedSpec) -> ModelIR:
    return _Resolver(loaded).resolve()
