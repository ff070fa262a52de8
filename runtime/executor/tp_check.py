"""Static tensor-parallel checks and the per-rank plan: can a checkpoint be split over N ranks, and what
does each rank hold? One clear ValueError before any process starts or any weight is read.

`tp_plan(model_module, config, tp_size)` builds the generated Model on the meta device (no memory, no
weights, no process group) under a temporary TP rank/size, once per rank, and reads what the layers
decided: each parameter's per-rank shape, bytes and split (runtime.executor.sharding.ParamSplit: kind,
dim, and per segment this rank's rows). The layers are the single source of sharding; the loader runs
their weight loaders, `check_tensor_parallel` and `xllm-gen --explain --tp N` read this plan.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

from xllm_gen.runtime.executor import distributed as tpdist
from xllm_gen.runtime.executor.sharding import (
    SegmentSlice,
    ShardingError,
    deferred_sharding_errors,
    padded_vocab,
    segment_range,
)


@contextlib.contextmanager
def _default_dtype(dtype: Optional[torch.dtype]):
    saved = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


class _ParamsOnMeta(TorchFunctionMode):
    """`torch.empty` without a device (how layers create their parameters) allocates on the meta device;
    everything else is left as it is. Narrower than `with torch.device("meta")`, which would also move the
    small CPU work that layers do when built (rotary tables, cached for the real build) to meta."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.empty and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class ParamPlan:
    """One parameter on one rank."""
    name: str
    shape: tuple[int, ...]                 # this rank's shape
    global_shape: tuple[int, ...]          # the checkpoint tensor's (all segments; the unpadded vocabulary)
    kind: str                              # replicated | column | row | vocab
    dim: Optional[int]                     # the split dim (None: replicated)
    segments: tuple[SegmentSlice, ...]     # per segment: global size and this rank's rows [start, stop)
    itemsize: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def segment(self, name: str) -> SegmentSlice:
        for s in self.segments:
            if s.name == name:
                return s
        raise KeyError(f"{self.name} has no segment {name!r} (segments: {[s.name for s in self.segments]})")


@dataclass(frozen=True)
class RankPlan:
    rank: int
    params: tuple[ParamPlan, ...]                      # model.named_parameters() order (tied ones once)
    heads: tuple[tuple[str, int, int], ...]            # (QKV module, q heads, kv heads) on this rank

    def __getitem__(self, name: str) -> ParamPlan:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)


@dataclass(frozen=True)
class TPPlan:
    tp_size: int
    ranks: tuple[RankPlan, ...]                        # the ranks asked for (all by default), in order

    @property
    def nbytes_per_rank(self) -> tuple[int, ...]:
        return tuple(r.nbytes for r in self.ranks)

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_per_rank)


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)              # one line for all layers


def _sharding_problems(model: torch.nn.Module) -> list[str]:
    problems = []
    for mname, m in model.named_modules():
        errs = getattr(m, "sharding_errors", None)
        if not errs:
            continue
        own = [n for n, _ in m.named_parameters(recurse=False)]
        pname = f"{mname}.{'weight' if 'weight' in own else (own[0] if own else '')}".strip(".")
        problems.extend(f"{_pattern(pname)}: {e}" for e in errs)
    return list(dict.fromkeys(problems))


def _rank_plan(model: torch.nn.Module, rank: int) -> RankPlan:
    from xllm_gen.runtime.layers.linear import QKVParallelLinear

    params = []
    for name, p in model.named_parameters():
        split = getattr(p, "tp_split", None)
        if split is None:
            kind, dim, segs, gshape = "replicated", None, (), tuple(p.shape)
        else:
            kind, dim, segs, gshape = split.kind, split.dim, split.segments, split.global_shape()
            if kind == "vocab":
                gshape = (segs[0].size,) + tuple(p.shape[1:])
        params.append(ParamPlan(name, tuple(p.shape), tuple(gshape), kind, dim, tuple(segs), p.element_size()))
    heads = tuple((n, m.num_heads, m.num_kv_heads) for n, m in model.named_modules()
                  if isinstance(m, QKVParallelLinear))
    return RankPlan(rank, tuple(params), heads)


def build_meta_model(model_module, config, tp_size: int, rank: int = 0, dtype: Optional[torch.dtype] = None):
    """The generated Model of `rank` of `tp_size` on the meta device. Raises ShardingError naming every
    parameter whose size cannot be split (and the TP size)."""
    with tpdist.tp_state(rank, tp_size), deferred_sharding_errors(), _ParamsOnMeta(), _default_dtype(dtype):
        model = model_module.Model(config)
    problems = _sharding_problems(model)
    if problems:
        raise ShardingError(f"tensor parallel size {tp_size}: " + "; ".join(problems), problems)
    return model


