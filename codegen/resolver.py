"""Spec -> frozen IR. All cross-field checks live here, in one place, and point at the offending node.

Checks: symbols exist and have the right type; block and module names; the decoder dataflow references
real blocks and uses each once; every parameter the blocks create has exactly one `weights` entry with a
fitting sharding rule, and every entry names a real parameter; fused sources match the block's segments;
tied lm_head consistent with the embedding; graph buckets; each variant (types, heads % kv_heads,
mRoPE sections, deepstack layers); divisibility for every declared tensor-parallel size and variant.
"""
from __future__ import annotations

import keyword
import re
from typing import Any, Dict, List, Optional, Tuple

from xllm_gen.runtime.sharding import Segment, check_segment, heads_per_rank, padded_vocab

from .errors import SpecError, did_you_mean
from .ir import (AttentionIR, ConfigFieldIR, EmbeddingIR, GatedMLPIR, LayerIR, LinearIR, LMHeadIR, ModelIR,
                 NormIR, ParamIR, RankTableIR, RotaryIR, RunnerIR, SegmentIR, Size, StepIR, Value, VariantIR,
                 WeightIR)
from .loader import LoadedSpec
from .schema import (AttentionBlock, FusedLinearBlock, GatedMLPBlock, LayerNormBlock, LinearBlock,
                     RMSNormBlock, Spec)
from .yaml_loader import display_path

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def default_buckets(max_batch: int) -> Tuple[int, ...]:
    """1, 2, 4, 8, then multiples of 16 up to max_batch."""
    small = [b for b in (1, 2, 4, 8) if b <= max_batch]
    return tuple(small + list(range(16, max_batch + 1, 16)))


def _type_ok(kind: str, value: Any) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    return isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


