"""Loads an HF checkpoint dir into a generated model by executing its weight plan.

Each rank reads only its slices (safetensors `get_slice`), never the whole tensor. Strict: a missing,
unexpected or mis-shaped tensor is an error that names it, and every parameter is loaded exactly once.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open

from xllm_gen.runtime.executor.sharding import segment_range, vocab_range
from xllm_gen.runtime.loading.weights import WeightRule


class CheckpointError(ValueError):
    pass


class Checkpoint:
    """Lazy view of a checkpoint's safetensors files: tensor name -> file, opened on demand."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        self.file_of: dict[str, str] = {}
        if index.exists():
            self.file_of = dict(json.loads(index.read_text())["weight_map"])
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.dir}: no *.safetensors files and no model.safetensors.index.json")
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    for name in h.keys():
                        self.file_of[name] = f.name
        self._handles: dict[str, object] = {}

    def names(self) -> Iterable[str]:
        return self.file_of.keys()

    def slice(self, name: str):
        if name not in self.file_of:
            raise CheckpointError(f"{self.dir}: missing tensor {name!r}")
        fname = self.file_of[name]
        if fname not in self._handles:
            path = self.dir / fname
            if not path.exists():
                raise CheckpointError(f"{self.dir}: index names {fname!r} for {name!r}, but the file is missing")
            self._handles[fname] = safe_open(str(path), framework="pt")
        return self._handles[fname].get_slice(name)


def _read_rule(ckpt: Checkpoint, rule: WeightRule, tp_size: int, tp_rank: int) -> torch.Tensor:
    if rule.shard == "replicated":
        return ckpt.slice(rule.sources[0])[:]
    if rule.shard == "vocab":
        sl = ckpt.slice(rule.sources[0])
        shape = sl.get_shape()
        if shape[0] != rule.vocab_size:
            raise CheckpointError(f"tensor {rule.sources[0]!r}: {shape[0]} rows, expected vocab size {rule.vocab_size}")
        start, stop = vocab_range(rule.vocab_size, tp_size, tp_rank)
        part = sl[start:min(stop, rule.vocab_size)]
        if part.shape[0] < stop - start:   # padding rows past the vocabulary
            pad = torch.zeros((stop - start - part.shape[0],) + tuple(part.shape[1:]), dtype=part.dtype)
            part = torch.cat([part, pad])
        return part
    dim = 0 if rule.shard == "colwise" else 1
    pieces = []
    if len(rule.sources) > 1:
        for name, seg in zip(rule.sources, rule.segments):
            sl = ckpt.slice(name)
            shape = sl.get_shape()
            if shape[dim] != seg.size:
                raise CheckpointError(f"tensor {name!r}: dim {dim} is {shape[dim]}, expected {seg.size} "
                                      f"(segment {seg.name!r} of {rule.param!r})")
            a, b = segment_range(seg, tp_size, tp_rank)
            pieces.append(sl[a:b] if dim == 0 else sl[:, a:b])
    else:
        name = rule.sources[0]
        sl = ckpt.slice(name)
        shape = sl.get_shape()
        total = sum(s.size for s in rule.segments)
        if shape[dim] != total:
            raise CheckpointError(f"tensor {name!r}: dim {dim} is {shape[dim]}, expected {total} for {rule.param!r}")
        offset = 0
        for seg in rule.segments:   # a fused source (e.g. vision attn.qkv): split before sharding
            a, b = segment_range(seg, tp_size, tp_rank)
            pieces.append(sl[offset + a:offset + b] if dim == 0 else sl[:, offset + a:offset + b])
            offset += seg.size
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


def load_weights(model: torch.nn.Module, plan: list[WeightRule], model_dir: str | Path, *,
                 tp_size: int = 1, tp_rank: int = 0, ignored: Iterable[str] = ()) -> set[str]:
    """Fills `model`'s parameters from the checkpoint; returns the set of loaded parameter names."""
    ckpt = Checkpoint(model_dir)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    used_sources: set[str] = set()
    for rule in plan:
        if rule.param not in params:
            raise CheckpointError(f"weight plan names parameter {rule.param!r}, which the model does not have")
        if rule.param in loaded:
            raise CheckpointError(f"parameter {rule.param!r} is loaded twice by the weight plan")
        tensor = _read_rule(ckpt, rule, tp_size, tp_rank)
        param = params[rule.param]
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(f"tensor {', '.join(rule.sources)}: shape {tuple(tensor.shape)} does not fit "
                                  f"parameter {rule.param!r} of shape {tuple(param.shape)} (tp rank {tp_rank}/{tp_size})")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add(rule.param)
        used_sources.update(rule.sources)
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{model_dir}: no checkpoint tensor for parameter(s) {', '.join(missing[:8])}"
                              + (" ..." if len(missing) > 8 else ""))
    patterns = [re.compile(p) for p in ignored]
    unexpected = sorted(n for n in ckpt.names() if n not in used_sources and not any(p.fullmatch(n) for p in patterns))
    if unexpected:
        raise CheckpointError(f"{model_dir}: unexpected tensor(s) in the checkpoint: {', '.join(unexpected[:8])}"
                              + (" ..." if len(unexpected) > 8 else ""))
    return loaded