def tp_plan(model_module, config, tp_size: int, *, ranks: Optional[Sequence[int]] = None,
            dtype: Optional[torch.dtype] = None) -> TPPlan:
    """Per-rank parameter shapes, bytes and splits of `model_module.Model(config)` at `tp_size` ranks.

    Builds the model on the meta device once per rank in `ranks` (default: all) under a temporary TP
    state; `dtype` (default torch's default dtype) is the floating-point dtype the bytes are counted in.
    A size that cannot be split raises ShardingError (`.problems`: one line per parameter pattern)."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tensor parallel size must be an integer >= 1, got {tp_size!r}")
    ranks = range(tp_size) if ranks is None else ranks
    out = []
    for r in ranks:
        if not 0 <= r < tp_size:
            raise ValueError(f"rank {r} is not in 0..{tp_size - 1}")
        out.append(_rank_plan(build_meta_model(model_module, config, tp_size, r, dtype), r))
    return TPPlan(tp_size, tuple(out))


# --------------------------------------------------------------------------------------------- checks
def _legacy_plan_problems(model_module, config, plan: TPPlan) -> list[str]:
    """Transitional: a weight plan rendered before plans were names only still states segment sizes;
    they must agree with the layers. Remove with the legacy WeightRule fields."""
    weight_plan = getattr(model_module, "weight_plan", None)
    if not callable(weight_plan) or not plan.ranks:
        return []
    tp = plan.tp_size
    try:
        with tpdist.tp_state(0, tp):
            rules = list(weight_plan(config))
    except Exception:            # a names-only plan: weight_plan(model), nothing to compare
        return []
    rank0 = {p.name: p for p in plan.ranks[0].params}
    problems = []
    for rule in rules:
        p = rank0.get(rule.param)
        shard = getattr(rule, "shard", "")
        if p is None:
            continue
        if shard == "vocab":
            dim, size = 0, padded_vocab(rule.vocab_size, tp) // tp
        elif shard in ("colwise", "rowwise") and getattr(rule, "legacy_segments", ()):
            dim = 0 if shard == "colwise" else 1
            try:
                size = sum(b - a for a, b in (segment_range(s, tp, 0) for s in rule.legacy_segments))
            except ShardingError as e:
                problems.append(f"{_pattern(rule.param)}: {e}")
                continue
        else:
            continue
        if len(p.shape) > dim and p.shape[dim] != size:
            problems.append(f"{rule.param}: the model's per-rank shape {p.shape} has {p.shape[dim]} along "
                            f"dim {dim}, but its weight rule ({shard}) gives {size} per rank")
    return problems


def tensor_parallel_problems(model_module, config, tp_size: int, *, build: bool = True) -> list[str]:
    """Why `config` (a resolved generated Config) cannot be split over `tp_size` ranks; [] when it can.

    Builds rank 0's model on the meta device (tp_plan): the layers' own checks (q heads, KV heads with
    replication, intermediate size; the vocabulary is padded, never a problem), one line per parameter
    pattern. Also the generated module's own check when it renders one (`tensor_parallel_problems(config,
    tp)`). `build` is accepted for compatibility: the plan is always built (it is cheap on meta)."""
    problems: list[str] = []
    hook = getattr(model_module, "tensor_parallel_problems", None)
    if callable(hook):
        problems.extend(str(p) for p in hook(config, tp_size))
    try:
        plan = tp_plan(model_module, config, tp_size, ranks=(0,))
    except ShardingError as e:
        problems.extend(e.problems)
    except Exception:          # not a sharding problem: the real build reports it with its own message
        pass
    else:
        problems.extend(_legacy_plan_problems(model_module, config, plan))
    return list(dict.fromkeys(problems))


def check_tensor_parallel(model_module, hf_config: dict, tp_size: Any, config=None, *, build: bool = True) -> None:
    """Raises one ValueError when `tp_size` is impossible for the checkpoint (before any process starts)."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp_size!r}")
    if tp_size == 1:
        return
    if config is None:
        config = model_module.Config.from_hf(hf_config)
    problems = tensor_parallel_problems(model_module, config, tp_size)
    if not problems:
        return
    possible = [t for t in range(1, 65) if not tensor_parallel_problems(model_module, config, t)]
    archs = ", ".join(hf_config.get("architectures") or [getattr(model_module, "__name__", "?")])
    raise ValueError(f"tensor_parallel_size={tp_size} is not possible for this checkpoint ({archs}):\n  - "
                     + "\n  - ".join(problems)
                     + f"\nsizes that divide it (up to 64): {', '.join(map(str, possible))}")
