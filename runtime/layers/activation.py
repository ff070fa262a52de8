"""Activations: the table of Hugging Face activation names (ACTIVATION_FNS, transformers' ACT2FN computed alike),
gated (SiluAndMul, GeluAndMul fused; ActAndMul for the others; `gated_act` by name), GELU, and plain ones (`act`, for
a non-gated MLP)."""
from __future__ import annotations

import math
from typing import Callable

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


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """HF gelu_new / gelu_accurate / gelu_python_tanh: the tanh approximation written out (GPT-2)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def _gelu_python(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _laplace(x: torch.Tensor, mu: float = 0.707107, sigma: float = 0.282095) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf((x - mu).div(sigma * math.sqrt(2.0))))


# THE activation table: Hugging Face activation name (config `hidden_act` / `activation` / `hidden_activation`,
# transformers' ACT2FN key) -> the elementwise function, written as transformers computes it (tests/test_layouts.py
# compares every entry with ACT2FN itself). Not here: `xielu` and `prelu` (learned per-layer parameters).
ACTIVATION_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "relu2": _relu2,                  # squared ReLU
    "relu6": F.relu6,
    "leaky_relu": F.leaky_relu,
    "gelu": lambda x: F.gelu(x, approximate="none"),
    "gelu_python": _gelu_python,
    "gelu_10": lambda x: torch.clip(F.gelu(x), -10.0, 10.0),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "gelu_accurate": _gelu_new,
    "gelu_python_tanh": lambda x: x * 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))),
    "gelu_fast": _gelu_fast,
    "quick_gelu": _quick_gelu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "mish": F.mish,
    "hardswish": F.hardswish,
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "laplace": _laplace,
    "linear": lambda x: x,
}
ACTIVATIONS: tuple[str, ...] = tuple(ACTIVATION_FNS)

# The gated forms with a fused kernel (ops.silu_and_mul / ops.gelu_and_mul, Triton on CUDA); every other name runs
# its table function on the gate half and multiplies (ActAndMul). gelu_new is HF's NewGELUActivation, the tanh
# approximation written out: the fused tanh kernel equals it up to float rounding.
_FUSED_GATED = {
    "silu": ("silu", None),
    "swish": ("silu", None),
    "gelu": ("gelu", "none"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "gelu_new": ("gelu", "tanh"),
}
GATED_ACTIVATIONS: tuple[str, ...] = ACTIVATIONS


class Act(nn.Module):
    """An activation of the table (ACTIVATION_FNS), by its Hugging Face name."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.fn = ACTIVATION_FNS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def extra_repr(self) -> str:
        return repr(self.name)


class ActAndMul(Act):
    """x [..., 2n] -> act(x[..., :n]) * x[..., n:] for an activation without a fused gated kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1] // 2
        return self.fn(x[..., :n]) * x[..., n:]


def gated_act(name: str, **params) -> nn.Module:
    """The gated activation module (x [..., 2n] -> act(x[..., :n]) * x[..., n:]) for a Hugging Face activation
    name: silu, swish -> SiluAndMul; gelu -> GeluAndMul("none"); gelu_pytorch_tanh, gelu_new ->
    GeluAndMul("tanh"); with `params`, a parameterized form of GATED_FORMS (swiglu_clamped: alpha, limit;
    glu_clamped: act, limit, clamp).
    Any other name raises ValueError."""
    if name == "glu_clamped" and params.get("limit") is None and set(params) <= {"act", "limit", "clamp"}:
        return gated_act(params["act"])          # no clamp in this layer: the plain (fused) gated activation
    if name in GATED_FORMS:
        return GATED_FORMS[name](**params)
    if params:
        raise ValueError(f"gated activation {name!r} takes no parameters, got {sorted(params)}")
    if name not in ACTIVATION_FNS:
        raise ValueError(f"unsupported gated activation {name!r}; supported: {', '.join(GATED_ACTIVATIONS)}")
    if name not in _FUSED_GATED:
        return ActAndMul(name)
    kind, approximate = _FUSED_GATED[name]
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


class ClampedGLU(nn.Module):
    """x [..., 2n] (gate | up halves) -> min(act(gate), limit) * clamp(up, -limit, limit), act a name of the table
    (ACTIVATION_FNS): the clamp after the activation (`glu_clamped`; a per-layer SwiGLU limit,
    transformers' `limit_after_act`). `clamp="before_act"`: act(min(gate, limit)) * clamp(up, -limit, limit), the
    gate clamped before the activation (HY-V4's routed experts). `limit` None: act(gate) * up, no clamping."""

    def __init__(self, act: str, limit: float | None = None, clamp: str = "after_act"):
        super().__init__()
        if clamp not in ("after_act", "before_act"):
            raise ValueError(f"glu_clamped: clamp must be 'after_act' or 'before_act', got {clamp!r}")
        self.clamp = clamp
        if act not in ACTIVATION_FNS:
            raise ValueError(f"glu_clamped: unsupported activation {act!r}; supported: {', '.join(ACTIVATIONS)}")
        if limit is not None and not (float(limit) > 0 and math.isfinite(float(limit))):
            raise ValueError(f"glu_clamped: limit must be a finite number > 0 or None, got {limit!r}")
        self.act, self.fn = act, ACTIVATION_FNS[act]
        self.limit = None if limit is None else float(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        if self.limit is not None and self.clamp == "before_act":
            return self.fn(gate.clamp(min=None, max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)
        gate = self.fn(gate)
        if self.limit is not None:
            gate = gate.clamp(min=None, max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
        return gate * up

    def extra_repr(self) -> str:
        return f"act={self.act!r}, limit={self.limit}" + (f", clamp={self.clamp!r}" if self.clamp != "after_act" else "")


# parameterized gated activation forms (`activation: {kind: ..., <params>}` in a spec) -> module
GATED_FORMS = {"swiglu_clamped": ClampedSwiGLU, "glu_clamped": ClampedGLU}


class XIELU(nn.Module):
    """xIELU (Apertus; transformers' XIELUActivation, its Python form), with its learned parameters as the
    checkpoint stores them under the activation module (`act_fn.alpha_p`, `act_fn.alpha_n` [1]; `act_fn.beta`,
    `act_fn.eps` scalars): a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n);
    x > 0: a_p x^2 + beta x, else (expm1(min(x, eps)) - x) a_n + beta x. Replicated under TP."""

    def __init__(self):
        super().__init__()
        self.alpha_p = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.beta = nn.Parameter(torch.tensor(0.5), requires_grad=False)
        self.eps = nn.Parameter(torch.tensor(-1e-6), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)


# activations with learned parameters (stored in the checkpoint under the activation module): plain MLPs only
PARAM_ACTIVATIONS = {"xielu": XIELU}


def act(name: str) -> nn.Module:
    """The activation module for a Hugging Face activation name (see ACTIVATIONS, PARAM_ACTIVATIONS); any other
    raises ValueError."""
    if name in PARAM_ACTIVATIONS:
        return PARAM_ACTIVATIONS[name]()
    if name not in ACTIVATION_FNS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return Act(name)
