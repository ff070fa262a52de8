"""Griffin's real-gated linear recurrent unit: `rg_lru_scan` / `rg_lru_scan_chunked` (a prompt chunk), `RGLRUGates`
(the block-diagonal gates) and the `RGLRU` mixer.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.executor.context import get_context
from xllm_gen.runtime.executor.distributed import get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, Segment, attach, raise_or_defer, split_segment

# the state helpers and kernels through the package (R.<name>): a test patching recurrent.<name> reaches every mixer
from xllm_gen.runtime.layers import recurrent as R
from xllm_gen.runtime.layers.recurrent.conv import CausalConv1d
from xllm_gen.runtime.layers.recurrent.state import RecurrentMixer, _fields_named


# ---------------------------------------------------------------------------------------------- RG-LRU
def rg_lru_scan(x: torch.Tensor, a: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, the linear recurrence h_t = a_t h_{t-1} + x_t in float32 (transformers' _rnn_scan, linear mode,
    step by step): x, a [T, C] (x already gated and normalized, a already zero at a reset), state [C] (float32).
    Returns (h [T, C] in x's dtype, the last h float32). The reference of `rg_lru_scan_chunked`."""
    h = state.float()
    out = torch.empty_like(x)
    af, xf = a.float(), x.float()
    for t in range(x.shape[0]):
        h = af[t] * h + xf[t]
        out[t] = h.to(x.dtype)
    return out, h


