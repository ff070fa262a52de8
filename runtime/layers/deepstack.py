"""Deepstack injection: level k's visual features (from the vision tower's intermediate blocks) are added at
the visual-token rows after decoder layer k."""
from __future__ import annotations

import torch

from xllm_gen.runtime.executor import context as _context


def inject_deepstack(hidden: torch.Tensor, level: int) -> torch.Tensor:
    """hidden [N, dim] -> hidden with `ctx.deepstack.embeds[level]` added at `ctx.deepstack.visual_rows`.

    A no-op when no context is set or the step has no deepstack input. Out of place; the sum per row is
    `hidden[row] + embeds[level][i]` (HF's `hidden[mask] = hidden[mask] + visual_embeds`). Rows must be unique;
    fixed-size (graph) buffers can pad with rows whose embeds are zero.
    """
    ctx = _context._CONTEXT
    if ctx is None or ctx.deepstack is None:
        return hidden
    ds = ctx.deepstack
    if level >= ds.embeds.shape[0]:
        return hidden
    return hidden.index_add(0, ds.visual_rows, ds.embeds[level].to(hidden.dtype))
