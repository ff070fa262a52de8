"""The weight plan of a model: what each parameter loads from the checkpoint.

A generated model module gives only the names that differ (`WEIGHT_SOURCES`: renamed tensors and the
segments of fused parameters); every other parameter loads the tensor of its own name. `{i}` in a name is the
layer index; `{e}` in a source is the expert index of a stacked expert parameter: the rule lists one tensor per
expert (`param.tp_split.expert_ids`), each filling shard "e" or "e.<segment>" (the layer skips another rank's). How a tensor is
sharded is the business of the parameter's layer (its `weight_loader`), never restated here. `WEIGHT_LAYOUTS` (optional)
gives the row layout (runtime.loading.layout.RowLayout) of a fused tensor stored per head or per KV group, or a
RowLayoutChoice that the model's config resolves here (the loader then reads, and shards, the tensor in the layout
this checkpoint's config chooses). `WEIGHT_FUSED_SOURCES` (optional): per parameter, the FusedSources of a segment
mapping whose tensor holds several segments (the mapping names that tensor for each of them; the rule reads each
segment's rows through the FusedSource, its RowLayoutChoice resolved against the model's config). A source given as a TensorLayout (a
`weights` entry's `transpose` / `segments_interleaved`) is read through its layout view. A callable source gives the
name(s) of layer i's tensor (a spec's `{<expression>}` placeholder: the checkpoint's name depends on the layer).
"""
from __future__ import annotations

import re
from typing import Callable, Mapping, Optional, Union

from torch import nn

from xllm_gen.runtime.loading.layout import FusedSource, RowLayout, RowLayoutChoice
from xllm_gen.runtime.loading.weights import TensorLayout, WeightRule

Sources = Union[str, Mapping[str, str], TensorLayout, Callable[[int], Union[str, Mapping[str, str]]]]


def _pattern(name: str) -> re.Pattern:
    return re.compile("^" + re.escape(name).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


def _per_expert(name: str, param, fill, src: Sources) -> WeightRule:
    """The rule of a stacked expert parameter from per-expert tensor names (`{e}`)."""
    ids = getattr(getattr(param, "tp_split", None), "expert_ids", None)
    if ids is None:
        raise ValueError(f"weight plan: {name!r} is stacked from per-expert tensors ({{e}}), but its layer holds no "
                         f"experts (param.tp_split.expert_ids)")
    if isinstance(src, str):
        return WeightRule(name, tuple(fill(src).replace("{e}", str(e)) for e in ids),
                          segments=tuple(str(e) for e in ids))
    return WeightRule(name, tuple(fill(s).replace("{e}", str(e)) for e in ids for s in src.values()),
                      segments=tuple(f"{e}.{seg}" for e in ids for seg in src))


def _fused_parts(name: str, src: Mapping[str, str], groups) -> tuple:
    """Per segment of `src` (segment -> tensor), the FusedSource of the tensor holding it, or None."""
    by_seg = {seg: g for g in groups for seg in g.segments}
    for g in groups:
        left = [seg for seg in g.segments if seg not in src]
        if left and len(left) < len(g.segments):
            raise ValueError(f"weight plan: {name!r} fills segments {', '.join(src)}, but the tensor of "
                             f"{'+'.join(g.segments)} also holds {', '.join(left)}, which this layer has not")
    return tuple(by_seg.get(seg) for seg in src)


def plan_from_parameters(model: nn.Module, sources: Mapping[str, Sources],
                         layouts: Optional[Mapping[str, Union[RowLayout, RowLayoutChoice]]] = None,
                         fused: Optional[Mapping[str, tuple[FusedSource, ...]]] = None) -> list[WeightRule]:
    """One rule per parameter of `model` (shared parameters once, under their first name); `layouts`: parameter
    name (with {i}) -> the row layout of its one fused checkpoint tensor (a RowLayoutChoice: the one `model.config`
    chooses; None: blocked); `fused`: parameter name -> the FusedSources of its segment mapping (tensors that hold
    several of its segments)."""
    layouts = {k: lay.pick(model.config) if isinstance(lay, RowLayoutChoice) else lay
               for k, lay in (layouts or {}).items()}
    layouts = {k: lay for k, lay in layouts.items() if lay is not None}
    fused = {k: tuple(g.resolved(model.config) for g in groups) for k, groups in (fused or {}).items()}
    table = [(_pattern(k), v, layouts.get(k), fused.get(k, ())) for k, v in sources.items()]
    # a laid-out tensor stored under the parameter's own name has no WEIGHT_SOURCES entry: its layout still applies
    table += [(_pattern(k), k, lay, ()) for k, lay in layouts.items() if k not in sources]
    rules = []
    for name, param in model.named_parameters():
        for pat, src, row_layout, groups in table:
            m = pat.match(name)
            if m is None:
                continue
            fill = (lambda s: s.replace("{i}", m.group("i"))) if "i" in pat.groupindex else (lambda s: s)
            if callable(src):     # a per-layer name computed from the layer index (a spec's {<expression>} placeholder)
                src = src(int(m.group("i")))
            stored = None
            if isinstance(src, TensorLayout):
                stored, src = src, src.source
                if "{e}" in src and stored.interleave > 1:     # a per-expert tensor: the expert dim is not there
                    stored = TensorLayout(src, stored.transpose, stored.interleave, stored.dim - 1)
            if any("{e}" in s for s in ([src] if isinstance(src, str) else src.values())):
                rules.append(_per_expert(name, param, fill, src))
            elif isinstance(src, str):
                rules.append(WeightRule(name, (fill(src),), layout=row_layout))
            else:
                split = getattr(param, "tp_split", None)
                have = split.segment_names if split is not None and split.segments else None
                if have is not None and set(have) < set(src):
                    # a fused parameter built without some segments in this layer (an attention whose values are its
                    # keys has no `v`): it loads the segments it has
                    src = {seg: s for seg, s in src.items() if seg in have}
                parts = _fused_parts(name, src, groups) if groups else ()
                if have is not None and len(have) == 1 and len(src) == 1 and not any(parts):
                    # one segment left: the whole parameter
                    rules.append(WeightRule(name, (fill(next(iter(src.values()))),), layout=row_layout))
                else:
                    rules.append(WeightRule(name, tuple(fill(s) for s in src.values()), segments=tuple(src),
                                            fused=parts))
            if stored is not None:
                r = rules.pop()
                rules.append(WeightRule(r.param, r.sources, segments=r.segments, layout=r.layout, stored=stored,
                                        fused=r.fused))
            break
        else:
            rules.append(WeightRule(name, (name,)))
    return rules
