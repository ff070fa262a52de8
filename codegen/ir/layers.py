"""A decoder layer: `BlockIR` (any block kind), the dataflow steps (`ChoiceIR`, `StepIR`, `BranchStepIR`,
`ParallelStepIR`), `LayerIR`, and the LM head (`LMHeadIR`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

from .attention import MLAIR, AttentionIR
from .blocks import LinearIR, NormIR, ResidualGateIR
from .hyper import HyperIR
from .mlp import MLPIR, GatedMLPIR, MoEIR
from .recurrent import (
    MLSTMIR,
    RGLRUIR,
    WKVIR,
    ChannelMixIR,
    GatedDeltaNetIR,
    LightningIR,
    Mamba2IR,
    MambaIR,
    ShortConvIR,
)
from .values import Size, Value

BlockIR = Union[NormIR, LinearIR, AttentionIR, GatedMLPIR, MLPIR, MoEIR, MLAIR, GatedDeltaNetIR, Mamba2IR, MambaIR,
                ShortConvIR, RGLRUIR, LightningIR, HyperIR, WKVIR, ChannelMixIR, MLSTMIR,
                ResidualGateIR]


@dataclass(frozen=True)
class ChoiceIR:
    """A per-layer choice of block, one module per layer. `if` form: layer i builds `then` where cond(i) holds,
    else `else_`. `select` form (`cases` given): layer i builds the block of the case whose value equals cond(i)
    (the selector); a value with no case is refused."""
    cond: Value                   # `if`: a bool expression over config symbols and `layer`; `select`: the selector
    then: str = ""
    else_: str = ""
    cases: Tuple[Tuple[str, str, Any], ...] = ()   # select: (value, block, the bool expression `selector == value`)

    @property
    def alternatives(self) -> Tuple[str, ...]:
        return tuple(b for _, b, _ in self.cases) if self.cases else (self.then, self.else_)

    @property
    def anchor(self) -> str:
        """The alternative at whose place among the blocks the generated layer builds the module."""
        return self.cases[0][1] if self.cases else self.then

    def when(self, block: str) -> Tuple[Any, bool]:
        """(bool expression, value): the block exists in layer i iff the expression gives the value for i."""
        if self.cases:
            return next((Value(expr=c), True) for _, b, c in self.cases if b == block)
        return self.cond, block == self.then

    def describe(self) -> str:
        if self.cases:
            return f"select {self.cond}: " + ", ".join(f"{v!r} -> {b}" for v, b, _ in self.cases)
        return f"{self.then} if {self.cond} else {self.else_}"


@dataclass(frozen=True)
class StepIR:
    """A residual step: residual += hidden; hidden = post_norm(block(norm(residual))); without a norm the block
    reads the residual stream itself."""
    norm: Optional[str]
    block: str                    # the module (for a choice: the module both alternatives become)
    takes_positions: bool         # attention blocks get (positions, hidden), the others (hidden)
    post_norm: Optional[str] = None
    choice: Optional[ChoiceIR] = None
    scale: Optional[Value] = None  # the block's output is multiplied by it before joining the residual
    after_norm: Optional[str] = None  # post-LN: the residual stream is normalized after the add
    # a choice whose alternatives take different inputs (attention / recurrent mixer vs MLP / MoE): the layer
    # passes the positions where its module takes them (a per-layer flag `self.<block>_takes_positions`)
    mixed_input: bool = False
    add: Optional[str] = None     # a branch value added to the block's input (not to the residual)
    input_scale: Optional[Value] = None  # the block's input (the normed residual) is multiplied by it
    residual_normed: bool = False        # the stream becomes norm(x) (times residual_scale) before the output joins it
    residual_scale: Optional[Value] = None
    join: Optional[str] = None    # a branch value added to the step's output (it joins the residual with it)
    join_optional: bool = False   # the joined branch runs on some layers only (its value may be None)
    when: Optional[Value] = None         # the step runs (and its blocks exist) only where it holds
    hyper: Optional[str] = None   # a hyper_connection block: the step reads / writes the residual streams through it
    gate: Optional[str] = None    # a residual_gate block: x = residual(w) * x + branch(w) * h


@dataclass(frozen=True)
class BranchStepIR:
    """A side computation: value = ops(concat(inputs)), each op `h = block(norm(h))`, no residual; `branches` holds
    the ops (StepIR, as a parallel step's branches: code that walks the steps' blocks reads them alike)."""
    value: str                    # the value's name
    inputs: Tuple[str, ...]       # residual | embeddings | an earlier branch's value, concatenated on the last dim
    branches: Tuple[StepIR, ...]  # the ops, in order
    when: Optional[Value] = None  # per-layer: the branch runs (and its blocks exist) only where it holds


@dataclass(frozen=True)
class ParallelStepIR:
    """Parallel residual: every branch reads the same residual (normed by its own norm, or the stream itself);
    their outputs (each after its own post_norm) are summed, and the sum normalized by `post_norm` where given."""
    branches: Tuple[StepIR, ...]
    post_norm: Optional[str] = None


@dataclass(frozen=True)
class LayerIR:
    class_name: str
    count: Size
    blocks: Tuple[BlockIR, ...]
    steps: Tuple[StepIR, ...]
    # `dataflow: {if: cond, then: A, else: B}`: `steps` is B (class_name), alt_steps A (alt_class_name, a subclass
    # overriding forward), chosen per checkpoint; only_in: (block, in A) for the blocks one dataflow uses
    alt_cond: Optional[Value] = None
    alt_steps: Tuple[StepIR, ...] = ()
    alt_class_name: Optional[str] = None
    only_in: Tuple[Tuple[str, bool], ...] = ()
    # `layers.shared`: (block, instance expression over `layer`): layers with equal values share its parameters
    shared: Tuple[Tuple[str, Value], ...] = ()
    output_scale: Optional[str] = None     # a learned scalar [1] that multiplies the stream after the layer
    stream_scale: Optional[Value] = None   # a per-layer constant that multiplies the stream after the layer
    # `layers.stored_as`: the checkpoint prefix of layer i's weights, the body of an f-string over layer_idx / config;
    # layers with equal prefixes share their parameters (looped decoders)
    stored_as: Optional[str] = None

    @property
    def uses_per_layer_input(self) -> bool:
        """Some MLP reads the decoder's per-layer input: the layers take their slice as an input."""
        return any(getattr(b, "multiply", False) for b in self.blocks)

    @property
    def uses_embeddings(self) -> bool:
        """Some branch reads the decoder's embeddings: the layers take them as an input."""
        return any("embeddings" in getattr(s, "inputs", ()) for s in self.all_steps)

    def branch_when(self, block: str) -> Optional[Value]:
        """The `when` of the branch or step that uses `block` (it exists only where that holds); None: every
        layer."""
        for s in self.all_steps:
            if getattr(s, "value", None) is not None:
                if any(op.block == block or op.norm == block for op in s.branches):
                    return s.when
            elif getattr(s, "when", None) is not None and (
                    block in (s.norm, s.block, s.post_norm) or (s.choice is not None and block in s.choice.alternatives)):
                return s.when
        return None

    @property
    def all_steps(self) -> Tuple[StepIR, ...]:
        return self.steps + self.alt_steps

    def only_in_then(self, block: str) -> Optional[bool]:
        """True / False: the block exists only with the `then` / `else` dataflow; None: with both."""
        return dict(self.only_in).get(block)


@dataclass(frozen=True)
class LMHeadIR:
    name: str
    vocab: Size
    dim: Size
    tie: Value                    # literal bool or a bool config symbol
    softcap: Optional[Value] = None   # final logit soft-capping
    logit_scale: Optional[Value] = None   # logits multiplied by it (before the soft-cap)
    bias: Value = Value(literal=False)    # a [vocab] bias, vocab-parallel like the weight
    normalize: Value = Value(literal=False)   # rows L2-normalized once at load (an untied head)
