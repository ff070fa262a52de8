"""The engine's options checked before anything is read: each bad value a ValueError naming the option (not an
error from deep inside torch, a failure per request later, or an option silently ignored)."""
from __future__ import annotations

import numbers
from typing import Any

import torch

LOAD_FORMATS = ("auto", "safetensors", "dummy")


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def resolve_device(device: Any) -> torch.device:
    """`device` as a torch.device; an unknown device string, or a CUDA device this host does not have, is a
    ValueError naming it (not torch's RuntimeError from deep inside the model build)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a device ('auto', 'cpu', 'cuda', 'cuda:N'): {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available on this host (torch "
                             f"{torch.__version__}, CUDA build {torch.version.cuda}); use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this host has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "meta"):
        raise ValueError(f"device {device!r}: only 'cpu' and 'cuda' devices are served")
    return dev


def check_engine_args(*, block_size, num_kv_blocks, max_num_batched_tokens, gpu_memory_utilization, seed,
                       load_format) -> None:
    """Engine options that would otherwise fail deep inside torch (a negative KV-cache size), per request (a
    block_size of 0 divides by zero at admission), or pass silently (a load_format that is not read, a
    max_num_batched_tokens of 0 taken as the default): each a ValueError naming the option and its value."""
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1 (tokens per KV-cache block), got {block_size!r}")
    if block_size > 4096:
        raise ValueError(f"block_size {block_size} is larger than any KV-cache block size served (at most 4096 "
                         f"tokens a block; 16 is the default)")
    if num_kv_blocks is not None and (not _is_int(num_kv_blocks) or num_kv_blocks < 1):
        raise ValueError(f"num_kv_blocks must be an integer >= 1, or None (sized from the memory available), "
                         f"got {num_kv_blocks!r}")
    if max_num_batched_tokens is not None and (not _is_int(max_num_batched_tokens) or max_num_batched_tokens < 1):
        raise ValueError(f"max_num_batched_tokens must be an integer >= 1, or None (the default), got "
                         f"{max_num_batched_tokens!r}")
    g = gpu_memory_utilization
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1:
        raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {g!r}")
    if not _is_int(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported (one of {', '.join(LOAD_FORMATS)}: "
                         f"safetensors checkpoints, or dummy random weights)")
