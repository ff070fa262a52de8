"""The default arm of an every-spec battery: the flagship specs and a stable quarter of the rest (--runslow: all).

An every-spec battery repeats one mechanism over ~130 specs (a resolved-spec golden, a real-size shape check, a
schema check, ...). Its default arm runs FLAGSHIPS and the specs whose stable hash of (battery, spec) falls in one
of SHARE buckets: a different quarter for each battery, so that every spec is still exercised by several default
batteries, a new spec does not reshuffle the others, and the default suite keeps its time budget (README.md) as
specs are added. The conformance battery's features-ON parity is not sampled: every served family runs by default.
"""
from __future__ import annotations

import zlib
from typing import Callable, Iterable

import pytest

FLAGSHIPS = frozenset({"qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe", "llama",           # specs, and their classes
                       "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3VLForConditionalGeneration", "LlamaForCausalLM"})
SHARE = 4


def in_default(battery: str, name: str) -> bool:
    """Whether spec (or family) `name` runs in `battery`'s default arm."""
    return name in FLAGSHIPS or zlib.crc32(f"{battery}:{name}".encode()) % SHARE == 0


def sampled(battery: str, items: Iterable, name: Callable = str) -> list:
    """`items` as parametrize values, those outside the default arm marked slow (`name`: an item's spec name)."""
    return [x if in_default(battery, name(x)) else pytest.param(x, marks=pytest.mark.slow) for x in items]
