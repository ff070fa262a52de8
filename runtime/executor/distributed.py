"""Tensor-parallel state and collectives.

One process per rank. `init_tp(rank, size, group)` records this process's place; layers read
`get_tp_rank()` / `get_tp_size()` when they are built. Collectives are torch custom ops
(`xllm::all_reduce`, `xllm::all_gather`) with fake implementations, so they can be traced and captured
in CUDA graphs (NCCL collectives are capturable); at tp=1 they are skipped entirely.
Backends: NCCL for CUDA tensors, gloo for CPU tensors (whatever the process group was created with).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

_RANK = 0
_SIZE = 1
_GROUP = None


def init_tp(rank: int, size: int, group=None) -> None:
    """Records the tensor-parallel rank and size; `group` is a torch.distributed group (None = WORLD)."""
    global _RANK, _SIZE, _GROUP
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad tensor-parallel rank {rank} of size {size}")
    _RANK, _SIZE, _GROUP = rank, size, group


def reset_tp() -> None:
    init_tp(0, 1, None)


@contextlib.contextmanager
def tp_state(rank: int, size: int, group=None):
    """This process's TP state set to (rank, size, group) for the block, then restored."""
    saved = (_RANK, _SIZE, _GROUP)
    init_tp(rank, size, group)
    try:
        yield
    finally:
        init_tp(*saved)


class SingleRank:
    """A tensor-parallel size 1 runner in a process that may also be another engine's rank 0 (verify runs a float32
    engine beside the TP 2 engine under test): its layers read the TP state when they are built and the collectives
    when they run, so it is built, and every method of it runs, with the state (0, 1) and the process's own state
    restored after. Attributes read, set and deleted pass through to the runner."""

    def __init__(self, build):
        with tp_state(0, 1):
            object.__setattr__(self, "_runner", build())

    def __getattr__(self, name):
        attr = getattr(self._runner, name)
        if (_RANK, _SIZE, _GROUP) == (0, 1, None) or not callable(attr) \
                or getattr(attr, "__self__", None) is not self._runner:
            return attr         # the process is TP 1 (the usual case: no wrapping on the step path), or data

        def call(*args, **kwargs):
            with tp_state(0, 1):
                return attr(*args, **kwargs)
        return call

    def __setattr__(self, name, value):
        setattr(self._runner, name, value)

    def __delattr__(self, name):
        delattr(self._runner, name)


def get_tp_rank() -> int:
    return _RANK


def get_tp_size() -> int:
    return _SIZE


def get_tp_group():
    return _GROUP


def init_process_group(rank: int, size: int, init_method: Optional[str] = None, backend: Optional[str] = None,
                       device: Optional[torch.device] = None):
    """Convenience: creates the default process group (NCCL on CUDA, gloo on CPU) and calls init_tp."""
    if backend is None:
        backend = "nccl" if (device is not None and torch.device(device).type == "cuda") else "gloo"
    if not dist.is_initialized():
        kw = {}
        if device is not None and torch.device(device).type == "cuda":
            kw["device_id"] = torch.device(device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, **kw)
    init_tp(rank, size, None)


@torch.library.custom_op("xllm::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=_GROUP)
    return out


@_all_reduce_op.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("xllm::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=_GROUP)
    return torch.cat(parts, dim=dim)


@_all_gather_op.register_fake
def _(x, dim, world):
    shape = list(x.shape)
    shape[dim] *= world
    return x.new_empty(shape)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel group (out of place); identity at tp=1."""
    if _SIZE == 1:
        return x
    return torch.ops.xllm.all_reduce(x)


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenates every rank's `x` along `dim` in rank order; identity at tp=1."""
    if _SIZE == 1:
        return x
    return torch.ops.xllm.all_gather(x, dim % x.dim(), _SIZE)
