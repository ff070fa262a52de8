"""Spec -> frozen IR. All cross-field checks live here, in one place, and point at the offending node.

Checks: symbols exist and have the right type; block and module names; the decoder dataflow references
real blocks and uses each once; every parameter the blocks create has exactly one `weights` entry with a
fitting sharding rule, and every entry names a real parameter; fused sources match the block's segments;
tied lm_head consistent with the embedding; graph buckets; each variant (types, heads % kv_heads,
mRoPE sections, deepstack layers); divisibility for every declared tensor-parallel size and variant.
"""
from __future__ import annotations

import dataclasses
import keyword
import math
import re
from typing import Any, Dict, List, Optional, Tuple

from .errors import SpecError, did_you_mean
from .expr import Expr, ExprError, is_symbol
from .expr import parse as parse_expr
from .ir import (
    MLAIR,
    MLPIR,
    MLSTMIR,
    RGLRUIR,
    WKVIR,
    AllOf,
    AttentionIR,
    BranchStepIR,
    ChannelMixIR,
    ChoiceIR,
    ConfigFieldIR,
    EmbeddingIR,
    GatedDeltaNetIR,
    GatedMLPIR,
    HeadTransformIR,
    LayerIR,
    LightningIR,
    LMHeadIR,
    Mamba2IR,
    MambaIR,
    ModelIR,
    MoEIR,
    NormIR,
    ParamIR,
    ProjectionIR,
    ResidualGateIR,
    RunnerIR,
    ShortConvIR,
    Size,
    StepIR,
    Value,
    VisionIR,
)
from .loader import LoadedSpec
from .schema import (
    BranchStep,
    Choice,
    DataflowChoice,
    ParallelStep,
    RMSNormBlock,
    Select,
    Spec,
)
from .yaml_loader import display_path

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
from .resolver_blocks import ACTIVATIONS, GATED_ACTIVATIONS, BlockResolver, _is_int, _maybe  # noqa: F401

# the attention block kinds (they take the positions)
ATTENTION_IRS = (AttentionIR, MLAIR, GatedDeltaNetIR, Mamba2IR, MambaIR, ShortConvIR, RGLRUIR, LightningIR,
                 WKVIR, MLSTMIR)   # (a recurrent mixer takes them too; most ignore them, rg_lru resets at position 0)
from .resolver_dataflow import DataflowResolver
from .resolver_ple import PerLayerInputResolver
from .resolver_positions import PositionsResolver
from .resolver_schedule import ScheduleResolver
from .resolver_variants import MAX_LAYERS, MAX_SIZE, VariantResolver, _is_num, _type_ok  # noqa: F401
from .resolver_vision import VisionResolver
from .resolver_weights import WeightsResolver

# rope types as transformers names them (modeling_rope_utils); the runtime Rotary computes each
# transformers' rope_type names (what config.json carries) -> the rotary primitive's scaling kinds
# (runtime/rope_kinds.py); a spec's `type: rope` symbol lists the names it models.
HF_ROPE_TYPES = {"default": "default", "linear": "linear", "dynamic": "dynamic", "yarn": "yarn",
                 "llama3": "frequency_bands", "longrope": "longrope", "proportional": "proportional"}
ROPE_TYPES = tuple(HF_ROPE_TYPES)

# transformers' name suffixes of image-text models (Qwen3-VL, Gemma 3, LLaVA, ...): such a spec has a vision
# tower; a text-only decoder is served as *ForCausalLM
MULTIMODAL_SUFFIXES = ("ForConditionalGeneration", "ForImageTextToText", "ForVision2Seq")
# variants are a family's published checkpoints; each is checked statically, the TP sizes on a meta model each
MAX_VARIANTS = 64


