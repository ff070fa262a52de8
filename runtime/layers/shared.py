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
