"""The weight plan of a model: what each parameter loads from the checkpoint.

A generated model module gives only the names that differ (`WEIGHT_SOURCES`: renamed tensors and the
segments of fused parameters); every other parameter loads the tensor of its own name. How a tensor is
sharded is the business of the parameter's layer (its `weight_loader`), never restated here.
"""
from __future__ import annotations

import re
from typing import Mapping, Union

from torch import nn

from xllm_gen.runtime.loading.weights import WeightRule

Sources = Union[str, Mapping[str, str]]


def _pattern(name: str) -> re.Pattern:
    return re.compile("^" + re.escape(name).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


def plan_from_parameters(model: nn.Module, sources: Mapping[str, Sources]) -> list[WeightRule]:
    """One rule per parameter of `model` (shared parameters once, under their first name)."""
    table = [(_pattern(k), v) for k, v in sources.items()]
    rules = []
    for name, _ in model.named_parameters():
        for pat, src in table:
            m = pat.match(name)
            if m is None:
                continue
            fill = (lambda s: s.replace("{i}", m.group("i"))) if "i" in pat.groupindex else (lambda s: s)
            if isinstance(src, str):
                rules.append(WeightRule(name, (fill(src),)))
            else:
                rules.append(WeightRule(name, tuple(fill(s) for s in src.values()), segments=tuple(src)))
            break
        else:
            rules.append(WeightRule(name, (name,)))
    return rules
