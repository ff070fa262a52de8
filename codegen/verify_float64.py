"""`xllm-gen verify --dtype float64`: both sides computed in float64 throughout.

transformers' float64 run is not float64 end to end, nor is the engine's: each keeps float32 steps that mimic the
other's 16-bit conventions (an RMSNorm's `hidden_states.to(torch.float32)`, eager attention's softmax with
`dtype=torch.float32`, the rotary angles' `.float()`; the engine's reference ops the same and more: its attention and
sampler in float32). Those steps round to float32 whatever the model dtype, so a float64 comparison would still carry
float32 noise and, where the two sides put their float32 steps in different places, a float32-sized difference that
is no error of the spec. `Float64` is a torch function mode that promotes them for the forwards run inside it:
`Tensor.float()` and every `torch.float32` passed as an argument (`.to(torch.float32)`, `dtype=torch.float32`) become
float64, on both sides alike, so what the two compute differs by float64 round-off where they compute the same
function. The models are built and loaded outside it (the checkpoint's bytes are read as they are), so constant
tables made at construction (rotary inverse frequencies, computed in float32 by both) keep their float32 values on
both sides. Any float32 tensor an op still returns inside it is counted (`residue`): verify names those ops.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

# dtype arguments of these are a reinterpretation of bytes or storage, not a precision to compute in
_KEEP = {torch.Tensor.view, torch.frombuffer, torch.Tensor.view_as}


def _wide(a):
    if a is torch.float32:
        return torch.float64
    if isinstance(a, (list, tuple)) and any(x is torch.float32 for x in a):
        return type(a)(torch.float64 if x is torch.float32 else x for x in a)
    return a


class Float64(TorchFunctionMode):
    """Inside `active()`: float32 computation steps promoted to float64 (module doc); `residue` counts the ops that
    still returned a float32 tensor, by name."""

    def __init__(self):
        super().__init__()
        self.on = False
        self.residue: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.on and func not in _KEEP:
            if func is torch.Tensor.float:
                func, args = torch.Tensor.double, args[:1]
            else:
                args = tuple(_wide(a) for a in args)
                kwargs = {k: _wide(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if self.on and isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
            self.residue[name] = self.residue.get(name, 0) + 1
        return out

    @contextlib.contextmanager
    def active(self):
        """The mode pushed (on the calling thread) and promoting inside."""
        was = self.on
        with self:
            self.on = True
            try:
                yield self
            finally:
                self.on = was

    @contextlib.contextmanager
    def paused(self):
        """Inside `active()`: a stretch computed as written (transformers' float32 yardstick run)."""
        was, self.on = self.on, False
        try:
            yield
        finally:
            self.on = was

    def residue_note(self) -> list:
        if not self.residue:
            return []
        ops = ", ".join(f"{k} ({v}x)" for k, v in sorted(self.residue.items(), key=lambda kv: -kv[1])[:8])
        return [f"float64: some ops still returned float32 tensors inside the float64 forwards ({ops}): a float32 "
                f"step there rounds at float32's precision, so a difference of float32 round-off's size may be that, "
                f"not the spec"]


def engine_failed(e: BaseException):
    """The VerifyError of an engine that cannot run the checkpoint in float64 (a state buffer kept in float32 that a
    float64 forward writes into: the Mamba / Mamba-2 caches)."""
    from .verify_report import VerifyError
    return VerifyError(f"--dtype float64: the engine cannot run this checkpoint in float64 ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:160] if str(e) else ''}); use --dtype float32")
