"""Where the generated code fuses an op into the decode GEMV of the linear layer after it (runtime layers/fused.py).

Decided from the IR, so a spec whose layers do not have the pattern keeps the plain code:

- norm prologue: a residual step `norm -> block` (not a parallel branch, not a per-layer choice) whose norm is an
  RMSNorm without bias (any weight_offset) and whose block's first op is a column-parallel linear of the normed
  input (attention: the fused q/k/v projection; gated MLP: gate/up; MLP: up). The layer then calls
  `block(..., hidden_states, residual, norm)` and the block computes `L.norm_linear(norm, first_linear, ...)`,
  returning (output, residual). A block is fused only if every step that uses it is such a step.
- KV-cache store in the rotary kernel: an attention block whose q/k norm + rotary is the fused qk_norm_rope form
  (per-head RMSNorm before a rotary, shared weights), or that has no q/k norm and rotary on every layer, calls
  `L.qk_norm_rope_store(..., v, ..., self.attn)`, which at decode also writes k and v into the attention's paged
  cache, and passes `kv_stored` to the attention layer (which then does not store them again).
- activation prologue: a gated MLP whose activation is one the fused kernels compute (silu / swish, gelu,
  gelu_pytorch_tanh, gelu_new) or a config symbol choosing it at load (the runtime falls back to the plain ops for
  other values) calls `L.act_linear(act_fn, down, gate_up)`.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ir import AttentionIR, GatedMLPIR, ModelIR, NormIR

NORM_PROLOGUE_KINDS = ("attention", "gated_mlp", "mlp")
FUSED_GATED_ACTS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new")


@dataclass(frozen=True)
class FusionPlan:
    norm_prologue: frozenset      # names of the blocks whose step norm runs in their first linear's GEMV

    @staticmethod
    def act_prologue(b: GatedMLPIR) -> bool:
        """The gated MLP's activation runs in its down projection's GEMV."""
        if b.activation_params or b.sub_norm is not None:   # a sub_norm runs between the activation and down
            return False
        return b.activation.literal is None or b.activation.literal in FUSED_GATED_ACTS

    @staticmethod
    def rope_store(b: AttentionIR) -> str | None:
        """"qk_norm_rope" / "rope": the attention's rotary step (with its q/k norm) also stores k, v; None: not."""
        if b.differential is not None or b.experts is not None:   # paired values / routed q: the plain path
            return None
        if b.v_head_dim is not None or b.value_scale is not None:   # v of its own width, or scaled: the attention stores
            return None
        if b.v_norm is not None or b.values_from_keys is not None or b.kv_source is not None:  # the attention stores
            return None
        n = b.qk_norm
        if n is not None:
            return "qk_norm_rope" if n.fusable else None
        return "rope" if b.rotary is not None and b.rotary.enabled.literal is True else None


def fusion_plan(ir: ModelIR) -> FusionPlan:
    layer = ir.layer
    if ir.residual_float32.literal is not False:    # the step norms add into a float32 stream: the plain ops
        return FusionPlan(frozenset())
    blocks = {b.name: b for b in layer.blocks}
    ok, bad = set(), set()
    for s in layer.all_steps:
        parallel = hasattr(s, "branches")
        for st in (s.branches if parallel else (s,)):
            names = st.choice.alternatives if st.choice is not None else (st.block,)
            norm = blocks.get(st.norm) if st.norm else None
            # in a parallel step the first branch only, where no other branch reads its norm's output (they read
            # the stream the fused call returns, or their own norm of it)
            alone = not parallel or (getattr(s, "value", None) is None and st is s.branches[0]   # not a branch step
                                     and all(b.norm != st.norm for b in s.branches[1:]))
            fusable = (alone and st.choice is None and st.input_scale is None   # the GEMV reads norm(x) itself
                       and isinstance(norm, NormIR) and norm.kind == "rmsnorm" and norm.gate_rank is None
                       and not norm.bias and norm.always and blocks[st.block].kind in NORM_PROLOGUE_KINDS
                       and not getattr(blocks[st.block], "out_gate", None)   # the gate reads the normed input
                       and not getattr(blocks[st.block], "lora", None)       # the adapters read the normed input
                       and not getattr(blocks[st.block], "experts", None)    # the router reads it too
                       and getattr(st, "add", None) is None                  # the norm reads residual + a value
                       and not getattr(st, "residual_normed", False)         # the stream becomes norm(x) itself
                       and not getattr(blocks[st.block], "multiply", False))  # it takes a per-layer input too
            (ok if fusable else bad).update(names)
    return FusionPlan(frozenset(ok - bad))