def rg_lru_scan_chunked(x: torch.Tensor, log_a: torch.Tensor, state: torch.Tensor,
                        chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence over chunks of `chunk` tokens (a few batched ops per chunk instead of a step per token):
    within a chunk, h_t = sum_{s <= t} exp(sum_{s < r <= t} log a_r) x_s + exp(sum_{r <= t} log a_r) h_0. The
    segment sums are summed as such (masked cumulative sums, as Mamba-2's SSD segsum), not as differences of running
    sums, which would lose the small ones to cancellation when the decays are strong. x, log_a [T, C] (log a finite:
    a reset may only be the first token of a zero state, where a multiplies nothing), state [C] float32. Returns
    (h [T, C] in x's dtype, the last h float32)."""
    T = x.shape[0]
    h = state.float()
    out = torch.empty_like(x)
    for s0 in range(0, T, chunk):
        xs, la = x[s0:s0 + chunk].float(), log_a[s0:s0 + chunk].float()
        n = xs.shape[0]
        ones = torch.ones(n, n, dtype=torch.bool, device=x.device)
        # seg[t, s] = sum_{s < r <= t} log a_r: la_r kept where r > s, summed over r <= t
        seg = la[:, None, :].expand(n, n, -1).masked_fill(~ones.tril(-1)[:, :, None], 0.0).cumsum(0)
        decay = seg.masked_fill(~ones.tril()[:, :, None], float("-inf")).exp()          # [t, s, C]
        hs = (decay * xs[None, :, :]).sum(1) + la.cumsum(0).exp() * h[None, :]
        out[s0:s0 + n] = hs.to(x.dtype)
        h = hs[-1]
    return out, h


class RGLRUGates(nn.Module):
    """The RG-LRU's parameters (module `rg_lru`, Griffin's RG-LRU): `recurrent_param [width]` (the
    learned log-decay, a = exp(-c softplus(recurrent_param) r)), and the input and recurrence gates, block-diagonal
    linears with one [block_width, block_width] block per head, stored [in, out] (`x @ W[h] + b[h]`):
    `input_gate_weight`, `recurrent_gate_weight [heads, block_width, block_width]`, `input_gate_bias`,
    `recurrent_gate_bias [heads, block_width]`. Split over TP ranks by heads."""

    def __init__(self, heads: int, block_width: int):
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        per = max(1, heads // tp)
        hseg = split_segment(Segment("heads", heads), tp, rank, [])
        cseg = split_segment(Segment("heads", heads, block_width), tp, rank, [])

        def param(shape, seg):
            p = nn.Parameter(torch.empty(shape))
            return attach(p, ParamSplit("column", 0, (seg,), tuple(shape), tp, rank, "RGLRU"))
        self.recurrent_param = param((per * block_width,), cseg)
        self.input_gate_weight = param((per, block_width, block_width), hseg)
        self.input_gate_bias = param((per, block_width), hseg)
        self.recurrent_gate_weight = param((per, block_width, block_width), hseg)
        self.recurrent_gate_bias = param((per, block_width), hseg)

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, heads * block_width] -> (input gate, recurrence gate) [N, heads * block_width], sigmoids of the
        block-diagonal linears (in x's dtype, as transformers' baddbmm)."""
        N = x.shape[0]
        H, bw = self.input_gate_bias.shape
        xr = x.reshape(N, H, bw).transpose(0, 1)                                    # [H, N, bw]
        gi = torch.baddbmm(self.input_gate_bias[:, None, :].to(x.dtype), xr, self.input_gate_weight.to(x.dtype))
        ga = torch.baddbmm(self.recurrent_gate_bias[:, None, :].to(x.dtype), xr, self.recurrent_gate_weight.to(x.dtype))
        return (torch.sigmoid(gi.transpose(0, 1).reshape(N, H * bw)),
                torch.sigmoid(ga.transpose(0, 1).reshape(N, H * bw)))

    def extra_repr(self) -> str:
        H, bw = self.input_gate_bias.shape
        return f"heads={H} (per rank), block_width={bw}"


class RGLRU(RecurrentMixer):
    """The state and math of a Griffin recurrent block (the `rg_lru` block kind; the generated block subclasses it and
    adds its input projections x and y and its output projection): the x branch goes through a depthwise causal
    conv1d (`conv_1d`, kernel `conv_kernel`, optional bias, no activation) and the RG-LRU (`rg_lru`, RGLRUGates):
    with the gates i = sigmoid(x W_i + b_i), r = sigmoid(x W_r + b_r) per head block, log a = -c r softplus(recurrent_param)
    (c = `decay_scale`, Griffin's 8), the state evolves h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t); at a sequence's
    position 0 the state is reset (a_t = 0) and the input not normalized (transformers' `reset`). The output is h times
    the y branch (the generated block's activation of its y projection). Heads split over TP ranks (each rank its
    heads' channels of x, y, the conv, the gates and the output projection's input).

    States per sequence: `conv` [width, kernel - 1] (model dtype) and `lru` [width] (float32)."""

    def __init__(self, width: int, heads: int, conv_kernel: int, conv_bias: bool = True, decay_scale: float = 8.0,
                 fields: Optional[dict] = None):
        # fields: the config fields of the sizes ({"heads": "num_attention_heads", "width": "lru_width"}), for refusals
        super().__init__()
        named = _fields_named(fields)
        if width % heads:
            raise ValueError(f"rg_lru: width {width}{named('width')} must be a multiple of heads "
                             f"{heads}{named('heads')} (the gates' diagonal blocks)")
        tp = get_tp_size()
        problems = [f"rg_lru: {heads} heads{named('heads')} (the gates' diagonal blocks, with their channels) cannot "
                    f"be split over tensor parallel size {tp}"] if heads % tp else []
        raise_or_defer(self, problems)
        self.block_width = width // heads
        self.heads = max(1, heads // tp)                 # per rank
        self.width = self.heads * self.block_width       # per rank
        self.conv_kernel = conv_kernel
        self.decay_scale = float(decay_scale)
        self.normalize_input = True      # sqrt(1 - a^2) on the input (tests switch it off: a sensitivity arm)
        self.conv_1d = CausalConv1d((("x", heads, self.block_width),), conv_kernel, conv_bias)
        self.rg_lru = RGLRUGates(heads, self.block_width)
        self.state_spec = {"conv": ((self.width, conv_kernel - 1), None), "lru": ((self.width,), torch.float32)}

    def mix(self, positions: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """positions [N], x [N, width] (the x projection, this rank's channels), y [N, width] (the activated y branch)
        -> RG-LRU(conv(x)) * y [N, width] (before the output projection), states updated."""
        ctx = get_context()
        conv_state, lru_state = self.states["conv"], self.states["lru"]
        w, cb = self.conv_1d.weight, self.conv_1d.bias
        slots = R.decode_slots(ctx)
        if slots is not None:                          # one token each, batched, graph-safe (slots: a device tensor)
            h, new_conv = R.causal_conv1d_step(x, w, cb, R.gather_states(conv_state, slots), activation=None)
            R.scatter_states(conv_state, slots, new_conv)
        else:
            seqs = R.step_sequences(ctx)
            h = torch.empty_like(x)
            for s, e, slot, cont in seqs:
                cs = R.slot_state(conv_state, slot, cont)
                h[s:e], new_conv = R.causal_conv1d(x[s:e], w, cb, cs, activation=None)
                conv_state[slot] = new_conv.to(conv_state.dtype)
        log_a, reset, xn = self._decay_and_input(positions, h)
        if slots is not None:
            a = torch.exp(log_a) * ~reset
            st = a.float() * R.gather_states(lru_state, slots) + xn.float()
            R.scatter_states(lru_state, slots, st)
            out = st.to(x.dtype)
        else:
            # a prompt chunk: the reset (position 0) can only be the first token of a sequence that starts here, whose
            # state is zero, so the chunked scan runs on the unreset decays (a_0 multiplies a zero state)
            out = torch.empty_like(h)
            for s, e, slot, cont in seqs:
                out[s:e], lru_state[slot] = R.rg_lru_scan_chunked(xn[s:e], log_a[s:e], R.slot_state(lru_state, slot, cont))
        return out * y

    def _decay_and_input(self, positions: torch.Tensor, h: torch.Tensor):
        """(log a_t, reset [N, 1], the normalized, gated input), as Griffin's RG-LRU computes them (in the model
        dtype): the reset is position 0, a device comparison (no host value); there the input is not normalized and
        a_t is zero (applied by the caller)."""
        gate_x, gate_a = self.rg_lru.gates(h)
        log_a = -self.decay_scale * gate_a * F.softplus(self.rg_lru.recurrent_param.to(h.dtype))
        xn = h * gate_x
        reset = (positions.reshape(-1) == 0)[:, None]
        if self.normalize_input:
            mult = torch.sqrt(1 - torch.exp(2 * log_a))
            xn = xn * torch.where(reset, torch.ones_like(mult), mult).to(h.dtype)
        return log_a, reset, xn

    def extra_repr(self) -> str:
        return (f"width={self.width}, heads={self.heads} (per rank), block_width={self.block_width}, conv_kernel="
                f"{self.conv_kernel}, decay_scale={self.decay_scale}")
