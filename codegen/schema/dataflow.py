"""A layer's dataflow: per-layer choices of block (`Choice`, `Select`), residual steps, branches and parallel
steps, and a per-layer choice of dataflow (`DataflowChoice`)."""
from __future__ import annotations

from typing import Dict, List, Literal, Optional, Union

from pydantic import Field, StrictStr

from .base import Num, Strict


class Choice(Strict):
    """A per-layer choice of block: `{if: <bool expression over config symbols and `layer`>, then: A, else: B}`.
    Layer i builds A where the expression is true for i, else B; both become the same module, named `name`
    (default: the name of B). A and B may take different inputs (an attention or recurrent mixer gets the
    positions, an MLP not): the layer then passes them where its module takes them."""
    if_: StrictStr = Field(alias="if")
    then: StrictStr
    else_: StrictStr = Field(alias="else")
    name: Optional[StrictStr] = None


class Select(Strict):
    """A per-layer choice among several blocks: `{select: <expression over config symbols and `layer`>, cases:
    {value: block, ...}, name: M}`. Layer i builds the block of the case equal to the expression's value for i
    (NemotronH's `layers_block_type[layer]`: a Mamba-2 mixer, attention, an MLP or a MoE); every alternative becomes
    the same module `name` (default: the first case's block). A value with no case is refused when the model is
    built (and for every variant), naming the value. The alternatives may take different inputs (attention and
    recurrent mixers get the positions, MLPs and MoEs not)."""
    select: StrictStr
    cases: Dict[StrictStr, StrictStr]
    name: Optional[StrictStr] = None


class ResidualStep(Strict):
    """`{norm: N, block: B}`: residual += h; h = B(N(residual)) (the norm fuses the residual add). Without
    `norm` the block reads the residual stream itself (h = B(residual); OLMo 2's post-norm-only steps).
    `post_norm: P` normalizes the block's output before it joins the residual (sandwich norms, Gemma 2);
    `scale: S` multiplies it (after the post-norm) before it joins the residual (Granite); `input_scale: S` multiplies
    the block's input, the normed residual (FalconH1's attention_in_multiplier).
    `block` may be a per-layer choice `{if: expr, then: A, else: B}` (e.g. a MoE on some layers, a dense MLP on
    the others)."""
    norm: Optional[StrictStr] = None
    block: Union[StrictStr, Choice, Select]
    post_norm: Optional[StrictStr] = None
    scale: Optional[Num] = None          # the block's output is multiplied by it before it joins the residual
                                         # (Granite's residual_multiplier); None = 1
    # the block's input (the normed residual) is multiplied by it (FalconH1's attention_in_multiplier); None = 1
    input_scale: Optional[Num] = None
    # classic post-LN (OPT-350m, the original Transformer): the residual stream itself is normalized after the
    # add, x = after_norm(x + h); the block reads x (no `norm` then)
    after_norm: Optional[StrictStr] = None
    # `residual: normed`: the residual stream itself becomes the block's normed input before the block's output joins
    # it, times `residual_scale`: x = residual_scale * N(x) + scale * B(N(x)) (MiniMax's per-layer-type
    # *_alpha_factor / *_beta_factor); only with a `norm`. `stream` (default): x = x + scale * B(N(x))
    residual: Literal["stream", "normed"] = "stream"
    residual_scale: Optional[Num] = None
    # a branch value (`branch.name`) added to the block's input, not to the residual: residual += h;
    # h = B(N(residual + value)) (Zamba: the shared transformer's output joins the Mamba layer's input). In a layer
    # where the branch does not run (its `when` is false) nothing is added
    add: Optional[StrictStr] = None
    # a branch value that joins the residual stream with this step's output (after its post_norm / scale):
    # residual += h; h = B(N(residual)) + value (LongCat-Flash's shortcut MoE, computed from an earlier step's normed
    # input, joins after the layer's last step). In a layer where the branch does not run nothing is added
    join: Optional[StrictStr] = None
    # a bool expression over config symbols (and `layer`): the step runs, and the blocks only it uses exist, only
    # where it holds (per checkpoint: Gemma 4's per-layer-input step where hidden_size_per_layer_input > 0); elsewhere
    # the stream passes the step unchanged; with a per-layer choice `block`, the choice's module exists only there
    # (Nemotron-NAS: attention, a linear, or nothing per layer). Not inside `parallel`
    when: Optional[StrictStr] = None
    # hyper-connections: a `hyper_connection` block of the layer that forms the block's input from the residual streams
    # and writes its output back into them (streams_out = post * h + mix(streams)); `norm` then normalizes that input
    hyper: Optional[StrictStr] = None
    # a `residual_gate` block of the layer: the step's residual add becomes x = residual(w) * x + branch(w) * h (after
    # post_norm / scale / join), w its learned per-channel weight (Ergo's attention / feedforward residual gates)
    gate: Optional[StrictStr] = None


class BranchOp(Strict):
    """One operation of a branch: `h = block(norm(h))` (no residual); `norm` optional."""
    norm: Optional[StrictStr] = None
    block: StrictStr


class Branch(Strict):
    """A side computation of the layer whose result is a named value, not a residual update: its input is the
    concatenation (last dim) of `input` values: `residual` (the residual stream as this step sees it),
    `embeddings` (the decoder's input to the first layer), or an earlier branch's name; then each op in order,
    `h = block(norm(h))`; the result is the value `name`, which a later step reads through `add` (or a later
    branch through `input`). `when`: a bool expression over config symbols and `layer`: the branch (and the
    blocks only it uses) exists only in the layers where it holds (Zamba's hybrid layers)."""
    name: StrictStr
    input: List[StrictStr]
    steps: List[BranchOp]
    when: Optional[StrictStr] = None


class BranchStep(Strict):
    branch: Branch


class ParallelStep(Strict):
    """`{parallel: [{norm: N1, block: B1}, {norm: N2, block: B2}]}`: both blocks read the same residual and
    their outputs are summed into it (GPT-J / NeoX style parallel residual). N1 and N2 may be one norm. A branch may
    be any block a step takes, a recurrent mixer too (FalconH1: Mamba-2 beside attention). A branch without `norm`
    reads the residual stream itself; a branch's `post_norm` normalizes its output before the sum, the step's
    `post_norm` the sum before it joins the residual: Gemma 4's MoE layers,
    h = P(P1(mlp(N(x))) + P2(moe(x)))."""
    parallel: List[ResidualStep]
    post_norm: Optional[StrictStr] = None


class DataflowChoice(Strict):
    """`{if: <bool expression over config symbols>, then: [steps], else: [steps]}`: the layer's dataflow chosen
    per checkpoint (StableLM's and GPT-NeoX's `use_parallel_residual`), or per layer where the expression reads
    `layer` (OLMo-Hybrid: post-norm attention layers, pre-norm DeltaNet layers). Each is a list of residual / parallel
    / branch steps (Arctic's MoE layers: a branch of the layer's input joined after the residual MLP); a block used by one of them only exists in that one's checkpoints. Rendered as two layer classes (the
    `then` one named `<class_prefix><name>DecoderLayer`; `name` defaults to the flag in CamelCase), picked when
    the model is built."""
    if_: StrictStr = Field(alias="if")
    then: List[Union[ResidualStep, ParallelStep, BranchStep]]
    else_: List[Union[ResidualStep, ParallelStep, BranchStep]] = Field(alias="else")
    name: Optional[StrictStr] = None
