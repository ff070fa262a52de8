"""Per-step forward context: the attention metadata of one engine step, set once and read by every layer.

The runner fills it before a forward pass; Attention layers read it with get_context() instead of
taking extra arguments (nano-vllm's idea). Tensors here are on the model's device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass
class ForwardContext:
    is_prefill: bool
    # Tokens of all sequences of the step are flattened: sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1].
    cu_seqlens_q: torch.Tensor            # [B+1] int32
    seq_lens: torch.Tensor                # [B] int32: KV length of each sequence after this step's tokens
    slot_mapping: torch.Tensor            # [N] int64: KV-cache slot (block * block_size + offset) per token, -1 = skip
    block_tables: torch.Tensor            # [B, max_blocks] int32, -1 padded
    block_size: int = 16
    seq_lens_cpu: Optional[list] = None   # host copies, so backends can plan without a device sync
    query_lens_cpu: Optional[list] = None
    backend: Any = None                   # the AttentionBackend, already planned for this step
    # deepstack injection: level k is added to hidden states at rows visual_rows after decoder layer k.
    deepstack: Optional["DeepstackInput"] = None
    extra: dict = field(default_factory=dict)
    # recurrent-state mixers (runtime/layers/recurrent/): each sequence's state slot [B] int64 (device) and host
    # copies, and whether the slot continues the sequence's state (False: its first prefill chunk, state from zero);
    # a decode step reads only state_slots (in a decode graph bucket: a static buffer, padding rows on the scratch
    # slot; the host copies are None there)
    state_slots: Optional[torch.Tensor] = None
    state_slots_cpu: Optional[list] = None
    state_continue_cpu: Optional[list] = None
    # set only while PrefillGraphs captures: attention layers hand (layer, q, k, v) to it instead of attending
    graph_break: Optional[Callable] = None


@dataclass
class DeepstackInput:
    visual_rows: torch.Tensor             # [M] int64, rows of the flattened step that hold visual tokens
    embeds: torch.Tensor                  # [levels, M, hidden]


_CONTEXT: Optional[ForwardContext] = None


def set_context(ctx: Optional[ForwardContext]) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context is set: call the model through a runner")
    return _CONTEXT


def reset_context() -> None:
    set_context(None)
