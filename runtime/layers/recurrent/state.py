"""The shared state helpers of every recurrent mixer: the `RecurrentMixer` base (its state tensors and their
pool), the step's slots (`decode_slots` for a batched decode step, `step_sequences` for a prefill step per
sequence), the pool's rows (`gather_states` / `scatter_states`, graph-safe; `slot_state`, a prompt chunk's start)
and a refusal's config field (`_fields_named`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class RecurrentMixer(nn.Module):
    """Base of a token mixer with per-sequence state. Subclasses set `self.state_spec` {name: (shape, dtype)}
    (this rank's per-sequence shapes); the runner fills `self.states` {name: [num_slots, *shape]}."""

    state_spec: dict = {}

    def state_shapes(self) -> dict:
        return dict(self.state_spec)

    def init_states(self, num_slots: int, device, dtype) -> None:
        self.states = {name: torch.zeros((num_slots,) + tuple(shape), dtype=dt or dtype, device=device)
                       for name, (shape, dt) in self.state_shapes().items()}

    def state_bytes(self, dtype) -> int:
        """Bytes of one sequence's state."""
        n = 0
        for shape, dt in self.state_shapes().values():
            numel = 1
            for s in shape:
                numel *= int(s)
            n += numel * torch.tensor([], dtype=dt or dtype).element_size()
        return n


def decode_slots(ctx) -> Optional[torch.Tensor]:
    """The state slot of each row [B] int64 (device) when the step is a decode step, else None (a prefill step runs
    per sequence, `step_sequences`). A decode step has one token per sequence and every sequence continues its
    state, so its mixer path reads only this tensor: no host value, which makes it graph-safe (a decode CUDA graph
    binds a static slot buffer here; its padding rows hold the pool's scratch slot, runtime/executor/cuda_graph.py)."""
    if ctx.is_prefill:
        return None
    if ctx.state_slots is None:
        raise RuntimeError("a recurrent mixer ran a decode step without state slots in the forward context (the "
                           "runner allocates them for models with recurrent layers)")
    if ctx.query_lens_cpu is not None and any(q != 1 for q in ctx.query_lens_cpu):
        return None
    return ctx.state_slots


def gather_states(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows `slots` [B] of a state pool [num_slots, ...] (a copy; graph-safe, no host sync)."""
    return pool.index_select(0, slots)


def scatter_states(pool: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Writes `new` [B, ...] into the rows `slots` of the pool, in place (graph-safe, no host sync). Slots are
    distinct but for a decode graph's padding rows, which all share the scratch slot (any of them may win)."""
    pool.index_copy_(0, slots, new.to(pool.dtype))


def slot_state(pool: torch.Tensor, slot: int, continues: bool) -> torch.Tensor:
    """A prompt chunk's starting state: its sequence's row of the pool when it continues an earlier chunk, else
    zeros (a new sequence, or one recomputed after preemption)."""
    return pool[slot] if continues else torch.zeros_like(pool[slot])


def step_sequences(ctx):
    """[(row_start, row_end, slot, continues)] of the step's sequences (host values; no device sync)."""
    if ctx.state_slots_cpu is None:
        raise RuntimeError("a recurrent mixer ran without state slots in the forward context (the runner allocates "
                           "them for models with recurrent layers)")
    out, start = [], 0
    for qlen, slot, cont in zip(ctx.query_lens_cpu, ctx.state_slots_cpu, ctx.state_continue_cpu):
        out.append((start, start + qlen, slot, cont))
        start += qlen
    return out


def _fields_named(fields: Optional[dict]):
    """A refusal's ' (config.json <field>)' for a size, where the generated block named its field."""
    return lambda size: f" (config.json {fields[size]})" if fields and size in fields else ""