class _Resolver:
    def __init__(self, loaded: LoadedSpec):
        self.spec: Spec = loaded.spec
        self.tree = loaded.tree
        self.smap = loaded.tree.smap
        self.config: Dict[str, ConfigFieldIR] = {}

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

    def dim(self, path, value) -> Size:
        if isinstance(value, str):
            self.symbol(path, value, ("int",))
        elif value <= 0:
            raise self.err(path, f"{self._where(path)}: a size must be positive, got {value}")
        return Size.of(value)

    def num(self, path, value) -> Value:
        if isinstance(value, str):
            self.symbol(path, value, ("float", "int"))
            return Value(symbol=value)
        return Value(literal=value)

    def flag(self, path, value) -> Value:
        if isinstance(value, str):
            self.symbol(path, value, ("bool",))
            return Value(symbol=value)
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
        self.resolve_config()

        d = s.decoder
        embed = EmbeddingIR("embed_tokens", self.dim(("decoder", "embed_tokens", "vocab"), d.embed_tokens.vocab),
                            self.dim(("decoder", "embed_tokens", "dim"), d.embed_tokens.dim))
        layer = self.resolve_layer()
        norm = self.resolve_norm(("decoder", "norm"), "norm", d.norm)
        lm_head = self.resolve_lm_head(embed)
        self.check_widths(embed, layer, norm)
        deepstack = tuple(d.deepstack.after_layers) if d.deepstack else ()
        if d.deepstack:
            dp = ("decoder", "deepstack", "after_layers")
            if not deepstack:
                raise self.err(dp, "decoder.deepstack.after_layers: list at least one layer index")
            if list(deepstack) != sorted(set(deepstack)) or deepstack[0] < 0:
                raise self.err(dp, "decoder.deepstack.after_layers: layer indices must be >= 0, sorted and unique")

        params = self.collect_params(embed, layer, norm, lm_head)
        weights = self.resolve_weights(params)
        ignored = self.resolve_ignored()
        runner = self.resolve_runner(layer)
        tp_sizes = self.resolve_tp()
        variants = tuple(self.resolve_variant(name, layer, lm_head, params, tp_sizes, deepstack)
                         for name in s.variants)
        return ModelIR(
            name=s.name, spec_path=display_path(self.tree.files[0]),
            spec_files=tuple(display_path(f) for f in self.tree.files), description=s.description.strip(),
            class_prefix=s.class_prefix, architectures=tuple(s.architectures), config=tuple(self.config.values()),
            embed=embed, layer=layer, norm=norm, lm_head=lm_head, deepstack_after=deepstack, params=params,
            weights=weights, ignored=ignored, runner=runner, tp_sizes=tp_sizes, variants=variants)

    def resolve_config(self) -> None:
        for name, f in self.spec.config.items():
            path = ("config", name)
            self.ident(path, name, "config symbol", at_key=True)
            paths = (f.from_,) if isinstance(f.from_, str) else tuple(f.from_)
            if not paths or any(not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$", p)
                                for p in paths):
                raise self.err(path + ("from",), f"config.{name}.from: give one or more dotted config.json paths")
            has_default = f.default is not None
            if has_default and not _type_ok(f.type, f.default):
                raise self.err(path + ("default",), f"config.{name}.default: {f.default!r} is not {f.type}")
            default = f.default
            if f.type == "float" and has_default:
                default = float(default)
            if f.type == "int_tuple" and has_default:
                default = tuple(default)
            self.config[name] = ConfigFieldIR(name, f.type, paths, default if has_default else None, has_default,
                                              f.doc.strip())

    def resolve_norm(self, path, name, b) -> NormIR:
        if isinstance(b, RMSNormBlock):
            return NormIR("rmsnorm", name, self.dim(path + ("dim",), b.dim), self.num(path + ("eps",), b.eps))
        return NormIR("layernorm", name, self.dim(path + ("dim",), b.dim), self.num(path + ("eps",), b.eps), b.bias)

    def resolve_layer(self) -> LayerIR:
        L = self.spec.decoder.layers
        base = ("decoder", "layers")
        count = self.dim(base + ("count",), L.count)
        blocks = {}
        kinds_seen: Dict[str, int] = {}
        for b in L.blocks.values():
            kinds_seen[b.kind] = kinds_seen.get(b.kind, 0) + 1
        for name, b in L.blocks.items():
            path = base + ("blocks", name)
            self.ident(path, name, "block name", at_key=True)
            blocks[name] = self.resolve_block(path, name, b, unique_kind=kinds_seen[b.kind] == 1)
        steps, used = [], {}
        for i, st in enumerate(L.dataflow):
            sp = base + ("dataflow", i)
            for role, ref, kinds in (("norm", st.norm, ("rmsnorm",)),
                                     ("block", st.block, ("attention", "gated_mlp"))):
                if ref not in blocks:
                    raise self.err(sp + (role,), f"decoder.layers.dataflow[{i}].{role}: no block '{ref}' in "
                                                 f"decoder.layers.blocks{did_you_mean(ref, blocks)}")
                if blocks[ref].kind not in kinds:
                    raise self.err(sp + (role,), f"decoder.layers.dataflow[{i}].{role}: block '{ref}' is "
                                                 f"{blocks[ref].kind}, expected {' or '.join(kinds)}")
                if ref in used:
                    raise self.err(sp + (role,), f"decoder.layers.dataflow[{i}].{role}: block '{ref}' is already "
                                                 f"used by dataflow[{used[ref]}]; each block is used once")
                used[ref] = i
            steps.append(StepIR(st.norm, st.block, isinstance(blocks[st.block], AttentionIR)))
        if not steps:
            raise self.err(base + ("dataflow",), "decoder.layers.dataflow: list at least one residual step")
        for name in blocks:
            if name not in used:
                raise self.err(base + ("blocks", name), f"decoder.layers.blocks.{name}: block is never used by "
                                                        f"decoder.layers.dataflow", at_key=True)
        return LayerIR(f"{self.spec.class_prefix}DecoderLayer", count, tuple(blocks.values()), tuple(steps))

    def resolve_block(self, path, name, b, unique_kind: bool):
        prefix = self.spec.class_prefix
        camel = "".join(p.capitalize() for p in name.split("_"))
        if isinstance(b, (RMSNormBlock, LayerNormBlock)):
            return self.resolve_norm(path, name, b)
        if isinstance(b, LinearBlock):
            return LinearIR("linear", name, self.dim(path + ("in",), b.in_), (((name, self.dim(path + ("out",), b.out)),)),
                            b.parallel, b.bias)
        if isinstance(b, FusedLinearBlock):
            if len(b.segments) < 2:
                raise self.err(path + ("segments",), f"{self._where(path)}.segments: a fused linear has 2 or more segments")
            segs = tuple((self.ident(path + ("segments", k), k, "segment name", at_key=True),
                          self.dim(path + ("segments", k), v)) for k, v in b.segments.items())
            return LinearIR("fused_linear", name, self.dim(path + ("in",), b.in_), segs, "column", b.bias)
        if isinstance(b, AttentionBlock):
            modules = {}
            def module(mpath, mname):
                self.ident(mpath, mname, "module name")
                if mname in modules or mname in ("rotary_emb", "attn"):
                    raise self.err(mpath, f"{self._where(mpath)}: module name '{mname}' is already used in this block")
                modules[mname] = mpath
                return mname
            qkv_segs = b.qkv.segments
            if len(qkv_segs) != 3 or len(set(qkv_segs)) != 3:
                raise self.err(path + ("qkv", "segments"), f"{self._where(path)}.qkv.segments: name the three "
                                                          f"segments q, k, v (in this order), e.g. [q, k, v]")
            rot = b.rotary
            rp = path + ("rotary",)
            mrope = None
            if rot.kind.startswith("mrope"):
                if rot.mrope_section is None:
                    raise self.err(rp, f"{self._where(rp)}: rotary kind '{rot.kind}' needs mrope_section")
                if isinstance(rot.mrope_section, str):
                    self.symbol(rp + ("mrope_section",), rot.mrope_section, ("int_tuple",))
                    mrope = Value(symbol=rot.mrope_section)
                else:
                    mrope = Value(literal=tuple(rot.mrope_section))
            elif rot.mrope_section is not None:
                raise self.err(rp + ("mrope_section",), f"{self._where(rp)}.mrope_section: only for mrope rotary kinds")
            qk = None
            if b.qk_norm:
                qp = path + ("qk_norm",)
                qk = (module(qp + ("q",), b.qk_norm.q), module(qp + ("k",), b.qk_norm.k),
                      self.num(qp + ("eps",), b.qk_norm.eps))
            return AttentionIR(
                kind="attention", name=name, class_name=f"{prefix}Attention" if unique_kind else f"{prefix}{camel}",
                hidden=self.dim(path + ("hidden",), b.hidden), heads=self.dim(path + ("heads",), b.heads),
                kv_heads=self.dim(path + ("kv_heads",), b.kv_heads), head_dim=self.dim(path + ("head_dim",), b.head_dim),
                qkv_name=module(path + ("qkv", "name"), b.qkv.name), qkv_segments=tuple(qkv_segs), qkv_bias=b.qkv.bias,
                out_name=module(path + ("out", "name"), b.out.name), out_bias=b.out.bias,
                rotary=RotaryIR(rot.kind, self.num(rp + ("theta",), rot.theta),
                                self.dim(rp + ("max_position",), rot.max_position), mrope),
                qk_norm=qk, scale=self.num(path + ("scale",), b.scale) if b.scale is not None else None)
        if isinstance(b, GatedMLPBlock):
            segs = b.gate_up.segments
            if len(segs) != 2 or len(set(segs)) != 2:
                raise self.err(path + ("gate_up", "segments"), f"{self._where(path)}.gate_up.segments: name the two "
                                                              f"segments gate, up (in this order), e.g. [gate, up]")
            g = self.ident(path + ("gate_up", "name"), b.gate_up.name, "module name")
            dn = self.ident(path + ("down", "name"), b.down.name, "module name")
            if g == dn:
                raise self.err(path + ("down", "name"), f"{self._where(path)}.down.name: module name '{dn}' is already used")
            return GatedMLPIR("gated_mlp", name, f"{prefix}MLP" if unique_kind else f"{prefix}{camel}",
                              self.dim(path + ("hidden",), b.hidden), self.dim(path + ("intermediate",), b.intermediate),
                              b.activation, g, tuple(segs), b.gate_up.bias, dn, b.down.bias)
        raise AssertionError(type(b))  # pragma: no cover - the schema admits no other kind

    def check_widths(self, embed: EmbeddingIR, layer: LayerIR, norm: NormIR) -> None:
        """Everything on the residual stream has the embedding's width."""
        checks = [(("decoder", "norm", "dim"), "decoder.norm.dim", norm.dim)]
        for b in layer.blocks:
            bp = ("decoder", "layers", "blocks", b.name)
            if isinstance(b, NormIR):
                checks.append((bp + ("dim",), f"decoder.layers.blocks.{b.name}.dim", b.dim))
            elif isinstance(b, (AttentionIR, GatedMLPIR)):
                checks.append((bp + ("hidden",), f"decoder.layers.blocks.{b.name}.hidden", b.hidden))
        for path, where, size in checks:
            if size != embed.dim:
                raise self.err(path, f"{where}: is {size}, but the residual stream has the embedding's width "
                                     f"{embed.dim} (decoder.embed_tokens.dim)")

    def resolve_lm_head(self, embed: EmbeddingIR) -> LMHeadIR:
        h = self.spec.lm_head
        p = ("lm_head",)
        head = LMHeadIR("lm_head", self.dim(p + ("vocab",), h.vocab), self.dim(p + ("dim",), h.dim),
                        self.flag(p + ("tie",), h.tie))
        if head.tie.literal is not False and (head.vocab != embed.vocab or head.dim != embed.dim):
            raise self.err(p, f"lm_head: a tied head must have the embedding's shape: vocab {head.vocab} vs "
                              f"{embed.vocab}, dim {head.dim} vs {embed.dim}", at_key=True)
        return head

    # ---- parameters and weights -------------------------------------------------------------------
    def collect_params(self, embed, layer, norm, lm_head) -> Tuple[ParamIR, ...]:
        out: List[ParamIR] = []
        out.append(ParamIR("model.embed_tokens.weight", "decoder.embed_tokens", (embed.vocab, embed.dim), "vocab",
                           vocab=embed.vocab))
        for b in layer.blocks:
            out += self.block_params(f"model.layers.{{i}}.{b.name}", f"decoder.layers.blocks.{b.name}", b, True)
        out += self.block_params("model.norm", "decoder.norm", norm, False)
        if lm_head.tie.literal is not True:
            out.append(ParamIR("lm_head.weight", "lm_head", (lm_head.vocab, lm_head.dim), "vocab", vocab=lm_head.vocab,
                               only_if_untied=lm_head.tie.symbol))
        return tuple(out)

    @staticmethod
    def block_params(prefix: str, block: str, b, per_layer: bool) -> List[ParamIR]:
        one = Size.of(1)

        def P(name, shape, shard, segments=()):
            return ParamIR(f"{prefix}.{name}", block, tuple(shape), shard, tuple(segments), per_layer=per_layer)

        def column(module, in_f, segs, bias):
            total = segs[0].heads * segs[0].unit
            for s in segs[1:]:
                total = total + s.heads * s.unit
            ps = [P(f"{module}weight", (total, in_f), "colwise", segs)]
            if bias:
                ps.append(P(f"{module}bias", (total,), "colwise", segs))
            return ps

        def row(module, in_seg, out_f, bias):
            ps = [P(f"{module}weight", (out_f, in_seg.heads * in_seg.unit), "rowwise", (in_seg,))]
            if bias:
                ps.append(P(f"{module}bias", (out_f,), "replicated"))
            return ps

        if isinstance(b, NormIR):
            return [P("weight", (b.dim,), "replicated")] + ([P("bias", (b.dim,), "replicated")] if b.bias else [])
        if isinstance(b, LinearIR):
            out_total = b.out_sizes[0][1]
            for _, s in b.out_sizes[1:]:
                out_total = out_total + s
            if b.parallel == "column":
                return column("", b.in_features, [SegmentIR(n, s, one) for n, s in b.out_sizes], b.bias)
            if b.parallel == "row":
                return row("", SegmentIR(b.name, b.in_features, one), out_total, b.bias)
            return [P("weight", (out_total, b.in_features), "replicated")] + \
                ([P("bias", (out_total,), "replicated")] if b.bias else [])
        if isinstance(b, AttentionIR):
            q, k, v = b.qkv_segments
            segs = [SegmentIR(q, b.heads, b.head_dim), SegmentIR(k, b.kv_heads, b.head_dim, True),
                    SegmentIR(v, b.kv_heads, b.head_dim, True)]
            ps = column(f"{b.qkv_name}.", b.hidden, segs, b.qkv_bias)
            ps += row(f"{b.out_name}.", SegmentIR(b.out_name, b.heads, b.head_dim), b.hidden, b.out_bias)
            if b.qk_norm:
                ps += [P(f"{b.qk_norm[0]}.weight", (b.head_dim,), "replicated"),
                       P(f"{b.qk_norm[1]}.weight", (b.head_dim,), "replicated")]
            return ps
        if isinstance(b, GatedMLPIR):
            g, u = b.gate_up_segments
            ps = column(f"{b.gate_up_name}.", b.hidden, [SegmentIR(g, b.intermediate, one),
                                                         SegmentIR(u, b.intermediate, one)], b.gate_up_bias)
            ps += row(f"{b.down_name}.", SegmentIR(b.down_name, b.intermediate, one), b.hidden, b.down_bias)
            return ps
        raise AssertionError(type(b))  # pragma: no cover

    def resolve_weights(self, params: Tuple[ParamIR, ...]) -> Tuple[WeightIR, ...]:
        by_name = {p.name: p for p in params}
        entries = self.spec.weights
        for key in entries:
            if key not in by_name:
                hint = did_you_mean(key, by_name)
                if not hint and "{i}" not in key and re.search(r"\.layers\.\d+\.", key):
                    hint = " (write the layer index as {i})"
                raise self.err(("weights", key), f"weights: '{key}' is not a parameter of the model{hint}",
                               at_key=True)
        out = []
        for p in params:
            if p.name not in entries:
                raise self.err(tuple(p.block.split(".")),
                               f"{p.block}: parameter '{p.name}' has no entry in `weights` (add "
                               f"'{p.name}: {{from: <checkpoint tensor>, shard: {p.shard}}}')", at_key=True)
            e = entries[p.name]
            path = ("weights", p.name)
            if e.shard != p.shard:
                raise self.err(path + ("shard",), f"weights['{p.name}'].shard: '{e.shard}' does not fit the "
                                                  f"parameter (its layer is {_SHARD_WORDS[p.shard]}): expected '{p.shard}'")
            if e.from_ is None:
                sources = (p.name,)
            elif isinstance(e.from_, str):
                sources = (e.from_,)
            else:
                names = [s.name for s in p.segments]
                if len(p.segments) < 2:
                    raise self.err(path + ("from",), f"weights['{p.name}'].from: a mapping of segments stacks a fused "
                                                     f"parameter; this one has no segments, give one tensor name")
                if list(e.from_) != names:
                    bad = next((k for k in e.from_ if k not in names), None)
                    where = path + ("from", bad) if bad else path + ("from",)
                    hint = did_you_mean(bad, names) if bad else ""
                    raise self.err(where, f"weights['{p.name}'].from: segments must be {names} in this order, got "
                                          f"{list(e.from_)}{hint}", at_key=bool(bad))
                sources = tuple(e.from_.values())
            for i, src in enumerate(sources):
                if p.per_layer and "{i}" not in src:
                    raise self.err(path + ("from",), f"weights['{p.name}'].from: '{src}' is a per-layer tensor; "
                                                     f"name it with {{i}} for the layer index")
                if re.sub(r"\{i\}", "", src).count("{") or re.sub(r"\{i\}", "", src).count("}") or \
                        (not p.per_layer and "{i}" in src):
                    raise self.err(path + ("from",), f"weights['{p.name}'].from: '{src}': only per-layer tensors "
                                                     f"may use {{i}}, and no other placeholder exists")
            out.append(WeightIR(p, sources))
        return tuple(out)

    def resolve_ignored(self) -> Tuple[str, ...]:
        for i, pat in enumerate(self.spec.ignore_checkpoint_tensors):
            try:
                re.compile(pat)
            except re.error as e:
                raise self.err(("ignore_checkpoint_tensors", i), f"ignore_checkpoint_tensors[{i}]: bad regex: {e}")
        return tuple(self.spec.ignore_checkpoint_tensors)

    def resolve_runner(self, layer: LayerIR) -> RunnerIR:
        r = self.spec.runner
        if r.max_batch < 1:
            raise self.err(("runner", "max_batch"), f"runner.max_batch: must be >= 1, got {r.max_batch}")
        if r.graph_buckets is None:
            buckets = default_buckets(r.max_batch)
        else:
            buckets = tuple(r.graph_buckets)
            bp = ("runner", "graph_buckets")
            if not buckets:
                raise self.err(bp, "runner.graph_buckets: list at least one batch size (or leave it out for the default)")
            for i, b in enumerate(buckets):
                if b < 1:
                    raise self.err(bp + (i,), f"runner.graph_buckets[{i}]: batch size must be >= 1, got {b}")
                if i and b <= buckets[i - 1]:
                    raise self.err(bp + (i,), f"runner.graph_buckets[{i}]: buckets must be sorted ascending and "
                                              f"unique: {b} after {buckets[i - 1]}")
                if b > r.max_batch:
                    raise self.err(bp + (i,), f"runner.graph_buckets[{i}]: bucket {b} exceeds runner.max_batch "
                                              f"{r.max_batch}")
        mrope = any(isinstance(b, AttentionIR) and b.rotary.kind.startswith("mrope") for b in layer.blocks)
        return RunnerIR(r.max_batch, buckets, r.prefill_mode, "mrope" if mrope else "rope")

    def resolve_tp(self) -> Tuple[int, ...]:
        sizes = self.spec.tensor_parallel.sizes
        tp = ("tensor_parallel", "sizes")
        for i, n in enumerate(sizes):
            if n < 1:
                raise self.err(tp + (i,), f"tensor_parallel.sizes[{i}]: must be >= 1, got {n}")
            if n in sizes[:i]:
                raise self.err(tp + (i,), f"tensor_parallel.sizes[{i}]: {n} is listed twice")
        return tuple(sizes)

    # ---- variants ---------------------------------------------------------------------------------
    def resolve_variant(self, name, layer, lm_head, params, tp_sizes, deepstack) -> VariantIR:
        vp = ("variants", name)
        given = self.spec.variants[name]
        for key, value in given.items():
            if key not in self.config:
                raise self.err(vp + (key,), f"variants.{name}: unknown config symbol '{key}'"
                                            f"{did_you_mean(key, self.config)}", at_key=True)
            if not _type_ok(self.config[key].type, value):
                raise self.err(vp + (key,), f"variants.{name}.{key}: {value!r} is not {self.config[key].type}")
        values: Dict[str, Any] = {}
        for sym, f in self.config.items():
            if sym in given:
                values[sym] = given[sym]
            elif f.has_default:
                values[sym] = f.default
            else:
                raise self.err(vp, f"variants.{name}: no value for '{sym}' (it has no default)", at_key=True)

        def at(sym: Optional[str]):
            return vp + (sym,) if sym in given else vp

        def check_ints(size: Size):
            for t in size.terms:
                for f in t:
                    if isinstance(f, str) and values[f] <= 0:
                        raise self.err(at(f), f"variants.{name}.{f}: must be positive, got {values[f]}", at_key=f not in given)

        for p in params:
            for s in p.shape:
                check_ints(s)
        layers = layer.count.eval(values)
        check_ints(layer.count)
        for b in layer.blocks:
            if isinstance(b, AttentionIR):
                h, kv, hd = b.heads.eval(values), b.kv_heads.eval(values), b.head_dim.eval(values)
                if h % kv:
                    sym = b.kv_heads.terms[0][0] if isinstance(b.kv_heads.terms[0][0], str) else None
                    raise self.err(at(sym), f"variants.{name}: {b.name}.heads ({h}) must be a multiple of "
                                            f"{b.name}.kv_heads ({kv})")
                if b.rotary.mrope_section is not None:
                    sec = b.rotary.mrope_section.eval(values)
                    if sum(sec) != hd // 2 or hd % 2:
                        where = at(b.rotary.mrope_section.symbol) if b.rotary.mrope_section.symbol else \
                            ("decoder", "layers", "blocks", b.name, "rotary", "mrope_section")
                        raise self.err(where, f"variants.{name}: mrope_section {list(sec)} sums to {sum(sec)}, "
                                              f"expected head_dim / 2 = {hd // 2}")
        if deepstack and deepstack[-1] >= layers:
            raise self.err(("decoder", "deepstack", "after_layers"),
                           f"decoder.deepstack.after_layers: layer {deepstack[-1]} does not exist in variant "
                           f"{name} ({layers} layers)")
        tied = bool(lm_head.tie.eval(values))
        ranks = []
        for i, tp in enumerate((1,) + tuple(t for t in tp_sizes if t != 1)):
            where = ("tensor_parallel", "sizes", tp_sizes.index(tp)) if tp in tp_sizes else vp
            ranks.append(self.rank_table(name, values, layer, params, tied, tp, where))
        return VariantIR(name, tuple(values.items()), tied, layers, tuple(ranks))

    def rank_table(self, vname, values, layer, params, tied, tp, where) -> RankTableIR:
        rows, layer_numel, total = [], 0, 0
        for p in params:
            if p.only_if_untied and tied:
                continue
            shape = [s.eval(values) for s in p.shape]
            if p.shard in ("colwise", "rowwise"):
                dim = 0 if p.shard == "colwise" else 1
                n = 0
                for s in p.segments:
                    seg = Segment(s.name, s.heads.eval(values), s.unit.eval(values), s.replicate_ok)
                    msg = check_segment(seg, tp)
                    if msg:
                        raise self.err(where, f"tensor parallel size {tp}, variant {vname}: {p.name}: {msg}")
                    n += heads_per_rank(seg.heads, tp) * seg.unit
                shape[dim] = n
            elif p.shard == "vocab":
                shape[0] = padded_vocab(shape[0], tp) // tp
            numel = 1
            for d in shape:
                numel *= d
            rows.append((p.name, tuple(shape), numel))
            if p.per_layer:
                layer_numel += numel
            else:
                total += numel
        layers = layer.count.eval(values)
        heads = tuple((b.name, heads_per_rank(b.heads.eval(values), tp), heads_per_rank(b.kv_heads.eval(values), tp))
                      for b in layer.blocks if isinstance(b, AttentionIR))
        return RankTableIR(tp, heads, tuple(rows), layer_numel, total + layer_numel * layers)


_SHARD_WORDS = {"colwise": "column-parallel", "rowwise": "row-parallel", "vocab": "vocab-parallel",
                "replicated": "replicated"}


def resolve(loaded: LoadedSpec) -> ModelIR:
    return _Resolver(loaded).resolve()


def rank_table_for(ir: ModelIR, loaded: LoadedSpec, variant: VariantIR, tp: int) -> RankTableIR:
    """Per-rank table at any TP size (for `--explain --tp N`); an impossible N raises SpecError."""
    for r in variant.ranks:
        if r.tp == tp:
            return r
    res = _Resolver(loaded)
    res.config = {f.name: f for f in ir.config}
    return res.rank_table(variant.name, dict(variant.values), ir.layer, ir.params, variant.tied, tp,
                          ("variants", variant.name))
