"""Static tensor-parallel checks: can a checkpoint be split over N ranks? One clear ValueError, before
any process starts or any weight is read (the compiler runs the same segment checks per spec variant)."""
from __future__ import annotations

import contextlib
import re
from typing import Any, Optional

import torch

from xllm_gen.runtime.executor import distributed as tpdist
from xllm_gen.runtime.executor.sharding import ShardingError, check_segment, padded_vocab, segment_range


@contextlib.contextmanager
def _tp_state(rank: int, size: int):
    """This process's TP state set to (rank, size) for a moment (static checks), then restored."""
    saved = (tpdist.get_tp_rank(), tpdist.get_tp_size(), tpdist.get_tp_group())
    tpdist.init_tp(rank, size, None)
    try:
        yield
    finally:
        tpdist.init_tp(*saved)


def _weight_plan(model_module, config, tp_size: int):
    """The plan as rank 0 of `tp_size` ranks will execute it: a plan may depend on the TP size (Qwen3-VL's
    vision tower is split only where its heads divide, else replicated), read from get_tp_size()."""
    with _tp_state(0, tp_size):
        return list(model_module.weight_plan(config))


def _plan_problems(plan, tp_size: int) -> list[str]:
    grouped: dict[tuple[str, str], int] = {}
    for rule in plan:
        if rule.shard not in ("colwise", "rowwise"):
            continue                                       # replicated: nothing to split; vocab: padded
        for seg in rule.segments:
            msg = check_segment(seg, tp_size)
            if msg:
                key = (re.sub(r"\.\d+\.", ".*.", rule.param), msg)    # one line for all decoder layers
                grouped[key] = grouped.get(key, 0) + 1
    return [f"{param}: {msg}" for (param, msg) in grouped]


def _expected_dim(rule, tp_size: int) -> Optional[tuple[int, int]]:
    """(dim, size per rank) that the loader will give `rule`'s parameter at rank 0, when known."""
    if rule.shard == "vocab":
        return 0, padded_vocab(rule.vocab_size, tp_size) // tp_size
    if rule.shard in ("colwise", "rowwise") and rule.segments:
        rows = 0
        for seg in rule.segments:
            a, b = segment_range(seg, tp_size, 0)
            rows += b - a
        return (0 if rule.shard == "colwise" else 1), rows
    return None


def _meta_build_problems(model_module, config, plan, tp_size: int) -> list[str]:
    """Builds rank 0's model on the meta device (no memory, no weights) under a temporary TP state, so the
    layers' own sharding checks run, and compares per-rank shapes with what the weight plan will load."""
    try:
        with _tp_state(0, tp_size), torch.device("meta"):
            model = model_module.Model(config)
    except ShardingError as e:
        return [str(e)]
    except Exception:          # not a sharding problem: the real build reports it with its own message
        return []
    params = dict(model.named_parameters())
    problems = []
    for rule in plan:
        p = params.get(rule.param)
        exp = _expected_dim(rule, tp_size)
        if p is None or exp is None or p.dim() <= exp[0]:
            continue
        dim, size = exp
        if p.shape[dim] != size:
            problems.append(f"{rule.param}: the model's per-rank shape {tuple(p.shape)} has {p.shape[dim]} along "
                            f"dim {dim}, but its weight rule ({rule.shard}) gives {size} per rank")
    return problems


def tensor_parallel_problems(model_module, config, tp_size: int, *, build: bool = False) -> list[str]:
    """Why `config` (a resolved generated Config) cannot be split over `tp_size` ranks; [] when it can.

    Uses the generated module's own check when it renders one (`tensor_parallel_problems(config, tp)`),
    the weight plan's segments (runtime.sharding.check_segment: q heads, KV heads with replication,
    intermediate size; the vocabulary is padded, never a problem), and, with `build`, a meta-device build
    of rank 0's model (the layers' own checks, and per-rank shapes against the plan). `build` is off by
    default: it costs as much as building the model's modules (seconds for an 8B model, most of it in
    rotary tables), and the ranks run the same layer checks when they build for real."""
    problems: list[str] = []
    hook = getattr(model_module, "tensor_parallel_problems", None)
    if callable(hook):
        problems.extend(str(p) for p in hook(config, tp_size))
    plan = _weight_plan(model_module, config, tp_size)
    problems.extend(_plan_problems(plan, tp_size))
    if build and not problems:
        problems.extend(_meta_build_problems(model_module, config, plan, tp_size))
    return list(dict.fromkeys(problems))


def check_tensor_parallel(model_module, hf_config: dict, tp_size: Any, config=None, *, build: bool = False) -> None:
    """Raises one ValueError when `tp_size` is impossible for the checkpoint (before any process starts)."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp_size!r}")
    if tp_size == 1:
        return
    if config is None:
        config = model_module.Config.from_hf(hf_config)
    problems = tensor_parallel_problems(model_module, config, tp_size, build=build)
    if not problems:
        return
    possible = [t for t in range(1, 65)
                if not _plan_problems(_weight_plan(model_module, config, t), t)
                and not (callable(getattr(model_module, "tensor_parallel_problems", None))
                         and model_module.tensor_parallel_problems(config, t))]
    archs = ", ".join(hf_config.get("architectures") or [getattr(model_module, "__name__", "?")])
    raise ValueError(f"tensor_parallel_size={tp_size} is not possible for this checkpoint ({archs}):\n  - "
                     + "\n  - ".join(problems)
                     + f"\nsizes that divide it (up to 64): {', '.join(map(str, possible))}")
