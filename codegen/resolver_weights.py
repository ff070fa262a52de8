"""The `weights` part of the resolver: each parameter's checkpoint source(s) (`weights` entries, `{i}` / `{e}`,
segment stacking), `checkpoint_prefixes` (the checkpoint name of a parameter without an entry), the storage
layouts of a checkpoint tensor (`transpose`, `segments_interleaved`) and the row `layout` of a fused tensor
(`weights[...].layout`, fixed or chosen by a config flag: `{if: ..., then: ..., else: ...}`), and the tensors of a
segment mapping that hold several segments (a key `k+v`, with a layout of its own over those segments), with their
static checks: the layout names the parameter's (or the tensor's) segments, the parameter is a fused
column-parallel one, and in every variant the segments' heads fit the groups (of the branch the variant's flag
chooses); and `ignore_checkpoint_tensors`.
A mixin of resolver._Resolver, as resolver_blocks.py is."""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Optional, Tuple

from .errors import did_you_mean
from .ir import LayoutChoice, ParamIR, SegmentGroupIR, WeightIR, size_at
from .schema import RowLayoutChoice

_PLACEHOLDER = re.compile(r"\{(?![ieh]\})[^{}]+\}")   # {<expression>}: any placeholder but {i}, {e}, {h}


class WeightsResolver:
    def resolve_weights(self, params: Tuple[ParamIR, ...], section: Tuple[str, ...] = ("weights",)) -> Tuple[WeightIR, ...]:
        by_name = {p.name: p for p in params}
        top = section == ("weights",)
        raw = self.spec.weights if top else self.spec.vision.weights
        rename = self.rename if top else (lambda n: n)
        where_s = ".".join(section)
        entries, keys = {}, {}
        for key, e in raw.items():
            name = rename(key)
            entries[name], keys[name] = e, key
            if name not in by_name:
                shown = {(n if not top or self.prefix == "model" or not n.startswith(self.prefix + ".")
                          else "model" + n[len(self.prefix):]): n for n in by_name}
                hint = did_you_mean(key, shown)
                if not hint and "{i}" not in key and re.search(r"\.(layers|blocks|deepstack_merger_list)\.\d+\.", key):
                    hint = " (write the layer index as {i})"
                moved = f" (decoder tensors are written `model.*`, meaning `{self.prefix}.*`)" \
                    if top and self.prefix != "model" and not hint else ""
                raise self.err(section + (key,), f"{where_s}: '{key}' is not a parameter of the model{hint}{moved}",
                               at_key=True)
        out = []
        for p in params:
            e = entries.get(p.name)
            path = section + (keys.get(p.name, ""),)
            if e is None:
                if p.segments and len(p.segments) > 1 and not (p.tp_if or p.repeat or p.experts or p.stacked):
                    shown = p.name if not top or self.prefix == "model" or not p.name.startswith(self.prefix + ".") \
                        else "model" + p.name[len(self.prefix):]
                    names = ", ".join(f"{sg.name}: <tensor>" for sg in p.segments)
                    raise self.err(tuple(p.block.split(".")),
                                   f"{p.block}: fused parameter '{shown}' has no entry in `{where_s}`: say which "
                                   f"checkpoint tensor fills each segment ('{shown}: {{from: {{{names}}}}}')",
                                   at_key=True)
                sources = (self.checkpoint_name(p.name) if top else p.name,)
            elif e.from_ is None:
                if not (e.transpose or e.segments_interleaved or e.squeeze):
                    raise self.err(path, f"{where_s}['{keys[p.name]}']: give `from` (the checkpoint tensor(s)), or a "
                                         f"layout (`transpose`, `segments_interleaved`, `squeeze`) of the tensor of "
                                         f"its own name",
                                   at_key=True)
                sources = (p.name,)
            elif isinstance(e.from_, str):
                sources = (rename(e.from_),)
            else:
                names = [s.name for s in p.segments]
                if len(p.segments) < 2:
                    raise self.err(path + ("from",), f"{where_s}['{keys[p.name]}'].from: a mapping of segments stacks a fused "
                                                     f"parameter; this one has no segments, give one tensor name")
                # a key `k+v`: the consecutive segments one tensor holds (a SegmentSource gives its row layout)
                split = [tuple(k.split("+")) for k in e.from_]
                flat = [n for g in split for n in g]
                if flat != names:
                    bad_key, bad = next(((k, n) for k, g in zip(e.from_, split) for n in g if n not in names),
                                        (None, None))
                    where = path + ("from", bad_key) if bad_key else path + ("from",)
                    hint = did_you_mean(bad, names) if bad else ""
                    raise self.err(where, f"{where_s}['{keys[p.name]}'].from: segments must be {names} in this order, got "
                                          f"{flat}{hint}", at_key=bool(bad_key))
                sources = tuple(rename(v if isinstance(v, str) else v.from_)
                                for g, v in zip(split, e.from_.values()) for _ in g)
            looped = p.per_layer or p.repeat is not None
            per_expert = p.experts is not None and e is not None and any("{e}" in src for src in sources)
            fstrings = self.source_exprs(p, sources, path, where_s, keys.get(p.name, ""), looped)
            for i, src in enumerate(sources):
                src = _PLACEHOLDER.sub("", src) if fstrings else src
                if looped and "{i}" not in src and not fstrings:
                    raise self.err(path + ("from",), f"{where_s}['{keys[p.name]}'].from: '{src}' is a per-layer tensor; "
                                                     f"name it with {{i}} for the layer index")
                if per_expert and "{e}" not in src:
                    raise self.err(path + ("from",), f"{where_s}['{keys[p.name]}'].from: '{src}': the experts are "
                                                     f"stacked from per-expert tensors: name each with {{e}}")
                # {h}: one tensor per row of dim 0 (a head: a per-head norm stored as `norms.{h}.weight`), stacked
                stacked_rows = "{h}" in src and len(sources) == 1 and p.experts is None and len(p.shape) >= 2 \
                    and not (e is not None and (e.transpose or e.segments_interleaved or e.squeeze or e.layout))
                rest = re.sub(r"\{[ie]\}" if p.experts is not None else r"\{i\}", "", src)
                if stacked_rows:
                    rest = rest.replace("{h}", "", 1)
                if rest.count("{") or rest.count("}") or (not looped and "{i}" in src):
                    raise self.err(path + ("from",), f"{where_s}['{keys[p.name]}'].from: '{src}': only per-layer tensors "
                                                     f"may use {{i}}, only stacked expert parameters {{e}}, only "
                                                     f"a parameter of two or more dims read from one name {{h}} (one "
                                                     f"tensor per row of its first dim), and no other placeholder "
                                                     f"exists")
            wt = self.weight_layout(p, sources, e, path, where_s, keys.get(p.name, ""))
            if fstrings:
                wt = dataclasses.replace(wt, fstrings=fstrings)
            if e is not None:
                wt = dataclasses.replace(wt, layout=self.resolve_layout(path, f"{where_s}['{keys[p.name]}']", p, e))
            if e is not None and isinstance(e.from_, dict):
                wt = dataclasses.replace(wt, groups=self.segment_groups(path, f"{where_s}['{keys[p.name]}']", p, e))
            out.append(wt)
        return self.bias_layouts(out, keys, section, where_s)

    def bias_layouts(self, out: list, keys: dict, section: tuple, where_s: str) -> Tuple[WeightIR, ...]:
        """A fused bias read from one tensor holds its rows in its weight's layout: it takes the weight's layout
        where its entry gives none (GPTBigCode's c_attn bias, per kv_group like its weight: read blocked, it was
        right only where the two orders coincide, multi-query), and one that differs is an error."""
        at = {wt.param.name: i for i, wt in enumerate(out)}
        for i, wt in enumerate(out):
            name = wt.param.name
            w = at.get(name[:-len(".bias")] + ".weight") if name.endswith(".bias") else None
            if w is None or out[w].layout is None or len(wt.sources) != 1 or len(wt.param.segments or ()) < 2:
                continue
            if wt.layout is None:
                out[i] = dataclasses.replace(wt, layout=out[w].layout)
            elif wt.layout != out[w].layout:
                key = keys.get(name, name)
                raise self.err(section + (key, "layout"), f"{where_s}['{key}'].layout: the bias's rows are laid out "
                                                          f"as its weight's ({keys.get(out[w].param.name)}), or the "
                                                          f"two disagree on which row is which segment")
        return tuple(out)

    def source_exprs(self, p: ParamIR, sources, path, where_s: str, key: str, looped: bool) -> Tuple[str, ...]:
        """`{<expression>}` in a per-layer source name (any placeholder but {i}, {e}, {h}): an expression over config
        symbols and `layer` whose value is written there (the checkpoint's name of layer i's tensor depends on the
        layer: Zamba's `mamba_decoder.` prefix on its hybrid layers, an adapter stored under another layer). Returns
        each source as the body of a Python f-string over `layer_idx` and `config` (empty: no such placeholder)."""
        if not any(_PLACEHOLDER.search(src) for src in sources):
            return ()
        if not looped or p.experts is not None:
            raise self.err(path + ("from",), f"{where_s}['{key}'].from: an expression placeholder is for the sources "
                                             f"of a per-layer parameter (not stacked per expert)")
        out = []
        for src in sources:
            parts, pos = [], 0
            for m in re.finditer(r"\{([^{}]*)\}", src):
                parts.append(src[pos:m.start()].replace("{", "{{").replace("}", "}}"))
                inner = m.group(1)
                if inner == "i":
                    parts.append("{layer_idx}")
                elif inner in ("e", "h"):
                    raise self.err(path + ("from",), f"{where_s}['{key}'].from: '{src}': {{{inner}}} with an "
                                                     f"expression placeholder is not supported")
                else:
                    parts.append("{" + self.expr(path + ("from",), inner, per_layer=True).py() + "}")
                pos = m.end()
            parts.append(src[pos:])
            out.append("".join(parts))
        return tuple(out)

    def weight_layout(self, p: ParamIR, sources, e, path, where_s: str, key: str) -> WeightIR:
        """The WeightIR of parameter `p`, with its entry's layout (`transpose`, `segments_interleaved`) checked."""
        if e is not None and isinstance(e.squeeze, list) and not e.squeeze:
            raise self.err(path + ("squeeze",), f"{where_s}['{key}'].squeeze: an empty list (true, or the stored unit "
                                                f"dims)")
        if e is None or not (e.transpose or e.segments_interleaved or e.squeeze):
            return WeightIR(p, tuple(sources))
        if e.squeeze and (len(sources) != 1 or p.experts is not None or e.transpose or e.segments_interleaved):
            raise self.err(path + ("squeeze",), f"{where_s}['{key}'].squeeze: only a parameter read from one tensor, "
                                                f"not stacked per expert, without transpose / segments_interleaved")
        if e.squeeze is True:
            return WeightIR(p, tuple(sources), squeeze=True)
        if isinstance(e.squeeze, list):
            dims = e.squeeze
            stored = len(p.shape) + len(dims)
            if len(set(dims)) != len(dims) or any(d < 0 or d >= stored for d in dims):
                raise self.err(path + ("squeeze",), f"{where_s}['{key}'].squeeze: {dims}: distinct dims of the stored "
                                                    f"shape (the parameter's {len(p.shape)} dims plus "
                                                    f"{len(dims)} unit dims: 0 .. {stored - 1})")
            return WeightIR(p, tuple(sources), squeeze=tuple(sorted(dims)))
        dims = len(p.shape) - (1 if p.experts is not None else 0)
        if e.transpose and dims < 2:
            raise self.err(path + ("transpose",), f"{where_s}['{key}'].transpose: '{key}' is not a matrix (one dim "
                                                  f"per {'expert' if p.experts is not None else 'parameter'})")
        if e.segments_interleaved and (len(p.segments) < 2 or len(sources) != 1):
            why = "has no segments" if len(p.segments) < 2 else "is stacked from one tensor per segment here"
            raise self.err(path + ("segments_interleaved",), f"{where_s}['{key}'].segments_interleaved: the parameter "
                                                             f"{why}; interleaving needs a fused parameter read from "
                                                             f"one tensor")
        return WeightIR(p, tuple(sources), transpose=e.transpose,
                        interleave=len(p.segments) if e.segments_interleaved else 1)

    def resolve_ignored(self) -> Tuple[str, ...]:
        for i, pat in enumerate(self.spec.ignore_checkpoint_tensors):
            try:
                re.compile(pat)
            except re.error as e:
                raise self.err(("ignore_checkpoint_tensors", i), f"ignore_checkpoint_tensors[{i}]: bad regex: {e}")
            if re.search(r"\\\.\$?$", pat):     # the loader fullmatches: a name never ends in a dot
                raise self.err(("ignore_checkpoint_tensors", i),
                               f"ignore_checkpoint_tensors[{i}]: '{pat}' matches no tensor name (patterns match the "
                               "whole name, and none ends in '.'): end it with '.*' to skip every tensor under the "
                               "prefix")
        return tuple(self.spec.ignore_checkpoint_tensors)

    def resolve_renames(self) -> Tuple[Tuple[str, str], ...]:
        out = []
        for pat, to in self.spec.checkpoint_renames.items():
            if isinstance(to, list) and len(to) < 2:
                raise self.err(("checkpoint_renames", pat), f"checkpoint_renames: '{pat}': a split names two or more "
                                                            f"tensors (one: write the replacement as a string)")
            try:
                rx = re.compile(pat)
                for t in (to if isinstance(to, list) else [to]):
                    rx.sub(t, "")          # a bad group reference in the replacement fails here
            except (re.error, IndexError) as e:
                raise self.err(("checkpoint_renames", pat), f"checkpoint_renames: '{pat}: {to}': bad regex or "
                                                            f"replacement: {e}")
            out.append((pat, tuple(to) if isinstance(to, list) else to))
        return tuple(out)

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint tensor a parameter without a `weights` entry loads: its own name, with the longest matching
        `checkpoint_prefixes` prefix replaced."""
        best: Optional[Tuple[str, str]] = None
        for pre, to in self.spec.checkpoint_prefixes.items():
            full = self.rename(pre)
            if name.startswith(full) and (best is None or len(full) > len(best[0])):
                best = (full, to)
        return name if best is None else best[1] + name[len(best[0]):]

    def check_prefixes(self, params: Tuple[ParamIR, ...]) -> None:
        for pre, to in self.spec.checkpoint_prefixes.items():
            path = ("checkpoint_prefixes", pre)
            if not pre or not to or "{" in pre + to or "}" in pre + to:
                raise self.err(path, f"checkpoint_prefixes: '{pre}: {to}': two non-empty name prefixes without "
                                     f"placeholders", at_key=True)
            if not any(p.name.startswith(self.rename(pre)) for p in params):
                raise self.err(path, f"checkpoint_prefixes: no parameter name starts with '{pre}'"
                                     f"{did_you_mean(pre, sorted({p.name.rsplit('.', 1)[0] + '.' for p in params}))}",
                               at_key=True)

    def resolve_layout(self, path: tuple, where: str, p: ParamIR, entry):
        """The row layout of a `weights` entry: a fixed one, as WeightIR.layout holds it, or a LayoutChoice
        (`{if: flag, then: <layout>, else: <layout>}`: the checkpoint's config chooses; each branch is checked as a
        fixed layout, and per variant only the branch its flag chooses must fit its heads)."""
        lay = entry.layout
        if lay is None:
            return None
        lp = path + ("layout",)
        if not isinstance(entry.from_, str):
            raise self.err(lp, f"{where}.layout: a layout describes one fused checkpoint tensor: give `from` one name "
                               f"(a mapping of segments is already split; a tensor that holds several of them takes "
                               f"its own: `k+v: {{from: <tensor>, layout: ...}}`)", at_key=True)
        self.check_layout_param(lp, f"{where}.layout", p)
        return self.layout_value(lp, f"{where}.layout", p, lay, p.segments)

    def check_layout_param(self, lp: tuple, where: str, p: ParamIR) -> None:
        if len(p.segments) < 2 or p.shard != "colwise" or p.experts is not None or p.tp_if is not None:
            raise self.err(lp, f"{where}: only a fused column-parallel parameter (attention qkv, gated MLP "
                               f"gate_up, fused_linear) has segments to lay out", at_key=True)

    def layout_value(self, lp: tuple, where: str, p: ParamIR, lay, segs):
        """A RowLayout (a fixed layout) or RowLayoutChoice (a LayoutChoice) over the segments `segs` of `p` (all of
        them, or those one tensor of a segment mapping holds)."""
        if not isinstance(lay, RowLayoutChoice):
            return self.fixed_layout(lp, where, p, lay, None, segs)
        cond = self.flag(lp + ("if",), lay.if_)          # over config symbols only: `layer` is refused there
        names = tuple(s.name for s in segs)
        branches = []
        for key, holds in (("then", True), ("else", False)):
            fixed = self.fixed_layout(lp + (key,), f"{where}.{key}", p, getattr(lay, key + "_" * (key == "else")),
                                      (cond, holds), segs)
            branches.append(None if fixed == ("tensor", names) else fixed)   # blocked in segment order: nothing to undo
        return LayoutChoice(cond, *branches)

    def segment_groups(self, path: tuple, where: str, p: ParamIR, entry) -> Tuple[SegmentGroupIR, ...]:
        """The keys `k+v` of a segment mapping: one tensor holding those consecutive segments, blocked in their order
        or in its SegmentSource's row layout (over those segments alone: undone before sharding, each rank reading
        its heads' rows); checked as an entry's layout is (segments named once, heads fitting the groups per
        variant), on a fused column-parallel parameter only."""
        out = []
        by_name = {s.name: s for s in p.segments}
        for key, value in entry.from_.items():
            group = tuple(key.split("+"))
            if len(group) < 2 and isinstance(value, str):
                continue
            gp, gw = path + ("from", key), f"{where}.from.{key}"
            if len(group) < 2:
                raise self.err(gp, f"{gw}: a mapping of `from` and `layout` reads several segments from one tensor, "
                                   f"named by a key that joins them with '+' (`k+v`); one segment is a tensor name "
                                   f"(`{key}: <tensor>`)", at_key=True)
            if len(group) == len(p.segments):
                raise self.err(gp, f"{gw}: one tensor holds every segment: give `from` its name (and the entry its "
                                   f"`layout`)", at_key=True)
            if p.shard != "colwise" or p.experts is not None or p.tp_if is not None:
                raise self.err(gp, f"{gw}: only a fused column-parallel parameter (attention qkv, gated MLP gate_up, "
                                   f"fused_linear) reads several segments from one tensor", at_key=True)
            lay = None
            if not isinstance(value, str) and value.layout is not None:
                lay = self.layout_value(gp + ("layout",), f"{gw}.layout", p, value.layout,
                                        tuple(by_name[n] for n in group))
                if lay == ("tensor", group):                 # blocked in the segments' order: nothing to undo
                    lay = None
            out.append(SegmentGroupIR(group, lay))
        return tuple(out)

    def fixed_layout(self, lp: tuple, where: str, p: ParamIR, lay, branch, segs=None) -> tuple:
        """One RowLayout over `segs` (default: every segment of `p`), checked (segments, groups) and queued for the
        per-variant head check; `branch`: None, or (cond, value) for a branch of a choice, checked only in the
        variants where cond is value."""
        segs = tuple(p.segments if segs is None else segs)
        names = [s.name for s in segs]
        inter = list(lay.interleave)
        if sorted(inter) != sorted(names) or len(set(inter)) != len(inter):
            bad = next((n for n in inter if n not in names), None)
            whose = "the parameter's segments" if len(segs) == len(p.segments) else "the tensor's segments"
            raise self.err(lp + ("interleave",), f"{where}.interleave: must name each of {whose} "
                                                 f"{names} once, got {inter}"
                                                 f"{did_you_mean(bad, names) if bad else ''}")
        if (lay.per == "group") != (lay.groups is not None):
            raise self.err(lp, f"{where}: `groups` (the number of groups) goes with `per: group` and only with "
                               f"it", at_key=True)
        if lay.groups is not None and lay.groups < 1:
            raise self.err(lp + ("groups",), f"{where}.groups: must be >= 1, got {lay.groups}")
        self.layouts_to_check.append((lp, where, segs, lay.per if lay.groups is None else lay.groups, branch))
        return (lay.per, tuple(inter)) if lay.groups is None else (lay.per, tuple(inter), lay.groups)

    def check_layout_variant(self, name: str, values: Mapping[str, Any]) -> None:
        """In a variant, each laid-out parameter's segments split into the layout's groups (for a layout chosen by a
        flag: the flag gives a bool, and the branch it chooses fits)."""
        for lp, where, segs, per, branch in self.layouts_to_check:
            if branch is not None:
                cond, holds = branch
                ip = lp[:-1] + ("if",)
                try:
                    x = cond.eval(values)
                except Exception as exc:  # noqa: BLE001 - the spec's formula fails for this variant
                    raise self.err(ip, f"variants.{name}: {where.rsplit('.', 1)[0]}.if fails: "
                                       f"{type(exc).__name__}: {exc}") from None
                if not isinstance(x, bool):
                    raise self.err(ip, f"variants.{name}: {where.rsplit('.', 1)[0]}.if gives {x!r}, not a bool")
                if x != holds:
                    continue
            heads = {s.name: size_at(s.heads, values) for s in segs}   # (a per-layer count: in layer 0)
            shown = ", ".join(f"{n}: {h}" for n, h in heads.items())
            chosen = "" if branch is None else f" (chosen: {branch[0]} is {branch[1]})"
            if per == "head" and len(set(heads.values())) != 1:
                raise self.err(lp + ("per",), f"variants.{name}: {where} per: head needs every segment to "
                                              f"have as many heads, got {shown}{chosen}")
            if isinstance(per, int):             # per: group, `per` groups
                bad = [n for n, h in heads.items() if h % per]
                if bad:
                    raise self.err(lp + ("groups",), f"variants.{name}: {where} per: group: {shown}: segment "
                                                     f"'{bad[0]}' does not split into {per} groups{chosen}")
            if per == "kv_group":
                g = min(heads.values())
                bad = [n for n, h in heads.items() if h % g]
                if bad:
                    raise self.err(lp + ("per",), f"variants.{name}: {where} per: kv_group: {shown}: segment "
                                                  f"'{bad[0]}' does not split into {g} groups{chosen}")
