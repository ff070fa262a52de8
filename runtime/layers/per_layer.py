"""Per-layer side inputs and scales of the residual stream: the decoder's per-layer input (a second
embedding table plus a normed projection of the embedding output, one slice per layer), the rank's columns of it that
a column-parallel projection's output meets, and a learned scalar per layer."""
from __future__ import annotations

import torch
from torch import nn

from xllm_gen.runtime.executor.distributed import get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import replicated


def per_layer_inputs(input_ids: torch.Tensor, embeds: torch.Tensor, table: nn.Module, projection: nn.Module,
                     norm: nn.Module, layers: int, dim: int, embed_scale: float, project_scale: float,
                     combine_scale: float) -> torch.Tensor:
    """`[tokens, layers, dim]`: (norm(projection(embeds) * project_scale) + table(ids) * embed_scale) * combine_scale,
    the norm over each layer's `dim` (the scales multiply in the model dtype)."""
    if input_ids is None:
        raise ValueError("the per-layer input embeds the token ids: a request given only as embeddings cannot be served")
    e = table(input_ids) * torch.tensor(embed_scale, dtype=embeds.dtype)
    p = norm((projection(embeds) * project_scale).reshape(-1, layers, dim))
    return (p + e.reshape(-1, layers, dim)) * combine_scale


def rank_columns(n: int) -> slice:
    """The columns of a width-`n` column-parallel output that this TP rank holds (n split evenly)."""
    tp, rank = get_tp_size(), get_tp_rank()
    part = n // tp            # an uneven split is the projection's to refuse (ColumnParallelLinear names it)
    return slice(rank * part, (rank + 1) * part)


def learned_scalar() -> nn.Parameter:
    """A learned scalar `[1]`, replicated on every rank (a per-layer scale of the residual stream)."""
    return replicated(nn.Parameter(torch.empty(1)), "learned_scalar")
