"""The attention backend interface."""
from __future__ import annotations

import torch

from xllm_gen.runtime.executor.context import ForwardContext


class AttentionBackend:
    """plan(ctx) once per step (outside graph capture), shared by all layers; forward(...) per layer.

    When forward runs, the step's K/V are already written to (k_cache, v_cache) ([num_blocks, block_size,
    Hk, D], NHD) by the Attention layer. q [N, H, D], k/v [N, Hk, D] -> out [N, H, D].
    """

    def plan(self, ctx: ForwardContext) -> None:
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, ctx: ForwardContext, scale: float) -> torch.Tensor:
        raise NotImplementedError
