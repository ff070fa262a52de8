"""Activations: gated (SiluAndMul, GeluAndMul, `gated_act` from a Hugging Face activation name), GELU, and plain
ones (`act`, for a non-gated MLP)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime import ops


class SiluAndMul(nn.Module):
    """x [..., 2n] -> silu(x[..., :n]) * x[..., n:] (gate | up halves, as a merged gate/up projection gives)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)


def _check_approximate(approximate: str) -> None:
    if approximate not in ("tanh", "none"):
        raise ValueError(f"GELU approximate must be 'tanh' or 'none', not {approximate!r}")


class GeluAndMul(nn.Module):
    """x [..., 2n] -> gelu(x[..., :n]) * x[..., n:]; approximate "tanh" (HF gelu_pytorch_tanh) or "none"
    (exact erf GELU, HF gelu). Same op order and roundings as HF's `act_fn(gate_proj(x)) * up_proj(x)`."""

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        _check_approximate(approximate)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.gelu_and_mul(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class GELU(nn.Module):
    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        _check_approximate(approximate)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


# Hugging Face activation names (config `hidden_act` / `hidden_activation`) -> gated op. gelu_new is HF's
# NewGELUActivation, the tanh approximation written out (equal to gelu_pytorch_tanh up to float rounding).
_GATED = {
    "silu": ("silu", None),
    "swish": ("silu", None),
    "gelu": ("gelu", "none"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "gelu_new": ("gelu", "tanh"),
}
GATED_ACTIVATIONS: tuple[str, ...] = tuple(_GATED)


def gated_act(name: str, **params) -> nn.Module:
    """The gated activation module (x [..., 2n] -> act(x[..., :n]) * x[..., n:]) for a Hugging Face activation
    name: silu, swish -> SiluAndMul; gelu -> GeluAndMul("none"); gelu_pytorch_tanh, gelu_new ->
    GeluAndMul("tanh"); with `params`, a parameterized form of GATED_FORMS (swiglu_clamped: alpha, limit).
    Any other name raises ValueError."""
    if name in GATED_FORMS:
        return GATED_FORMS[name](**params)
    if params:
        raise ValueError(f"gated activation {name!r} takes no parameters, got {sorted(params)}")
    if name not in _GATED:
        raise ValueError(f"unsupported gated activation {name!r}; supported: {', '.join(GATED_ACTIVATIONS)}")
    kind, approximate = _GATED[name]
    return SiluAndMul() if kind == "silu" else GeluAndMul(approximate)


class ClampedSwiGLU(nn.Module):
    """x [..., 2n] (gate | up halves) -> (up + 1) * glu with gate = min(gate, limit), up = clamp(up, -limit, limit),
    glu = gate * sigmoid(alpha * gate): the clamped SwiGLU of GPT-OSS's experts (`swiglu_clamped`), same op order
    as transformers. `limit` None: no clamping."""

    def __init__(self, alpha: float, limit: float | None = None):
        super().__init__()
        self.alpha, self.limit = float(alpha), None if limit is None else float(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        if self.limit is not None:
            gate = gate.clamp(min=None, max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


# parameterized gated activation forms (`activation: {kind: ..., <params>}` in a spec) -> module
GATED_FORMS = {"swiglu_clamped": ClampedSwiGLU}


# Hugging Face activation names -> the plain activation of a non-gated MLP (up -> act -> down)
_PLAIN = {
    "silu": lambda: nn.SiLU(),
    "swish": lambda: nn.SiLU(),
    "relu": lambda: nn.ReLU(),
    "gelu": lambda: GELU("none"),
    "gelu_pytorch_tanh": lambda: GELU("tanh"),
    "gelu_new": lambda: GELU("tanh"),
}
ACTIVATIONS: tuple[str, ...] = tuple(_PLAIN)


def act(name: str) -> nn.Module:
    """The activation module for a Hugging Face activation name (see ACTIVATIONS); any other raises ValueError."""
    if name not in _PLAIN:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return _PLAIN[name]()