class _Resolver(BlockResolver, VisionResolver, DataflowResolver, WeightsResolver, PositionsResolver,
                VariantResolver, PerLayerInputResolver, ScheduleResolver):
    def __init__(self, loaded: LoadedSpec):
        self.spec: Spec = loaded.spec
        self.tree = loaded.tree
        self.layouts_to_check: list = []   # (path, where, param, per) of `weights` row layouts, checked per variant
        self.smap = loaded.tree.smap
        self.config: Dict[str, ConfigFieldIR] = {}
        self.positives: List[Tuple[tuple, Value]] = []   # (path, value) that must be > 0 in every variant
        self.below: List[Tuple[tuple, Value, float]] = []  # (path, value, bound): value < bound in every variant
        self.sizes: List[Tuple[tuple, Any]] = []         # (path, size) of every symbolic size: 1..MAX_SIZE

    # ---- helpers ----------------------------------------------------------------------------------
    def err(self, path, message: str, at_key: bool = False) -> SpecError:
        loc = self.smap.key(tuple(path)) if at_key else self.smap.value(tuple(path))
        return SpecError(message, loc)

    def _where(self, path) -> str:
        out = ""
        for p in path:
            out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
        return out

    def symbol(self, path, name: str, types: Tuple[str, ...]) -> ConfigFieldIR:
        field = self.config.get(name)
        if field is None:
            raise self.err(path, f"{self._where(path)}: unknown config symbol '{name}'"
                                 f"{did_you_mean(name, self.config)}; symbols are the keys of `config`")
        if field.type not in types:
            raise self.err(path, f"{self._where(path)}: config symbol '{name}' is {field.type}, "
                                 f"expected {' or '.join(types)}")
        return field

    def expr(self, path, source: str, per_layer: bool = False) -> Expr:
        """A spec expression over config symbols (and `layer` where per_layer), parsed and checked."""
        try:
            e = parse_expr(source)
        except ExprError as exc:
            raise self.err(path, f"{self._where(path)}: {exc}") from None
        for n in e.names:
            if n == "layer" and per_layer:
                continue
            if n == "layer":
                raise self.err(path, f"{self._where(path)}: `layer` (the layer index) is only defined for "
                                     f"per-layer values of decoder layer blocks")
            if n not in self.config:
                raise self.err(path, f"{self._where(path)}: unknown config symbol '{n}'"
                                     f"{did_you_mean(n, self.config)}; symbols are the keys of `config`")
        return e

    def dim(self, path, value, per_layer: bool = False):
        if isinstance(value, str):
            if is_symbol(value):
                self.symbol(path, value, ("int",))
                size = Size.of(value)
            else:
                size = self.expr(path, value, per_layer)
            self.sizes.append((path, size))
            return size
        if value <= 0:
            raise self.err(path, f"{self._where(path)}: a size must be positive, got {value}")
        if value > MAX_SIZE:
            raise self.err(path, f"{self._where(path)}: a size must be at most 2**31 - 1, got {value}")
        return Size.of(value)

    def num(self, path, value, per_layer: bool = False, optional: bool = False) -> Value:
        if isinstance(value, str):
            if is_symbol(value):
                f = self.symbol(path, value, ("float", "int"))
                if f.optional and not optional:
                    raise self.err(path, f"{self._where(path)}: config symbol '{value}' is optional (may be "
                                         f"None), which this field does not admit")
                return Value(symbol=value)
            return Value(expr=self.expr(path, value, per_layer))
        if not math.isfinite(value):
            raise self.err(path, f"{self._where(path)}: must be finite, got {value}")
        return Value(literal=value)

    def positive(self, path, value, per_layer: bool = False, optional: bool = False,
                 below: Optional[float] = None) -> Value:
        """A number that must be > 0 (eps, theta, scale, soft-cap), and < `below` when given (eps < 1):
        literals checked here, symbols and expressions for every variant (and at load, by the symbol's
        bounds)."""
        v = self.num(path, value, per_layer, optional)
        if v.expr is None and v.symbol is None and v.literal <= 0:
            raise self.err(path, f"{self._where(path)}: must be > 0, got {v.literal}")
        if below is not None and v.expr is None and v.symbol is None and v.literal >= below:
            raise self.err(path, f"{self._where(path)}: must be < {below}, got {v.literal}")
        self.positives.append((path, v))
        if below is not None:
            self.below.append((path, v, below))
        return v

    def flag(self, path, value, per_layer: bool = False) -> Value:
        if isinstance(value, str):
            if is_symbol(value):
                self.symbol(path, value, ("bool",))
                return Value(symbol=value)
            return Value(expr=self.expr(path, value, per_layer))
        return Value(literal=value)

    def ident(self, path, name: str, what: str, at_key: bool = False) -> str:
        if not _IDENT.match(name) or keyword.iskeyword(name):
            raise self.err(path, f"{self._where(path)}: {what} '{name}' is not a valid Python identifier",
                           at_key=at_key)
        return name

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
        multimodal = [a for a in s.architectures if a.endswith(MULTIMODAL_SUFFIXES)]
        if multimodal and s.vision is None:
            suffix = next(x for x in MULTIMODAL_SUFFIXES if multimodal[0].endswith(x))
            raise self.err(("architectures",), f"architectures: {multimodal[0]} is a multimodal architecture (a "
                                               f"*{suffix} takes images): the spec needs its `vision` tower; a "
                                               f"text-only decoder is served as *ForCausalLM", at_key=True)
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
            self.check_projection_variant(v.name, dict(v.values), embed, stream, project_in, project_out, lm_head)
        return ModelIR(
            name=s.name, spec_path=display_path(self.tree.files[0]),
            spec_files=tuple(display_path(f) for f in self.tree.files), description=s.description.strip(),
            class_prefix=s.class_prefix, architectures=tuple(s.architectures), config=tuple(self.config.values()),
            embed=embed, layer=layer, norm=norm, lm_head=lm_head, deepstack_after=deepstack, params=params,
            weights=weights, ignored=ignored, checkpoint_renames=renames, runner=runner, tp_sizes=tp_sizes, variants=variants,
            decoder_prefix=self.prefix, deepstack_levels=levels, vision=vision,
            spec_file=str(self.tree.files[0]), config_assume=tuple(s.config_assume.items()), config_ignore=tuple(s.config_ignore),
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

    def resolve_config(self) -> None:
        pending = []
        for name, f in self.spec.config.items():
            path = ("config", name)
            self.ident(path, name, "config symbol", at_key=True)
            if name in ("layer", "config") or name in ("len", "min", "max", "int", "float", "bool", "range"):
                raise self.err(path, f"config.{name}: '{name}' is reserved in spec expressions", at_key=True)
            if f.values is not None:
                if f.type not in ("str", "rope"):
                    raise self.err(path + ("values",), f"config.{name}.values: only str and rope symbols take values")
                if not f.values or len(set(f.values)) != len(f.values):
                    raise self.err(path + ("values",), f"config.{name}.values: list the admitted values, each once")
                if f.type == "rope":
                    for i, v in enumerate(f.values):
                        if v not in ROPE_TYPES:
                            raise self.err(path + ("values", i), f"config.{name}.values[{i}]: unknown rope type "
                                                                 f"'{v}'{did_you_mean(v, ROPE_TYPES)}; known: "
                                                                 f"{', '.join(ROPE_TYPES)}")
            elif f.type == "rope":
                raise self.err(path, f"config.{name}: a rope symbol lists the rope types the spec models: "
                                     f"`values: [default, ...]`", at_key=True)
            for key in ("min", "max"):
                bound = getattr(f, key)
                if bound is not None and (f.type not in ("int", "float") or not math.isfinite(bound)):
                    raise self.err(path + (key,), f"config.{name}.{key}: bounds are finite numbers of int / float "
                                                  f"symbols")
            if f.guard and f.values is None and f.min is None and f.max is None:
                raise self.err(path + ("guard",), f"config.{name}.guard: a guard-only symbol restricts its field: give "
                                                  f"`values`, `min` or `max` (a fixed value is `config_assume`)")
            if f.expr is not None:
                if f.from_ is not None or f.default is not None or f.default_expr is not None:
                    raise self.err(path + ("expr",), f"config.{name}: a derived symbol (`expr`) reads no config.json "
                                                     f"field: drop `from` / `default`")
                pending.append((name, f, path))
                self.config[name] = ConfigFieldIR(name, f.type, (), None, False, f.doc.strip(), expr=True,
                                                  optional=f.optional, values=tuple(f.values) if f.values else None,
                                                  bounds=(f.min, f.max), guard=f.guard)
                continue
            if f.from_ is None:
                raise self.err(path, f"config.{name}: missing required key 'from' (or `expr` for a derived "
                                     f"symbol)", at_key=True)
            paths = (f.from_,) if isinstance(f.from_, str) else tuple(f.from_)
            # a `*` part (not first, not last) reads every key of a mapping, which must all hold one value (transformers'
            # per_layer_config.<layer>.head_dim)
            if not paths or any(not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\.([A-Za-z_][A-Za-z0-9_]*|\*))*$", p)
                                or p.endswith(".*") for p in paths):
                raise self.err(path + ("from",), f"config.{name}.from: give one or more dotted config.json paths")
            if f.default is not None and f.default_expr is not None:
                raise self.err(path + ("default_expr",), f"config.{name}: give `default` or `default_expr`, not both")
            default = f.default
            if default is not None:
                if not _type_ok(f.type, default):
                    raise self.err(path + ("default",), f"config.{name}.default: {default!r} is not {f.type}")
                if f.type == "float":
                    default = float(default)
                if f.type.endswith("_tuple"):
                    default = tuple(default)
            has_default = default is not None or f.optional or f.default_expr is not None or f.type == "rope"
            if f.default_expr is not None:
                pending.append((name, f, path))
            self.config[name] = ConfigFieldIR(
                name, f.type, paths, default, has_default, f.doc.strip(),
                values=tuple(f.values) if f.values else None, optional=f.optional, bounds=(f.min, f.max),
                guard=f.guard)
            if default is not None:
                self.check_value(path + ("default",), f"config.{name}.default", self.config[name], default)
        for name, f, path in pending:       # expressions may name symbols declared after them
            key = "expr" if f.expr is not None else "default_expr"
            e = self.expr(path + (key,), getattr(f, key))
            if name in e.names:
                raise self.err(path + (key,), f"config.{name}.{key}: a symbol cannot refer to itself")
            self.config[name] = dataclasses.replace(self.config[name], **{"expr" if key == "expr" else "default_expr":
                                                                          e})
        self.check_cycles()
        self.resolve_guard()

    def check_defaults(self) -> None:
        """A literal `default` of a symbol used as a size, or as a positive number (eps, theta, scale, ...), is
        in range: a checkpoint without the field gets it, whatever the variants set."""
        def bad(sym, ok, what):
            f = self.config.get(sym) if sym else None
            if f is None or f.default is None or isinstance(f.default, (tuple, dict, str, bool)):
                return
            if not ok(f.default):
                raise self.err(("config", sym, "default"), f"config.{sym}.default: {f.default!r}; {what}")

        for _, size in self.sizes:
            bad(getattr(size, "symbol", None) if isinstance(size, Size) else None,
                lambda x: _is_int(x) and 0 < x <= MAX_SIZE, "it is used as a size (an int in 1..2**31-1)")
        for _, v in self.positives:
            bad(v.symbol, lambda x: _is_num(x) and x > 0, "it is used where a number must be > 0")
        for _, v, bound in self.below:
            bad(v.symbol, lambda x, b=bound: _is_num(x) and x < b, f"it is used where a number must be < {bound}")

    def imply_bounds(self) -> None:
        """An int symbol read from config.json and used as a size gets the bounds [1, 2**31-1] (narrowed by
        its own min / max), checked when a checkpoint is loaded: a config.json with a zero or negative size
        is refused naming the field, before any tensor is built."""
        for _, size in self.sizes:
            sym = getattr(size, "symbol", None) if isinstance(size, Size) else None
            f = self.config.get(sym) if sym else None
            if f is None or f.derived or f.type != "int":
                continue
            lo, hi = f.bounds
            bounds = (1 if lo is None else max(lo, 1), MAX_SIZE if hi is None else min(hi, MAX_SIZE))
            if bounds != tuple(f.bounds):
                self.config[sym] = dataclasses.replace(f, bounds=bounds)
        # a number used where it must be > 0 (norm eps, rope theta, scales, soft-caps): a config.json with 0 or
        # a negative value is refused naming the field, instead of serving NaN or a silently wrong model
        for _, v in self.positives:
            sym = getattr(v, "symbol", None)
            f = self.config.get(sym) if sym else None
            if f is not None and not f.derived and f.type in ("int", "float") and not f.positive:
                self.config[sym] = dataclasses.replace(f, positive=True)

    def check_cycles(self) -> None:
        """Derived symbols and default expressions form no cycle."""
        deps = {n: set((f.expr or f.default_expr).names) if (f.expr or f.default_expr) else set()
                for n, f in self.config.items()}
        state: Dict[str, int] = {}

        def visit(n, chain):
            if state.get(n) == 2:
                return
            if state.get(n) == 1:
                raise self.err(("config", n), f"config.{n}: expressions form a cycle: {' -> '.join(chain + [n])}",
                               at_key=True)
            state[n] = 1
            for d in sorted(deps.get(n, ())):
                visit(d, chain + [n])
            state[n] = 2

        for n in self.config:
            visit(n, [])

    def check_value(self, path, where: str, f: ConfigFieldIR, value, at_key: bool = False) -> None:
        """A str / rope value against the symbol's admitted values, and numbers against its bounds."""
        if f.values and value is not None:
            v = value.get("rope_type", value.get("type", "default")) if isinstance(value, dict) else value
            if v not in f.values:
                raise self.err(path, f"{where}: {v!r} is not one of the values the spec models: "
                                     f"{', '.join(f.values)}", at_key=at_key)
        lo, hi = f.bounds
        if value is not None and ((lo is not None and value < lo) or (hi is not None and value > hi)):
            raise self.err(path, f"{where}: {value!r} is outside [{lo}, {hi}]", at_key=at_key)

    def resolve_guard(self) -> None:
        """config_assume / config_ignore: the fields the spec does not read are declared."""
        read = {p for f in self.config.values() for p in f.paths}
        for key, value in self.spec.config_assume.items():
            path = ("config_assume", key)
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$", key):
                raise self.err(path, f"config_assume: '{key}' is not a dotted config.json path", at_key=True)
            if key in read:
                raise self.err(path, f"config_assume.{key}: this field is read by a config symbol; a field is "
                                     f"either read or assumed", at_key=True)
        for key in self.spec.config_defaults:
            if key not in self.spec.config_assume:
                where = "read by a config symbol: state its default with the symbol's `default`" if key in read \
                    else "not in config_assume: list the value the spec assumes there"
                raise self.err(("config_defaults", key), f"config_defaults.{key}: this field is {where}", at_key=True)
        for i, pat in enumerate(self.spec.config_ignore):
            if not pat or not re.match(r"^[A-Za-z0-9_.*?\[\]]+$", pat):
                raise self.err(("config_ignore", i), f"config_ignore[{i}]: '{pat}' is not a dotted path pattern")

    def resolve_norm(self, path, name, b, context: str = "decoder") -> NormIR:
        """A norm block. `context`: "layer" (a decoder layer's block: `enabled` may be per layer), "decoder" (the
        final / embedding / head-transform norm: always there; `decoder.norm_enabled` is the final norm's flag), or
        "vision" (literal bias only)."""
        eps = self.positive(path + ("eps",), b.eps, below=1.0)
        if b.enabled is not True:
            if context != "layer":
                hint = " (the final norm's flag is decoder.norm_enabled)" if path == ("decoder", "norm") else ""
                raise self.err(path + ("enabled",), f"{self._where(path)}.enabled: only a decoder layer's norm may be "
                                                    f"absent on some layers{hint}", at_key=True)
        enabled = self.rotary_enabled(path + ("enabled",), b.enabled) if context == "layer" else Value(literal=True)
        if enabled.literal is False:
            raise self.err(path + ("enabled",), f"{self._where(path)}.enabled: false: delete the norm (a step without "
                                                f"a norm reads the residual stream)")
        bias_flag = None
        if not isinstance(b.bias, bool):
            if context == "vision":
                raise self.err(path + ("bias",), f"{self._where(path)}.bias: a vision norm's bias is a literal bool")
            bias_flag = self.flag(path + ("bias",), b.bias)
        bias = b.bias if isinstance(b.bias, bool) else True
        if not math.isfinite(b.weight_offset):
            raise self.err(path + ("weight_offset",), f"{self._where(path)}.weight_offset: must be finite")
        if b.weight_offset and not b.weight:
            raise self.err(path + ("weight_offset",), f"{self._where(path)}.weight_offset: a norm without a "
                                                      f"weight (weight: false) has no weight to offset")
        kind = "rmsnorm" if isinstance(b, RMSNormBlock) else "layernorm"
        gate_rank, gate_enabled = None, Value(literal=True)
        if getattr(b, "gate", None) is not None:
            gp = path + ("gate",)
            if context != "layer":
                raise self.err(gp, f"{self._where(gp)}: only a decoder layer's norm may have a gate", at_key=True)
            if enabled.literal is not True or bias_flag is not None or bias or not b.weight or b.weight_offset:
                raise self.err(gp, f"{self._where(gp)}: a gated norm is a plain RMSNorm with a weight (no bias, "
                                   f"weight_offset or per-layer `enabled`)", at_key=True)
            gate_rank = self.dim(gp + ("rank",), b.gate.rank)
            gate_enabled = self.rotary_enabled(gp + ("enabled",), b.gate.enabled)
            if gate_enabled.literal is False:
                raise self.err(gp + ("enabled",), f"{self._where(gp)}.enabled: false: delete the gate")
        return NormIR(kind, name, self.dim(path + ("dim",), b.dim), eps, bias,
                      weight_offset=float(b.weight_offset), weight=b.weight, enabled=enabled, bias_flag=bias_flag,
                      gate_rank=gate_rank, gate_enabled=gate_enabled)

    def resolve_layer(self) -> LayerIR:
        L = self.spec.decoder.layers
        base = ("decoder", "layers")
        count = self.dim(base + ("count",), L.count)
        blocks = {}
        kinds_seen: Dict[str, int] = {}
        group = {"gated_mlp": "mlp"}      # both kinds' classes are <prefix>MLP when alone: one name space
        for b in L.blocks.values():
            kinds_seen[group.get(b.kind, b.kind)] = kinds_seen.get(group.get(b.kind, b.kind), 0) + 1
        for name, b in L.blocks.items():
            path = base + ("blocks", name)
            self.ident(path, name, "block name", at_key=True)
            blocks[name] = self.resolve_block(path, name, b,
                                              unique_kind=kinds_seen[group.get(b.kind, b.kind)] == 1)
        steps, used = [], {}

        def step(st, sp, where, shared_norm_ok=()):
            mixers = ("attention", "mla_attention", "gated_delta_net", "mamba2", "mamba", "short_conv", "rg_lru",
                      "lightning_attention", "wkv", "channel_mix", "mlstm", "gated_mlp", "mlp", "moe")
            choice = None
            # a per-layer expression may read `layer` (MiniMax's per-layer-type beta factors)
            scale = self.num(sp + ("scale",), st.scale, per_layer=True) if st.scale is not None else None
            in_scale = self.num(sp + ("input_scale",), st.input_scale) if st.input_scale is not None else None
            res_scale = (self.num(sp + ("residual_scale",), st.residual_scale, per_layer=True)
                         if getattr(st, "residual_scale", None) is not None else None)
            normed = getattr(st, "residual", "stream") == "normed"
            if normed and (st.norm is None or getattr(st, "add", None) is not None or st.after_norm is not None):
                raise self.err(sp + ("residual",), f"{where}.residual: the stream becomes the normed input of a step "
                                                   f"with a `norm` (no add / after_norm)")
            if res_scale is not None and (st.after_norm is not None or getattr(st, "hyper", None) is not None):
                # residual: stream: x = residual_scale * x + scale * h (Beam's depth-scaled adds)
                raise self.err(sp + ("residual_scale",), f"{where}.residual_scale: scales the stream that the step's "
                                                         f"output joins (not after_norm, nor hyper)")
            if in_scale is not None and st.norm is None:
                raise self.err(sp + ("input_scale",), f"{where}.input_scale: scales the normed input of a step with a "
                                                      f"`norm` (a step without one reads the residual stream itself)")
            when = None
            if getattr(st, "when", None) is not None:     # the step runs only where it holds
                if not isinstance(st.block, str) or st.after_norm is not None or getattr(st, "add", None):
                    raise self.err(sp + ("when",), f"{where}.when: a step `{{norm: N, block: B}}` or `{{block: B}}` "
                                                   f"(no per-layer choice, after_norm or add)")
                when = Value(expr=self.expr(sp + ("when",), st.when, per_layer=True))
            if isinstance(st.block, Choice):
                c = st.block
                roles = [("norm", st.norm, ("rmsnorm", "layernorm")), (("block", "then"), c.then, mixers),
                         (("block", "else"), c.else_, mixers)]
                cond = self.expr(sp + ("block", "if"), c.if_, per_layer=True)
                module = self.ident(sp + ("block", "name"), c.name or c.else_, "module name")
                if module in blocks and module not in (c.then, c.else_):
                    raise self.err(sp + ("block", "name"), f"{where}.block.name: '{module}' is another block's name")
                choice = ChoiceIR(Value(expr=cond), c.then, c.else_)
            elif isinstance(st.block, Select):
                c = st.block
                if len(c.cases) < 2:
                    raise self.err(sp + ("block", "cases"), f"{where}.block.cases: list two or more cases")
                roles = [("norm", st.norm, ("rmsnorm", "layernorm"))]
                roles += [(("block", "cases", v), b, mixers) for v, b in c.cases.items()]
                sel = self.expr(sp + ("block", "select"), c.select, per_layer=True)
                cases = []
                for v, b in c.cases.items():
                    if b in [x for _, x, _ in cases]:
                        raise self.err(sp + ("block", "cases", v), f"{where}.block.cases.{v}: block '{b}' is already "
                                                                   f"another case's; each case names its own block")
                    cases.append((v, b, self.expr(sp + ("block", "select"), f"({c.select}) == {v!r}", per_layer=True)))
                first = next(iter(c.cases.values()))
                module = self.ident(sp + ("block", "name"), c.name or first, "module name")
                if module in blocks and module not in c.cases.values():
                    raise self.err(sp + ("block", "name"), f"{where}.block.name: '{module}' is another block's name")
                choice = ChoiceIR(Value(expr=sel), cases=tuple(cases))
            else:
                roles = [("norm", st.norm, ("rmsnorm", "layernorm")), ("block", st.block, mixers)]
                module = st.block
            if st.norm is None:
                roles = roles[1:]
            if st.post_norm is not None:
                roles.append(("post_norm", st.post_norm, ("rmsnorm", "layernorm")))
            if getattr(st, "hyper", None) is not None:
                roles.append(("hyper", st.hyper, ("hyper_connection",)))
            if getattr(st, "gate", None) is not None:      # x = residual(w) * x + branch(w) * h
                if st.after_norm is not None or getattr(st, "hyper", None) is not None:
                    raise self.err(sp + ("gate",), f"{where}.gate: gates the residual add of a step with a residual "
                                                   f"stream (not after_norm, whose stream is normalized, nor hyper)")
                roles.append(("gate", st.gate, ("residual_gate",)))
            if st.after_norm is not None:
                if st.norm is not None:
                    raise self.err(sp + ("after_norm",), f"{where}.after_norm: a post-LN step normalizes the residual "
                                                         f"stream after the add; its block reads the stream (no `norm`)")
                roles.append(("after_norm", st.after_norm, ("rmsnorm", "layernorm")))
            for role, ref, kinds in roles:
                rp = sp + (role if isinstance(role, tuple) else (role,))
                role = ".".join(role) if isinstance(role, tuple) else role
                if ref not in blocks:
                    raise self.err(rp, f"{where}.{role}: no block '{ref}' in "
                                       f"decoder.layers.blocks{did_you_mean(ref, blocks)}")
                if blocks[ref].kind not in kinds:
                    raise self.err(rp, f"{where}.{role}: block '{ref}' is "
                                       f"{blocks[ref].kind}, expected {' or '.join(kinds)}")
                # a norm may be shared by the branches of one parallel step, and by a branch op and a step
                # (both read the same stream: LongCat-Flash's shortcut MoE and its first MLP)
                if ref in used and not (role == "norm" and (ref in shared_norm_ok or norm_uses.get(ref) == "branch")):
                    raise self.err(rp, f"{where}.{role}: block '{ref}' is already "
                                       f"used by {used[ref]}; each block is used once")
                used[ref] = where
                if role == "norm":
                    norm_uses.setdefault(ref, "step")
            add = None
            if getattr(st, "add", None) is not None:
                if st.add not in values:
                    raise self.err(sp + ("add",), f"{where}.add: no branch value '{st.add}' before this step"
                                                  f"{did_you_mean(st.add, values) if values else ''}")
                if st.norm is None or st.after_norm is not None or choice is not None:
                    raise self.err(sp + ("add",), f"{where}.add: a branch value is added to the input of a step "
                                                  f"`{{norm: N, block: B}}` (no after_norm, no per-layer choice)")
                add = st.add
            join = getattr(st, "join", None)
            if join is not None:
                if join not in values:
                    raise self.err(sp + ("join",), f"{where}.join: no branch value '{join}' before this step"
                                                   f"{did_you_mean(join, values) if values else ''}")
                if st.after_norm is not None or choice is not None or getattr(st, "residual", "stream") != "stream":
                    raise self.err(sp + ("join",), f"{where}.join: a branch value joins the output of a plain residual "
                                                   f"step (no after_norm, no per-layer choice, residual: stream)")
            if choice is not None:
                if not choice.cases and choice.then == choice.else_:
                    raise self.err(sp + ("block", "then"), f"{where}.block: `then` and `else` name the same block")
                takes = {isinstance(blocks[b], ATTENTION_IRS) for b in choice.alternatives}
                # alternatives of different inputs (positions + hidden vs hidden): a per-layer flag in the layer
                return StepIR(st.norm, module, takes == {True}, st.post_norm, choice, scale, st.after_norm,
                              mixed_input=len(takes) > 1, input_scale=in_scale, residual_normed=normed,
                              residual_scale=res_scale, hyper=getattr(st, "hyper", None),
                              gate=getattr(st, "gate", None))
            return StepIR(st.norm, st.block, isinstance(blocks[st.block], ATTENTION_IRS), st.post_norm, None, scale,
                          st.after_norm, add=add, input_scale=in_scale, residual_normed=normed,
                          residual_scale=res_scale, join=join, join_optional=join in optional_values, when=when,
                          hyper=getattr(st, "hyper", None), gate=getattr(st, "gate", None))

        def branch_step(st, sp, where):
            b = st.branch
            bp = sp + ("branch",)
            name = self.ident(bp + ("name",), b.name, "branch name")
            if name in ("residual", "embeddings") or name in values or name in blocks:
                raise self.err(bp + ("name",), f"{where}.branch.name: '{name}' is already a value or block name")
            if not b.input:
                raise self.err(bp + ("input",), f"{where}.branch.input: list one or more values")
            for j, v in enumerate(b.input):
                if v not in ("residual", "embeddings") and v not in values:
                    raise self.err(bp + ("input", j), f"{where}.branch.input[{j}]: '{v}' is not `residual`, "
                                                      f"`embeddings` or an earlier branch's name")
            if not b.steps:
                raise self.err(bp + ("steps",), f"{where}.branch.steps: list one or more operations")
            ops = []
            for j, op in enumerate(b.steps):
                op_p, op_w = bp + ("steps", j), f"{where}.branch.steps[{j}]"
                roles = ([("norm", op.norm, ("rmsnorm", "layernorm"))] if op.norm is not None else []) + \
                    [("block", op.block, ("attention", "mla_attention", "gated_mlp", "mlp", "moe", "linear"))]
                for role, ref, kinds in roles:
                    if ref not in blocks:
                        raise self.err(op_p + (role,), f"{op_w}.{role}: no block '{ref}' in "
                                                       f"decoder.layers.blocks{did_you_mean(ref, blocks)}")
                    if blocks[ref].kind not in kinds:
                        raise self.err(op_p + (role,), f"{op_w}.{role}: block '{ref}' is {blocks[ref].kind}, "
                                                       f"expected {' or '.join(kinds)}")
                    if ref in used and not (role == "norm" and norm_uses.get(ref) == "step"):
                        raise self.err(op_p + (role,), f"{op_w}.{role}: block '{ref}' is already used by "
                                                       f"{used[ref]}; each block is used once")
                    used[ref] = op_w
                    if role == "norm":
                        norm_uses.setdefault(ref, "branch")
                ops.append(StepIR(op.norm, op.block, isinstance(blocks[op.block], ATTENTION_IRS)))
            when = Value(expr=self.expr(bp + ("when",), b.when, per_layer=True)) if b.when is not None else None
            values.append(name)
            if when is not None:
                optional_values.add(name)
            return BranchStepIR(name, tuple(b.input), tuple(ops), when)

        df = L.dataflow
        if isinstance(df, DataflowChoice):     # one dataflow or the other, by the checkpoint's config
            flows = [(df.else_, base + ("dataflow", "else"), "decoder.layers.dataflow.else"),
                     (df.then, base + ("dataflow", "then"), "decoder.layers.dataflow.then")]
        else:
            flows = [(df, base + ("dataflow",), "decoder.layers.dataflow")]
        resolved, all_used = [], {}
        for flow, fp, fw in flows:
            steps, used, values, norm_uses, optional_values = [], {}, [], {}, set()
            for i, st in enumerate(flow):
                sp = fp + (i,)
                if isinstance(st, BranchStep):
                    steps.append(branch_step(st, sp, f"{fw}[{i}]"))
                elif isinstance(st, ParallelStep):
                    steps.append(self.parallel_step(st, sp, f"{fw}[{i}]", step, blocks, used))
                else:
                    steps.append(step(st, sp, f"{fw}[{i}]"))
            if not steps:
                raise self.err(fp, f"{fw}: list at least one residual step")
            resolved.append((tuple(steps), set(used)))
            all_used.update(used)
        for name in blocks:
            if name not in all_used:
                raise self.err(base + ("blocks", name), f"decoder.layers.blocks.{name}: block is never used by "
                                                        f"decoder.layers.dataflow", at_key=True)
        shared = []
        for bname, src in L.shared.items():
            sp = base + ("shared", bname)
            if bname not in blocks:
                raise self.err(sp, f"decoder.layers.shared: no block '{bname}' in decoder.layers.blocks"
                                   f"{did_you_mean(bname, blocks)}", at_key=True)
            shared.append((bname, Value(expr=self.expr(sp, src, per_layer=True))))
        out_scale = self.spec.decoder.layers.output_scale
        if out_scale is not None:
            op = ("decoder", "layers", "output_scale")
            self.ident(op, out_scale, "parameter name")
            if out_scale in blocks:
                raise self.err(op, f"decoder.layers.output_scale: '{out_scale}' is already a block of the layer")
        stream_scale = self.spec.decoder.layers.stream_scale
        if stream_scale is not None:
            stream_scale = self.num(("decoder", "layers", "stream_scale"), stream_scale, per_layer=True)
        layer = LayerIR(f"{self.spec.class_prefix}DecoderLayer", count, tuple(blocks.values()), resolved[0][0],
                        shared=tuple(shared), output_scale=out_scale, stream_scale=stream_scale,
                        stored_as=self.resolve_stored_as())
        if isinstance(df, DataflowChoice):
            layer = self.dataflow_choice(layer, df, resolved)
        return layer

    def resolve_projection(self, name: str, b) -> ProjectionIR:
        p = ("decoder", name)
        return ProjectionIR(name, self.dim(p + ("in",), b.in_), self.dim(p + ("out",), b.out),
                            self.flag(p + ("bias",), b.bias), self.flag(p + ("enabled",), b.enabled))

    def projection_params(self, proj: ProjectionIR) -> Tuple[ParamIR, ...]:
        """`<prefix>.<name>.weight [out, in]` (and `.bias [out]`), replicated; where `enabled` is not literally true
        they exist only in the checkpoints where it holds."""
        when = None if proj.enabled.literal is True else (proj.enabled, True)
        out = [ParamIR(f"{self.prefix}.{proj.name}.weight", f"decoder.{proj.name}", (proj.out, proj.in_),
                       "replicated", when=when)]
        if _maybe(proj.bias):
            out.append(ParamIR(f"{self.prefix}.{proj.name}.bias", f"decoder.{proj.name}", (proj.out,), "replicated",
                               when=when))
        return tuple(out)

    def both(self, when, inner):
        """The `when` of a parameter that exists where `when` holds and, inside its block, where `inner` holds."""
        if inner is None:
            return when
        (a, av), (b, bv) = when, inner
        text = f"({'' if av else 'not '}({a})) and ({'' if bv else 'not '}({b}))"
        return (Value(expr=self.expr(("decoder", "layers"), text, per_layer=True)), True)
    def resolve_head_transform(self, b, width, lm_head: LMHeadIR) -> HeadTransformIR:
        """decoder.head_transform: `in` is the width it reads (the residual stream's, or project_out's output), `out`
        the LM head's `dim`, its norm `out` wide."""
        p = ("decoder", "head_transform")
        ht = HeadTransformIR(self.dim(p + ("in",), b.in_), self.dim(p + ("out",), b.out), self.flag(p + ("bias",), b.bias),
                             self.activation(p + ("activation",), b.activation, ACTIVATIONS, "an activation"),
                             self.resolve_norm(p + ("norm",), "norm", b.norm) if b.norm is not None else None)
        if str(ht.in_) != str(width):
            raise self.err(p + ("in",), f"decoder.head_transform.in: is {ht.in_}, but it reads the width {width} (the "
                                        f"residual stream's, or decoder.project_out.out)")
        if str(ht.out) != str(lm_head.dim):
            raise self.err(p + ("out",), f"decoder.head_transform.out: is {ht.out}, but the LM head reads {lm_head.dim} "
                                         f"(lm_head.dim)")
        if ht.norm is not None and str(ht.norm.dim) != str(ht.out):
            raise self.err(p + ("norm", "dim"), f"decoder.head_transform.norm.dim: is {ht.norm.dim}, but the transform's "
                                                f"output is {ht.out} wide (decoder.head_transform.out)")
        return ht

    def head_transform_params(self, ht: HeadTransformIR) -> Tuple[ParamIR, ...]:
        """`<prefix>.head_transform.dense.weight [out, in]` (and `.bias`), its norm's weight / bias: replicated."""
        pre, blk = f"{self.prefix}.head_transform", "decoder.head_transform"
        out = [ParamIR(f"{pre}.dense.weight", blk, (ht.out, ht.in_), "replicated")]
        if _maybe(ht.bias):
            out.append(ParamIR(f"{pre}.dense.bias", blk, (ht.out,), "replicated"))
        if ht.norm is not None:
            out += self.block_params(f"{pre}.norm", blk + ".norm", ht.norm, False)
        return tuple(out)

    def check_widths(self, embed: EmbeddingIR, layer: LayerIR, norm: Optional[NormIR]) -> None:
        """Everything on the residual stream has its width (the embedding's, or decoder.project_in's output)."""
        checks = [(("decoder", "norm", "dim"), "decoder.norm.dim", norm.dim)] if norm is not None else []
        off_stream = {n for s in layer.all_steps if getattr(s, "value", None) is not None
                      for op in s.branches for n in (op.norm, op.block) if n}
        for b in layer.blocks:
            if b.name in off_stream:      # a branch's blocks: their widths are the branch's business
                continue
            bp = ("decoder", "layers", "blocks", b.name)
            if isinstance(b, NormIR):
                checks.append((bp + ("dim",), f"decoder.layers.blocks.{b.name}.dim", b.dim))
            elif isinstance(b, (AttentionIR, GatedMLPIR, MLPIR, MoEIR, MLAIR, GatedDeltaNetIR, Mamba2IR, MambaIR,
                                ShortConvIR, RGLRUIR, LightningIR, WKVIR, ChannelMixIR, MLSTMIR, ResidualGateIR)):
                checks.append((bp + ("hidden",), f"decoder.layers.blocks.{b.name}.hidden", b.hidden))
        for path, where, size in checks:
            if str(size) != str(embed.dim):
                raise self.err(path, f"{where}: is {size}, but the residual stream has the embedding's width "
                                     f"{embed.dim} (decoder.embed_tokens.dim)")

    def resolve_lm_head(self, embed: EmbeddingIR) -> LMHeadIR:
        h = self.spec.lm_head
        p = ("lm_head",)
        head = LMHeadIR("lm_head", self.dim(p + ("vocab",), h.vocab), self.dim(p + ("dim",), h.dim),
                        self.flag(p + ("tie",), h.tie),
                        self.positive(p + ("softcap",), h.softcap, optional=True) if h.softcap is not None else None,
                        self.positive(p + ("logit_scale",), h.logit_scale) if h.logit_scale is not None else None,
                        self.flag(p + ("bias",), h.bias))
        if head.tie.literal is not False and (str(head.vocab) != str(embed.vocab) or str(head.dim) != str(embed.dim)):
            # a tie decided per checkpoint may go with a head of another width (a pruned head): the generated model
            # refuses a tied checkpoint whose widths differ, and each variant that ties is checked here
            if head.tie.literal is True or str(head.dim) != str(embed.dim):
                raise self.err(p, f"lm_head: a tied head must have the embedding's shape: vocab {head.vocab} vs "
                                  f"{embed.vocab}, dim {head.dim} vs {embed.dim}", at_key=True)
        return head

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
            if w is not None:
                when_of[b.name] = (w, True)
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
