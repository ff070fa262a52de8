"""The simple blocks: `NormIR`, `EmbeddingIR`, `PositionEmbeddingIR`, `LinearIR`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .values import Size, Value


@dataclass(frozen=True)
class NormIR:
    kind: str                     # rmsnorm | layernorm
    name: str
    dim: Size
    eps: Value
    bias: bool = False
    weight_offset: float = 0.0    # y = x_normed * (weight_offset + w) (+ b)
    weight: bool = True           # layernorm: false = no weight (OLMo 1's non-parametric LayerNorm)
    # where the norm exists (per layer: may read `layer`); elsewhere the identity with no parameters
    enabled: Value = Value(literal=True)
    bias_flag: Optional[Value] = None   # a bool symbol / expression: the bias exists only where it holds (bias: True)
    gate_rank: Optional[Size] = None    # a low-rank sigmoid gate on the output: y * sigmoid(fc2(silu(fc1(y))))
    gate_enabled: Value = Value(literal=True)   # the layers with the gate (per layer); the others: the plain norm
    # layernorm: where it holds the mean is subtracted; elsewhere y = x / rms(x) * w (a config-chosen RMSNorm form)
    center: Value = Value(literal=True)

    @property
    def always(self) -> bool:
        """The norm exists in every layer, its bias is fixed by the spec and so is its form."""
        return self.enabled.literal is True and self.bias_flag is None and self.center.literal is True

    def bias_py(self) -> str:
        return self.bias_flag.py() if self.bias_flag is not None else repr(self.bias)


@dataclass(frozen=True)
class EmbeddingIR:
    name: str
    vocab: Size
    dim: Size
    scale: Optional[Value] = None     # output multiplier (Gemma: hidden_size ** 0.5)
    scale_dtype: str = "model"        # "bfloat16": the scale rounded to bfloat16 first (RecurrentGemma)


@dataclass(frozen=True)
class PositionEmbeddingIR:
    """Absolute position embeddings added to the token embedding: `learned` (a replicated table
    [positions + offset, dim], parameter embed_positions.weight) or `sinusoidal` (computed, no parameter)."""
    kind: str                     # learned | sinusoidal
    positions: Size
    dim: Size
    offset: int = 0
    frequencies: str = "fairseq"  # sinusoidal: fairseq (10000 ** (-j / (d/2 - 1))) | transformer (10000 ** (-2j / d))
    zero_row: Optional[Value] = None   # sinusoidal: a table row set to zeros (None at load: none)
    scale: Optional[Value] = None      # the position embedding is multiplied by it before the add (Jais)
    enabled: Value = Value(literal=True)   # where the position embedding exists (a per-checkpoint flag)


@dataclass(frozen=True)
class LinearIR:
    kind: str                     # linear | fused_linear
    name: str
    in_features: Size
    out_sizes: Tuple[Tuple[str, Size], ...]   # (segment name, size); one segment for a plain linear
    parallel: str                 # column | row | replicated
    bias: bool
    # a residual step's block: its input is the whole normed stream on every rank (a row-parallel one multiplies its
    # rank's columns of it, runtime RowParallelLinear(input_is_parallel=False)), its output joins the stream whole
    on_stream: bool = False


@dataclass(frozen=True)
class ResidualGateIR:
    """A learned per-channel gate on a step's residual add (runtime L.ResidualGate): x = residual(w) * x +
    branch(w) * h; `branch_py` / `residual_py` the formulas as torch source over the float32 weight `w` (None: 1)."""
    kind: str                     # residual_gate
    name: str
    hidden: Size
    branch: str                   # the formulas as written in the spec (explain, docstrings)
    residual: str
    branch_py: Optional[str] = None
    residual_py: Optional[str] = None

    def ctor(self) -> str:
        fns = "".join(f", {k}=lambda w: {v}" for k, v in (("branch", self.branch_py), ("residual", self.residual_py))
                      if v is not None)
        return f"L.ResidualGate({self.hidden.py()}{fns})"
