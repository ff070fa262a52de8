"""LFM2's gated short convolution mixer (`ShortConv`): b * conv(c * x), its state the conv's last inputs.
"""
from __future__ import annotations

import torch

from xllm_gen.runtime.executor.context import get_context

# the state helpers and kernels through the package (R.<name>): a test patching recurrent.<name> reaches every mixer
from xllm_gen.runtime.layers import recurrent as R
from xllm_gen.runtime.layers.recurrent.conv import CausalConv1d
from xllm_gen.runtime.layers.recurrent.state import RecurrentMixer


# ----------------------------------------------------------------------------------------------- short conv
class ShortConv(RecurrentMixer):
    """The state and math of a gated short-convolution mixer (the `short_conv` block kind; the generated block subclasses it and
    adds its projections): `y = C * conv(B * x)` with a depthwise causal conv1d over `channels` channels (no
    activation), parameter `conv.weight [channels, 1, kernel]`. Channels split over TP ranks.

    State per sequence: `conv` [channels, kernel - 1]."""

    def __init__(self, channels: int, conv_kernel: int, bias: bool = False):
        super().__init__()
        self.conv = CausalConv1d((("x", channels, 1),), conv_kernel, bias)
        self.channels, self.conv_kernel = self.conv.channels, conv_kernel
        self.state_spec = {"conv": ((self.conv.channels, conv_kernel - 1), None)}

    def mix(self, b: torch.Tensor, c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """b, c, x [N, channels] -> c * conv(b * x) [N, channels], the conv state updated."""
        ctx = get_context()
        conv_state = self.states["conv"]
        w, cb = self.conv.weight, self.conv.bias
        bx = b * x
        slots = R.decode_slots(ctx)
        if slots is not None:                                   # decode: one token each, batched, graph-safe
            h, new = R.causal_conv1d_step(bx, w, cb, R.gather_states(conv_state, slots), activation=None)
            R.scatter_states(conv_state, slots, new)
        else:
            h = torch.empty_like(bx)
            for s, e, slot, cont in R.step_sequences(ctx):
                cs = R.slot_state(conv_state, slot, cont)
                h[s:e], new = R.causal_conv1d(bx[s:e], w, cb, cs, activation=None)
                conv_state[slot] = new.to(conv_state.dtype)
        return c * h

    def extra_repr(self) -> str:
        return f"channels={self.channels} (per rank), conv_kernel={self.conv_kernel}"
