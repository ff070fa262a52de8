"""Blocks whose weights several decoder layers reuse, and the per-use low-rank adapters on them.

`share_blocks(layers, name)`: the layers' modules `name` whose `<name>_shared` values (an instance index the
generated layer computes from its layer index) are equal share one set of parameters: the first such layer holds
them, the others' parameters are replaced by the same `nn.Parameter` objects. Everything else stays per layer: each
layer keeps its own module (so its own `L.Attention`, hence its own KV cache slot, or its own recurrent state) and
its own `LoRA` / `SegmentLoRA` adapters. `model.named_parameters()` then lists a shared parameter once, under its
first layer's name, which is what the loader's plan and the TP plan read (runtime/loading/plan.py).

`LoRA(in, rank, out_sizes, ...)`: `up(down(x))`, the delta of a column-parallel projection of those output segments
(down `[rank, in]` replicated, up `[sum(out_sizes), rank]` split over the TP ranks exactly as the projection's
segments are, so the delta adds to each rank's slice of the projection's output). `SegmentLoRA`: one `LoRA` per
segment (its own down and up), the deltas concatenated in segment order.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from xllm_gen.runtime.layers.linear import MergedColumnParallelLinear, ReplicatedLinear


class LoRA(nn.Module):
    """delta(x) = up(down(x)) for a column-parallel projection whose output is `out_sizes` (global) segments."""

    def __init__(self, in_features: int, rank: int, out_sizes: Sequence[int], segment_names: Sequence[str],
                 units: Optional[Sequence[int]] = None, replicate: Optional[Sequence[bool]] = None):
        super().__init__()
        self.down = ReplicatedLinear(in_features, rank, bias=False)
        self.up = MergedColumnParallelLinear(rank, list(out_sizes), bias=False, segment_names=segment_names,
                                             units=units, replicate=replicate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class SegmentLoRA(nn.ModuleDict):
    """One LoRA per output segment of a fused projection (`<name>.<segment>.down` / `.up`), deltas concatenated."""

    def __init__(self, in_features: int, rank: int, out_sizes: Sequence[int], segment_names: Sequence[str],
                 units: Optional[Sequence[int]] = None, replicate: Optional[Sequence[bool]] = None):
        units = [1] * len(out_sizes) if units is None else list(units)
        replicate = [False] * len(out_sizes) if replicate is None else list(replicate)
        super().__init__({n: LoRA(in_features, rank, [o], [n], [u], [r])
                          for n, o, u, r in zip(segment_names, out_sizes, units, replicate)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.values()], dim=-1)


def _tie(dst: nn.Module, src: nn.Module) -> None:
    """Every parameter of `dst` outside its LoRA adapters becomes `src`'s parameter at the same path."""
    adapters = [n for n, m in dst.named_modules() if isinstance(m, (LoRA, SegmentLoRA))]
    for path, mod in dst.named_modules():
        if any(path == a or path.startswith(a + ".") for a in adapters):
            continue
        peer = src.get_submodule(path)
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            q = peer._parameters.get(pname)
            if q is None or q.shape != p.shape:
                raise ValueError(f"shared block: {path or '<block>'}.{pname} has no parameter of its shape in the "
                                 f"block it shares")
            setattr(mod, pname, q)


def share_blocks(layers: Sequence[nn.Module], name: str) -> None:
    """Layers whose module `name` has equal `<name>_shared` values share its parameters (the first holds them)."""
    owners: dict = {}
    for layer in layers:
        module = getattr(layer, name, None)
        if module is None:
            continue
        key = getattr(layer, f"{name}_shared")
        if key in owners:
            _tie(module, owners[key])
        else:
            owners[key] = module


def share_layers(layers: Sequence[nn.Module]) -> None:
    """Layers with equal `stored_as` (their weights' checkpoint prefix) run the same weights: every parameter of a
    later one becomes the first's (a looped decoder runs one stored layer several times). Each layer keeps its own
    modules, so its own KV cache slot and recurrent state."""
    owners: dict = {}
    for i, layer in enumerate(layers):
        key = layer.stored_as
        if key not in owners:
            owners[key] = layer
            continue
        try:
            _tie(layer, owners[key])
        except (AttributeError, ValueError) as e:
            raise ValueError(f"decoder layer {i} runs the weights of {key!r}, but its modules differ from that "
                             f"layer's: {e}") from None


def learned_vector(size: int) -> nn.Parameter:
    """A learned vector `[size]`, replicated on every rank (a decoder-level value the schedule reads)."""
    from xllm_gen.runtime.executor.sharding import replicated
    return replicated(nn.Parameter(torch.empty(size)), "learned_vector")


def relocate_layers(rules: list, layers_prefix: str, stored_as: Sequence[str]) -> list:
    """Rewrites the checkpoint sources of a looped decoder's layer parameters: `<layers_prefix><i>.` becomes layer i's
    `stored_as` prefix (the parameters are named after the first layer that runs them)."""
    import re

    from xllm_gen.runtime.loading.weights import WeightRule

    rx = re.compile(re.escape(layers_prefix) + r"(\d+)\.")

    def move(src: str) -> str:
        m = rx.match(src)
        return src if m is None else stored_as[int(m.group(1))] + src[m.end():]

    return [WeightRule(r.param, tuple(move(s) for s in r.sources), segments=r.segments, layout=r.layout,
                       stored=r.stored, fused=r.fused) for r in rules]


def check_schedule(on: Sequence[tuple], reads: Sequence[tuple], sets: Sequence[str]) -> None:
    """A decoder schedule's rewrites (rewrite k reads the carried values `reads[k]` and sets `sets[k]`, before the
    layers i where `on[i][k]`) read only values an earlier rewrite has set: checked when the model is built, so a
    config whose conditions leave a value unset is refused by name instead of failing in a forward."""
    have: set = set()
    for i, row in enumerate(on):
        for k, flag in enumerate(row):
            if not flag:
                continue
            missing = [r for r in reads[k] if r not in have]
            if missing:
                raise ValueError(f"decoder.schedule: before layer {i}, rewrite {k} reads {missing[0]!r}, which no "
                                 f"earlier rewrite sets with this config")
            have.add(sets[k])
