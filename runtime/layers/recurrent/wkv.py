"""Token-shift mixers: the WKV time mix (`WKV`: a receptance-weighted key-value recurrence with a per-channel decay)
and the token-shifted MLP (`TokenShiftMLP`), both over a per-sequence state. Their shared piece is the token shift
(`TokenShiftMixer`): each token's projections read a per-channel mix of its own input and its predecessor's, the
predecessor of a sequence's first token coming from the state (zero for a new sequence).

The WKV recurrence, per channel, with w = -exp(time_decay) and u = time_first, over a state (num, den, m) that holds
the numerator and denominator sums scaled by exp(-m) (so no exponential overflows):

    out_t = (exp(m - q) num + exp(k_t + u - q) v_t) / (exp(m - q) den + exp(k_t + u - q)),   q = max(m, k_t + u)
    m' = max(m + w, k_t);  num' = exp(m + w - m') num + exp(k_t - m') v_t;  den' likewise with 1 for v_t

(a fresh state: num = den = 0, m = -1e30). `wkv_step` is one token of a batch (a decode step, graph-safe),
`wkv_scan` a prompt chunk of one sequence, token by token: the same float32 operations in the same order as the
reference implementation, so a float32 run reproduces it bit for bit.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from xllm_gen.runtime.executor.context import get_context
from xllm_gen.runtime.executor.distributed import get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, Segment, attach, raise_or_defer, replicated, split_segment

# the state helpers through the package (R.<name>): a test patching recurrent.<name> reaches every mixer
from xllm_gen.runtime.layers import recurrent as R
from xllm_gen.runtime.layers.recurrent.state import RecurrentMixer, _fields_named

WKV_EMPTY_MAX = -1e30         # the running maximum of a fresh state (nothing summed yet)


def wkv_step(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num: torch.Tensor,
             den: torch.Tensor, mx: torch.Tensor):
    """One token: w, u [C] float32 (w = -exp(time_decay)), k, v [..., C], the state num, den, mx [..., C] float32 ->
    (out [..., C] in v's dtype, num', den', mx')."""
    kf = k.float()
    q = torch.maximum(mx, kf + u)
    e1 = torch.exp(mx - q)
    e2 = torch.exp(kf + u - q)
    out = ((e1 * num + e2 * v) / (e1 * den + e2)).to(v.dtype)
    m2 = torch.maximum(mx + w, kf)
    e1 = torch.exp(mx + w - m2)
    e2 = torch.exp(kf - m2)
    return out, e1 * num + e2 * v, e1 * den + e2, m2


def wkv_scan(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Sequence[torch.Tensor]):
    """A prompt chunk of one sequence, token by token: k, v [T, C], state (num, den, mx) [C] float32 ->
    (out [T, C] in v's dtype, (num, den, mx) after the last token)."""
    num, den, mx = state
    out = torch.empty_like(v)
    for t in range(k.shape[0]):
        out[t], num, den, mx = wkv_step(w, u, k[t], v[t], num, den, mx)
    return out, (num, den, mx)


def fresh_wkv_state(pool_row: torch.Tensor) -> tuple:
    """(num, den, mx) of a sequence that starts here: zero sums, the running maximum WKV_EMPTY_MAX."""
    z = torch.zeros_like(pool_row)
    return z, z.clone(), torch.full_like(pool_row, WKV_EMPTY_MAX)


class TokenShiftMixer(RecurrentMixer):
    """A mixer whose projections read `lerp(x, prev, mix) = x * mix + prev * (1 - mix)` per channel, `prev` the
    previous token's input (the shift state at a sequence's first token: zero for a new sequence). Parameters
    `time_mix_<name> [1, 1, hidden]` for each name of `mixes` (replicated: every rank mixes the whole input).

    State per sequence: `shift` [hidden] (model dtype), the last token's input."""

    def __init__(self, hidden: int, mixes: Sequence[str]):
        super().__init__()
        self.hidden = hidden
        self.mixes = tuple(mixes)
        for name in self.mixes:
            setattr(self, f"time_mix_{name}", replicated(nn.Parameter(torch.empty(1, 1, hidden)), type(self).__name__))
        self.state_spec = {"shift": ((hidden,), None)}

    def shift(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] (this step's tokens, sequence after sequence) -> prev [N, hidden], each token's
        predecessor; the shift state of each sequence becomes its last token's input."""
        ctx = get_context()
        pool = self.states["shift"]
        slots = R.decode_slots(ctx)
        if slots is not None:                       # one token each, batched, graph-safe
            prev = R.gather_states(pool, slots).to(x.dtype)
            R.scatter_states(pool, slots, x)
            return prev
        prev = torch.empty_like(x)
        for s, e, slot, cont in R.step_sequences(ctx):
            prev[s] = R.slot_state(pool, slot, cont).to(x.dtype)
            prev[s + 1:e] = x[s:e - 1]
            pool[slot] = x[e - 1].to(pool.dtype)
        return prev

    @staticmethod
    def lerp(x: torch.Tensor, prev: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
        """x * mix + prev * (1 - mix), as the reference writes it (not torch.lerp, which rounds otherwise)."""
        m = mix.reshape(-1)
        return x * m + prev * (1 - m)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, mixes={self.mixes}"


class WKV(TokenShiftMixer):
    """The WKV time mix (the `wkv` block kind; the generated block subclasses it and adds its key, value, receptance
    and output projections): k, v, r from the token-shifted input, `out(sigmoid(r) * wkv(k, v))`. Parameters
    `time_decay`, `time_first [width]` (float32, as the reference keeps them), split over TP ranks by channels
    with the projections' outputs; `time_mix_*` replicated.

    State per sequence: `shift` [hidden] (model dtype), `num`, `den`, `max` [width] (float32, this rank's channels)."""

    def __init__(self, hidden: int, width: int, mixes: Sequence[str] = ("key", "value", "receptance"),
                 fields: Optional[dict] = None):
        super().__init__(hidden, mixes)
        named = _fields_named(fields)
        tp, rank = get_tp_size(), get_tp_rank()
        problems: list = []
        if width % tp:
            problems.append(f"wkv: {width} channels{named('width')} cannot be split over tensor parallel size {tp}")
        seg = split_segment(Segment("channels", width), tp, rank, [])
        raise_or_defer(self, problems)
        self.width = seg.rows
        for name in ("time_decay", "time_first"):
            p = nn.Parameter(torch.empty(self.width, dtype=torch.float32))
            setattr(self, name, attach(p, ParamSplit("column", 0, (seg,), (self.width,), tp, rank, "WKV")))
        f32 = torch.float32
        self.state_spec = {"shift": ((hidden,), None), "num": ((self.width,), f32), "den": ((self.width,), f32),
                           "max": ((self.width,), f32)}

    def wkv(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [N, width] (this rank's channels) -> the WKV output [N, width], each sequence from its state slot."""
        ctx = get_context()
        num, den, mx = self.states["num"], self.states["den"], self.states["max"]
        w = -torch.exp(self.time_decay.float())
        u = self.time_first.float()
        slots = R.decode_slots(ctx)
        if slots is not None:                       # one token each, batched, graph-safe
            out, n2, d2, m2 = wkv_step(w, u, k, v, R.gather_states(num, slots), R.gather_states(den, slots),
                                       R.gather_states(mx, slots))
            for pool, new in ((num, n2), (den, d2), (mx, m2)):
                R.scatter_states(pool, slots, new)
            return out
        out = torch.empty_like(v)
        for s, e, slot, cont in R.step_sequences(ctx):
            state = (num[slot], den[slot], mx[slot]) if cont else fresh_wkv_state(num[slot])
            out[s:e], (num[slot], den[slot], mx[slot]) = R.wkv_scan(w, u, k[s:e], v[s:e], state)
        return out

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, width={self.width} (per rank), mixes={self.mixes}"


class TokenShiftMLP(TokenShiftMixer):
    """The token-shifted MLP (the `channel_mix` block kind; the generated block adds its projections): `key` and
    `receptance` read the token-shifted input, `sigmoid(receptance(.)) * value(act(key(.)))`. State per sequence:
    `shift` [hidden] (model dtype)."""

    def __init__(self, hidden: int, mixes: Sequence[str] = ("key", "receptance")):
        super().__init__(hidden, mixes)
